"""The machine a figure was taken on: the CPU, the flags that matter to its kernels, the software versions.

    >>> from scripts.machine import machine, machine_line
    >>> print(machine_line(machine()))  # doctest: +SKIP
    CPU AMD EPYC ... (2 logical, torch threads 2); flags avx2 avx512f ...; torch 2.14.1, ...
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

from cltrain.platform import cpu_bf16_support


def machine() -> dict[str, Any]:
    """The CPU, its flags that matter here, and the software versions."""
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                info["flags"] = [f for f in ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile",
                                             "amx_bf16") if f in have]
                break
    except OSError:
        pass
    import lightning
    import torchvision

    versions = {"torch": torch.__version__, "torchvision": torchvision.__version__, "lightning": lightning.__version__}
    for name in ("timm", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = "missing"
    info.update(logical_cpus=os.cpu_count(), torch_threads=torch.get_num_threads(),
                capability=torch.backends.cpu.get_cpu_capability(), native_bf16=cpu_bf16_support()[0],
                onednn=next(iter(re.findall(r"(?:MKL-DNN|oneDNN) v([\d.]+)", torch.__config__.show())), ""),
                versions=versions, emulation={k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
                                                 if k in os.environ})
    return info


def machine_line(m: dict[str, Any]) -> str:
    """``machine()``'s dict as one line."""
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    emulated = f"; emulating {m['emulation']}" if m["emulation"] else ""
    return (f"CPU {m['cpu']} ({m['logical_cpus']} logical, torch threads {m['torch_threads']}); flags "
            f"{' '.join(m['flags']) or 'none of avx2/avx512/amx'}; ATen capability {m['capability']}; native bf16 "
            f"{'yes' if m['native_bf16'] else 'no'}{emulated}; oneDNN {m['onednn'] or '?'}; {versions}")
