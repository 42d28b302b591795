"""Reaching the modules around a LightningModule through public objects only: the module a
batch goes through, copies of it that other callbacks hold, a hook that runs once after the
module's own, optimizer state that should follow its parameter's strides, and true copies of a
module for the layout check (eager, bound to themselves, seeing the trainer read only)."""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning_utilities.core.overrides import is_overridden
from torch import nn

from cltrain.layout import memory_format_for
from cltrain.layout.closures import callables_of, rebound

__all__ = ["COPY_LIMIT", "ReadOnlyTrainer", "detached_copy", "eager_copy", "model_copies", "overrides",
           "rebind_methods", "restride_optimizer_state", "run_after", "step_target", "undo_run_after"]

#: Named in every error a copy's ``ReadOnlyTrainer`` raises: a limit of the copy, not of the user's code.
COPY_LIMIT = "the layout check's copy"


def run_after(module: nn.Module, hook: str, then: Callable[[], None]) -> None:
    """Make ``module.<hook>()`` call ``then()`` after itself, once, then restore the hook."""
    if getattr(module.__dict__.get(hook), "_cltrain_once", False):
        del module.__dict__[hook]  # left from a run that stopped early
    original = getattr(module, hook)

    @functools.wraps(original)  # keeps Lightning's is_overridden() answer unchanged
    def once(*args: Any, **kwargs: Any) -> Any:
        module.__dict__.pop(hook, None)
        result = original(*args, **kwargs)
        then()
        return result

    once._cltrain_once = True  # type: ignore[attr-defined]
    # nn.Module.__setattr__ would accept this too, but __dict__ keeps it out of state_dict logic.
    module.__dict__[hook] = once


def undo_run_after(module: nn.Module) -> None:
    """Remove any hook wrapper ``run_after`` left on ``module`` (a run that stopped early)."""
    for hook in ("setup", "configure_model"):
        if getattr(module.__dict__.get(hook), "_cltrain_once", False):
            del module.__dict__[hook]


def model_copies(trainer: Trainer, pl_module: LightningModule, exclude: Callback | None = None) -> list[nn.Module]:
    """The modules that ``trainer``'s callbacks hold as copies of ``pl_module``.

    A copy is an ``nn.Module`` attribute of a callback with the same parameter shapes as
    ``pl_module`` in the same order, and none of its parameter objects: the
    ``AveragedModel`` of Lightning's ``WeightAveraging`` / ``EMAWeightAveraging``, the
    deep-copied LightningModule of ``StochasticWeightAveraging``, or a user's own EMA
    callback's model. Only public objects are read (``trainer.callbacks`` and each
    callback's attributes), not the attribute names of any one callback.
    """
    params = list(pl_module.parameters())
    shapes = [p.shape for p in params]
    own = {id(p) for p in params}
    found: list[nn.Module] = []
    for callback in trainer.callbacks:
        if callback is exclude:
            continue
        for value in vars(callback).values():
            if not isinstance(value, nn.Module) or value is pl_module or any(v is value for v in found):
                continue
            theirs = list(value.parameters())
            if [p.shape for p in theirs] == shapes and not any(id(p) in own for p in theirs):
                found.append(value)
    return found


def overrides(method: str, pl_module: nn.Module) -> bool:
    """Whether ``pl_module``'s class defines ``method`` itself: for a ``lightning.pytorch`` or a
    ``pytorch_lightning`` LightningModule alike (Lightning's ``is_overridden`` knows only its own package)."""
    parent = next((cls for cls in type(pl_module).__mro__ if cls.__name__ == "LightningModule"
                   and cls.__module__ in ("lightning.pytorch.core.module", "pytorch_lightning.core.module")), None)
    return parent is not None and is_overridden(method, pl_module, parent)


