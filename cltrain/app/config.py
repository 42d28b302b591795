"""Check a composed config before anything is built, and map the toggles onto Lightning.

Every problem is a :class:`ConfigError` that names the key, the value and what is
allowed; the CLI prints it as one line and exits with status 2.

The toggles, and what they become:

=============  ===========  ===========================================================
``device``     ``amp``      Lightning ``accelerator`` / ``precision``
=============  ===========  ===========================================================
cpu            false        ``cpu`` / ``32-true``
cpu            true         ``cpu`` / ``bf16-mixed`` (``amp_dtype`` auto or bf16; fp16 is
                            refused). A CPU without native bf16 (AVX512-BF16, AMX or Arm
                            BF16) gets a warning: bf16 autocast runs there but is usually
                            slower than fp32 (pytorch#118499).
cuda[:N]       false        ``cuda`` / ``32-true``
cuda[:N]       true         ``cuda`` / ``16-mixed`` (fp16 with dynamic loss scaling, as
                            main_amp.py; ``amp_dtype`` auto or fp16) or ``bf16-mixed``
                            (``amp_dtype=bf16``, refused on GPUs without bf16)
mps            false        ``mps`` / ``32-true``; ``amp=true`` is refused
auto                        ``cuda`` when available, else ``cpu``
=============  ===========  ===========================================================
"""

from __future__ import annotations

import os
import platform
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

__all__ = ["ConfigError", "Resolved", "cpu_has_native_bf16", "is_launched_child", "resolve_device", "resolve_precision", "validate"]

AMP_DTYPES = ("auto", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")
CHANNELS_LAST_MODES = ("full", "conv", "auto")
OPTIMIZERS = ("sgd", "adamw")


def _show(value: Any) -> str:
    """A value as it is written on the command line (true, null, 'text', 3)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return repr(value) if isinstance(value, str) else str(value)


class ConfigError(ValueError):
    """A bad configuration value: ``key=value: reason (allowed: ...)``."""

    def __init__(self, key: str, value: Any, reason: str, allowed: str | None = None) -> None:
        self.key, self.value, self.reason, self.allowed = key, value, reason, allowed
        message = f"{key}={_show(value)}: {reason}"
        if allowed:
            message += f" (allowed: {allowed})"
        super().__init__(message)


@dataclass(frozen=True)
class Resolved:
    """What the toggles mean on this machine."""

    accelerator: str  # "cpu" | "cuda" | "mps"
    devices: Any  # trainer.devices, or [N] for device=cuda:N
    precision: str  # Lightning precision flag


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (x86 AVX512-BF16 or AMX, Arm BF16)."""
    cpu = getattr(torch, "cpu", None)
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(cpu, probe, None)
        if fn is not None and fn():
            return True
    if platform.machine().lower() in ("aarch64", "arm64"):
        try:
            return " bf16" in Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.system() == "Darwin"  # Apple M2 and later
    return False


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _require_bool(cfg: DictConfig, key: str) -> None:
    value = cfg.get(key)
    if not _is_bool(value):
        raise ConfigError(key, value, "must be a boolean", "true, false")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def resolve_device(device: Any) -> tuple[str, int | None]:
    """(accelerator, cuda index or None); raises when the device is unknown or absent."""
    if not isinstance(device, str) or not (device in DEVICES or re.fullmatch(r"cuda:\d+", device)):
        raise ConfigError("device", device, "unknown device", ", ".join(DEVICES))
    if device == "auto":
        return ("cuda" if torch.cuda.is_available() else "cpu"), None
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("device", device, "no CUDA device on this machine", "auto, cpu")
        index = int(device.split(":")[1]) if ":" in device else None
        if index is not None and index >= torch.cuda.device_count():
            raise ConfigError(
                "device", device, f"this machine has {torch.cuda.device_count()} CUDA device(s)",
                f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}",
            )
        return "cuda", index
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError("device", device, "MPS is not available on this machine", "auto, cpu")
    return device, None


def resolve_precision(amp: bool, amp_dtype: str, accelerator: str) -> str:
    if not amp:
        return "32-true"
    if accelerator == "cpu":
        if amp_dtype == "fp16":
            raise ConfigError("amp_dtype", amp_dtype, "AMP on the CPU is bf16 autocast", "auto, bf16; or amp=false")
        if not cpu_has_native_bf16():
            warnings.warn(
                "amp=true on a CPU without native bf16 (no AVX512-BF16/AMX/Arm BF16): bf16 autocast runs, "
                "but usually slower than fp32 here (pytorch#118499); amp=false is likely faster",
                stacklevel=3,
            )
        return "bf16-mixed"
    if accelerator == "cuda":
        if amp_dtype == "bf16":
            if not torch.cuda.is_bf16_supported():
                raise ConfigError("amp_dtype", amp_dtype, "this GPU has no bf16 support", "auto, fp16")
            return "bf16-mixed"
        return "16-mixed"
    raise ConfigError("amp", amp, f"AMP is not supported on device {accelerator!r}", "false; or device=cpu|cuda")


