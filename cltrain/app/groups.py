"""Loggers and callbacks from the ``logger=`` and ``callbacks=`` config groups.

As in lightning-hydra-template, each option of a group is one yaml file holding
one named entry with a ``_target_``; several can be chosen at once
(``logger=[csv,tensorboard]``, ``callbacks=[default,early_stopping]``) and any
Lightning logger or callback can be added without code
(``+callbacks.swa._target_=lightning.pytorch.callbacks.StochasticWeightAveraging
+callbacks.swa.swa_lrs=0.01``).

Paths are the run's: an entry whose ``save_dir`` / ``dirpath`` is ``null`` gets
the run directory (``<run dir>/checkpoints`` for checkpoints), and an MLflow
logger without a ``tracking_uri`` writes to ``sqlite:///<run dir>/mlflow.db``
(MLflow 3 refuses its old ``./mlruns`` file store), artifacts to
``<run dir>/mlartifacts``. A logger whose package is missing is a one-line
``ConfigError`` naming the ``pip install`` extra.

Example::

    loggers = build_loggers(cfg.logger, run_dir)       # [CSVLogger(...), TensorBoardLogger(...)]
    callbacks = build_callbacks(cfg.callbacks, run_dir)
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from lightning.pytorch.callbacks import LearningRateMonitor
from omegaconf import DictConfig, OmegaConf

from cltrain.app.config.errors import ConfigError
from cltrain.app.config.hints import unknown_argument
from cltrain.app.module import FINDER_REFUSAL, FINDERS

__all__ = ["LOGGER_EXTRAS", "build_callbacks", "build_loggers"]

#: Logger class name -> (module that must be importable, pyproject extra that installs it).
LOGGER_EXTRAS: dict[str, tuple[tuple[str, ...], str]] = {
    "TensorBoardLogger": (("tensorboard", "tensorboardX"), "tensorboard"),
    "MLFlowLogger": (("mlflow",), "mlflow"),
    "WandbLogger": (("wandb",), "wandb"),
    "CometLogger": (("comet_ml",), "comet"),
    "NeptuneLogger": (("neptune",), "neptune"),
}


def _entries(group: Any, key: str) -> dict[str, dict[str, Any]]:
    """The group's named entries as plain dicts; ``None`` or ``{}`` means none."""
    if group is None:
        return {}
    if not isinstance(group, (Mapping, DictConfig)):
        raise ConfigError(key, group, "must be a group of named entries",
                          f"{key}=<option> or {key}=[<option>,<option>] from conf/{key}/")
    entries = OmegaConf.to_container(group, resolve=True) if isinstance(group, DictConfig) else dict(group)
    for name, entry in entries.items():
        if entry is None:  # `~callbacks.checkpoint` style removal leaves nothing; `callbacks.x=null` too
            continue
        if not isinstance(entry, dict) or "_target_" not in entry:
            raise ConfigError(f"{key}.{name}", entry, "needs a _target_ (the class to build)",
                              f"+{key}.{name}._target_=<module.Class>")
    return {name: entry for name, entry in entries.items() if entry is not None}


def _class(target: str, key: str) -> type:
    try:
        return get_class(target)
    except Exception as err:  # ImportError, AttributeError, ValueError: not a class path
        raise ConfigError(f"{key}._target_", target, f"cannot import it ({type(err).__name__})",
                          "a class path such as lightning.pytorch.callbacks.EarlyStopping") from None


def _build(entry: dict[str, Any], key: str) -> Any:
    for name, value in entry.items():  # +callbacks.x.patiense=3: the closest argument, before the class's TypeError
        error = unknown_argument(f"{key}.{name}", value, entry["_target_"])
        if error is not None:
            raise error
    try:
        return instantiate(entry, _convert_="all")
    except InstantiationException as err:  # a bad argument: the class's own message, first line
        cause = err.__cause__ or err
        raise ConfigError(key, entry.get("_target_"), str(cause).strip().splitlines()[0]) from None


def _require_package(cls: type, name: str, key: str) -> None:
    needs = LOGGER_EXTRAS.get(cls.__name__)
    if needs is None:
        return
    modules, extra = needs
    if not any(importlib.util.find_spec(m) is not None for m in modules):
        raise ConfigError(key, name, f"{cls.__name__} needs the {modules[0]} package",
                          f"pip install 'cltrain[{extra}]'; or another logger=")


def build_loggers(group: Any, run_dir: str | Path, key: str = "logger") -> list[Any]:
    """Instantiate the chosen loggers, writing under ``run_dir`` unless an entry says otherwise.

    Raises:
        ConfigError: an entry without ``_target_``, a class that does not import, a missing
            optional package (naming the extra to install), or an argument the class refuses.
    """
    run_dir = Path(run_dir)
    loggers = []
    for name, entry in _entries(group, key).items():
        cls = _class(entry["_target_"], f"{key}.{name}")
        _require_package(cls, name, f"{key}.{name}")
        if cls.__name__ == "MLFlowLogger" and entry.get("tracking_uri") is None:
            entry["tracking_uri"] = f"sqlite:///{run_dir / 'mlflow.db'}"
            if entry.get("artifact_location") is None:
                entry["artifact_location"] = str(run_dir / "mlartifacts")
        if "save_dir" in entry and entry["save_dir"] is None:
            entry["save_dir"] = str(run_dir)
        loggers.append(_build(entry, f"{key}.{name}"))
    return loggers


def build_callbacks(group: Any, run_dir: str | Path, has_logger: bool = True, key: str = "callbacks") -> dict[str, Any]:
    """Instantiate the chosen callbacks by entry name; ``dirpath: null`` becomes ``<run dir>/checkpoints``.

    A ``LearningRateMonitor`` is left out when the run has no logger (``logger=none``): it has
    nowhere to write, and Lightning would refuse the run.

    Raises:
        ConfigError: as ``build_loggers``.
    """
    built = {}
    for name, entry in _entries(group, key).items():
        cls = _class(entry["_target_"], f"{key}.{name}")
        if isinstance(cls, type) and issubclass(cls, FINDERS):  # refused here, before the run has written anything
            raise ConfigError(f"{key}.{name}", entry["_target_"], *FINDER_REFUSAL)
        if not has_logger and issubclass(cls, LearningRateMonitor):
            continue
        if "dirpath" in entry and entry["dirpath"] is None:
            entry["dirpath"] = str(Path(run_dir) / "checkpoints")
        built[name] = _build(entry, f"{key}.{name}")
    return built
