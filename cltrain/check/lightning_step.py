"""The first-batch layout check on a Lightning step, for ``ChannelsLast``: the step called as Lightning calls it, on
copies of the LightningModule that see the real trainer, in which precision.

A copy (``lightning_copy``) reads every value of the real trainer (``current_epoch``, ``global_step``, ``datamodule``,
``gradient_clip_val``, ``accumulate_grad_batches``, ``estimated_stepping_batches``, the strategy's devices, ...)
through a ``TrainerView``. What would reach the real run from a step is the copy's own instead: the trainer's
``optimizers``, ``lr_scheduler_configs`` and ``lightning_module``, ``self.optimizers()`` (wrapped in the
``LightningOptimizer`` of the module's own package), ``self.manual_backward``; ``self.log``, ``self.log_dict`` and the
loggers write nothing; callbacks' methods bound to the model as hooks act on the copy (``cltrain.layout.closures``).
Nothing can be set on the trainer, and in a distributed run a collective (``all_gather``, ``reduce``, ``barrier``,
...) raises: the check runs on rank 0 alone. The same holds for ``lightning.pytorch`` and ``pytorch_lightning``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cltrain.check.compare import LayoutCheck, check_layout, projection_loss
from cltrain.check.copies import copy_optimizer, copy_schedulers, eager_copy, elementwise, float32_tensors, \
    half_dtype, in_float32, shared_note
from cltrain.check.fallback import map_images
from cltrain.check.result import COPY_LIMIT, MODEL_ALONE, STEP_RAISED
from cltrain.layout.batches import Inputs, first_image_tensor, restride_batch
from cltrain.layout.stacks import to_input_layout
from cltrain.lightning_access import is_lightning_module, lightning_package, overrides, step_arguments, step_target
from cltrain.precision import autocast_dtype

__all__ = ["STEPS", "TrainerView", "check_lightning_step", "lightning_copy"]

#: The step method of each stage.
STEPS = {"train": "training_step", "validation": "validation_step", "test": "test_step", "predict": "predict_step"}

_COLLECTIVES = frozenset({"all_gather", "reduce", "all_reduce", "broadcast", "barrier", "reduce_boolean_decision"})


class _Silent:
    """A logger stand-in: every attribute and call gives itself back, nothing is written."""

    def __getattr__(self, name: str) -> Any:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self

    def __bool__(self) -> bool:
        return False

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _StrategyView:
    """The real strategy read through; its collectives raise in a distributed run (the check runs on one rank)."""

    def __init__(self, strategy: Any) -> None:
        object.__setattr__(self, "_strategy", strategy)

    def __getattr__(self, name: str) -> Any:
        if name in _COLLECTIVES:
            raise RuntimeError(f"trainer.strategy.{name} is a collective, which {COPY_LIMIT} cannot run: the check "
                               "runs on rank 0 alone")
        return getattr(self._strategy, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"trainer.strategy.{name} cannot be set from {COPY_LIMIT}")


class TrainerView:
    """What a check copy sees as ``self.trainer``: the real trainer's attributes, read through, except what the copy
    owns (``lightning_module`` and ``model``: the copy; ``optimizers`` and ``lr_scheduler_configs``: the copies;
    ``callbacks``: the real callbacks, with the module's hooks already bound to the copy) and the loggers (silent).
    Nothing can be set."""

    def __init__(self, trainer: Any, module: nn.Module, optimizers: list[Any], schedulers: list[Any]) -> None:
        owned = {"lightning_module": module, "model": module, "optimizers": optimizers,
                 "lr_scheduler_configs": schedulers, "logger": _Silent(), "loggers": []}
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "_owned", owned)

    def __getattr__(self, name: str) -> Any:
        owned = object.__getattribute__(self, "_owned")
        if name in owned:
            return owned[name]
        value = getattr(object.__getattribute__(self, "_trainer"), name)
        if name == "strategy" and getattr(self._trainer, "world_size", 1) > 1:
            return _StrategyView(value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"trainer.{name} cannot be set from {COPY_LIMIT}")


def lightning_copy(pl_module: nn.Module, trainer: Any, memo: dict[int, Any] | None = None,
                   optimizers: list[Any] | None = None, schedulers: list[Any] | None = None) -> nn.Module:
    """A true copy of ``pl_module`` (``cltrain.check.copies.eager_copy``) whose step leaves no trace on the real run:
    ``self.trainer`` is a ``TrainerView`` of ``trainer``; ``self.log`` and ``self.log_dict`` do nothing;
    ``self.optimizers()`` gives ``optimizers`` (copies the caller fills after the copy, ``memo`` mapping each
    original to its copy) as Lightning does; ``self.manual_backward`` is the loss's ``backward``. Datasets and data
    loaders it holds are shared, not copied."""
    from torch.utils.data import DataLoader, Dataset

    memo = {} if memo is None else memo
    memo.update({id(v): v for v in vars(pl_module).values() if isinstance(v, (Dataset, DataLoader))})
    clone = eager_copy(pl_module, memo)  # a LightningModule's __getstate__ drops its trainer
    optimizers = optimizers if optimizers is not None else []
    schedulers = schedulers if schedulers is not None else []
    view = TrainerView(trainer, clone, optimizers, schedulers)
    wrapped: dict[int, Any] = {}
    for module in clone.modules():
        if is_lightning_module(module):
            vars(module)["_trainer"] = view
            vars(module)["log"] = vars(module)["log_dict"] = _no_log
            vars(module)["optimizers"] = _optimizers_of(clone, optimizers, wrapped)
            vars(module)["manual_backward"] = _backward
    return clone


class _CopyStrategy:
    """What a copy's ``LightningOptimizer`` steps through: the optimizer's own ``step`` with the closure."""

    def __init__(self, module: nn.Module) -> None:
        self.lightning_module = module

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return optimizer.step(closure=closure, **kwargs)


def _optimizers_of(module: nn.Module, optimizers: list[Any], wrapped: dict[int, Any]) -> Callable[..., Any]:
    """``self.optimizers`` of a copy: its optimizers in the ``LightningOptimizer`` of its package, or bare."""
    wrapper = importlib.import_module(f"{lightning_package(module)}.core.optimizer").LightningOptimizer

    def optimizers_(use_pl_optimizer: bool = True) -> Any:
        found = list(optimizers)
        if use_pl_optimizer:
            found = [wrapped.setdefault(id(o), _wrap(wrapper, module, o)) for o in found]
        return found[0] if len(found) == 1 else found

    return optimizers_


def _wrap(wrapper: type, module: nn.Module, optimizer: Any) -> Any:
    lightning_optimizer = wrapper(optimizer)
    lightning_optimizer._strategy = _CopyStrategy(module)
    return lightning_optimizer


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def _backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    loss.backward(*args, **kwargs)


def check_lightning_step(trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int, stage: str, *,
                         inputs: Inputs = None, one_d: bool = False, dataloader_idx: int | None = None,
                         convert_inputs: bool = True) -> LayoutCheck:
    """``cltrain.check.compare.check_layout`` on a Lightning step: ``stage``'s step method of copies of
    ``pl_module`` (``training_step``, ``validation_step``, ...), called with the arguments Lightning gives it
    (``cltrain.lightning_access.step_arguments``), on copies of ``batch`` in each layout.

    In training the whole step runs as the Trainer runs it: the step, the backward, ``on_after_backward``,
    ``on_before_optimizer_step``, ``configure_gradient_clipping`` and the optimizer's step, on copies of the
    optimizers and their state (a manual-optimization step gets the copies from ``self.optimizers()``).
    Where the step cannot run on the copies, the model's forward is checked alone on the inputs the step gave it
    (or the batch's image tensor), and the line says so. Under mixed precision the check runs in float32 first and
    in the training precision only where float32 raises. ``convert_inputs=False`` (the run leaves its inputs as they
    come): both copies get the batch as it is.
    """
    from lightning_utilities.core.apply_func import apply_to_collection

    precision = trainer.strategy.precision_plugin
    method = STEPS[stage]
    own_context = precision.train_step_context if stage == "train" else getattr(
        precision, f"{'val' if stage == 'validation' else stage}_step_context")
    grad = torch.enable_grad if stage == "train" else torch.no_grad
    # Mixed precision's rounding would hide a wrong op in noise (bf16 gradients through BatchNorm differ
    # by O(1) between any two kernels): check in float32 first, in the training precision if that raises.
    # 16-bit weights ("bf16-true") likewise: their copies in float32 first (_in_float32).
    half = half_dtype(pl_module) is not None
    contexts = [_in_float32 if half else contextlib.nullcontext, own_context] \
        if autocast_dtype(trainer.precision) is not None or half else [own_context]
    train = stage == "train"
    manual = train and not pl_module.automatic_optimization
    optimizers = list(trainer.optimizers) if train else []
    # torch's elementwise optimizers give the same update in any layout: with no code of the user's between the
    # backward and the step, that step is not re-run on the copies.
    hooks = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")
    after_code = any(overrides(m, pl_module) for m in hooks) or bool(trainer.gradient_clip_val)
    update = train and (manual or after_code or not elementwise(optimizers))
    uncopied: dict[str, str] = {}

    def batch_in(layout: str, clone: nn.Module, upcast: bool = False) -> Any:
        copied = apply_to_collection(batch, torch.Tensor, lambda t: (float32_tensors(t) if upcast else t).clone())
        if convert_inputs:
            restride_batch(copied, layout, one_d=one_d, inputs=inputs, model=clone)
        return copied

    def copy_model(module: nn.Module, upcast: bool = False) -> nn.Module:
        memo: dict[int, Any] = {}
        copies: list[torch.optim.Optimizer] = []
        schedulers: list[Any] = []
        clone = lightning_copy(module, trainer, memo=memo, optimizers=copies, schedulers=schedulers)
        for optimizer in optimizers:  # what self.optimizers() gives the copy (a fresh run's state is empty)
            try:
                copies.append(copy_optimizer(optimizer, memo))
                memo[id(optimizer)] = copies[-1]
            except TypeError as error:
                uncopied.setdefault(type(optimizer).__name__, str(error))
        if train:
            schedulers += copy_schedulers(trainer.lr_scheduler_configs, memo)
        return in_float32(clone, copies) if upcast else clone

    def after_backward(clone: nn.Module) -> None:
        clone.on_after_backward()
        for optimizer in clone.trainer.optimizers:
            clone.on_before_optimizer_step(optimizer)
            clone.configure_gradient_clipping(optimizer, gradient_clip_val=trainer.gradient_clip_val,
                                              gradient_clip_algorithm=trainer.gradient_clip_algorithm)
            optimizer.step()

    # DDP has wrapped the model by now: its buckets keep the parameters' layout, so keep that layout.
    options = dict(step_owner=pl_module, copy_model=copy_model, time_fallbacks=trainer.world_size == 1,
                   after_backward=after_backward if update and not manual else None, updates=update,
                   update_owner=_update_owner(pl_module, optimizers, hooks))
    fed: list[Any] = []  # what the step gave the model at its first call, in the reference run
    result = None
    for context in contexts:  # the step in float32 first, then in the training precision

        def step_code(clone: nn.Module, layout: str, context: Any = context) -> Any:
            copied = batch_in(layout, clone, upcast=context is _in_float32)

            def note_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                if not fed and layout == "contiguous":
                    fed.append(map_images((args, kwargs), lambda t: t.detach().clone(), ranks=None))

            handle = step_target(clone).register_forward_pre_hook(note_input, with_kwargs=True)
            try:
                with grad(), context():
                    result = getattr(clone, method)(*step_arguments(clone, method, copied, batch_idx, dataloader_idx))
            finally:
                handle.remove()
            return None if manual else result  # a manual step has run its own backward

        result = check_layout(pl_module, step_code, **{**options, "copy_model": functools.partial(
            copy_model, upcast=context is _in_float32)})
        if result.verdict != "not checked":
            break
    if result.verdict == "not checked" and result.step_raised is not None:
        for context in contexts:  # the step cannot run on the copies in any precision: the model alone

            def model_only(clone: nn.Module, layout: str, context: Any = context) -> Any:
                if fed:
                    args, kwargs = map_images(fed[0], torch.Tensor.clone, ranks=None)
                    if layout == "channels_last":
                        args, kwargs = map_images((args, kwargs), lambda t: to_input_layout(t, clone))
                else:
                    copied = batch_in(layout, clone, context is _in_float32)
                    args, kwargs = (first_image_tensor(copied, inputs),), {}
                with grad(), context():
                    out = step_target(clone)(*args, **kwargs)
                return projection_loss(out) if train else out

            copies = functools.partial(copy_model, upcast=context is _in_float32)
            alone = _model_alone(result, pl_module, model_only, copies, trainer, fed, batch, inputs)
            if alone.verdict != "not checked" or context is contexts[-1]:
                result = alone
                break
    notes = [f"the optimizer step of {name} was not checked ({why})" for name, why in uncopied.items()]
    notes += [note for note in (shared_note(pl_module),) if note is not None]
    return dataclasses.replace(result, notes=(*result.notes, *notes)) if notes else result


@contextlib.contextmanager
def _in_float32() -> Any:
    """The attempt whose copies compute in float32 (``cltrain.check.copies.in_float32``), in no precision context."""
    yield


def _model_alone(step_result: LayoutCheck, pl_module: nn.Module, model_only: Callable[[nn.Module, str], Any],
                 copy_model: Callable[[nn.Module], nn.Module], trainer: Any, fed: list[Any], batch: Any,
                 inputs: Inputs) -> LayoutCheck:
    """The model's forward checked alone, on what the step gave it (or the batch's image tensor), where the step
    could not run on the copies; the line says which was checked."""
    why = f"({step_result.step_raised})"
    if not fed and first_image_tensor(batch, inputs) is None:
        return dataclasses.replace(step_result, reason=f"{STEP_RAISED} {why}, before it called the model, and the "
                                   "batch holds no floating image tensor to check the model alone on")
    alone = check_layout(pl_module, model_only, step_owner=pl_module, copy_model=copy_model,
                         time_fallbacks=trainer.world_size == 1)
    if alone.verdict == "not checked":
        return dataclasses.replace(step_result, reason=f"{STEP_RAISED} {why}; the model alone: {alone.reason}")
    on = "the inputs the step gave it" if fed else "the batch's image tensor"
    return dataclasses.replace(alone, notes=(f"{MODEL_ALONE}, on {on}: {STEP_RAISED} {why}", *alone.notes),
                               step_raised=step_result.step_raised)


def _update_owner(pl_module: Any, optimizers: list[Any], hooks: tuple[str, ...]) -> tuple[Any, str] | None:
    """Whose code a divergence after the backward is in: the first of the user's hooks there where every optimizer
    is one of torch's elementwise ones (they update alike in any layout), else the optimizer's ``step``."""
    mine = [hook for hook in hooks if overrides(hook, pl_module)]
    if mine and elementwise(optimizers):
        return pl_module, mine[0]
    return (optimizers[0], "step") if optimizers else None
