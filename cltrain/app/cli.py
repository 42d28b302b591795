"""``main()``: the command line (``python train.py ...`` and the ``cltrain-train`` console script).

Hydra composes ``conf/config.yaml`` with the command-line overrides and calls
``cltrain.app.train.train``. The overrides are composed and checked against
the schema first (``cltrain.app.config.check_command_line``, every value of
a ``-m`` sweep): an unknown key, a bad value or an unknown group option (``model=resnet5``:
``did you mean model=resnet50?``) ends the run with one line on stderr and exit status 2 before
anything starts.
A problem with the data found once the run has started (an empty class folder, an unreadable
image under ``data.bad_files=raise``, in ``setup`` or in a DataLoader worker: a
``cltrain.data.DataError``) ends it with one line naming the file or folder and the fix, exit status 2.

The configs are cltrain's own (``cltrain.app.config.config_dir``), or ``$CLTRAIN_CONFIG_DIR``;
Hydra's ``--config-dir`` adds a folder of the user's beside them.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import CompactHydraException
from omegaconf import DictConfig

from cltrain.app.config import ConfigError, check_command_line, compose_config, config_dir

__all__ = ["as_keys", "compose_config", "main"]


#: A write refused: a full disk or quota, a folder not writable, a file where a folder should be.
_NO_WRITE = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR}


class SweepJobFailed(CompactHydraException):
    """A failed job of a ``-m`` sweep, after its own line: an ``Exception``, where a ``SystemExit`` would end the
    sweep, so Hydra's sweepers run the other jobs (the basic sweeper raises it after them, Optuna counts it against
    ``max_failure_rate``); compact: Hydra prints its line alone."""


def _run(cfg: DictConfig) -> float | None:
    """One run; returns validation top-1 (%), the value Hydra's sweepers (Optuna) maximise."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        return _train(cfg)
    except SystemExit as stop:
        hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
        if stop.code in (0, None, 130, 143) or hydra_cfg is None or hydra_cfg.mode != RunMode.MULTIRUN:
            raise  # a signal stops the whole sweep
        raise SweepJobFailed(
            f"cltrain: error: a job of the sweep failed (exit status {stop.code}; its line is in "
            f"{Path(hydra_cfg.runtime.output_dir) / (hydra_cfg.job.name + '.log')}); the sweep's other jobs run on, "
            f"and cltrain-sweep-report {hydra_cfg.sweep.dir} tables them") from None


def _train(cfg: DictConfig) -> float | None:
    from cltrain.app.finite import NonFiniteLossError
    from cltrain.app.train import train  # after Hydra has parsed the command line: `--help` stays fast
    from cltrain.atomic import DiskFullError, NotWritableError
    from cltrain.checkpoint_io import CheckpointLoadError
    from cltrain.data.errors import DataError, error_line

    _redact_job_files()
    try:
        return train(cfg).get("val_top1")
    except ConfigError as err:
        _error(f"cltrain: error: {err}")
        raise SystemExit(2) from None  # not an Exception: Hydra lets it through instead of printing a traceback
    except DataError as err:  # raised in setup or a worker: its own line, without the worker's traceback
        _error(f"cltrain: error: {as_keys(error_line(err))}")
        raise SystemExit(2) from None
    except (NonFiniteLossError, DiskFullError, NotWritableError, CheckpointLoadError) as err:  # a diverged run, a
        _error(f"cltrain: error: {err}")  # full disk or a folder not writable, a bad checkpoint:
        # metrics.json says "failed"; one line
        raise SystemExit(1) from None
    except Exception as err:  # noqa: BLE001 - another library's error (a logger's server, ...): its traceback, but
        # without the secrets it may carry (a URL's password); Hydra would print it and the command line as they are
        from cltrain.app.signals import lost_peer
        from cltrain.data.remote import redact

        if lost_peer(err):
            from cltrain.check.localise import first_line

            rank = os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or "0"
            _error(f"cltrain: error: another rank stopped first (its error is above); rank {rank}'s collective lost it "
                   f"({redact(first_line(err))})")
            raise SystemExit(getattr(err, "peer_status", None) or 1) from None

        if isinstance(err, OSError) and err.errno in _NO_WRITE and err.filename:  # a logger's files: where, the fix
            _error(f"cltrain: error: {redact(str(err.filename))}: {err.strerror} (give the key that names it, run_dir "
                   "or logger.<name>.save_dir, a folder this user can write, with free space)")
            raise SystemExit(1) from None
        print(redact("".join(traceback.format_exception(err))), file=sys.stderr, end="")
        _error(f"cltrain: error: {redact(f'{type(err).__name__}: {err}'.splitlines()[0])}")
        raise SystemExit(1) from None