def step_target(pl_module: LightningModule) -> nn.Module:
    """The module a batch goes through: the LightningModule if it defines ``forward``, else its
    largest child (``self.model``, ``self.net``, ...)."""
    if overrides("forward", pl_module):
        return pl_module
    children = [m for m in pl_module.children() if any(True for _ in m.parameters())]
    if not children:
        raise ValueError(
            f"ChannelsLast: {type(pl_module).__name__} defines no forward() and has no child module with "
            "parameters to time or audit; define forward(), or use mode='full' without audit."
        )
    return max(children, key=lambda m: sum(p.numel() for p in m.parameters()))


def restride_optimizer_state(optimizers: list[torch.optim.Optimizer]) -> None:
    """Give every optimizer state tensor (momentum buffer, Adam moment) its parameter's strides.

    A checkpoint restores them with the strides they were saved with, which may be another
    layout than their parameter's; each update would then mix layouts."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                for key, value in state.items():
                    if _needs_param_strides(value, param):
                        state[key] = torch.empty_like(param, dtype=value.dtype, device=value.device).copy_(value)


def _needs_param_strides(value: Any, param: torch.Tensor) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and memory_format_for(param) is not None
        and value.shape == param.shape
        and value.stride() != param.stride()
    )


class _Eager(nn.Module):
    """Stands in a copy for a ``torch.compile``d child: runs the module it wraps eagerly, under the same name."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod(*args, **kwargs)


def rebind_methods(obj: Any, memo: dict[int, Any], drop_class_wrappers: bool = False) -> None:
    """Instance attributes of ``obj`` that wrap a method bound to an original object (``memo``: original id ->
    copy): the method bound to its copy instead, unwrapped (a ``torch.compile`` wrapper around a step method
    runs eagerly on the copy). ``drop_class_wrappers``: also drop a wrapper around the class's own function
    (an LR scheduler's on an optimizer's ``step`` calls the original optimizer)."""
    for name, value in list(vars(obj).items()):
        if not callable(value) or isinstance(value, (nn.Module, torch.Tensor, type)):
            continue
        if isinstance(value, types.MethodType) and value.__self__ is obj:
            # deepcopy bound it to the copy already (accelerate's forward wrappers); its defaults may hold originals
            vars(obj)[name] = rebound(value, memo)
            continue
        try:
            inner = inspect.unwrap(value)
        except ValueError:
            continue
        if _compiled(value) and isinstance(inner, types.MethodType) and id(inner.__self__) in memo:
            vars(obj)[name] = types.MethodType(inner.__func__, memo[id(inner.__self__)])
        elif drop_class_wrappers and inner is not value and _unwrapped(getattr(type(obj), name, None)) is inner:
            del vars(obj)[name]
        else:  # a user's wrapper or closure over the original: the same code, holding the copy
            vars(obj)[name] = rebound(value, memo)


def _compiled(fn: Any) -> bool:
    """Whether ``fn`` or a function it wraps is a ``torch.compile`` wrapper."""
    for _ in range(16):
        if fn is None:
            return False
        if hasattr(fn, "_torchdynamo_orig_callable"):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _unwrapped(fn: Any) -> Any:
    try:
        return inspect.unwrap(fn) if fn is not None else None
    except ValueError:
        return None


