"""One directory per run, claimed atomically; never write over an earlier run.

A new directory is claimed by ``os.mkdir``; an existing one given explicitly (``run_dir=``,
``hydra.run.dir=``) only when it holds nothing but Hydra's bookkeeping, by creating the marker
file ``CLAIM`` with ``O_CREAT | O_EXCL``. Both are atomic, so two runs never both win; a marker
whose process is gone is stale. ``RunDirGuard`` (a Hydra callback) claims the directory before
Hydra writes ``.hydra/`` into it and, when a time-pattern directory is taken, takes
``<dir>-1``, ``<dir>-2``, ...; ``train(cfg)`` checks again with ``claim_run_dir``. A requeued
SLURM job may come back to its fixed directory, and processes started by Lightning's DDP
launcher share their parent's. The guarantees: docs/guides/app.md.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from cltrain.app.config.errors import ConfigError
from cltrain.app.launch import is_launched_child
from cltrain.atomic import pid_running

__all__ = ["CLAIM", "OUTPUTS", "RunDirGuard", "check_run_dir", "claim_run_dir", "is_slurm_requeue", "run_dir_of"]

#: What a run writes into its directory.
OUTPUTS = ("metrics.json", "checkpoints", "csv")
#: The marker file of a claimed directory: ``<pid> <host>``.
CLAIM = ".cltrain-run"
_MAX_SUFFIX = 1000


def _is_bookkeeping(entry: Path) -> bool:
    """Hydra's own files (config copies, the job log) and our marker: all a run stopped by a config error leaves."""
    return entry.name in (".hydra", "multirun.yaml", CLAIM) or entry.suffix == ".log"


def _claim_owner(directory: Path) -> tuple[int, str] | None:
    try:
        pid, host = (directory / CLAIM).read_text().split(maxsplit=1)
        return int(pid), host.strip()
    except (OSError, ValueError):
        return None


def _alive(pid: int, host: str) -> bool:
    return host != socket.gethostname() or pid_running(pid)  # another machine's run: assume it is running


def _write_claim(directory: Path, replace: bool = False) -> bool:
    """Create the marker atomically; False if another process holds it."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL)
    try:
        fd = os.open(directory / CLAIM, flags, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()} {socket.gethostname()}\n")
    return True


def is_slurm_requeue() -> bool:
    """True in a SLURM job that was requeued (``SLURM_RESTART_COUNT`` > 0)."""
    return bool(os.environ.get("SLURM_JOB_ID")) and os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0")


def _requeued_run(directory: Path) -> bool:
    """A requeued SLURM job coming back to its own directory, where Lightning saved ``hpc_ckpt_<n>.ckpt``."""
    return is_slurm_requeue() and any(directory.glob("hpc_ckpt_*.ckpt"))


def _failed_before_training(directory: Path) -> bool:
    """A run that stopped before its first step (a data error found at setup): no checkpoint, and a ``metrics.json``
    that says it failed at step 0."""
    if (directory / "checkpoints").exists():
        return False
    try:
        metrics = json.loads((directory / "metrics.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(metrics, dict) and metrics.get("status") == "failed" and not metrics.get("global_step")


def _refusal(directory: Path, key: str) -> ConfigError | None:
    """Why an existing ``directory`` cannot be this run's, or None if it holds only bookkeeping."""
    if not directory.is_dir():
        return ConfigError(key, str(directory), "is a file, not a directory", "a new directory path")
    if _requeued_run(directory):
        return None  # Lightning resumes from the hpc checkpoint there
    entries = sorted(directory.iterdir())
    failed = _failed_before_training(directory)  # its metrics.json and csv/ say only that: the retry writes them anew
    earlier = [e.name for e in entries if e.name in OUTPUTS and not failed]
    if earlier:
        return ConfigError(key, str(directory), f"holds an earlier run ({', '.join(earlier)}); it is never overwritten",
                           "a new directory")
    other = [e.name + ("/" if e.is_dir() else "") for e in entries
             if not _is_bookkeeping(e) and not (failed and e.name in OUTPUTS)]
    if other:
        shown = ", ".join(other[:4]) + (", ..." if len(other) > 4 else "")
        return ConfigError(key, str(directory), f"is not empty and not a cltrain run (holds {shown})",
                           "a new or empty directory")
    return None


def _claim_existing(directory: Path, key: str) -> bool:
    """Claim an existing explicit directory; raises if it cannot be a run directory of ours."""
    refusal = _refusal(directory, key)
    if refusal is not None:
        raise refusal
    owner = _claim_owner(directory)
    # claimed earlier by this process (the Hydra callback, then train()), or now, or taken over from a run that is gone
    claimed = owner is not None and owner[0] == os.getpid() and owner[1] == socket.gethostname() \
        or _write_claim(directory)
    if not claimed:
        owner = _claim_owner(directory)
        claimed = owner is not None and (not _alive(*owner) or _requeued_run(directory)) \
            and _write_claim(directory, replace=True)
    if claimed and _failed_before_training(directory):  # ours now: the failed run's outputs make way for this one's
        (directory / "metrics.json").unlink()
        shutil.rmtree(directory / "csv", ignore_errors=True)
    return claimed


