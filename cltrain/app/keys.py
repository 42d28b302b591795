"""Every key a user can type, checked before anything is built: names, types, ranges, choices.

:func:`check_keys` goes over the composed config:

* unknown keys (``+chanels_last=false``) are refused with the closest known key;
  the known top-level keys are read from ``conf/config.yaml`` itself, the known
  ``model.*`` / ``optim.*`` keys from every yaml of their group, ``data.*`` from the
  DataModule's constructor and ``trainer.*`` from ``lightning.pytorch.Trainer``'s;
* Trainer arguments the application sets itself (``+trainer.precision``,
  ``+trainer.logger``, ``+trainer.callbacks``, ...) are refused with the key to use instead;
* every value the application reads has its type and range checked (``seed=abc``,
  ``trainer.max_epochs=abc``, ``throughput_warmup=-5``, ...).

Each problem is a :class:`~cltrain.app.errors.ConfigError`: one line, exit status 2.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from cltrain.app.errors import ConfigError

__all__ = ["APP_SET_TRAINER_KEYS", "check_keys"]

#: Trainer arguments train() sets from other keys: the key to use instead.
APP_SET_TRAINER_KEYS = {
    "accelerator": "device (auto, cpu, cuda, cuda:N, mps)",
    "precision": "amp and amp_dtype",
    "logger": "logger=csv|tensorboard|mlflow|wandb|none (several: logger=[csv,tensorboard])",
    "callbacks": "callbacks=[default,early_stopping,...] or +callbacks.<name>._target_=<class>",
    "sync_batchnorm": "sync_bn",
    "deterministic": "deterministic",
    "default_root_dir": "run_dir",
    "benchmark": "cudnn_benchmark",
    "enable_checkpointing": "checkpoint.save_top_k (last.ckpt is always written)",
}


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# (test, reason, allowed) per kind of value.
Check = tuple[Callable[[Any], bool], str, str | None]
BOOL: Check = (lambda v: isinstance(v, bool), "must be a boolean", "true, false")
POSITIVE: Check = (lambda v: _int(v) and v > 0, "must be a whole number > 0", None)
COUNT: Check = (lambda v: _int(v) and v >= 0, "must be a whole number >= 0", None)
SEED: Check = (lambda v: _int(v) and 0 <= v < 2**32, "must be a whole number", "0 .. 2**32-1")
STEPS: Check = (lambda v: v is None or (_int(v) and v >= -1), "must be a whole number >= -1", "-1 for no limit, or null")
OPT_POSITIVE: Check = (lambda v: v is None or (_int(v) and v > 0), "must be a whole number > 0", "or null")
FRACTION_OR_COUNT: Check = (lambda v: v is None or (_int(v) and v >= 0) or (_number(v) and 0.0 <= v <= 1.0),
                            "must be a number of batches or a fraction", "a whole number >= 0, 0.0 .. 1.0, or null")
NON_NEGATIVE: Check = (lambda v: _number(v) and v >= 0, "must be a number >= 0", None)
OPT_NON_NEGATIVE: Check = (lambda v: v is None or (_number(v) and v >= 0), "must be a number >= 0", "or null")
GT_ZERO: Check = (lambda v: _number(v) and v > 0, "must be a number > 0", None)
UNIT: Check = (lambda v: _number(v) and 0.0 <= v < 1.0, "out of range", "0 <= value < 1")
UNIT_CLOSED: Check = (lambda v: _number(v) and 0.0 <= v <= 1.0, "out of range", "0 <= value <= 1")
TEXT: Check = (lambda v: isinstance(v, str) and v != "", "must be a non-empty string", None)
OPT_PATH: Check = (lambda v: v is None or (isinstance(v, str) and v != ""), "must be a path", "a path, or null")
TOP_K: Check = (lambda v: _int(v) and v >= -1, "must be a whole number >= -1", "-1 keeps all, 0 none, k the best k")
DEVICES: Check = (lambda v: v == "auto" or (_int(v) and v > 0) or (isinstance(v, (list, ListConfig)) and len(v) > 0
                  and all(_int(i) and i >= 0 for i in v)), "must be a number of devices", "a whole number > 0, auto, or [0, 1, ...]")
MILESTONES: Check = (lambda v: isinstance(v, (list, ListConfig)) and all(_int(i) and i >= 0 for i in v),
                     "must be a list of epochs", "e.g. [30, 60, 80]")
BETAS: Check = (lambda v: isinstance(v, (list, ListConfig)) and len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
                "must be two numbers in [0, 1)", "e.g. [0.9, 0.999]")
AMP: Check = (lambda v: v == "auto" or isinstance(v, bool), "must be auto or a boolean", "auto, true, false")
MAPPING: Check = (lambda v: v is None or isinstance(v, (dict, DictConfig)), "must be a mapping", "{key: value}, or null")

TOP_LEVEL: dict[str, Check] = {
    "channels_last": BOOL, "amp": AMP, "compile": BOOL, "sync_bn": BOOL, "deterministic": BOOL,
    "evaluate_only": BOOL, "cudnn_benchmark": BOOL, "tf32": BOOL,
    "seed": SEED, "compile_backend": TEXT, "label_smoothing": UNIT, "print_freq": COUNT,
    "throughput_warmup": COUNT, "ckpt_path": OPT_PATH, "run_dir": OPT_PATH,
    "ema": BOOL, "ema_decay": UNIT, "ema_warmup_steps": COUNT, "ema_every_n_steps": POSITIVE,
}
GROUPS: dict[str, dict[str, Check]] = {
    "checkpoint": {"save_top_k": TOP_K},
    "trainer": {
        "max_epochs": STEPS, "max_steps": STEPS, "min_epochs": STEPS, "min_steps": STEPS, "devices": DEVICES,
        "num_nodes": POSITIVE, "strategy": TEXT, "accumulate_grad_batches": POSITIVE,
        "check_val_every_n_epoch": OPT_POSITIVE, "limit_train_batches": FRACTION_OR_COUNT,
        "limit_val_batches": FRACTION_OR_COUNT, "num_sanity_val_steps": STEPS, "log_every_n_steps": POSITIVE,
        "gradient_clip_val": OPT_NON_NEGATIVE, "enable_progress_bar": BOOL, "enable_model_summary": BOOL,
    },
    "data": {
        "root": OPT_PATH, "batch_size": POSITIVE, "num_workers": COUNT, "image_size": POSITIVE,
        "val_resize_size": OPT_POSITIVE, "bad_files": TEXT, "allow_missing_val_classes": BOOL, "demo": MAPPING,
    },
    "model": {"name": TEXT, "source": TEXT, "pretrained": OPT_PATH, "kwargs": MAPPING},
    "optim": {
        "name": TEXT, "lr": GT_ZERO, "scale_lr": BOOL, "momentum": UNIT_CLOSED, "weight_decay": NON_NEGATIVE,
        "nesterov": BOOL, "betas": BETAS, "warmup_epochs": NON_NEGATIVE, "milestones": MILESTONES, "gamma": GT_ZERO,
        "schedule": TEXT, "min_lr_ratio": UNIT_CLOSED,
    },
}


def _config_dir() -> Path:
    from cltrain.app.configs import CONFIG_DIR

    return CONFIG_DIR


@lru_cache(maxsize=None)
def _yaml_keys(config_dir: Path, group: str | None) -> frozenset[str]:
    """Keys the yaml files define: conf/config.yaml (group None) or every conf/<group>/*.yaml."""
    files = [config_dir / "config.yaml"] if group is None else sorted((config_dir / group).glob("*.yaml"))
    keys: set[str] = set()
    for path in files:
        node = OmegaConf.load(path)
        if isinstance(node, DictConfig):
            keys |= {str(k) for k in node.keys() if k not in ("defaults", "hydra")}
    return frozenset(keys)


def _signature_keys(target: Any) -> frozenset[str]:
    """Constructor arguments of ``target`` (a class or its dotted path); empty if it cannot be imported."""
    if isinstance(target, str):
        module, _, name = target.rpartition(".")
        try:
            target = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return frozenset()
    try:
        return frozenset(inspect.signature(target).parameters) - {"self", "args", "kwargs"}
    except (TypeError, ValueError):
        return frozenset()


def _unknown(key: str, value: Any, known: frozenset[str] | set[str], prefix: str = "") -> ConfigError:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"did you mean {prefix + close[0]}?" if close else "see python train.py --help"
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    return ConfigError(prefix + key, value, f"unknown key; {hint}")


def _check_value(key: str, value: Any, check: Check) -> None:
    test, reason, allowed = check
    if not test(value):
        raise ConfigError(key, value, reason, allowed)


def _known_keys(cfg: DictConfig) -> dict[str, frozenset[str]]:
    conf = _config_dir()
    from lightning.pytorch import Trainer

    data_target = cfg.data.get("_target_") if isinstance(cfg.get("data"), DictConfig) else None
    return {
        # logger / callbacks: free-form groups of named entries, checked when they are built (components.py)
        "": _yaml_keys(conf, None) | set(GROUPS) | set(TOP_LEVEL) | {"experiment", "logger", "callbacks"},
        # a Trainer subclass (trainer._target_) may add arguments of its own
        "trainer": ((_signature_keys(Trainer) | _signature_keys(cfg.trainer.get("_target_")))
                    - set(APP_SET_TRAINER_KEYS)) | {"_target_"},
        "data": _signature_keys(data_target) | _yaml_keys(conf, "data") | {"_target_"},
        "model": _yaml_keys(conf, "model") | set(GROUPS["model"]),
        "optim": _yaml_keys(conf, "optim") | set(GROUPS["optim"]),
        "checkpoint": frozenset(GROUPS["checkpoint"]),
    }


def check_keys(cfg: DictConfig) -> None:
    """Refuse unknown keys, keys the app sets itself, and values of the wrong type or range.

    Raises:
        ConfigError: on the first problem, naming the key, the value and what to use.
    """
    known = _known_keys(cfg)
    for key in cfg.keys():
        if key == "hydra":
            continue
        if key not in known[""]:
            raise _unknown(str(key), cfg.get(key), known[""])
    for key, check in TOP_LEVEL.items():
        if key in cfg:
            _check_value(key, cfg.get(key), check)
    for group, checks in GROUPS.items():
        node = cfg.get(group)
        if not isinstance(node, (DictConfig, Mapping)):
            raise ConfigError(group, node, "must be a config group", f"see conf/{group}/ or conf/config.yaml")
        for key in node.keys():
            if group == "trainer" and key in APP_SET_TRAINER_KEYS:
                raise ConfigError(f"trainer.{key}", node.get(key), "set by the app; do not set it here",
                                  f"use {APP_SET_TRAINER_KEYS[key]}")
            if group in known and known[group] and key not in known[group]:
                raise _unknown(str(key), node.get(key), known[group], prefix=f"{group}.")
        for key, check in checks.items():
            if key in node:
                _check_value(f"{group}.{key}", node.get(key), check)
    demo = cfg.data.get("demo")
    if demo is not None and "any_root" in demo:
        _check_value("data.demo.any_root", demo.get("any_root"), BOOL)
