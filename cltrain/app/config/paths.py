"""What the paths of a config must name on this machine: the data folder, the checkpoint, the weights.

``check_paths`` refuses a ``data.root`` that is not a folder (a URL, ``s3://...``, where the option reads one:
``data=shards``) (a demo option's set is generated only
at its own default root, ``demo_home``), a missing ``ckpt_path``, ``model.pretrained`` or ``data.exclude_files``
file, and
``evaluate_only`` without either; ``check_checkpoint`` opens ``ckpt_path`` without running anything
in it and refuses one the run cannot resume from (another optimizer, weights only, EMA state
without ``ema.enabled``).
"""

from __future__ import annotations

import re

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from cltrain.app.config.data_schema import (HFConfig, LitDataConfig, MDSConfig, ShardsConfig, WebDatasetConfig,
                                            demo_home)
from cltrain.app.config.errors import ConfigError
from cltrain.data.remote import is_url, redact

__all__ = ["check_checkpoint", "check_checkpoint_model", "check_paths"]

_HUB_ROOTS = "a folder written by save_to_disk, a folder of Parquet files, or a Hub id <owner>/<name>"


def check_paths(cfg: DictConfig) -> None:
    """``data.root``, ``ckpt_path`` and ``model.pretrained`` name what exists, and ``evaluate_only`` has
    something to evaluate.

    Raises:
        ConfigError: the first path that is missing, or not what its key needs.
    """
    data = cfg.data
    root = data.get("root")
    hub = _takes_hub_ids(data)
    if root is None:
        what = "a dataset" if hub else "an ImageNet-layout folder"
        raise ConfigError("data.root", root, f"not set; {what} is needed",
                          _HUB_ROOTS if hub else "a directory with train/ and val/ class folders")
    where = Path(str(root)).expanduser()
    if is_url(str(root)):
        if hub:
            from cltrain.data.hf_source import READS, URL_FIX

            raise ConfigError("data.root", redact(str(root)), f"a URL; {READS}", f"a local folder: {URL_FIX}")
        if not _takes_urls(data):
            raise ConfigError("data.root", redact(str(root)), "a URL; this data option reads a local folder",
                              "a local path; for a bucket, a pack (cltrain-pack ROOT OUT, OUT uploaded as it is) with "
                              "data=shards data.root=<URL of OUT>")
    elif hub:
        from cltrain.data.hf_source import is_hub_id

        if not where.is_dir() and not is_hub_id(root):
            raise ConfigError("data.root", str(root), "no such directory, and not a Hub id", _HUB_ROOTS)
    else:
        _check_folder(data, str(root), where)
    for key in ("ckpt_path", "model.pretrained"):
        path = cfg.get("ckpt_path") if key == "ckpt_path" else cfg.model.get("pretrained")
        if path is not None and not Path(str(path)).expanduser().is_file():
            folder = Path(str(path)).expanduser().is_dir()
            hint = " (a run's is <run dir>/checkpoints/last.ckpt)" if key == "ckpt_path" else ""
            raise ConfigError(key, str(path), "a folder, not a file" if folder else "no such file",
                              f"a local file path{hint}, or null")
    listed = data.get("exclude_files")
    if listed is not None and not Path(str(listed)).expanduser().is_file():  # before the ranks start, said once
        folder = Path(str(listed)).expanduser().is_dir()
        raise ConfigError("data.exclude_files", str(listed), "a folder, not a file" if folder else "no such file",
                          "a file of paths, one per line (cltrain-data-check's list, a run's skipped_files.tsv), "
                          "or null")
    if cfg.evaluate_only and cfg.get("ckpt_path") is None and cfg.model.get("pretrained") is None:
        raise ConfigError("evaluate_only", True, "nothing to evaluate",
                          "with ckpt_path=<checkpoint> or model.pretrained=<weights file>")


def _wanted(data: DictConfig) -> str:
    """What the data option's ``root`` holds, in a few words."""
    schema = OmegaConf.get_type(data)
    for config, what in ((ShardsConfig, "a pack (cltrain-pack IMAGEFOLDER OUT) as a folder"),
                         (LitDataConfig, "a folder with train/ and val/ LitData optimized datasets"),
                         (MDSConfig, "a folder with train/ and val/ Mosaic MDS datasets"),
                         (WebDatasetConfig, "a folder with train/ and val/ WebDataset .tar shards")):
        if isinstance(schema, type) and issubclass(schema, config):
            return f"{what}, or its URL (s3://, gs://, az://, https://)"
    return "a directory with train/ and val/ class folders"


