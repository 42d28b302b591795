"""Reaching the modules around a LightningModule through public objects only: the module a
batch goes through, copies of it that other callbacks hold, a hook that runs once after the
module's own, and optimizer state that should follow its parameter's strides."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from cltrain.layout import memory_format_for

__all__ = ["detached_copy", "model_copies", "restride_optimizer_state", "run_after", "step_target", "undo_run_after"]


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


def step_target(pl_module: LightningModule) -> nn.Module:
    """The module a batch goes through: the LightningModule if it defines ``forward``, else its
    largest child (``self.model``, ``self.net``, ...)."""
    if is_overridden("forward", pl_module):
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


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def detached_copy(pl_module: nn.Module) -> nn.Module:
    """A deep copy of ``pl_module`` whose step leaves no trace: not attached to the trainer (``self.log``
    and ``self.log_dict`` do nothing, there is no logger), datasets and data loaders it holds shared rather
    than copied, and every module eager (a module compiled in place runs uncompiled)."""
    from torch.utils.data import DataLoader, Dataset

    memo = {id(v): v for v in vars(pl_module).values() if isinstance(v, (Dataset, DataLoader))}
    clone = copy.deepcopy(pl_module, memo)  # a LightningModule's __getstate__ drops its trainer
    for module in clone.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
        if isinstance(module, LightningModule):
            module.__dict__["log"] = _no_log
            module.__dict__["log_dict"] = _no_log
    return clone
