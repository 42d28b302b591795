"""What cltrain reads of a LightningModule and its Trainer, through public objects only, for ``lightning.pytorch``
and the standalone ``pytorch_lightning`` package alike: which package a module comes from, whether it overrides a
hook, the module a batch goes through, a hook that runs once after the module's own, the copies of the module that
other callbacks hold, and a step's arguments as Lightning passes them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from lightning_utilities.core.overrides import is_overridden
from torch import nn

from cltrain.host import Host, Say
from cltrain.layout import is_materialized
from cltrain.nchw_code import pruning_aliases

__all__ = ["LightningHost", "is_lightning_module", "lightning_package", "model_copies", "overrides", "overrides_hook",
           "run_after", "step_arguments", "step_target", "undo_run_after"]

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _lightning_base(obj: Any) -> type | None:
    return next((cls for cls in type(obj).__mro__ if cls.__name__ == "LightningModule"
                 and cls.__module__ in tuple(f"{p}.core.module" for p in _PACKAGES)), None)


def is_lightning_module(obj: Any) -> bool:
    """Whether ``obj`` is a LightningModule of either package."""
    return _lightning_base(obj) is not None


def lightning_package(obj: Any) -> str:
    """``"lightning.pytorch"`` or ``"pytorch_lightning"``: the package ``obj``'s LightningModule class comes from
    (``"lightning.pytorch"`` for anything else)."""
    base = _lightning_base(obj)
    return base.__module__.rpartition(".core.")[0] if base is not None else "lightning.pytorch"


def overrides(method: str, pl_module: nn.Module) -> bool:
    """Whether ``pl_module``'s class defines ``method`` itself (Lightning's ``is_overridden`` knows only its own
    package)."""
    base = _lightning_base(pl_module)
    return base is not None and is_overridden(method, pl_module, base)


def overrides_hook(callback: Any, hook: str) -> bool:
    """Whether ``callback``'s class (a Callback of either package) defines ``hook`` over the base Callback's."""
    base = next((cls for cls in type(callback).__mro__ if cls.__name__ == "Callback"
                 and cls.__module__ in tuple(f"{p}.callbacks.callback" for p in _PACKAGES)), None)
    return base is not None and getattr(type(callback), hook, None) is not getattr(base, hook, None)


def step_target(pl_module: nn.Module) -> nn.Module:
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


def step_arguments(pl_module: nn.Module, method: str, batch: Any, batch_idx: int,
                   dataloader_idx: int | None = None) -> tuple[Any, ...]:
    """The positional arguments Lightning gives ``pl_module.<method>`` (``training_step``, ``validation_step``,
    ``test_step``, ``predict_step``): the batch; ``batch_idx`` where the signature takes a second argument
    (``training_step(self, batch)`` is legal); ``dataloader_idx`` where Lightning passes one (several
    evaluation data loaders)."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    args: tuple[Any, ...] = (batch,)
    if is_param_in_hook_signature(getattr(pl_module, method), "batch_idx", min_args=2):
        args += (batch_idx,)
    if dataloader_idx is not None and method != "training_step":
        args += (dataloader_idx,)
    return args


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


def _shapes(params: Any) -> tuple[Any, ...]:
    """The parameters' shapes; a lazy module's parameter before its first forward has none (``None``)."""
    return tuple(tuple(p.shape) if is_materialized(p) else None for p in params)


def model_copies(trainer: Any, pl_module: nn.Module, exclude: Any = None) -> list[nn.Module]:
    """The modules that ``trainer``'s callbacks hold as copies of ``pl_module`` or of one of its children.

    A copy is an ``nn.Module`` a callback holds (an attribute, or an item of a dict, list or tuple attribute) with
    the same parameter shapes, in the same order, as ``pl_module`` or as one of its children that holds a
    convolution's weight (``self.net`` beside a learnable temperature), and none of their parameter objects: the
    ``AveragedModel`` of Lightning's ``WeightAveraging`` / ``EMAWeightAveraging``, the deep-copied LightningModule
    of ``StochasticWeightAveraging``, or a user's own EMA callback's model. Only public objects are read
    (``trainer.callbacks`` and each callback's attributes), not the attribute names of any one callback.
    """
    params = list(pl_module.parameters())
    own = {id(p) for p in params}
    targets = {_shapes(params)}
    for child in pl_module.children():
        shapes = _shapes(child.parameters())
        if any(shape is not None and len(shape) >= 4 for shape in shapes):
            targets.add(shapes)
    found: list[nn.Module] = []
    for callback in trainer.callbacks:
        if callback is exclude:
            continue
        for value in vars(callback).values():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if not isinstance(item, nn.Module) or item is pl_module or any(v is item for v in found):
                    continue
                theirs = list(item.parameters())
                if theirs and _shapes(theirs) in targets and not any(id(p) in own for p in theirs):
                    found.append(item)
    return found


class LightningHost(Host):
    """A Lightning ``Trainer`` as the session's host: rank 0 decides, its strategy broadcasts and sums, its loggers
    log, and the optimizers and the copies of ``pl_module`` (``model_copies``, leaving out ``exclude``) are the
    trainer's; ``copies()``: the copies the user named besides."""

    evaluates_together = True  # the Trainer's validation, test and predict loops run on every rank

    def __init__(self, trainer: Any, pl_module: nn.Module, say: Say, exclude: Any = None,
                 copies: Callable[[], list[nn.Module]] = list) -> None:
        super().__init__(say, optimizers=lambda: trainer.optimizers,
                         copies=lambda: [*model_copies(trainer, pl_module, exclude=exclude), *copies()],
                         log=lambda metrics: [logger.log_metrics(metrics, step=trainer.global_step)
                                              for logger in trainer.loggers],
                         aliases=lambda: pruning_aliases(trainer.callbacks))
        self.trainer = trainer

    def several(self) -> bool:
        return self.trainer.world_size > 1

    def deciding(self) -> bool:
        return self.trainer.is_global_zero

    def broadcast(self, value: Any) -> Any:
        return self.trainer.strategy.broadcast(value, src=0)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        strategy = self.trainer.strategy
        return strategy.reduce(tensor.to(strategy.root_device), reduce_op="sum")
