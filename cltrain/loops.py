"""Channels_last in a Lightning Fabric or plain PyTorch loop, and a contiguous copy for export.

``convert_model`` does to a model what ``cltrain.ChannelsLast`` does at setup (the
channels-last format of each parameter's rank, and the kernel guardrails); ``convert_batch``
puts a batch's model inputs in that layout by the same rules as the callback (only the inputs:
targets and masks keep their layout, see ``cltrain.layout.batches``). Convert before
``fabric.setup`` / DDP / ``torch.compile``, so every rank wraps and compiles the final layout.
``verify_layout`` runs one step in both layouts on copies of the model (``cltrain.check.compare``) and
puts the part of the model whose code assumes NCHW in NCHW, as the callback does on its first batch.
A model that FSDP2 (``fully_shard``) will shard is converted with ``convert_model(model, sharded=True)``: its
weights stay NCHW, which FSDP2 requires, and ``convert_batch`` still feeds the convolutions channels_last
inputs (``cltrain.sharding``); call ``verify_layout`` on it before ``fully_shard``.
``contiguous_copy`` gives an NCHW copy of a trained model for ``torch.onnx.export``,
``torch.export`` and TorchScript, whose graphs should not depend on how training strided the weights.

Example (Fabric; a plain loop is the same without the ``fabric`` lines)::

    from lightning.fabric import Fabric
    from cltrain.loops import convert_batch, convert_model

    fabric = Fabric(accelerator="cpu")
    model = convert_model(torchvision.models.resnet18())
    verify_layout(model, next(iter(loader)), step=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    for batch in fabric.setup_dataloaders(loader):
        x, y = convert_batch(batch)
        fabric.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from cltrain.check.compare import LayoutCheck
from cltrain.check.plain_step import check_plain_step
from cltrain.layout import to_contiguous
from cltrain.layout.batches import Inputs, check_inputs, restride_batch
from cltrain.options import check_flags, check_mode
from cltrain.host import Host
from cltrain.session import LayoutSession
from cltrain.sharding import sharding_of

__all__ = ["contiguous_copy", "convert_batch", "convert_model", "verify_layout"]

log = logging.getLogger(__name__)
B = TypeVar("B")
M = TypeVar("M", bound=nn.Module)


def convert_model(
    model: M,
    mode: str = "full",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    guard: bool = True,
    sharded: bool = False,
) -> M:
    """Put ``model`` in channels_last, in place, with the kernel guardrails, as ``ChannelsLast`` does.

    Args:
        model: the model, before ``fabric.setup``, DDP, ``fully_shard`` or ``torch.compile`` wrap it.
        mode: ``"full"`` restrides every 4-D/5-D parameter and buffer (``channels_last`` for
            4-D, ``channels_last_3d`` for 5-D); ``"conv"`` only convolution weights.
        sharded: the model will be sharded (``fully_shard``, FSDP, DeepSpeed), which keeps parameters
            contiguous: its parameters and buffers are put in NCHW instead and only the inputs
            (``convert_batch``) are channels_last, so the convolutions still run NHWC kernels. A model
            sharded already is treated so, and not restrided.
        device: where the model will train (the guardrails depend on the backend); default
            the device of its parameters.
        dtype: the dtype its convolutions will compute in: the autocast dtype
            (``torch.bfloat16``, ``torch.float16``), or ``None`` for fp32.
        guard: apply ``cltrain.guardrails.apply_guardrails`` (one log line per known
            kernel fault worked around); ``False`` trains the bare kernels. Where a ``torch.distributed`` group
            of several ranks is initialised (``fabric.launch()``), the guardrails cover the modules any rank finds
            hazardous, so every rank calls ``convert_model`` (as every rank builds its model).

    Returns:
        ``model`` itself (its ``Parameter`` objects are kept: an optimizer made before still works).

    Raises:
        ValueError: ``mode`` is not ``"full"`` or ``"conv"``, or ``guard`` or ``sharded`` is not a bool.

    Example::

        >>> model = convert_model(torch.nn.Conv2d(3, 8, 3))
        >>> model.weight.is_contiguous(memory_format=torch.channels_last)
        True
        >>> convert_model(torch.nn.Conv2d(3, 8, 3), sharded=True).weight.is_contiguous()  # then fully_shard
        True
    """
    check_mode("convert_model", mode)
    check_flags("convert_model", guard=guard, sharded=sharded)
    engine = sharding_of(model)
    engine = engine if engine is not None else "" if sharded else None  # "": an engine not named yet
    return LayoutSession(mode, guard=guard, host=Host(_say)).convert(model, device=device, dtype=dtype, sharding=engine,
                                                                     owner=f"convert_model(mode={mode!r})")


def convert_batch(batch: B, inputs: Inputs = None, layout: str = "channels_last", model: nn.Module | None = None) -> B:
    """Put the model inputs of ``batch`` in ``layout``, in place, and return ``batch``.

    The same rules as ``ChannelsLast``: the batch when it is one tensor, the first element of a
    tuple/list batch, the image keys of a dict batch, or what ``inputs`` names (a key, an index, a
    list of them, ``"all"``); only floating 4-D/5-D tensors, and nothing is copied when they already
    are in ``layout``. The tensor objects stay the same (their ``.data`` is swapped).

    Args:
        batch: a tensor, or a tuple, list, dict, namedtuple or dataclass of them (nested).
        inputs: which tensors are the model's inputs; see ``cltrain.layout.batches``.
        layout: ``"channels_last"`` or ``"contiguous"``.
        model: the model that reads the batch: tells a 5-D stack of images ``(B, T, C, H, W)`` (each frame put
            channels_last) from a clip ``(N, C, T, H, W)`` (``channels_last_3d``) by its first convolution's
            input channels (``cltrain.layout.stacks``); without it, by the sizes.

    Returns:
        ``batch``.

    Raises:
        ValueError: a bad ``inputs`` or ``layout``, or a key or index named in ``inputs`` that ``batch`` lacks.

    Example::

        >>> x, heatmap = convert_batch((torch.randn(2, 3, 8, 8), torch.rand(2, 5, 8, 8)))
        >>> x.is_contiguous(memory_format=torch.channels_last), heatmap.is_contiguous()
        (True, True)
    """
    if layout not in ("channels_last", "contiguous"):
        raise ValueError(f"convert_batch(layout={layout!r}): expected 'channels_last' or 'contiguous'.")
    restride_batch(batch, layout, inputs=check_inputs(inputs, owner="convert_batch"), model=model)
    return batch


def verify_layout(
    model: nn.Module,
    batch: Any,
    step: Callable[[nn.Module, Any], Any] | None = None,
    *,
    inputs: Inputs = None,
    autocast_dtype: torch.dtype | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    samples: int | None = 4,
    report: bool = True,
) -> LayoutCheck:
    """Check one step in both layouts and apply what the check chooses to ``model``, in place.

    Call it once, after ``convert_model`` and before ``fabric.setup`` / DDP / ``fully_shard`` / ``torch.compile``,
    with a real batch; for a sharded run, on the model ``convert_model(model, sharded=True)`` gave (NCHW
    weights, channels_last inputs). A model sharded already cannot be copied: it is reported not checked.
    Where the code in the model or in ``step`` raises or diverges only in channels_last, the
    smallest part holding it runs in NCHW (``cltrain.check.fallback``); where that is the whole model, the
    model runs in NCHW (its inputs are put in NCHW on the way in, so the loop may keep converting batches).
    One log line says what was found and done. The model's weights, gradients and BatchNorm statistics
    and the RNG state are not changed. Where a ``torch.distributed`` group of several ranks is initialised
    (``fabric.launch()``), every rank calls it: rank 0 checks its batch and every rank applies what rank 0 chose
    (a model with ``SyncBatchNorm`` is then not checked: its copies would wait for the other ranks).

    Args:
        model: the model, converted by ``convert_model``.
        batch: one batch as the loop gets it (on the model's device).
        step: ``step(model, batch) -> loss`` (or the outputs): the forward and the loss code of the loop;
            by default the model is called on the batch's input (``inputs``) and its outputs reduced by a
            fixed random projection.
        inputs: which tensors of ``batch`` are the model's inputs (``convert_batch``'s rules).
        autocast_dtype: the loop's autocast dtype: the check runs the step in float32, and under autocast in
            this dtype only where it cannot run in float32.
        optimizer: the loop's optimizer: its step runs after the backward on a copy of it and its state (the
            optimizer itself is not touched), and the parameters' updates are compared too, on the same gradient
            values in both layouts; one of torch's elementwise optimizers
            (``cltrain.check.copies.ELEMENTWISE_OPTIMIZERS``: SGD, Adam, AdamW, ...), whose update is the same in
            any layout, is not re-run.
        samples: check the batch's first ``samples`` samples (``cltrain.check.budget``: the whole batch where
            the step cannot run on them, fewer where memory runs out); ``None``: the whole batch.
        report: log the result's line (``False``: the caller reports it in its own way).

    Returns:
        The ``cltrain.check.compare.LayoutCheck``.
    """
    inputs = check_inputs(inputs, owner="verify_layout")
    host = Host(_say, optimizers=lambda: [optimizer] if optimizer is not None else [])
    run = lambda: check_plain_step(model, batch, step, inputs=inputs,  # noqa: E731
                                   autocast_dtype=autocast_dtype, optimizer=optimizer, samples=samples)
    return LayoutSession.of(model, dtype=autocast_dtype, host=host).check("train", model, run, report=report)


def _say(message: str, warn: bool) -> None:
    log.log(logging.WARNING if warn else logging.INFO, message)


def contiguous_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every parameter and buffer in NCHW/NCDHW strides, for export.

    ``torch.onnx.export``, ``torch.export`` and TorchScript then see the layout every backend
    expects; the copy computes the same function (the layout changes strides, not values). A
    model wrapped by Fabric, DDP or ``torch.compile`` is unwrapped first. Train/eval mode is
    kept: call ``.eval()`` before exporting, as for any model. Gradients are not copied.

    Returns:
        The copy; ``model`` is not modified.

    Raises:
        ValueError: ``model`` is sharded (FSDP2, FSDP, DeepSpeed), which cannot be copied.

    Example::

        >>> trained = convert_model(torch.nn.Conv2d(3, 8, 3))
        >>> export_me = contiguous_copy(trained).eval()
        >>> export_me.weight.is_contiguous(), trained.weight.is_contiguous()
        (True, False)
    """
    bare = _unwrap(model)
    engine = sharding_of(bare)
    if engine is not None:
        raise ValueError(f"contiguous_copy: the model is sharded by {engine}, which cannot be copied; load its full "
                         "state dict (get_model_state_dict with full_state_dict=True) into an unsharded model instead.")
    grads = {p: p.grad for p in bare.parameters()}
    for p in grads:  # deepcopy would copy them, in the training layout
        p.grad = None
    try:
        clone = copy.deepcopy(bare)
    finally:
        for p, g in grads.items():
            p.grad = g
    return to_contiguous(clone)


def _unwrap(model: nn.Module) -> nn.Module:
    # torch.compile's OptimizedModule keeps the model as `_orig_mod`; Fabric's wrapper and DDP as `.module`.
    from lightning.fabric.wrappers import is_wrapped

    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif is_wrapped(model) or isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model
