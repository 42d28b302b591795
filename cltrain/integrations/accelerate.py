"""``prepare_channels_last``: channels_last training in a hand-written Accelerate loop, in one line.

``accelerator.prepare`` places the model, wraps it (DDP, FSDP) and compiles it last: the layout must be
final before it. ``prepare_channels_last(model, accelerator)`` is a front door of ``cltrain.session.LayoutSession``:
it converts the model for the accelerator's device and mixed precision (the channels-last format of each
parameter's rank and the kernel guardrails) and attaches ``cltrain.integrations.inputs_hook.ChannelsLastInputs``: the
loop's ``model(**batch)`` / ``model(x)`` then gets its images in the model's layout, the first training and
evaluation batch is checked, the first training steps race the layouts (a step ends where the next training
forward starts after the optimizer's step, so under gradient accumulation a step is the calls up to it) and keep
the faster, whatever moved a parameter's layout is put back when the loop turns to evaluation, and
``accelerator.save_state`` / ``load_state`` carry the verdicts and the decision (in a file of their folder,
``cltrain_layout.json``; a folder saved without cltrain loads too) and give the restored optimizer state its
parameters' strides. The same by hand, for a
loop that prefers to see each step: ``cltrain.loops.ChannelsLastRun`` (docs/guides/huggingface.md).

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

import json
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from torch import nn

from cltrain.atomic import atomic_write_text
from cltrain.check.resume import run_fingerprint
from cltrain.integrations.inputs_hook import IMAGE_ARGUMENTS, ChannelsLastInputs, argument_names
from cltrain.check.budget import DEFAULT_SAMPLES
from cltrain.options import check_copies, check_flags, check_layout_choice, check_mode, check_module, check_positive
from cltrain.precision import autocast_dtype
from cltrain.session import LayoutSession
from cltrain.sharding import sharding_of

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["prepare_channels_last"]

M = TypeVar("M", bound=nn.Module)

def prepare_channels_last(
    model: M,
    accelerator: Accelerator,
    *,
    mode: str = "full",
    inputs: str | Sequence[str] = IMAGE_ARGUMENTS,
    convert_inputs: bool = True,
    guard: bool = True,
    verify: bool = True,
    layout: str = "auto",
    copies: Callable[[], Iterable[nn.Module]] | nn.Module | Sequence[nn.Module] | None = None,
    check_samples: int | None = DEFAULT_SAMPLES,
) -> M:
    """Put ``model`` in channels_last for ``accelerator``, in place, and run its calls through a layout session.

    Args:
        model: the model, before ``accelerator.prepare``.
        accelerator: the ``accelerate.Accelerator`` that will prepare it (its ``device`` and ``mixed_precision``
            choose the guardrails and the check's autocast dtype; its optimizers' state follows every change of a
            parameter's layout; ``accelerator.log`` gets both layouts' step times).
        mode: ``"full"`` restrides every 4-D/5-D parameter and buffer; ``"conv"`` only convolution weights.
        inputs: the forward arguments holding images (the first positional argument is converted too).
        convert_inputs: put those arguments in the model's layout; ``False``: only the model is converted (its first
            convolution converts the activations) and the arguments stay as they come.
        guard: apply ``cltrain.guardrails.apply_guardrails``.
        verify: check the first training and evaluation batch (``ChannelsLastInputs.of(model).layout_checks``).
        layout: ``"auto"`` races channels_last against NCHW on the first training steps and keeps the faster;
            ``"channels_last"`` or ``"contiguous"`` pins one.
        copies: the model's copies that should follow its layout (an EMA's ``AveragedModel`` or timm's
            ``ModelEmaV3``): a module, a list, or a function giving them, asked at each change of layout.
        check_samples: the check runs on this many samples of the batch (``cltrain.check.budget``); ``None``: the
            whole batch.

    Returns:
        ``model`` itself (its parameters are kept). Under FSDP or DeepSpeed its weights stay NCHW, as those
        engines require, and only its image inputs are channels_last (``cltrain.sharding``).

    Raises:
        ValueError: a bad ``mode``, ``inputs``, ``convert_inputs``, ``guard``, ``verify``, ``layout``, ``copies`` or
            ``check_samples``; a ``model`` that is not a module, an ``accelerator`` that is not an ``Accelerator``, or
            one ``accelerator.prepare`` wrapped in DDP already.
    """
    names = argument_names(inputs, f"prepare_channels_last(inputs={inputs!r})")
    check_mode("prepare_channels_last", mode)
    check_flags("prepare_channels_last", convert_inputs=convert_inputs, guard=guard, verify=verify)
    check_layout_choice("prepare_channels_last", layout)
    copied = check_copies("prepare_channels_last", copies)
    check_positive("prepare_channels_last", "check_samples", check_samples, optional=True)
    check_module("prepare_channels_last", model)
    if not all(hasattr(accelerator, name) for name in ("device", "mixed_precision", "register_load_state_pre_hook")):
        raise ValueError(f"prepare_channels_last(accelerator={accelerator!r}): expected the accelerate.Accelerator that "
                         "will prepare the model (prepare_channels_last(model, accelerator)).")
    if isinstance(model, nn.parallel.DistributedDataParallel) or isinstance(getattr(model, "_orig_mod", None),
                                                                          nn.parallel.DistributedDataParallel):
        # its first-batch check would run DDP's collectives on one rank alone (gloo aborts, NCCL hangs)
        raise ValueError("prepare_channels_last(model=<DistributedDataParallel>): the model is already prepared; call "
                         "prepare_channels_last(model, accelerator) before accelerator.prepare(model, ...).")
    dtype = autocast_dtype({"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(str(accelerator.mixed_precision), ""))
    hook = ChannelsLastInputs(names, verify=verify, autocast_dtype=dtype)
    hook.optimizers = _Prepared(accelerator)  # the optimizers accelerator.prepare makes later
    host = hook.host(copies=copied, log=lambda metrics: accelerator.log(metrics))
    session = LayoutSession(mode, layout=layout, guard=guard, verify=verify, host=host, check_samples=check_samples,
                            convert_inputs=convert_inputs)
    # a step is the calls up to the optimizer's step (under accelerator.accumulate() or a loop's own accumulation)
    session.watch_optimizers = True
    session.fingerprint = lambda: run_fingerprint(model, precision=str(accelerator.mixed_precision),
                                                  device=accelerator.device.type)
    # FSDP and DeepSpeed (GPU only in Accelerate) keep parameters contiguous: then only the inputs go channels_last.
    session.start(model, device=accelerator.device, dtype=dtype, sharding=sharding_of(model, accelerator),
                  owner=f"prepare_channels_last(mode={mode!r})")
    hook.attach(model, session)
    _carry_state(accelerator, hook)
    return model


class _Prepared:
    """The optimizers an ``Accelerator`` has prepared, as they are when asked."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def __iter__(self):  # noqa: ANN204
        return iter(getattr(self.accelerator, "_optimizers", ()))


