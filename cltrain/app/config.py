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

from cltrain.app.errors import ConfigError
from cltrain.app.keys import check_keys

__all__ = ["ConfigError", "Resolved", "cpu_has_native_bf16", "demo_default_root", "is_launched_child", "resolve_device", "resolve_precision", "validate"]

AMP_DTYPES = ("auto", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")
CHANNELS_LAST_MODES = ("full", "conv", "auto")
OPTIMIZERS = ("sgd", "adamw")


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

    from cltrain.app.cli import CONFIG_DIR

    roots: dict[str, str] = {}
    for path in sorted((CONFIG_DIR / "data").glob("*.yaml")):
        node = OmegaConf.load(path)
        if node.get("demo") is not None and node.get("root") is not None:
            roots.setdefault(str(node.demo.get("_target_", "cltrain.data.make_demo_dataset")), str(node.root))
    return roots


def demo_default_root() -> str:
    """``data.root`` of ``conf/data/demo.yaml``: the one place ``train.py`` generates the demo set."""
    from omegaconf import OmegaConf

    from cltrain.app.cli import CONFIG_DIR

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
    precision = resolve_precision(cfg.amp, cfg.amp_dtype, accelerator)
    if cfg.sync_bn and accelerator != "cuda":
        raise ConfigError("sync_bn", True, f"SyncBatchNorm needs CUDA devices (torch has none for {accelerator})",
                          "false; or device=cuda")
    devices = [index] if index is not None else cfg.trainer.devices
    return Resolved(accelerator=accelerator, devices=devices, precision=precision)


def is_launched_child() -> bool:
    """True in the processes Lightning's DDP launcher starts (LOCAL_RANK > 0) and on nodes > 0."""
    return any(os.environ.get(var, "0") not in ("", "0") for var in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK"))