def _error(line: str) -> None:
    """The run's last line: on stderr, and in the run directory's ``train.log`` (Hydra's file handler) beside its
    other records."""
    print(line, file=sys.stderr)
    record = logging.LogRecord("cltrain", logging.ERROR, __file__, 0, line.encode("utf-8", "backslashreplace").decode(),
                               None, None)  # a file name that is not UTF-8: escaped, as stderr writes it
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _redact_job_files() -> None:
    """Hydra's record of the job in the run directory (``.hydra/*.yaml``: the command line, the config) without the
    secrets a command line may carry (a URL's password, a token's value), as every other file of the run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from cltrain.atomic import atomic_write_text
    from cltrain.data.remote import redact

    if not HydraConfig.initialized() or HydraConfig.get().output_subdir is None:
        return
    hydra_cfg = HydraConfig.get()
    paths = sorted((Path(hydra_cfg.runtime.output_dir) / hydra_cfg.output_subdir).glob("*.yaml"))
    if hydra_cfg.mode == RunMode.MULTIRUN:  # the sweep's, written by the launcher before its jobs
        paths += [p for p in [Path(hydra_cfg.sweep.dir) / "multirun.yaml"] if p.is_file()]
    for path in paths:
        text = path.read_text()
        if redact(text) != text:
            atomic_write_text(path, redact(text))


class _Redacting:
    """``sys.stderr`` writing ``redact``-ed text: Hydra writes a failed sweep job's overrides there as they are."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        from cltrain.data.remote import redact

        return self._stream.write(redact(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _redact_hydra_records() -> None:
    """Hydra's own log records (a sweep's launcher names each job's overrides) without the secrets they may carry."""
    from cltrain.data.remote import redact

    make = logging.getLogRecordFactory()
    if getattr(make, "redacts_hydra", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if record.name.startswith(("hydra", "hydra_plugins")):
            record.msg, record.args = redact(record.getMessage()), ()
        return record

    factory.redacts_hydra = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


def as_keys(line: str) -> str:
    """A data error's line with the DataModule's arguments it names as the app's keys (``data.bad_files=skip``)."""
    for name, key in (("bad_files='skip'", "data.bad_files=skip"), (" exclude_files=", " data.exclude_files=")):
        line = line.replace(name, key)
    return line


def main() -> None:
    """Entry point of ``train.py`` and ``cltrain-train``."""
    multirun = [a for a in sys.argv[1:] if a in ("-m", "--multirun")]
    if multirun:  # after an override too: Hydra's parser reads no flag among its overrides ("unrecognized arguments")
        sys.argv[1:] = multirun[:1] + [a for a in sys.argv[1:] if a not in ("-m", "--multirun")]
    try:
        folder = config_dir()  # here, not at import: a bad $CLTRAIN_CONFIG_DIR is one line too
        check_command_line(sys.argv[1:])
    except ConfigError as err:
        print(f"cltrain: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    _redact_hydra_records()
    sys.stderr = _Redacting(sys.stderr)
    try:
        hydra.main(version_base="1.3", config_path=str(folder), config_name="config")(_run)()
    except ValueError as err:  # Hydra's, before it reports errors itself: a traceback
        if not str(err).startswith("Only one of"):
            raise
        print(f"cltrain: error: {err} (a sweep, -m, runs its jobs; --cfg job without -m shows a config)",
              file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        sys.stderr = sys.stderr._stream if isinstance(sys.stderr, _Redacting) else sys.stderr
