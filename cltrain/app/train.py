"""``train(cfg)``: the whole training run behind ``python train.py``, testable without a shell.

The recipe: check the config (``validate``, before anything is built), claim the run directory,
seed; build the data (generating the demo set on first use), the model (guarded and compiled:
``cltrain.app.prepare``), the ``ImageClassifier``, the run's callbacks (``cltrain.app.callbacks``)
and a Lightning ``Trainer`` whose accelerator and precision come from ``device`` / ``amp``; then fit
(or resume from ``ckpt_path``) or, with ``evaluate_only``, validate; finally write ``metrics.json``
and print the result (``cltrain.app.results``).

Example::

    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir="/path/to/conf", version_base="1.3"):
        cfg = compose("config", overrides=["experiment=smoke", "run_dir=/tmp/run1"])
    metrics = train(cfg)          # {"val_top1": ..., "images_per_second": ..., ...}
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from cltrain.app.callbacks import build_run_callbacks
from cltrain.app.config import ConfigError, Resolved, validate
from cltrain.app.config.paths import check_checkpoint_model, check_checkpoint_progress
from cltrain.app.console import quiet_console
from cltrain.app.datasource import absolute, build_datamodule
from cltrain.app.groups import build_loggers
from cltrain.app.launch import check_launch
from cltrain.app.models import build_classifier, check_input_size
from cltrain.app.prepare import apply_cuda_math, build_lightning_module, prepare_model
from cltrain.app.results import RunResults, resume_command, resume_line, summary_line
from cltrain.app.rundir import run_dir_of
from cltrain.app.signals import RunInterrupted, SignalStop, lost_peer, peer_exit_status, trained_out
from cltrain.checkpoint_io import AtomicCheckpointIO

__all__ = ["build_datamodule", "resume_command", "train", "trainer_error"]


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured training (or evaluation); returns the final metrics (also in ``metrics.json``).

    A run stopped by SIGTERM / SIGINT saves ``checkpoints/last.ckpt``, writes ``metrics.json``
    with ``"status": "interrupted"``, prints the resume command and raises ``SystemExit(143 / 130)``.
    A run that fails with an exception saves ``last.ckpt`` too, and writes ``"status": "failed"``.
    Checkpoints are saved atomically (``AtomicCheckpointIO``): a save that
    fails for lack of space raises ``DiskFullError`` and leaves the previous
    ``last.ckpt`` as it was.

    Raises:
        ConfigError: a bad config value (raised before anything is built), or a run
            directory that cannot be this run's.
    """
    resolved: Resolved = validate(cfg)
    check_launch(cfg)
    run_dir = run_dir_of(cfg)
    started = time.perf_counter()
    with SignalStop() as stop:
        try:
            with quiet_console():
                return _train(cfg, resolved, run_dir, stop, started)
        except RunInterrupted as interrupt:
            code = 128 + interrupt.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
            if not getattr(interrupt, "reported", False):
                print(f"cltrain: interrupted by {signal.Signals(interrupt.signum).name} before training started; "
                      "nothing to resume", file=sys.stderr, flush=True)
            if interrupt.at_once:
                _exit_now(code)
    raise SystemExit(code)


