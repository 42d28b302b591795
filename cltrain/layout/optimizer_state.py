"""Optimizer state in its parameter's layout: a momentum buffer or Adam moment restored from a checkpoint keeps the
strides it was saved with, and a check's verdict can change a parameter's layout after the state was made."""

from __future__ import annotations

from typing import Any

import torch

from cltrain.layout.tensors import memory_format_for

__all__ = ["restride_optimizer_state"]


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
        optimizer = getattr(optimizer, "optimizer", optimizer)
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and memory_format_for(param) is not None \
                            and value.shape == param.shape and value.stride() != param.stride():
                        state[key] = torch.empty_like(param, dtype=value.dtype, device=value.device).copy_(value)