def eager_copy(model: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """A deep copy of ``model`` that runs eagerly and only on itself: methods bound as instance attributes
    (Lightning's rebinding of a compiled module's steps) are bound to the copy, ``module.compile()`` is
    undone and ``torch.compile``d children run their module eagerly (module names unchanged); closures,
    partials, default arguments and hooks that hold the original (a wrapped ``forward``) hold the copy
    (``cltrain.layout.closures``); parameter gradient hooks are copied, likewise."""
    memo = {} if memo is None else memo
    clone = copy.deepcopy(model, memo)
    originals = dict(model.named_parameters())
    for name, param in clone.named_parameters():
        _copy_grad_hooks(originals.get(name), param, memo)
    for parent in list(clone.modules()):
        rebind_methods(parent, memo)
        for label, container, key, value in callables_of(parent):
            if not label.isidentifier():  # its hooks (its attributes are rebound above)
                container[key] = rebound(value, memo)
        if getattr(parent, "_compiled_call_impl", None) is not None:
            parent._compiled_call_impl = None
        if getattr(parent, "_compiler_ctx", None) is not None:
            parent._compiler_ctx = None
        for child_name, child in list(parent.named_children()):
            if isinstance(child, torch._dynamo.eval_frame.OptimizedModule if _dynamo_loaded() else ()):
                setattr(parent, child_name, _Eager(child._orig_mod))
    return clone


def _dynamo_loaded() -> bool:
    return "torch._dynamo" in sys.modules


def _copy_grad_hooks(original: torch.Tensor | None, param: torch.Tensor, memo: dict[int, Any]) -> None:
    if original is None:
        return
    for hook in (getattr(original, "_backward_hooks", None) or {}).values():
        param.register_hook(rebound(hook, memo))
    for hook in (getattr(original, "_post_accumulate_grad_hooks", None) or {}).values():
        param.register_post_accumulate_grad_hook(rebound(hook, memo))


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


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


# What a check copy's step may read from the real trainer: values, and the user's datamodule.
_TRAINER_READS = frozenset({
    "datamodule", "current_epoch", "global_step", "world_size", "num_devices", "num_nodes", "node_rank",
    "local_rank", "global_rank", "is_global_zero", "training", "validating", "testing", "predicting",
    "sanity_checking", "estimated_stepping_batches", "max_epochs", "min_epochs", "max_steps", "min_steps",
    "precision", "gradient_clip_val", "gradient_clip_algorithm", "accumulate_grad_batches", "log_every_n_steps",
    "check_val_every_n_epoch", "val_check_interval", "num_training_batches", "num_val_batches",
    "num_sanity_val_batches", "num_test_batches", "num_predict_batches", "default_root_dir", "state",
    "precision_plugin", "interrupted", "fast_dev_run", "overfit_batches", "limit_train_batches",
    "limit_val_batches", "limit_test_batches", "limit_predict_batches", "lightning_module",
})


class ReadOnlyTrainer:
    """What a check copy sees as ``self.trainer``: the real trainer's values read through (``datamodule``,
    ``current_epoch``, ``global_step``, ``world_size``, ``training``, ``estimated_stepping_batches``, ...),
    a silent ``logger``, no callbacks, the copy as ``lightning_module``, the copied ``optimizers`` and
    ``lr_scheduler_configs`` (each holding a copy of its scheduler); anything else (the loops, the strategy)
    raises ``AttributeError`` naming it, and nothing can be set."""

    def __init__(self, trainer: Trainer, module: nn.Module, optimizers: list[Any] | None = None,
                 schedulers: list[Any] | None = None) -> None:
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_optimizers", optimizers if optimizers is not None else [])
        object.__setattr__(self, "_schedulers", schedulers if schedulers is not None else [])

    def __getattr__(self, name: str) -> Any:
        if name == "lightning_module":
            return self._module
        if name in ("logger", "progress_bar_callback", "checkpoint_callback", "early_stopping_callback"):
            return _Silent() if name == "logger" else None
        if name in ("loggers", "callbacks", "checkpoint_callbacks", "early_stopping_callbacks"):
            return []
        if name == "optimizers":
            return self._optimizers
        if name == "lr_scheduler_configs":
            return self._schedulers
        if name in _TRAINER_READS:
            return getattr(self._trainer, name)
        raise AttributeError(f"trainer.{name} is not available to {COPY_LIMIT} (only values such as "
                             "datamodule, current_epoch, global_step are)")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"trainer.{name} cannot be set from {COPY_LIMIT}")


