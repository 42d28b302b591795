"""Devices: a module's device, and device names as users type them (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``), checked against this machine.

Example::

    >>> from cltrain.devices import resolve_device
    >>> resolve_device("cpu")
    device(type='cpu')
"""

from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["DEVICES", "DeviceError", "device_of", "resolve_device"]

#: The device names ``resolve_device`` takes.
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")


class DeviceError(ValueError):
    """A device name that is unknown or absent here: ``reason`` and what is ``allowed`` instead."""

    def __init__(self, name: object, reason: str, allowed: str) -> None:
        self.name, self.reason, self.allowed = name, reason, allowed
        super().__init__(f"device {name!r}: {reason} (allowed: {allowed})")


def device_of(module: nn.Module) -> torch.device:
    """Where ``module`` lives: its first parameter's or buffer's device (the CPU for a module without either)."""
    return next((t.device for t in [*module.parameters(), *module.buffers()]), torch.device("cpu"))


def check_device_name(name: object) -> None:
    """``name`` is a device name cltrain takes (``DEVICES`` or ``cuda:N``), whatever this machine has.

    Raises:
        DeviceError: another name.
    """
    if not isinstance(name, str) or not (name in DEVICES or re.fullmatch(r"cuda:\d+", name)):
        raise DeviceError(name, "unknown device", ", ".join(DEVICES))


def resolve_device(name: object) -> torch.device:
    """The ``torch.device`` for ``name``; ``auto`` is ``cuda`` when a GPU is available, else ``cpu``.

    Raises:
        DeviceError: an unknown name, no CUDA (or not that many GPUs), or no MPS here.
    """
    check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError(name, "no CUDA device on this machine", "auto, cpu")
        device = torch.device(name)
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(name, f"this machine has {count} CUDA device(s)", f"cuda:0 .. cuda:{count - 1}")
        return device
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise DeviceError(name, "MPS is not available on this machine", "auto, cpu")
    return torch.device(name)
