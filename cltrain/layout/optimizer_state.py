"""Optimizer state in its parameter's layout: a momentum buffer or Adam moment restored from a checkpoint keeps the
strides it was saved with, and a check's verdict can change a parameter's layout after the state was made (a fused
or foreach kernel requires the state in its parameter's strides)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from cltrain.layout.tensors import memory_format_for

__all__ = ["own_hook", "restride_optimizer_state", "state_in_param_strides", "user_step_hooks"]


def _restride(optimizer: torch.optim.Optimizer, params: set[int] | None) -> None:
    """Every state tensor of ``optimizer`` (of the parameters ``params`` by id, or all) with its parameter's shape, in
    its parameter's strides where the parameter is dense in its own layout (NCHW or channels-last)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param) if params is None or id(param) in params else None
            if not state or not param.is_contiguous(memory_format=_layout_of(param)):
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.stride() != param.stride():
                    state[key] = torch.empty_like(param, dtype=value.dtype, device=value.device).copy_(value)


def _layout_of(t: torch.Tensor) -> torch.memory_format:
    fmt = memory_format_for(t)
    return fmt if fmt is not None and t.is_contiguous(memory_format=fmt) else torch.contiguous_format


def restride_optimizer_state(optimizers: list[Any]) -> None:
    """Give every state tensor of ``optimizers`` (torch optimizers, or wrappers holding one as ``.optimizer``:
    Lightning's, Accelerate's) that has its parameter's shape its parameter's strides, in place.

    Example::

        >>> p = torch.nn.Parameter(torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> opt.state[p]["momentum_buffer"] = torch.zeros(2, 3, 4, 4)  # as a checkpoint restores it
        >>> restride_optimizer_state([opt])
        >>> opt.state[p]["momentum_buffer"].stride() == p.stride()
        True
    """
    for optimizer in optimizers:
        _restride(getattr(optimizer, "optimizer", optimizer), None)


def state_in_param_strides(params: Iterable[torch.Tensor]) -> RemovableHandle:
    """A global optimizer pre-step hook (remove it with the handle): before any optimizer steps, the state of
    ``params`` takes their strides, as the same run in their layout would have built it (the check's copies)."""
    own = {id(p) for p in params}
    return register_optimizer_step_pre_hook(own_hook(lambda optimizer, args, kwargs: _restride(optimizer, own)))


def own_hook(hook: Any) -> Any:
    """``hook`` marked as cltrain's own (``user_step_hooks`` passes it over)."""
    hook.cltrain_own = True
    return hook


def user_step_hooks(optimizer: Any) -> bool:
    """Whether a step of ``optimizer`` (or a ``LightningOptimizer``'s) runs step hooks other than cltrain's: its own
    pre- and post-step hooks, or every optimizer's (``register_optimizer_step_pre_hook``)."""
    from torch.optim import optimizer as torch_optimizer

    inner = getattr(optimizer, "optimizer", optimizer)
    hooks = [*getattr(inner, "_optimizer_step_pre_hooks", {}).values(),
             *getattr(inner, "_optimizer_step_post_hooks", {}).values(),
             *torch_optimizer._global_optimizer_pre_hooks.values(),
             *torch_optimizer._global_optimizer_post_hooks.values()]
    # torch's own (the profiler's, where KINETO_USE_DAEMON is set) read no gradient
    return any(not getattr(hook, "cltrain_own", False) and not getattr(hook, "__module__", "").startswith("torch.")
               for hook in hooks)
