"""What the CPU under a device computes natively, as this process is configured: ``Platform``.

The facts come from the hardware (``/proc/cpuinfo``'s flags, torch's cpuinfo probes) and from the
two settings that hold the CPU kernels below it, read the same way for every question:

* ``ATEN_CPU_CAPABILITY``: ATen's own vector kernels; torch reads it once at start-up, and
  ``torch.backends.cpu.get_cpu_capability()`` (``Platform.aten_isa``) says what it chose;
* ``ONEDNN_MAX_CPU_ISA``, or ``DNNL_MAX_CPU_ISA`` where that is unset or empty (oneDNN's own
  order): the widest ISA oneDNN's kernels may use (``Platform.onednn_max_isa``), case-insensitive;
  a value oneDNN does not know caps nothing.

x86 is ``x86_64``, ``amd64``, ``i386`` or ``i686``, in any case. ``cltrain.guardrails`` asks
``Platform.onednn_isa`` which oneDNN kernels can fault; ``cltrain.precision`` asks
``cpu_bf16_support`` whether ``amp=auto`` picks bf16 on the CPU.

Example::

    >>> from cltrain.platform import cpu_bf16_support, current_platform
    >>> current_platform("cpu").onednn_isa in ("avx512", "avx2", "other")
    True
    >>> native, reason = cpu_bf16_support()
    >>> isinstance(native, bool) and isinstance(reason, str)
    True
"""

from __future__ import annotations

import itertools
import os
import platform as _platform
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

__all__ = ["Platform", "cpu_bf16_support", "cpu_model", "current_platform", "onednn_max_isa"]

# platform.machine() in lower case; Windows says AMD64, FreeBSD amd64.
_X86_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686"})
_ARM_MACHINES = frozenset({"aarch64", "arm64"})

# oneDNN's ONEDNN_MAX_CPU_ISA names, narrowest first, up to the first with bf16 dot products: the wider
# ones (AVX10_1_512, ..., DEFAULT) and names oneDNN does not know leave both questions asked here uncapped.
_ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16")


def onednn_max_isa(environ: Mapping[str, str] | None = None) -> str | None:
    """The cap on oneDNN's ISA that ``environ`` (default ``os.environ``) sets, upper case; ``None`` when unset.

    ``ONEDNN_MAX_CPU_ISA`` first, then ``DNNL_MAX_CPU_ISA``; an empty value counts as unset, as in oneDNN.

    Example::

        >>> onednn_max_isa({"DNNL_MAX_CPU_ISA": "avx2"})
        'AVX2'
    """
    environ = os.environ if environ is None else environ
    value = (environ.get("ONEDNN_MAX_CPU_ISA") or "").strip() or (environ.get("DNNL_MAX_CPU_ISA") or "").strip()
    return value.upper() or None


def _capped_below(cap: str | None, isa: str) -> bool:
    """Whether the oneDNN cap ``cap`` is narrower than ``isa`` (an unknown or absent cap caps nothing)."""
    cap = (cap or "").upper()
    return cap in _ONEDNN_ISAS and _ONEDNN_ISAS.index(cap) < _ONEDNN_ISAS.index(isa)


@lru_cache(maxsize=1)
def _onednn_version() -> tuple[int, ...] | None:
    if not torch.backends.mkldnn.is_available():
        return None
    found = re.search(r"MKL-DNN v(\d+(?:\.\d+)*)", torch.__config__.show())
    return tuple(int(p) for p in found.group(1).split(".")) if found else None


@lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``), else ``platform.processor()`` or the
    architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


@lru_cache(maxsize=4)
def _bf16_hardware(machine: str) -> str | None:
    """The CPU's bf16 dot-product feature (``"AVX512-BF16"``, ``"AMX"``, ``"Arm BF16"``, ``"Apple silicon"``), or None."""
    cpu = getattr(torch, "cpu", None)
    for probe, name in (("_is_avx512_bf16_supported", "AVX512-BF16"), ("_is_amx_tile_supported", "AMX")):
        fn = getattr(cpu, probe, None)
        if fn is not None and fn():
            return name
    if machine.lower() in _ARM_MACHINES:
        try:
            return "Arm BF16" if " bf16" in Path("/proc/cpuinfo").read_text() else None
        except OSError:
            return "Apple silicon" if _platform.system() == "Darwin" else None  # M2 and later
    return None