#: The sessions' states in a folder ``accelerator.save_state`` writes.
STATE_FILE = "cltrain_layout.json"
_HOOKS: weakref.WeakKeyDictionary[Any, list[ChannelsLastInputs]] = weakref.WeakKeyDictionary()


def _carry_state(accelerator: Accelerator, hook: ChannelsLastInputs) -> None:
    """``save_state`` writes the sessions' states beside Accelerate's files, one per ``prepare_channels_last`` call on
    ``accelerator`` in call order (a GAN's two models), and ``load_state`` reads them back. A file of our own, not
    ``register_for_checkpointing``: Accelerate refuses a folder whose count of registered objects differs, so a state
    saved before adopting cltrain (or loaded after dropping it) would not load."""
    hooks = _HOOKS.setdefault(accelerator, [])
    hooks.append(hook)
    if len(hooks) > 1:  # the first call's hooks carry every session
        return

    def save(models: Any, weights: Any, output_dir: str) -> None:
        for each in hooks:
            each.run_pending()  # a state loaded and saved again before any call
            each.session.close_stepped(each.model)  # saved after the optimizer's step: the step is in it
        on_each_node = getattr(getattr(accelerator, "project_configuration", None), "save_on_each_node", False)
        if accelerator.is_main_process or (on_each_node and accelerator.is_local_main_process):
            states = [each.session.state_dict() for each in hooks]
            atomic_write_text(os.path.join(output_dir, STATE_FILE), json.dumps({"sessions": states}))

    def load(models: Any, input_dir: str) -> None:
        path = os.path.join(input_dir, STATE_FILE)
        states = json.loads(Path(path).read_text())["sessions"] if os.path.isfile(path) else []  # saved without us
        for i, each in enumerate(hooks):
            state = states[i] if i < len(states) else None

            def restore(each: ChannelsLastInputs = each, state: dict[str, Any] | None = state) -> None:
                # once the optimizers are restored (after this hook), at the model's next call
                each.session.load_state_dict(state, model=each.model)
                each.session.resume()  # the restored optimizer state takes its parameters' strides

            each.pending[:] = [restore]  # a second load_state replaces the first's

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
