"""Check a composed config before anything is built, and map the toggles onto Lightning.

``validate`` is the one check of a config: the schema's (``cltrain.app.config.check.check``:
keys, types, ranges, choices), then what a value means on this machine (device, precision,
paths and the checkpoint to resume: ``cltrain.app.config.paths``). Every problem is a ``ConfigError`` that names the key,
the value and what is allowed; the CLI prints it as one line and exits with status 2.

The toggles, and what they become (``device=auto`` is ``cuda`` when available, else ``cpu``):

| ``device`` | ``amp`` | Lightning ``precision`` |
|---|---|---|
| any | auto (the default) | ``cltrain.precision.auto_precision``: bf16 autocast where bf16 is native, fp16 with loss scaling on older GPUs, else fp32 |
| cpu | true, bf16 | ``bf16-mixed``; without native bf16 it runs, with a warning: many times slower |
| cpu | fp16 | refused (AMP on the CPU is bf16 autocast) |
| cuda[:N] | true | by ``auto_precision`` (bf16 on Ampere+, else fp16) |
| cuda[:N] | bf16, fp16 | ``bf16-mixed`` (refused without bf16 support), ``16-mixed`` |
| mps | true, bf16, fp16 | refused |
| any | false | ``32-true`` |

``trainer.benchmark`` (``torch.backends.cudnn.benchmark``, set by Lightning) left ``null``
becomes true, as apex and timm run, or false with ``trainer.deterministic``: ``Resolved.benchmark``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from cltrain.app.config.check import check
from cltrain.app.config.errors import ConfigError, show
from cltrain.app.config.paths import check_checkpoint, check_paths
from cltrain.app.config.rules import AMP_DTYPE_FLAGS
from cltrain.devices import DeviceError, check_device_name, resolve_device
from cltrain.precision import auto_precision, say_bf16_emulated

__all__ = ["Resolved", "check_meanings", "check_model_name", "resolve_accelerator", "resolve_precision", "validate"]


@dataclass(frozen=True)
class Resolved:
    """What the toggles mean on this machine."""

    accelerator: str  # "cpu" | "cuda" | "mps"
    devices: Any  # trainer.devices, or [N] for device=cuda:N
    precision: str  # Lightning precision flag
    precision_reason: str = ""  # why amp became that flag on this machine
    benchmark: bool = True  # trainer.benchmark as Lightning gets it


def resolve_accelerator(device: Any) -> tuple[str, int | None]:
    """The Lightning accelerator (``"cpu"``, ``"cuda"``, ``"mps"``) and the CUDA index (or None) that
    ``device`` names: ``cltrain.devices.resolve_device``, its errors as a ``ConfigError``.

    Raises:
        ConfigError: a device name torch does not know, or a device this machine lacks.
    """
    try:
        resolved = resolve_device(device)
    except DeviceError as err:
        raise ConfigError("device", device, err.reason, err.allowed) from None
    return resolved.type, resolved.index


def _amp_allowed_without(refused: str) -> str:
    """The ``amp`` values a device takes when it cannot autocast to ``refused``: ``auto, true, bf16, false``."""
    return ", ".join(["auto", "true", *(name for name in AMP_DTYPE_FLAGS if name != refused), "false"])


def resolve_precision(amp: Any, accelerator: str, index: int | None = None) -> tuple[str, str]:
    """The Lightning precision flag for ``amp`` (``"auto"``, true, false, ``"bf16"``, ``"fp16"``) on
    ``accelerator``, and the reason in words.

    Raises:
        ConfigError: a dtype the device cannot autocast to, or mixed precision on a device without AMP.
    """
    if amp is False:
        return "32-true", "amp=false"
    if accelerator == "cpu" and amp == "fp16":
        raise ConfigError("amp", amp, "AMP on the CPU is bf16 autocast", _amp_allowed_without("fp16"))
    if accelerator == "cuda" and amp == "bf16" and not torch.cuda.is_bf16_supported():
        raise ConfigError("amp", amp, "this GPU has no bf16 support", _amp_allowed_without("bf16"))
    if accelerator not in ("cpu", "cuda"):
        if amp == "auto":
            return "32-true", f"amp=auto: no mixed precision is chosen automatically on {accelerator}"
        raise ConfigError("amp", amp, f"AMP is not supported on device {accelerator!r}", "auto, false; or device=cpu|cuda")
    device = torch.device(accelerator, index) if index is not None else torch.device(accelerator)
    if amp == "auto":
        choice = auto_precision(device)
        return choice.flag, f"amp=auto: {choice.reason}"
    if accelerator == "cpu":  # amp=true or bf16
        reason = say_bf16_emulated(lambda line: warnings.warn(line, stacklevel=5), f"amp={show(amp)}",
                                   "amp=auto or amp=false trains in fp32")
        return "bf16-mixed", f"amp={show(amp)}: bf16 autocast ({reason})"
    if amp is True:  # on CUDA: the dtype amp=auto picks
        choice = auto_precision(device)
        return choice.flag, f"amp=true: {choice.reason}"
    return AMP_DTYPE_FLAGS[amp], f"amp={amp}"


def check_model_name(name: Any, source: str = "auto") -> str:
    """The source of ``name`` (``cltrain.model_names.model_source``); a ``ConfigError`` naming close matches if unknown."""
    from cltrain.model_names import SOURCES, closest_model_names, model_source  # torchvision/timm only when checked

    if source not in SOURCES:
        raise ConfigError("model.source", source, "unknown model source", ", ".join(SOURCES))
    if source == "timm" and model_source("resnet18", "timm") is None:
        raise ConfigError("model.source", source, "timm is not installed (pip install 'cltrain[timm]')", "auto, torchvision")
    found = model_source(str(name), source) if isinstance(name, str) else None
    if found is None:
        close, lists = closest_model_names(str(name), source)
        allowed = "a name from " + " or ".join(lists)
        allowed += f"; closest: {', '.join(close)}" if close else "; e.g. resnet50, resnet18, efficientnet_b0"
        raise ConfigError("model.name", name, "unknown model", allowed)
    return found


def check_meanings(cfg: DictConfig) -> None:
    """What values mean together, wherever the run will go (``check_command_line`` asks before Hydra makes the run's
    folder): the ChannelsLast keys without channels_last, the device's name (not whether this machine has it: a
    sweep's launcher may run it elsewhere).

    Raises:
        ConfigError: the key, the value and the fix.
    """
    if not cfg.channels_last:  # the callback's keys mean nothing without it: a pin the run would not keep
        for key, default in (("channels_last_layout", "auto"), ("channels_last_mode", "full")):
            if cfg.get(key, default) != default:
                raise ConfigError(key, cfg[key], "channels_last=false trains in NCHW without the ChannelsLast "
                                  "callback, which this key sets", f"channels_last=true {key}={cfg[key]}; or drop "
                                  f"{key} (channels_last_layout=contiguous pins NCHW with the callback's checks)")
    try:
        check_device_name(cfg.device)
    except DeviceError as err:
        raise ConfigError("device", cfg.device, err.reason, err.allowed) from None


def validate(cfg: DictConfig) -> Resolved:
    """Check ``cfg`` (before building anything) and resolve device, precision and cuDNN benchmark.

    Raises:
        ConfigError: on the first bad value, naming the key, the value and what is allowed.
    """
    check(cfg)  # names, types, ranges and choices of every key (the schema); what follows checks meanings
    check_meanings(cfg)
    check_model_name(cfg.model.name, cfg.model.source)
    check_paths(cfg)
    if cfg.get("ckpt_path") is not None:
        check_checkpoint(str(cfg.ckpt_path), cfg)

    accelerator, index = resolve_accelerator(cfg.device)
    precision, reason = resolve_precision(cfg.amp, accelerator, index)
    if cfg.trainer.sync_batchnorm and accelerator != "cuda":
        raise ConfigError("trainer.sync_batchnorm", True, f"SyncBatchNorm needs CUDA devices (torch has none for "
                          f"{accelerator})", "false; or device=cuda")
    devices = [index] if index is not None else cfg.trainer.devices
    benchmark = cfg.trainer.benchmark
    if benchmark is None:
        benchmark = not cfg.trainer.deterministic
    return Resolved(accelerator=accelerator, devices=devices, precision=precision, precision_reason=reason,
                    benchmark=benchmark)