def _check_folder(data: DictConfig, root: str, where: Path) -> None:
    """``data.root`` is a folder, or the one place the data option's demo set is generated."""
    if where.exists() and not where.is_dir():
        raise ConfigError("data.root", root, "is a file, not a directory", _wanted(data))
    demo = data.get("demo")
    if demo is None and not where.is_dir():
        typo = re.match(r"^([A-Za-z][A-Za-z0-9+.-]+):/+(?!/)", root) if _takes_urls(data) else None
        if typo and not root.startswith(f"{typo.group(1)}://"):  # s3:/bucket/x: a URL with a slash missing
            raise ConfigError("data.root", redact(root), "no such directory, and not a URL (one slash after "
                              f"'{typo.group(1)}:')", f"{typo.group(1)}://{root[typo.end():]}")
        raise ConfigError("data.root", root, "no such directory", _wanted(data))
    home = demo_home(data)
    if demo is not None and not where.exists() and not demo.any_root \
            and (home is None or where.resolve() != Path(home).resolve()):
        # A typo'd path would otherwise get a freshly generated demo set and train on it without a word.
        raise ConfigError("data.root", root, "no such directory; the demo set is generated only at its default "
                          f"location {home}", "data=imagenet data.root=<your folder> for your own "
                          "data; or leave data.root unset for the demo set")


def _takes_urls(data: DictConfig) -> bool:
    """Whether the data option's ``root`` may be a URL in object storage (``data=shards``, ``litdata``, ``mds``, ``webdataset``)."""
    schema = OmegaConf.get_type(data)
    return isinstance(schema, type) and issubclass(schema, (ShardsConfig, LitDataConfig, MDSConfig, WebDatasetConfig))


def _takes_hub_ids(data: DictConfig) -> bool:
    """Whether the data option's ``root`` may be a Hub id (``data=hf``)."""
    schema = OmegaConf.get_type(data)
    return isinstance(schema, type) and issubclass(schema, HFConfig)


def check_checkpoint(path: str, cfg: DictConfig) -> None:
    """A resume/evaluate checkpoint is a Lightning checkpoint whose optimizer matches ``optim.name``
    (a changed optimizer would fail deep inside Lightning with ``KeyError: 'step'``).

    Raises:
        ConfigError: a file that is unsafe or unreadable, not a Lightning checkpoint, or not one
            this run can resume from.
    """
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


def check_checkpoint_model(path: str, model_state: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint holds the weights of the model the run built (``model_state``: the LightningModule's state
    dict), key for key and shape for shape: another model failed inside Lightning's load with every mismatch listed,
    after the run had started.

    Returns:
        The checkpoint, mapped (``check_checkpoint_progress`` reads it too).

    Raises:
        ConfigError: the first few keys that differ, and the fix.
    """
    from cltrain.checkpoint_io import load_checkpoint_file

    checkpoint = load_checkpoint_file(path, map_location="cpu", mmap=True)
    saved = checkpoint["state_dict"]
    differ = [f"{k} missing" for k in model_state if k not in saved]
    differ += [f"{k} not in this model" for k in saved if k not in model_state]
    differ += [f"{k} {tuple(saved[k].shape)} here {tuple(v.shape)}" for k, v in model_state.items()
               if k in saved and tuple(saved[k].shape) != tuple(v.shape)]
    if differ:
        shown = "; ".join(differ[:3]) + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")
        raise ConfigError("ckpt_path", path, f"holds the weights of another model than model.name builds here "
                          f"({shown})", "the model.name (and model.kwargs, data's classes) of the run that wrote it; "
                          "or model.pretrained=<ckpt> to start anew from the weights that fit")
    return checkpoint


def check_checkpoint_progress(path: str, saved: dict[str, Any], max_epochs: int | None, max_steps: int | None) -> None:
    """The checkpoint has training left under ``trainer.max_epochs`` / ``max_steps``: one that reached them already
    resumed into a fit that trained nothing, wrote no checkpoint and said nothing (``saved``: the checkpoint at
    ``path``, as ``check_checkpoint_model`` loaded it).

    Raises:
        ConfigError: the limit reached, and the fix.
    """
    epochs = saved.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {}).get("processed")
    steps = saved.get("global_step")
    if max_steps is not None and max_steps >= 0 and isinstance(steps, int) and steps >= max_steps:
        raise ConfigError("ckpt_path", path, f"has trained {steps} step(s), trainer.max_steps={max_steps} already: "
                          "nothing is left to train", f"trainer.max_steps above {steps} to train on")
    if max_epochs is not None and max_epochs >= 0 and isinstance(epochs, int) and epochs >= max_epochs:
        raise ConfigError("ckpt_path", path, f"has trained {epochs} epoch(s), trainer.max_epochs={max_epochs} "
                          "already: nothing is left to train", f"trainer.max_epochs above {epochs} to train on; "
                          "evaluate_only=true to validate it")