def _exit_now(code: int) -> NoReturn:
    """The exit a second signal asks for: the exit handlers run (temporary files removed, logs flushed), but no
    thread still busy is waited for (Python joins a thread pool's threads at exit: a shard download in flight in
    the loader's decode threads would hold the process until it ends)."""
    atexit._run_exitfuncs()  # CPython's own call at exit (multiprocessing's children make it too); no public one
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _train(cfg: DictConfig, resolved: Resolved, run_dir: Path, stop: SignalStop, started: float) -> dict[str, Any]:
    apply_cuda_math(cfg)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    if cfg.data.get("image_size") is not None:  # a too small input fails inside the first step, with a traceback
        check_input_size(cfg.model.name, cfg.model.source, cfg.data.image_size, cfg.data.get("num_frames"))
    datamodule = build_datamodule(cfg)
    kwargs = cfg.model.get("kwargs")
    model = build_classifier(cfg.model.name, datamodule.num_classes, cfg.model.source,
                             absolute(cfg.model.pretrained), {} if kwargs is None else OmegaConf.to_container(kwargs))
    guarded = prepare_model(cfg, resolved, model)

    loggers = build_loggers(cfg.get("logger"), run_dir)
    run = build_run_callbacks(cfg, resolved, run_dir, stop, has_logger=bool(loggers))
    try:
        trainer: pl.Trainer = instantiate(
            cfg.trainer, accelerator=resolved.accelerator, devices=resolved.devices, precision=resolved.precision,
            callbacks=run.callbacks, logger=loggers or False,
            plugins=[AtomicCheckpointIO()],  # atomic saves, weights_only loads
            benchmark=resolved.benchmark, default_root_dir=str(run_dir),
            # validating writes no checkpoint: Lightning's default one took the state of the checkpoint validated
            # and warned that its folder had changed
            **({"enable_checkpointing": False} if cfg.evaluate_only else {}),
        )
    except InstantiationException as err:  # a trainer.* value Lightning refuses: its own reason, first line
        raise trainer_error(cfg.trainer, str(err.__cause__ or err).strip().splitlines()[0]) from None
    global_batch = cfg.data.batch_size * trainer.world_size * trainer.accumulate_grad_batches
    module, lr = build_lightning_module(cfg, model, datamodule.num_classes, global_batch)
    ckpt_path = absolute(cfg.get("ckpt_path"))
    if ckpt_path is not None:
        saved = check_checkpoint_model(ckpt_path, module.state_dict())
        if not cfg.evaluate_only:
            check_checkpoint_progress(ckpt_path, saved, cfg.trainer.get("max_epochs"), cfg.trainer.get("max_steps"))
        del saved
    results = RunResults(cfg, resolved, trainer, run, run_dir, global_batch, lr, ckpt_path, guarded, started)

    rank_zero_info(f"cltrain: precision {resolved.precision} ({resolved.precision_reason})")
    try:
        if cfg.evaluate_only:
            with warnings.catch_warnings():  # "callbacks used to create the checkpoint": not needed to validate
                warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`")
                trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False)
        else:
            rank_zero_info(f"cltrain: lr {lr:.4g} (optim.lr {cfg.optim.lr} x global batch {global_batch} / 256)"
                           if cfg.optim.scale_lr else f"cltrain: lr {lr:.4g}")
            with stop.deferred():
                trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
            signum = stop.agreed(trainer) or (signal.SIGTERM if trainer.received_sigterm else None)
            if signum is not None:  # (received_sigterm: a signal after the last agreement)
                # trained out, or stopped by its own stop (an early stop, the user's code)
                ended = trained_out(trainer) or trainer.should_stop
                if not ended or run.progress.last_val_step != trainer.global_step:
                    raise RunInterrupted(signum)  # ended: the final validation is left to do, not started
                # a resume would have nothing to train (refused) or train past the stop: the run ends as it would
                # have, 0 its exit status
                rank_zero_info(f"cltrain: {signal.Signals(signum).name} came after the last training step and its "
                               "validation; the run ends as it would have")
            if run.progress.last_val_step != trainer.global_step:  # the final model has not been validated yet
                trainer.validate(module, datamodule=datamodule, verbose=False)
    except Exception as err:
        if not stop.stopped_by_peer(err):
            _failed(results, err)
            if lost_peer(err):  # the command's exit status is the failing rank's
                err.peer_status = peer_exit_status(trainer)  # type: ignore[attr-defined]
            explained = _explained(cfg, err)
            if explained is not None:
                raise explained from None
            raise
        _interrupted(trainer, results, run_dir, stop, RunInterrupted(stop.signum, at_once=True))
    except (RunInterrupted, SIGTERMException, KeyboardInterrupt) as err:
        _interrupted(trainer, results, run_dir, stop, err)

    metrics = results.finish("completed")
    if trainer.is_global_zero:
        unit = "clips" if len(getattr(datamodule, "input_shape", ())) == 5 else "images"  # what a sample is
        print(summary_line(metrics, datamodule.num_classes, unit), flush=True)
    return metrics


#: torch's refusal of a BatchNorm layer in training given one value per channel.
_ONE_VALUE_PER_CHANNEL = "Expected more than 1 value per channel when training, got input size torch.Size("


def _explained(cfg: DictConfig, err: Exception) -> ConfigError | None:
    """The failure as the config value that explains it, where one does: ``data.batch_size=1`` with a BatchNorm layer
    whose feature map is 1x1 at ``data.image_size`` (one value per channel to normalise)."""
    if cfg.data.get("batch_size") == 1 and isinstance(err, ValueError) and str(err).startswith(_ONE_VALUE_PER_CHANNEL):
        shape = str(err)[len(_ONE_VALUE_PER_CHANNEL):].rstrip(")")
        return ConfigError("data.batch_size", 1, f"a BatchNorm layer of the model got one value per channel to "
                           f"normalise (its input {shape})", "data.batch_size=2 or more per device")
    return None


def trainer_error(trainer: DictConfig, reason: str) -> ConfigError:
    """``reason`` (why Lightning's ``Trainer`` refused its arguments) as one line naming the ``trainer.<key>`` it is
    about: the key the reason names (the one whose value it quotes, where it names several), else the key whose value it
    quotes, else ``trainer`` itself.

    Example::

        >>> str(trainer_error(OmegaConf.create({"strategy": "fsdp", "devices": 1}),
        ...                   "The strategy `fsdp` requires a GPU accelerator"))
        "trainer.strategy='fsdp': The strategy `fsdp` requires a GPU accelerator"
    """
    values = {key: value for key, value in trainer.items() if key != "_target_"}
    named = [key for key in values if re.search(rf"(?<![\w.]){re.escape(str(key))}(?!\w)", reason, re.IGNORECASE)]
    quoted = [key for key, value in values.items() if isinstance(value, str) and len(value) > 1 and value in reason]
    key = next((k for k in named if k in quoted), None) or next(iter(named + quoted), None)
    if key is None:
        return ConfigError("trainer", trainer.get("_target_"), reason)
    return ConfigError(f"trainer.{key}", values[key], reason)


def _interrupted(trainer: pl.Trainer, results: RunResults, run_dir: Path, stop: SignalStop,
                 err: BaseException) -> NoReturn:
    """A run a signal stopped: ``metrics.json`` says so, rank 0 prints the resume line; raises the interruption."""
    signum = getattr(err, "signum", None) or stop.signum or (signal.SIGTERM if trainer.received_sigterm else signal.SIGINT)
    at_once = getattr(err, "at_once", False)
    metrics = results.finish("interrupted")
    for logger in trainer.loggers:  # Lightning finalized them as "failed"; MLflow has a status for a stopped run
        if type(logger).__name__ == "MLFlowLogger":
            with contextlib.suppress(Exception):  # the server gone: the run's own files say it
                logger.finalize("KILLED")
    if trainer.is_global_zero:
        last = metrics.get("last_checkpoint")
        trained = bool(last) and trained_out(trainer)  # a resume would have nothing to train (refused)
        if metrics.get("evaluate_only"):
            how = "its validation was not finished: run the same command again"
        elif not last:
            how = "no checkpoint was written " + (
                "(a second signal stopped the run at once)" if at_once else "(stopped before training)")
        elif trained:
            how = f"its training is complete; the final validation was not run: {resume_line(run_dir, evaluate=True)}"
        else:
            how = resume_line(run_dir)
        if at_once and last and not trained:  # the command last: a line copied to its end runs
            how = f"a second signal stopped it in the middle of a step (its last.ckpt is the latest whole state, " \
                  f"written before); {how}"
        print(f"\ncltrain: interrupted by {signal.Signals(signum).name} at step {trainer.global_step}; {how}",
              file=sys.stderr, flush=True)
    interrupt = RunInterrupted(signum, at_once=at_once)
    interrupt.reported = True
    raise interrupt from None


def _failed(results: RunResults, err: Exception) -> None:
    """A run an exception stopped, training or evaluating: ``metrics.json`` says so (a training run's ``last.ckpt``
    was written by the on-exception save, where it had trained a step)."""
    try:
        results.finish("failed", err)
    except Exception:  # noqa: BLE001 - the original error is the one to show
        pass