def _validate_paths(cfg: DictConfig) -> None:
    data = cfg.data
    root = data.get("root")
    if root is None:
        raise ConfigError("data.root", root, "not set; an ImageNet-layout folder is needed",
                          "a directory with train/ and val/ class folders")
    if data.get("demo") is None and not Path(str(root)).expanduser().is_dir():
        raise ConfigError("data.root", str(root), "no such directory",
                          "a directory with train/ and val/ class folders")
    for key in ("ckpt_path", "model.pretrained"):
        path = cfg.get("ckpt_path") if key == "ckpt_path" else cfg.model.get("pretrained")
        if path is not None and not Path(str(path)).expanduser().is_file():
            raise ConfigError(key, str(path), "no such file", "a local file path, or null")
    if cfg.evaluate_only and cfg.get("ckpt_path") is None and cfg.model.get("pretrained") is None:
        raise ConfigError("evaluate_only", True, "nothing to evaluate",
                          "with ckpt_path=<checkpoint> or model.pretrained=<weights file>")


def _validate_steps(cfg: DictConfig) -> None:
    """The schedule and EMA keys (steps engineer's block)."""
    from cltrain.app.schedule import SCHEDULES

    schedule = cfg.optim.get("schedule", "step")
    if schedule not in SCHEDULES:
        raise ConfigError("optim.schedule", schedule, "unknown schedule", ", ".join(SCHEDULES))
    ratio = cfg.optim.get("min_lr_ratio", 0.0)
    if not (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0.0 <= ratio <= 1.0):
        raise ConfigError("optim.min_lr_ratio", ratio, "out of range", "0 <= value <= 1")
    if not cfg.get("ema", False):
        return
    _require_bool(cfg, "ema")
    decay = cfg.get("ema_decay", 0.999)
    if not (isinstance(decay, (int, float)) and not isinstance(decay, bool) and 0.0 <= decay < 1.0):
        raise ConfigError("ema_decay", decay, "out of range", "0 <= value < 1, e.g. 0.999")
    warmup = cfg.get("ema_warmup_steps", 0)
    if not (isinstance(warmup, int) and not isinstance(warmup, bool) and warmup >= 0):
        raise ConfigError("ema_warmup_steps", warmup, "must be a whole number >= 0")
    if not _positive_int(cfg.get("ema_every_n_steps", 1)):
        raise ConfigError("ema_every_n_steps", cfg.get("ema_every_n_steps"), "must be a whole number > 0")


def validate(cfg: DictConfig) -> Resolved:
    """Check ``cfg`` (before building anything) and resolve device and precision.

    Raises:
        ConfigError: on the first bad value, naming the key, the value and what is allowed.
    """
    for key in ("channels_last", "amp", "compile", "sync_bn", "deterministic", "evaluate_only"):
        _require_bool(cfg, key)
    if cfg.channels_last_mode not in CHANNELS_LAST_MODES:
        raise ConfigError("channels_last_mode", cfg.channels_last_mode, "unknown mode", ", ".join(CHANNELS_LAST_MODES))
    if cfg.compile and cfg.channels_last and cfg.channels_last_mode == "auto":
        raise ConfigError("channels_last_mode", "auto", "cannot be combined with compile=true (the layout is "
                          "fixed before compiling)", "full, conv")
    if cfg.amp_dtype not in AMP_DTYPES:
        raise ConfigError("amp_dtype", cfg.amp_dtype, "unknown dtype", ", ".join(AMP_DTYPES))
    for key in ("data.batch_size", "data.image_size", "trainer.devices", "trainer.num_nodes",
                "trainer.accumulate_grad_batches"):
        group, name = key.split(".")
        value = cfg[group].get(name)
        if key == "trainer.devices" and (value == "auto" or isinstance(value, list)):
            continue
        if not _positive_int(value):
            raise ConfigError(key, value, "must be a whole number > 0")
    if not (isinstance(cfg.print_freq, int) and cfg.print_freq >= 0):
        raise ConfigError("print_freq", cfg.print_freq, "must be a whole number >= 0")
    if not (0.0 <= float(cfg.label_smoothing) < 1.0):
        raise ConfigError("label_smoothing", cfg.label_smoothing, "out of range", "0 <= value < 1")
    _validate_steps(cfg)
    if cfg.optim.get("name") not in OPTIMIZERS:
        raise ConfigError("optim.name", cfg.optim.get("name"), "unknown optimizer", ", ".join(OPTIMIZERS))
    if not (isinstance(cfg.optim.get("lr"), (int, float)) and cfg.optim.lr > 0):
        raise ConfigError("optim.lr", cfg.optim.get("lr"), "must be a number > 0")

    from cltrain.app.models import check_model_name  # keeps torchvision/timm lookups out of import time

    check_model_name(cfg.model.name, cfg.model.get("source", "auto"))
    _validate_paths(cfg)

    accelerator, index = resolve_device(cfg.device)
    precision = resolve_precision(cfg.amp, cfg.amp_dtype, accelerator)
    if cfg.sync_bn and accelerator != "cuda":
        raise ConfigError("sync_bn", True, f"SyncBatchNorm needs CUDA devices (torch has none for {accelerator})",
                          "false; or device=cuda")
    devices = [index] if index is not None else cfg.trainer.devices
    return Resolved(accelerator=accelerator, devices=devices, precision=precision)


def is_launched_child() -> bool:
    """True in the processes Lightning's DDP launcher starts (LOCAL_RANK > 0) and on nodes > 0."""
    return any(os.environ.get(var, "0") not in ("", "0") for var in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK"))
