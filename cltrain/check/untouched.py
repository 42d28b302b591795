"""The real model is not touched by the layout check: what its copies can still reach of it, and its tensors as
they were, given back where anything changed them.

* ``reaching_path(model, clone)``: where a copy's callables still hold the real model (a closure, a partial, a
  default argument, a hook that ``cltrain.layout.closures.rebound`` could not point at the copy): a check on that
  copy would run the real model, so the check is not run.
* ``RealState(model)``: every parameter's and buffer's values and gradient before the check; ``restore()`` puts
  back each one whose storage, version counter, bits or gradient changed, and names them. The values of CUDA
  tensors are kept in host memory (the check's memory on the device is the slice's activations and its copies).

Example::

    >>> import torch
    >>> net = torch.nn.BatchNorm2d(3)
    >>> state = RealState(net)
    >>> _ = net(torch.randn(2, 3, 4, 4))  # a forward in training mode moves the running statistics
    >>> state.restore(), bool(net.running_mean.abs().sum() == 0)
    (['running_mean', 'running_var', 'num_batches_tracked'], True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cltrain.layout.closures import path_to

__all__ = ["RealState", "describe", "reaching_path"]


def reaching_path(model: nn.Module, clone: nn.Module) -> str | None:
    """How ``clone``'s callables reach ``model`` (its modules or tensors), or ``None`` where they do not."""
    targets = {id(m) for m in model.modules()}
    targets |= {id(t) for t in (*model.parameters(), *model.buffers())}
    return path_to(list(clone.named_modules()), targets)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return -1


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same(t: torch.Tensor, kept: torch.Tensor) -> bool:
    """Bit for bit (a kernel may update a buffer in place without its version counter: BatchNorm's statistics)."""
    now = t.detach().to("cpu") if t.is_cuda else t.detach()
    if now.shape != kept.shape or now.dtype != kept.dtype:
        return False
    bits = _INTS.get(now.element_size()) if not now.is_complex() else None
    # The same element size views any strides (no copy); integers compare bits (NaN, -0.0).
    return torch.equal(now.view(bits), kept.view(bits)) if bits is not None else torch.equal(now, kept)


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True) if t.is_cuda else t.detach().clone()


@dataclass
class _Entry:
    name: str
    tensor: torch.Tensor
    version: int
    storage: int
    value: torch.Tensor
    grad: torch.Tensor | None
    grad_version: int
    grad_value: torch.Tensor | None


class RealState:
    """``model``'s parameters and buffers (values, storage, version) and gradients, to give back after the check."""

    def __init__(self, model: nn.Module) -> None:
        self.entries: list[_Entry] = []
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            grad = t.grad if isinstance(t, nn.Parameter) else None
            self.entries.append(_Entry(name, t, _version(t), t.data_ptr(), _keep(t), grad,
                                       _version(grad) if grad is not None else -1,
                                       _keep(grad) if grad is not None else None))

    def restore(self) -> list[str]:
        """Put back every tensor the check changed; the names of those it changed."""
        changed: list[str] = []
        grads: list[str] = []
        with torch.no_grad():
            for e in self.entries:
                t = e.tensor
                if t.data_ptr() != e.storage or _version(t) != e.version or not _same(t, e.value):
                    if t.data_ptr() != e.storage:
                        t.data = e.value.to(t.device)  # the kept copy has the tensor's strides
                    else:
                        t.copy_(e.value)
                    changed.append(e.name)
                grad_moved = e.grad is not None and (_version(e.grad) != e.grad_version
                                                     or not _same(e.grad, e.grad_value))
                if isinstance(t, nn.Parameter) and (t.grad is not e.grad or grad_moved):
                    if grad_moved:
                        e.grad.copy_(e.grad_value)
                    t.grad = e.grad
                    grads.append(f"{e.name} (gradient)")
        return changed + grads


def describe(changed: list[str], limit: int = 3) -> str:
    """``changed`` in a few words."""
    more = f" and {len(changed) - limit} more" if len(changed) > limit else ""
    return ", ".join(changed[:limit]) + more

