"""The running statistics a training step's forward updates (BatchNorm's mean, variance and count), as they were
before the step: a checkpoint saved while a step is unfinished (it raised) holds them, and the resumed run puts them
back before it reads that batch again, so it ends where the run that never raised ends.

``RunningStats.hold`` copies them before each step: one ``torch._foreach_copy_`` into tensors allocated once (no
host sync). The model's own ``state_dict`` in that checkpoint still holds the statistics the raised step left.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

_FIELDS = ("running_mean", "running_var", "num_batches_tracked")


def _running(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    found = []
    for prefix, module in model.named_modules():
        if isinstance(module, _NormBase) and module.track_running_stats:
            for field in _FIELDS:
                if isinstance(module._buffers.get(field), torch.Tensor):
                    found.append((f"{prefix}.{field}" if prefix else field, module, field))
    return found


class RunningStats:
    """The normalisation layers' running statistics of the model being trained, as they were before its step."""

    def __init__(self) -> None:
        self._model: nn.Module | None = None
        self._where: list[tuple[str, nn.Module, str]] = []  # the model's layers, walked once (about 0.3 ms)
        self._live: list[torch.Tensor] = []
        self._held: list[torch.Tensor] = []

    def hold(self, model: nn.Module) -> None:
        """Copy the statistics now (a training batch reached the device; its step has not run)."""
        if model is not self._model:
            self._model, self._where = model, _running(model)
        tensors = [module._buffers[field] for _, module, field in self._where]
        if len(tensors) != len(self._live) or any(a is not b for a, b in zip(tensors, self._live)):
            self._live, self._held = tensors, [t.detach().clone() for t in tensors]  # moved, or the first step
        elif tensors:
            torch._foreach_copy_(self._held, tensors)

    def held(self) -> dict[str, torch.Tensor]:
        """The copies, by buffer name, on the CPU (for a checkpoint)."""
        return {name: t.cpu() for (name, _, _), t in zip(self._where, self._held)}

    @staticmethod
    def put_back(model: nn.Module, held: dict[str, torch.Tensor]) -> None:
        """Write ``held`` into ``model``'s buffers of the same names (those it still has)."""
        live = {name: module._buffers[field] for name, module, field in _running(model)}
        with torch.no_grad():
            for name, value in held.items():
                if name in live and live[name].shape == value.shape:
                    live[name].copy_(value)