def claim_run_dir(run_dir: str | os.PathLike, key: str = "run_dir", next_free: bool = False) -> Path:
    """Claim ``run_dir`` for this run (atomically) and return it as an absolute path.

    Args:
        run_dir: the directory; created (with parents) when missing.
        key: the config key shown in errors.
        next_free: when ``run_dir`` is taken, claim ``<run_dir>-1``, ``-2``, ... instead
            (for Hydra's date/time pattern); otherwise a taken directory is an error.

    Raises:
        ConfigError: ``run_dir`` is a file, holds an earlier run, holds files that are
            not a run of ours, is claimed by another running process, or cannot be created or written.
    """
    path = Path(run_dir).expanduser().absolute()
    try:
        return _claim(path, key, next_free)
    except OSError as err:  # a read-only place, a file where a folder must be: the user's to choose another
        why = "a file is in the way" if isinstance(err, FileExistsError) else err.strerror or str(err)
        where = f" ({err.filename})" if err.filename and str(err.filename) != str(path) else ""
        raise ConfigError(key, str(path), f"cannot be created or written: {why}{where}",
                          f"another {key}, in a folder you can write to") from None


def _claim(path: Path, key: str, next_free: bool) -> Path:
    if is_launched_child():
        path.mkdir(parents=True, exist_ok=True)
        return path
    if path.exists() and not path.is_dir():
        raise ConfigError(key, str(path), "is a file, not a directory", "a new directory path")
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in range(_MAX_SUFFIX if next_free else 1):
        candidate = path if n == 0 else path.with_name(f"{path.name}-{n}")
        try:
            os.mkdir(candidate)
        except FileExistsError:
            if next_free:
                continue  # taken (by a run started in the same second, or earlier): try the next name
            if _claim_existing(candidate, key):
                return candidate
            owner = _claim_owner(candidate)
            raise ConfigError(key, str(candidate), f"in use by another run (pid {owner[0] if owner else '?'})",
                              "a new directory") from None
        _write_claim(candidate, replace=True)
        return candidate
    raise ConfigError(key, str(path), f"{path.name}-1 .. -{_MAX_SUFFIX - 1} are all taken", "a new directory")


def check_run_dir(run_dir: str | os.PathLike, key: str = "run_dir") -> Path:
    """``run_dir`` claimed for this run (see ``claim_run_dir``); kept for callers of the old name."""
    return claim_run_dir(run_dir, key)


def run_dir_of(cfg: DictConfig) -> Path:
    """The run's directory, claimed: ``run_dir`` when set, else Hydra's (claimed already by ``RunDirGuard``).

    Raises:
        ConfigError: neither is set, or the directory cannot be this run's (see ``claim_run_dir``).
    """
    from hydra.core.hydra_config import HydraConfig

    if cfg.get("run_dir"):
        return claim_run_dir(cfg.run_dir, "run_dir")
    if HydraConfig.initialized():  # claimed by RunDirGuard before Hydra wrote into it; this finds our claim
        return claim_run_dir(HydraConfig.get().runtime.output_dir, "hydra.run.dir")
    raise ConfigError("run_dir", None, "not set and not running under Hydra", "a directory path")


def _is_pattern(config: DictConfig, key: str) -> bool:
    """Whether ``key`` is a time pattern (Hydra's default ``outputs/${now:...}``, or any with ``${now:``):
    a name made up for the run, so a taken one is replaced by the next free; a fixed path is the user's
    choice, and a taken one is an error."""
    raw = OmegaConf.to_container(config.hydra.run if key == "hydra.run.dir" else config.hydra.sweep, resolve=False)
    return "${now:" in str(raw.get("dir", ""))


def _claim_for_hydra(config: DictConfig, key: str) -> None:
    if is_launched_child():
        return
    try:
        path = claim_run_dir(str(OmegaConf.select(config, key)), key, next_free=_is_pattern(config, key))
    except ConfigError as error:
        print(f"cltrain: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None  # Hydra turns exceptions into tracebacks; this stays one line
    group = config.hydra.run if key == "hydra.run.dir" else config.hydra.sweep
    with read_write(group), open_dict(group):
        group.dir = str(path)


class RunDirGuard(Callback):
    """Hydra callback: claim the run (or sweep) directory before Hydra writes into it; see the module docstring."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _claim_for_hydra(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _claim_for_hydra(config, "hydra.sweep.dir")
