"""Check a composed config before anything is built, and map the toggles onto Lightning.

``validate`` is the one check of a config: the schema's (``cltrain.app.schema_check.check``:
keys, types, ranges, choices), then what a value means on this machine (device, precision,
paths, the checkpoint to resume). Every problem is a ``ConfigError`` that names the key,
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

import dataclasses
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from cltrain.app.schema_check import check
from cltrain.app.errors import ConfigError, show
from cltrain.devices import DeviceError
from cltrain.devices import resolve_device as resolve_torch_device
from cltrain.precision import auto_precision, cpu_bf16_support

__all__ = ["ConfigError", "Resolved", "cpu_has_native_bf16", "demo_home", "is_launched_child", "resolve_device",
           "resolve_precision", "validate"]


@dataclass(frozen=True)
class Resolved:
    """What the toggles mean on this machine."""

    accelerator: str  # "cpu" | "cuda" | "mps"
    devices: Any  # trainer.devices, or [N] for device=cuda:N
    precision: str  # Lightning precision flag
    precision_reason: str = ""  # why amp became that flag on this machine
    benchmark: bool = True  # trainer.benchmark as Lightning gets it


def cpu_has_native_bf16() -> bool:
    """Whether bf16 autocast runs on native bf16 kernels on this CPU (``cltrain.precision.cpu_bf16_support``)."""
    return cpu_bf16_support()[0]


def resolve_device(device: Any) -> tuple[str, int | None]:
    """(accelerator, cuda index or None) for ``device``: ``cltrain.devices.resolve_device`` as a ConfigError."""
    try:
        resolved = resolve_torch_device(device)
    except DeviceError as err:
        raise ConfigError("device", device, err.reason, err.allowed) from None
    return resolved.type, resolved.index


#: What bf16 autocast cost on a CPU without native bf16 (ResNet-50 training, docs/performance.md).
CPU_BF16_EMULATED_SLOWDOWN = "ResNet-50 trained 14.5x slower than in fp32 (0.8 vs 11.6 img/s)"


def resolve_precision(amp: Any, accelerator: str, index: int | None = None) -> tuple[str, str]:
    """The Lightning precision flag for ``amp`` (``"auto"``, true, false, ``"bf16"``, ``"fp16"``) on
    ``accelerator``, and the reason in words.

    Raises:
        ConfigError: a dtype the device cannot autocast to, or mixed precision on a device without AMP.
    """
    if amp is False:
        return "32-true", "amp=false"
    if accelerator == "cpu" and amp == "fp16":
        raise ConfigError("amp", amp, "AMP on the CPU is bf16 autocast", "auto, true, bf16, false")
    if accelerator == "cuda" and amp == "bf16" and not torch.cuda.is_bf16_supported():
        raise ConfigError("amp", amp, "this GPU has no bf16 support", "auto, true, fp16, false")
    if accelerator not in ("cpu", "cuda"):
        if amp == "auto":
            return "32-true", f"amp=auto: no mixed precision is chosen automatically on {accelerator}"
        raise ConfigError("amp", amp, f"AMP is not supported on device {accelerator!r}", "auto, false; or device=cpu|cuda")
    device = torch.device(accelerator, index) if index is not None else torch.device(accelerator)
    if amp == "auto":
        choice = auto_precision(device)
        return choice.flag, f"amp=auto: {choice.reason}"
    if accelerator == "cpu":  # amp=true or bf16
        native, reason = cpu_bf16_support()
        if not native:
            warnings.warn(
                f"amp={show(amp)} on a CPU without native bf16 ({reason}): bf16 autocast runs, but emulated; "
                f"{CPU_BF16_EMULATED_SLOWDOWN}. amp=auto or amp=false trains in fp32",
                stacklevel=3,
            )
        return "bf16-mixed", f"amp={show(amp)}: bf16 autocast ({reason})"
    if amp is True:  # on CUDA: the dtype amp=auto picks
        choice = auto_precision(device)
        return choice.flag, f"amp=true: {choice.reason}"
    return {"bf16": "bf16-mixed", "fp16": "16-mixed"}[amp], f"amp={amp}"


def demo_home(data: DictConfig) -> str | None:
    """The one ``data.root`` at which the data option's demo set is generated: the default ``root`` of
    its schema (``data=demo`` -> ``data/demo``, ``data=video_demo`` -> ``data/video_demo``)."""
    schema = OmegaConf.get_type(data)
    root = next((f.default for f in dataclasses.fields(schema) if f.name == "root"), None) \
        if dataclasses.is_dataclass(schema) else None
    return root if isinstance(root, str) else None


def _validate_paths(cfg: DictConfig) -> None:
    data = cfg.data
    root = data.get("root")
    if root is None:
        raise ConfigError("data.root", root, "not set; an ImageNet-layout folder is needed",
                          "a directory with train/ and val/ class folders")
    where = Path(str(root)).expanduser()
    if where.exists() and not where.is_dir():
        raise ConfigError("data.root", str(root), "is a file, not a directory", "a directory with train/ and val/ class folders")
    demo = data.get("demo")
    if demo is None and not where.is_dir():
        raise ConfigError("data.root", str(root), "no such directory",
                          "a directory with train/ and val/ class folders")
    home = demo_home(data)
    if demo is not None and not where.exists() and not demo.any_root \
            and (home is None or where.resolve() != Path(home).resolve()):
        # A typo'd path would otherwise get a freshly generated demo set and train on it without a word.
        raise ConfigError("data.root", str(root), "no such directory; the demo set is generated only at its default "
                          f"location {home}", "data=imagenet data.root=<your folder> for your own "
                          "data; or leave data.root unset for the demo set")
    for key in ("ckpt_path", "model.pretrained"):
        path = cfg.get("ckpt_path") if key == "ckpt_path" else cfg.model.get("pretrained")
        if path is not None and not Path(str(path)).expanduser().is_file():
            raise ConfigError(key, str(path), "no such file", "a local file path, or null")
    if cfg.evaluate_only and cfg.get("ckpt_path") is None and cfg.model.get("pretrained") is None:
        raise ConfigError("evaluate_only", True, "nothing to evaluate",
                          "with ckpt_path=<checkpoint> or model.pretrained=<weights file>")


def _check_checkpoint(path: str, cfg: DictConfig) -> None:
    """A resume/evaluate checkpoint is a Lightning checkpoint whose optimizer matches ``optim.name``
    (a changed optimizer would fail deep inside Lightning with ``KeyError: 'step'``)."""
    from cltrain.checkpoint_io import UnreadableCheckpointError, UnsafeCheckpointError, load_checkpoint_file

    try:  # weights_only: nothing in the file runs, whoever wrote it
        state = load_checkpoint_file(path, map_location="cpu", mmap=True)
    except UnsafeCheckpointError as err:
        raise ConfigError("ckpt_path", path, f"refused to load: it holds {', '.join(err.types)}, which no checkpoint "
                          "written by train.py holds; unpickling it could run code", "a .ckpt file written by train.py") from None
    except UnreadableCheckpointError as err:
        raise ConfigError("ckpt_path", path, f"not a readable checkpoint ({err.reason}); {err.others}",
                          "a .ckpt file written by train.py") from None
    if not isinstance(state, dict) or "state_dict" not in state:
        raise ConfigError("ckpt_path", path, "not a Lightning checkpoint (no state_dict)", "a .ckpt file written by train.py")
    saved = (state.get("hyper_parameters") or {}).get("optimizer")
    if not cfg.evaluate_only and saved is not None and saved != cfg.optim.name:
        raise ConfigError("optim.name", cfg.optim.name, f"the checkpoint {path} was trained with optim={saved}; "
                          "resuming needs the same optimizer", f"optim={saved}; or model.pretrained=<ckpt> to start anew")
    if not cfg.evaluate_only and "optimizer_states" not in state:
        raise ConfigError("ckpt_path", path, "holds weights only, nothing to resume", "model.pretrained=<file> to start from weights")
    if not cfg.evaluate_only and "current_model_state" in state and not cfg.ema.enabled:
        # Its state_dict is the averaged weights; without the EMA callback nothing would restore the training
        # weights (current_model_state) and the run would go on from the average, silently.
        raise ConfigError("ema.enabled", False, f"the checkpoint {path} was trained with ema.enabled=true (its training "
                          "weights are kept apart from the averaged ones); resuming needs ema.enabled=true",
                          "ema.enabled=true; or model.pretrained=<ckpt> to start anew from the averaged weights")


def validate(cfg: DictConfig) -> Resolved:
    """Check ``cfg`` (before building anything) and resolve device, precision and cuDNN benchmark.

    Raises:
        ConfigError: on the first bad value, naming the key, the value and what is allowed.
    """
    check(cfg)  # names, types, ranges and choices of every key (the schema); what follows checks meanings
    if cfg.compile.enabled and cfg.channels_last and cfg.channels_last_mode == "auto":
        raise ConfigError("channels_last_mode", "auto", "cannot be combined with compile.enabled=true (the layout is "
                          "fixed before compiling)", "full, conv")

    from cltrain.app.models import check_model_name  # keeps torchvision/timm lookups out of import time

    check_model_name(cfg.model.name, cfg.model.source)
    _validate_paths(cfg)
    if cfg.get("ckpt_path") is not None:
        _check_checkpoint(str(cfg.ckpt_path), cfg)

    accelerator, index = resolve_device(cfg.device)
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


def is_launched_child() -> bool:
    """True in the processes Lightning's DDP launcher starts (LOCAL_RANK > 0) and on nodes > 0."""
    return any(os.environ.get(var, "0") not in ("", "0") for var in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK"))