@dataclass(frozen=True)
class Platform:
    """The device, the CPU and the backends under it, as this process is configured.

    Attributes:
        device_type: ``"cpu"``, ``"cuda"``, ...
        machine: the CPU architecture (``platform.machine()``: ``x86_64``, ``aarch64``, ...).
        torch_version: ``torch.__version__`` as ints (``(2, 14, 1)``).
        onednn_version: the oneDNN bundled with torch (``(3, 12, 0)``), ``None`` without oneDNN.
        aten_isa: ``torch.backends.cpu.get_cpu_capability()`` (ATen's own kernels, ``ATEN_CPU_CAPABILITY``).
        onednn_max_isa: the cap ``onednn_max_isa()`` reads from the environment, or ``None``.
        cpu_flags: the CPU's flags from ``/proc/cpuinfo``, ``None`` where they cannot be read.
        bf16_hardware: the CPU's bf16 dot-product feature (``"AVX512-BF16"``, ``"AMX"``, ``"Arm BF16"``,
            ``"Apple silicon"``), ``None`` without one.
    """

    device_type: str
    machine: str
    torch_version: tuple[int, ...]
    onednn_version: tuple[int, ...] | None
    aten_isa: str
    onednn_max_isa: str | None
    cpu_flags: frozenset[str] | None = field(default=None, repr=False)
    bf16_hardware: str | None = None

    @property
    def is_x86(self) -> bool:
        """Whether the CPU is x86: ``machine`` is ``x86_64``, ``amd64``, ``i386`` or ``i686``, in any case."""
        return self.machine.lower() in _X86_MACHINES

    @property
    def onednn_isa(self) -> str:
        """The widest vector ISA oneDNN's x86 kernels may use here: ``"avx512"``, ``"avx2"`` or ``"other"``.

        The hardware's flags (``avx512f``; when unreadable, ATen's capability, and AVX-512 when that is
        unknown too) capped by ``onednn_max_isa``. Torch has no call that returns oneDNN's own choice;
        where this cannot tell, it answers the wider ISA, whose fault range is the wider one.
        """
        if not self.is_x86:
            return "other"
        if self.cpu_flags is not None:
            has_512 = "avx512f" in self.cpu_flags
        else:
            has_512 = self.aten_isa.upper() not in ("AVX2", "DEFAULT", "NO AVX")
        return "avx2" if _capped_below(self.onednn_max_isa, "AVX512_CORE") or not has_512 else "avx512"

    @property
    def channel_block(self) -> int:
        """oneDNN's channel block on this ISA: 16 floats in an AVX-512 register, 8 in an AVX2 one."""
        return 16 if self.onednn_isa == "avx512" else 8

    def bf16_support(self) -> tuple[bool, str]:
        """``(native, reason)``: whether bf16 autocast runs on native bf16 kernels on this CPU.

        The hardware must have bf16 dot products (``bf16_hardware``); on x86, ATen's kernels must be
        AVX-512 ones (``aten_isa``) and oneDNN's cap (``onednn_max_isa``) must not be below
        ``AVX512_CORE_BF16``. Without native bf16, autocast emulates it and trains many times slower
        than fp32 (pytorch#118499).
        """
        name = self.bf16_hardware
        if name is None:
            return False, "this CPU has no AVX512-BF16, AMX or Arm BF16"
        if self.is_x86:
            if not self.aten_isa.upper().startswith("AVX512"):
                return False, f"PyTorch runs {self.aten_isa} kernels here (ATEN_CPU_CAPABILITY), though the CPU has {name}"
            if _capped_below(self.onednn_max_isa, "AVX512_CORE_BF16"):
                return False, (f"oneDNN is limited to {self.onednn_max_isa} (ONEDNN_MAX_CPU_ISA or DNNL_MAX_CPU_ISA), "
                               f"though the CPU has {name}")
        return True, f"this CPU computes bf16 natively ({name})"

    def describe(self) -> str:
        """One line: device, architecture, torch, oneDNN and ISA."""
        onednn = ".".join(map(str, self.onednn_version)) if self.onednn_version else "none"
        return (f"{self.device_type} on {self.machine}, torch {'.'.join(map(str, self.torch_version))}, oneDNN {onednn}, "
                f"oneDNN ISA {self.onednn_isa} (block {self.channel_block}), ATen {self.aten_isa}")


def _as_device_type(device: torch.device | str | None, model: nn.Module | None) -> str:
    if device is not None:
        return torch.device(device).type
    if model is not None:
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            return tensor.device.type
    return "cpu"


def current_platform(device: torch.device | str | None = None, model: nn.Module | None = None) -> Platform:
    """The ``Platform`` for ``device`` (default: where ``model``'s parameters are, else the CPU).

    The environment is read on every call; the hardware facts once per process.
    """
    version = tuple(int(p) for p in re.findall(r"\d+", torch.__version__.split("+")[0])[:3])
    machine = _platform.machine()
    return Platform(
        device_type=_as_device_type(device, model),
        machine=machine,
        torch_version=version,
        onednn_version=_onednn_version(),
        aten_isa=torch.backends.cpu.get_cpu_capability(),
        onednn_max_isa=onednn_max_isa(),
        cpu_flags=_cpu_flags(),
        bf16_hardware=_bf16_hardware(machine),
    )


def cpu_bf16_support() -> tuple[bool, str]:
    """``(native, reason)``: whether bf16 autocast runs on native bf16 kernels on this CPU, as this process
    is configured (``Platform.bf16_support``): ``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA`` and
    ``DNNL_MAX_CPU_ISA`` can hold the kernels below bf16 on a CPU that has it.
    """
    return current_platform("cpu").bf16_support()
