"""The machine a figure was taken on, in one dict and one line: what every timing quotes beside its numbers.

The CPU (its model, the flags its kernels depend on as ``lscpu`` lists them, the logical CPUs, torch's threads,
ATen's capability, oneDNN, native bf16, the ISA limits set in the environment), the GPU when the device is one
(name, compute capability, driver, CUDA, cuDNN and the settings that change its kernels: ``cudnn.benchmark``,
TF32, matmul precision), the load average, Python and the versions of the packages asked for. The CPU facts come
from ``cltrain.platform`` (the one reader of ``/proc/cpuinfo``).

Example::

    >>> from cltrain.timing.machine import machine, machine_line
    >>> line = machine_line(machine("cpu", packages=("torch",)))
    >>> line.startswith("CPU ") and "torch " in line
    True
"""

from __future__ import annotations

import importlib.metadata
import os
import platform as _platform
import subprocess
from collections.abc import Iterable
from typing import Any

import torch

from cltrain.platform import cpu_model, current_platform

__all__ = ["FLAGS", "PACKAGES", "machine", "machine_line"]

#: The CPU flags quoted (as ``lscpu`` names them): the vector, VNNI, bf16/fp16 and AMX units kernels dispatch on.
FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
         "amx_int8")
#: The packages whose versions a figure names unless told otherwise.
PACKAGES = ("torch", "torchvision", "lightning", "timm", "transformers")
#: Environment variables that hold the CPU kernels below what the hardware has.
_LIMITS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu(device: torch.device) -> dict[str, Any]:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        smi = []
    return {"name": torch.cuda.get_device_name(device), "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
            "driver": smi[0] if smi else "unknown", "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "cudnn_benchmark": torch.backends.cudnn.benchmark, "tf32": torch.backends.cudnn.allow_tf32,
            "matmul_precision": torch.get_float32_matmul_precision()}


def machine(device: torch.device | str | None = None, packages: Iterable[str] = PACKAGES) -> dict[str, Any]:
    """The machine as a dict (JSON-ready): ``cpu``, ``flags``, ``logical_cpus``, ``torch_threads``, ``capability``,
    ``onednn``, ``native_bf16``, ``limits``, ``load``, ``python``, ``versions`` (the installed ones of
    ``packages``), and ``gpu`` when ``device`` (default: CUDA where there is one) is a CUDA device."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    here = current_platform("cpu")
    info: dict[str, Any] = {
        "cpu": cpu_model(), "flags": [f for f in FLAGS if f in (here.cpu_flags or ())],
        "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "capability": here.aten_isa,
        "onednn": ".".join(map(str, here.onednn_version or ())), "native_bf16": here.bf16_support()[0],
        "limits": {k: os.environ[k] for k in _LIMITS if os.environ.get(k)},
        "load": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else [],
        "python": _platform.python_version(),
        "versions": {name: v for name in packages if (v := _version(name)) is not None},
    }
    if device.type == "cuda":
        info["gpu"] = _gpu(device)
    return info


def machine_line(m: dict[str, Any]) -> str:
    """``machine()``'s dict as one line (a dict an older version recorded, without some keys, too)."""
    gpu, limits = m.get("gpu"), m.get("limits") or m.get("emulation") or {}
    parts = [f"CPU {m['cpu']} ({m['logical_cpus']} logical, torch threads {m['torch_threads']}); flags "
             f"{' '.join(m['flags']) or 'none of avx2/avx512/amx'}; ATen {m['capability']}; oneDNN {m.get('onednn') or '?'}; "
             f"native bf16 {'yes' if m['native_bf16'] else 'no'}"
             + (f"; limited by {' '.join(f'{k}={v}' for k, v in limits.items())}" if limits else "")]
    if gpu:
        parts.append(f"GPU {gpu['name']} (compute capability {gpu['capability']}), driver {gpu['driver']}, CUDA "
                     f"{gpu['cuda']}, cuDNN {gpu['cudnn']}; cudnn.benchmark {gpu['cudnn_benchmark']}, fp32 convolutions "
                     f"{'TF32' if gpu['tf32'] else 'full fp32'}, matmul precision {gpu['matmul_precision']}")
    if m.get("load"):
        parts.append("load average " + " ".join(f"{x:.2f}" for x in m["load"]))
    versions = [f"{k} {v}" for k, v in m["versions"].items()]
    parts.append(", ".join([f"Python {m['python']}", *versions] if m.get("python") else versions))
    return "; ".join(parts)
