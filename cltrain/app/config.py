"""Check a composed config before anything is built, and map the toggles onto Lightning.

Every problem is a :class:`ConfigError` that names the key, the value and what is
allowed; the CLI prints it as one line and exits with status 2.

The toggles, and what they become (``device=auto`` is ``cuda`` when available, else ``cpu``):

=============  =====================  ===================================================
``device``     ``amp``                Lightning ``accelerator`` / ``precision``
=============  =====================  ===================================================
any            auto (the default)     :func:`cltrain.precision.auto_precision`: bf16 autocast
                                      where bf16 is native (CUDA compute capability 8.0+,
                                      CPUs with AVX512-BF16/AMX/Arm BF16 not held to AVX2),
                                      fp16 with loss scaling on older GPUs, else fp32
cpu            true                   ``bf16-mixed`` (``amp_dtype`` auto or bf16); without
                                      native bf16 it runs, with a warning: many times slower
cuda[:N]       true                   ``16-mixed`` (``amp_dtype=fp16``), ``bf16-mixed``
                                      (``amp_dtype=bf16``), or by ``auto_precision``
mps            true                   refused
any            false                  ``32-true``
=============  =====================  ===================================================
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from cltrain.app.errors import ConfigError
from cltrain.app.keys import check_keys
from cltrain.devices import DeviceError
from cltrain.devices import resolve_device as resolve_torch_device
from cltrain.precision import auto_precision, cpu_bf16_support

__all__ = ["ConfigError", "Resolved", "cpu_has_native_bf16", "demo_default_root", "is_launched_child", "resolve_device", "resolve_precision", "validate"]

AMP_DTYPES = ("auto", "bf16", "fp16")
CHANNELS_LAST_MODES = ("full", "conv", "auto")
OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class Resolved:
    """What the toggles mean on this machine."""

    accelerator: str  # "cpu" | "cuda" | "mps"
    devices: Any  # trainer.devices, or [N] for device=cuda:N
    precision: str  # Lightning precision flag
    precision_reason: str = ""  # why amp / amp_dtype became that flag on this machine


def cpu_has_native_bf16() -> bool:
    """Whether bf16 autocast runs on native bf16 kernels on this CPU (:func:`cltrain.precision.cpu_bf16_support`)."""
    return cpu_bf16_support()[0]


def resolve_device(device: Any) -> tuple[str, int | None]:
    """(accelerator, cuda index or None) for ``device``: :func:`cltrain.devices.resolve_device` as a ConfigError."""
    try:
        resolved = resolve_torch_device(device)
    except DeviceError as err:
        raise ConfigError("device", device, err.reason, err.allowed) from None
    return resolved.type, resolved.index


#: What bf16 autocast cost on a CPU without native bf16 (ResNet-50 training, docs/performance.md).
CPU_BF16_EMULATED_SLOWDOWN = "ResNet-50 trained 14.5x slower than in fp32 (0.8 vs 11.6 img/s)"


def resolve_precision(amp: Any, amp_dtype: str, accelerator: str, index: int | None = None) -> tuple[str, str]:
    """The Lightning precision flag for ``amp`` (``"auto"``, true, false) and ``amp_dtype`` on
    ``accelerator``, and the reason in words.

    Raises:
        ConfigError: a dtype the device cannot autocast to, or ``amp=true`` on a device without AMP.
    """
    if amp is False:
        return "32-true", "amp=false"
    if accelerator == "cpu" and amp_dtype == "fp16":
        raise ConfigError("amp_dtype", amp_dtype, "AMP on the CPU is bf16 autocast", "auto, bf16; or amp=false")
    if accelerator == "cuda" and amp_dtype == "bf16" and not torch.cuda.is_bf16_supported():
        raise ConfigError("amp_dtype", amp_dtype, "this GPU has no bf16 support", "auto, fp16")
    if accelerator not in ("cpu", "cuda"):
        if amp == "auto":
            return "32-true", f"amp=auto: no mixed precision is chosen automatically on {accelerator}"
        raise ConfigError("amp", amp, f"AMP is not supported on device {accelerator!r}", "auto, false; or device=cpu|cuda")
    explicit = {"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(amp_dtype)
    if amp == "auto" and explicit is None:
        choice = auto_precision(torch.device(accelerator, index) if index is not None else torch.device(accelerator))
        return choice.flag, f"amp=auto: {choice.reason}"
    if accelerator == "cpu":
        native, reason = cpu_bf16_support()
        if not native:
            warnings.warn(
                f"amp=true on a CPU without native bf16 ({reason}): bf16 autocast runs, but emulated; "
                f"{CPU_BF16_EMULATED_SLOWDOWN}. amp=auto or amp=false trains in fp32",
                stacklevel=3,
            )
        return "bf16-mixed", f"amp={amp} amp_dtype={amp_dtype}: bf16 autocast ({reason})"
    if explicit is None:  # amp=true amp_dtype=auto on CUDA: as amp=auto
        choice = auto_precision(torch.device("cuda", index) if index is not None else torch.device("cuda"))
        return choice.flag, f"amp=true: {choice.reason}"
    return explicit, f"amp_dtype={amp_dtype}"


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
    generator = demo.get("_target_", "cltrain.data.make_demo_dataset") if demo is not None else None
    home = demo_default_roots().get(generator, demo_default_root())
    if demo is not None and not where.exists() and not demo.get("any_root", False) \
            and where.resolve() != Path(home).resolve():
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
    if not cfg.evaluate_only and "current_model_state" in state and not cfg.get("ema", False):
        # Its state_dict is the averaged weights; without the EMA callback nothing would restore the training
        # weights (current_model_state) and the run would go on from the average, silently.
        raise ConfigError("ema", False, f"the checkpoint {path} was trained with ema=true (its training weights are kept "
                          "apart from the averaged ones); resuming needs ema=true",
                          "ema=true; or model.pretrained=<ckpt> to start anew from the averaged weights")


def demo_default_roots() -> dict[str, str]:
    """Demo generator (``data.demo._target_``) -> the ``data.root`` its ``conf/data/*.yaml`` declares: the
    places ``train.py`` may generate a demo set (``data=demo`` -> ``data/demo``, ``data=video_demo`` -> ...)."""
    from omegaconf import OmegaConf

    from cltrain.app.configs import CONFIG_DIR

    roots: dict[str, str] = {}
    for path in sorted((CONFIG_DIR / "data").glob("*.yaml")):
        node = OmegaConf.load(path)
        if node.get("demo") is not None and node.get("root") is not None:
            roots.setdefault(str(node.demo.get("_target_", "cltrain.data.make_demo_dataset")), str(node.root))
    return roots


def demo_default_root() -> str:
    """``data.root`` of ``conf/data/demo.yaml``: the one place ``train.py`` generates the demo set."""
    from omegaconf import OmegaConf

    from cltrain.app.configs import CONFIG_DIR

    path = CONFIG_DIR / "data" / "demo.yaml"
    return str(OmegaConf.load(path).get("root", "data/demo")) if path.is_file() else "data/demo"


def validate(cfg: DictConfig) -> Resolved:
    """Check ``cfg`` (before building anything) and resolve device and precision.

    Raises:
        ConfigError: on the first bad value, naming the key, the value and what is allowed.
    """
    check_keys(cfg)  # names, types and ranges of every key; what follows checks meanings
    if cfg.channels_last_mode not in CHANNELS_LAST_MODES:
        raise ConfigError("channels_last_mode", cfg.channels_last_mode, "unknown mode", ", ".join(CHANNELS_LAST_MODES))
    if cfg.compile and cfg.channels_last and cfg.channels_last_mode == "auto":
        raise ConfigError("channels_last_mode", "auto", "cannot be combined with compile=true (the layout is "
                          "fixed before compiling)", "full, conv")
    if cfg.amp_dtype not in AMP_DTYPES:
        raise ConfigError("amp_dtype", cfg.amp_dtype, "unknown dtype", ", ".join(AMP_DTYPES))
    from cltrain.app.schedule import SCHEDULES

    if cfg.optim.get("schedule", "step") not in SCHEDULES:
        raise ConfigError("optim.schedule", cfg.optim.get("schedule"), "unknown schedule", ", ".join(SCHEDULES))
    if cfg.optim.get("name") not in OPTIMIZERS:
        raise ConfigError("optim.name", cfg.optim.get("name"), "unknown optimizer", ", ".join(OPTIMIZERS))

    from cltrain.app.models import check_model_name  # keeps torchvision/timm lookups out of import time

    check_model_name(cfg.model.name, cfg.model.get("source", "auto"))
    _validate_paths(cfg)
    if cfg.get("ckpt_path") is not None:
        _check_checkpoint(str(cfg.ckpt_path), cfg)

    accelerator, index = resolve_device(cfg.device)
    precision, reason = resolve_precision(cfg.amp, cfg.amp_dtype, accelerator, index)
    if cfg.sync_bn and accelerator != "cuda":
        raise ConfigError("sync_bn", True, f"SyncBatchNorm needs CUDA devices (torch has none for {accelerator})",
                          "false; or device=cuda")
    devices = [index] if index is not None else cfg.trainer.devices
    return Resolved(accelerator=accelerator, devices=devices, precision=precision, precision_reason=reason)


def is_launched_child() -> bool:
    """True in the processes Lightning's DDP launcher starts (LOCAL_RANK > 0) and on nodes > 0."""
    return any(os.environ.get(var, "0") not in ("", "0") for var in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK"))
