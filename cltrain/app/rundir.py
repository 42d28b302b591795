"""Never write over an earlier run: refuse a run directory that already holds one.

Two guards, because Hydra writes ``.hydra/`` into the run directory before the
task starts:

* :class:`RunDirGuard`, a Hydra callback (``hydra.callbacks`` in ``conf/config.yaml``),
  refuses a ``hydra.run.dir`` / ``hydra.sweep.dir`` holding anything but Hydra's own
  bookkeeping (``.hydra/``, ``*.log``: all a run stopped by a config error leaves)
  before Hydra writes anything;
* :func:`check_run_dir`, called by ``train(cfg)``, refuses a directory holding
  a previous run's outputs (also when ``train`` is called without Hydra).

Processes that Lightning's DDP launcher starts (``LOCAL_RANK`` > 0) share their
parent's run directory by design and are let through.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from cltrain.app.config import ConfigError, is_launched_child

__all__ = ["OUTPUTS", "RunDirGuard", "check_run_dir"]

#: What a run writes into its directory.
OUTPUTS = ("metrics.json", "checkpoints", "csv")


def check_run_dir(run_dir: str | Path, key: str = "run_dir") -> Path:
    """``run_dir`` as an absolute path, created; raises :class:`ConfigError` if it holds a previous run."""
    path = Path(run_dir).expanduser().resolve()
    if not is_launched_child():
        found = [name for name in OUTPUTS if (path / name).exists()]
        if found:
            raise ConfigError(key, str(path), f"already holds a run ({', '.join(found)}); it is never overwritten",
                              "a new directory")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _is_bookkeeping(entry: Path) -> bool:
    """Hydra's own files (config copies, the job log): all a run that failed its config check leaves."""
    return entry.name in (".hydra", "multirun.yaml") or entry.suffix == ".log"


def _refuse_non_empty(directory: Any, key: str) -> None:
    path = Path(str(directory)).expanduser()
    if is_launched_child() or not path.is_dir():
        return
    found = sorted(entry.name for entry in path.iterdir() if not _is_bookkeeping(entry))
    if not found:
        return
    shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
    error = ConfigError(key, str(path.resolve()), f"holds an earlier run ({shown}); it is never overwritten",
                        "a new directory")
    print(f"cltrain: error: {error}", file=sys.stderr)
    raise SystemExit(2)  # Hydra turns exceptions into tracebacks; this stays one line


class RunDirGuard(Callback):
    """Hydra callback: stop before Hydra writes into a run or sweep directory that holds an earlier run."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_non_empty(OmegaConf.select(config, "hydra.run.dir"), "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_non_empty(OmegaConf.select(config, "hydra.sweep.dir"), "hydra.sweep.dir")