def detached_copy(pl_module: nn.Module, trainer: Trainer | None = None, memo: dict[int, Any] | None = None,
                  optimizers: list[Any] | None = None, schedulers: list[Any] | None = None) -> nn.Module:
    """A true copy of ``pl_module`` whose step leaves no trace: ``self.trainer`` is a ``ReadOnlyTrainer`` of
    ``trainer`` (``None``: not attached), ``self.log`` and ``self.log_dict`` do nothing, datasets and data
    loaders it holds are shared rather than copied, and it runs eagerly and only on itself
    (``eager_copy``: compiled modules and rebound step methods). ``memo`` receives the
    deep copy's map (for ``cltrain.check.copies.copy_optimizer``). ``optimizers`` and ``schedulers`` (lists the
    caller fills after the copy: copies of the optimizers, and of the trainer's ``LRSchedulerConfig``s holding
    copies of their schedulers) are what ``self.optimizers()`` (wrapped in ``LightningOptimizer``s, as Lightning
    wraps them, unless ``use_pl_optimizer=False``), ``self.lr_schedulers()`` and the trainer's
    ``optimizers`` / ``lr_scheduler_configs`` give; ``self.manual_backward`` is the loss's ``backward``."""
    from torch.utils.data import DataLoader, Dataset

    memo = {} if memo is None else memo
    memo.update({id(v): v for v in vars(pl_module).values() if isinstance(v, (Dataset, DataLoader))})
    clone = eager_copy(pl_module, memo)  # a LightningModule's __getstate__ drops its trainer
    schedulers = schedulers if schedulers is not None else []
    proxy = ReadOnlyTrainer(trainer, clone, optimizers, schedulers) if trainer is not None else None
    wrapped: dict[int, Any] = {}
    for module in clone.modules():
        if isinstance(module, LightningModule):
            module.__dict__["log"] = _no_log
            module.__dict__["log_dict"] = _no_log
            if proxy is not None:
                module.__dict__["_trainer"] = proxy
            if optimizers is not None:  # a manual-optimization step on the copies of the optimizers
                module.__dict__["optimizers"] = functools.partial(_optimizers_of, clone, optimizers, wrapped)
                module.__dict__["manual_backward"] = _backward
                module.__dict__["lr_schedulers"] = functools.partial(_schedulers_of, schedulers)
                module.__dict__["toggle_optimizer"] = module.__dict__["untoggle_optimizer"] = _no_log
                module.__dict__["toggled_optimizer"] = _Silent()
    return clone


class _CopyStrategy:
    """What a copy's ``LightningOptimizer`` steps through: the optimizer's own ``step`` with the closure."""

    def __init__(self, module: nn.Module) -> None:
        self.lightning_module = module

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return optimizer.step(closure=closure, **kwargs)


def _lightning_optimizer(module: nn.Module, optimizer: Any) -> Any:
    """``optimizer`` in the ``LightningOptimizer`` of the package ``module`` comes from (``lightning.pytorch`` or
    the standalone ``pytorch_lightning``), stepping through ``_CopyStrategy``."""
    import importlib

    package = next((cls.__module__.rpartition(".core.")[0] for cls in type(module).__mro__
                    if cls.__name__ == "LightningModule" and ".core." in cls.__module__), "lightning.pytorch")
    wrapper = importlib.import_module(f"{package}.core.optimizer").LightningOptimizer(optimizer)
    wrapper._strategy = _CopyStrategy(module)
    return wrapper


def _optimizers_of(module: nn.Module, optimizers: list[Any], wrapped: dict[int, Any],
                   use_pl_optimizer: bool = True) -> Any:
    if use_pl_optimizer:
        optimizers = [wrapped.setdefault(id(o), _lightning_optimizer(module, o)) for o in optimizers]
    return optimizers[0] if len(optimizers) == 1 else list(optimizers)


def _schedulers_of(configs: list[Any]) -> Any:
    schedulers = [config.scheduler for config in configs]
    return None if not schedulers else schedulers[0] if len(schedulers) == 1 else schedulers


def _backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    loss.backward(*args, **kwargs)
