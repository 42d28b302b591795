"""The copies the layout check runs on: true copies of a model (eager, methods bound to the copy) and of its
optimizers, and how user code knows it is running on one.

``is_check_copy(module)`` is ``True`` for a model the check made, and ``checking()`` while the check runs:
code with side effects outside the model (writing files, counting steps, a global registry) can skip them::

    from cltrain.check import checking

    def training_step(self, batch, batch_idx):
        loss = ...
        if not checking():
            self.samples_seen += len(batch[0])
        return loss
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from cltrain.layout.lightning_access import rebind_methods

__all__ = ["ELEMENTWISE_OPTIMIZERS", "checking", "copy_optimizer", "copy_schedulers", "elementwise",
           "is_check_copy", "mark_copy", "running"]

_MARK = "_cltrain_check_copy"

#: torch's optimizers whose update of a parameter is elementwise in its gradient and state (fused, foreach or
#: per tensor): the same values in any layout, so re-running them on the check's copies tells nothing.
#: LBFGS (which flattens gradients with ``view``) and every subclass or other optimizer are run.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
    torch.optim.ASGD,
)
_depth = 0


def checking() -> bool:
    """``True`` while the first-batch layout check runs the step on its copies."""
    return _depth > 0


def is_check_copy(module: Any) -> bool:
    """``True`` for a module (or LightningModule) that the layout check copied to run the step on."""
    return bool(getattr(module, _MARK, False))


@contextlib.contextmanager
def running() -> Iterator[None]:
    """``checking()`` is ``True`` inside."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def mark_copy(model: nn.Module) -> nn.Module:
    """Mark every module of ``model`` as a check copy (``is_check_copy``); returns ``model``."""
    for module in model.modules():
        module.__dict__[_MARK] = True
    return model


def copy_optimizer(optimizer: torch.optim.Optimizer, memo: dict[int, Any]) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` and its state whose parameters are the copies ``memo`` maps them to (``memo``:
    the one ``detached_copy`` filled); the original, its state and step count are not touched.

    Raises:
        TypeError: the optimizer can be neither deep-copied nor rebuilt from its ``defaults``.
    """
    own = dict(memo)
    try:  # every attribute of a custom optimizer, not only what Optimizer.__getstate__ keeps
        clone = object.__new__(type(optimizer))
        clone.__dict__.update(copy.deepcopy(vars(optimizer), own))
    except Exception:  # noqa: BLE001 - rebuild from the public constructor instead
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [memo[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
        try:
            clone = type(optimizer)(groups, **optimizer.defaults)
            clone.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        except Exception as error:  # noqa: BLE001
            raise TypeError(f"{type(optimizer).__name__} cannot be copied ({type(error).__name__}: {error})") from None
    if any(memo.get(id(p)) is not q for g, h in zip(optimizer.param_groups, clone.param_groups)
           for p, q in zip(g["params"], h["params"])):
        raise TypeError(f"{type(optimizer).__name__}'s copy does not hold the copied parameters")
    rebind_methods(clone, own, drop_class_wrappers=True)  # an LR scheduler's patched `step`
    return clone


def copy_schedulers(configs: list[Any], memo: dict[int, Any]) -> list[Any]:
    """Copies of Lightning's ``LRSchedulerConfig``s, each holding a copy of its scheduler bound to the copied
    optimizer (``memo`` maps each optimizer to its copy); a scheduler that cannot be copied gets a stand-in
    whose ``step`` does nothing (a scheduler steps after the update the check compares)."""
    import dataclasses

    copies = []
    for config in configs:
        scheduler: Any = _InertScheduler()
        if id(getattr(config.scheduler, "optimizer", None)) in memo:
            try:
                scheduler = copy.deepcopy(config.scheduler, dict(memo))
            except Exception:  # noqa: BLE001 - the stand-in instead
                pass
        copies.append(dataclasses.replace(config, scheduler=scheduler))
    return copies


class _InertScheduler:
    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return []


def elementwise(optimizers: list[Any]) -> bool:
    """Whether every optimizer (or ``LightningOptimizer``'s) is one of ``ELEMENTWISE_OPTIMIZERS`` itself."""
    return all(type(getattr(o, "optimizer", o)) in ELEMENTWISE_OPTIMIZERS for o in optimizers)
