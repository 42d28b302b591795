"""``prepare_channels_last``: channels_last training in a hand-written Accelerate loop, in one line.

``accelerator.prepare`` places the model, wraps it (DDP, FSDP) and compiles it last: the layout must be
final before it. ``prepare_channels_last(model, accelerator)`` converts the model for the accelerator's device
and mixed precision (``cltrain.loops.convert_model``: the channels-last format of each parameter's rank and the
kernel guardrails) and attaches ``cltrain.integrations.inputs_hook.ChannelsLastInputs``: the loop's
``model(**batch)`` / ``model(x)`` then gets its images in channels_last, and the first training and evaluation
batch is checked (``cltrain.loops.verify_layout``), with no ``convert_batch`` or ``verify_layout`` in the loop.
The same by hand, for a loop that prefers to see each step: ``convert_model`` before ``prepare``,
``verify_layout`` on the first batch, ``convert_batch`` on every batch (docs/guides/huggingface.md).

Example::

    from accelerate import Accelerator
    from cltrain.integrations.accelerate import prepare_channels_last

    accelerator = Accelerator(mixed_precision="bf16")
    model = prepare_channels_last(model, accelerator)          # before accelerator.prepare
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from cltrain.integrations.inputs_hook import IMAGE_ARGUMENTS, ChannelsLastInputs, argument_names
from cltrain.loops import convert_model
from cltrain.options import check_flags, check_mode
from cltrain.sharding import sharding_of

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["prepare_channels_last"]

M = TypeVar("M", bound=nn.Module)

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def prepare_channels_last(
    model: M,
    accelerator: Accelerator,
    *,
    mode: str = "full",
    inputs: str | Sequence[str] = IMAGE_ARGUMENTS,
    guard: bool = True,
    verify: bool = True,
) -> M:
    """Put ``model`` in channels_last for ``accelerator``, in place, and convert its image inputs on every call.

    Args:
        model: the model, before ``accelerator.prepare``.
        accelerator: the ``accelerate.Accelerator`` that will prepare it (its ``device`` and ``mixed_precision``
            choose the guardrails and the check's autocast dtype).
        mode: ``"full"`` restrides every 4-D/5-D parameter and buffer; ``"conv"`` only convolution weights.
        inputs: the forward arguments holding images (the first positional argument is converted too).
        guard: apply ``cltrain.guardrails.apply_guardrails``.
        verify: check the first training and evaluation batch (``ChannelsLastInputs.of(model).layout_checks``).

    Returns:
        ``model`` itself (its parameters are kept). Under FSDP or DeepSpeed its weights stay NCHW, as those
        engines require, and only its image inputs are channels_last (``cltrain.sharding``).

    Raises:
        ValueError: a bad ``mode``, ``inputs``, ``guard`` or ``verify``.
    """
    names = argument_names(inputs, f"prepare_channels_last(inputs={inputs!r})")
    check_mode("prepare_channels_last", mode)
    check_flags("prepare_channels_last", guard=guard, verify=verify)
    dtype = _AUTOCAST.get(str(accelerator.mixed_precision))
    hook = ChannelsLastInputs(names, verify=verify, autocast_dtype=dtype)
    # FSDP and DeepSpeed (GPU only in Accelerate) keep parameters contiguous: then only the inputs go channels_last.
    convert_model(model, mode, device=accelerator.device, dtype=dtype, guard=guard,
                  sharded=sharding_of(model, accelerator) is not None)
    hook.attach(model)
    return model
