"""The callbacks a ``train.py`` run trains with, built from its config.

Always main_amp's progress lines (or a progress bar) and the signal handler; the ``ChannelsLast``
callback with ``channels_last=true``; EMA weights with ``ema.enabled=true``; a count of the files
the DataModule's workers left out with ``data.bad_files=skip``; and, when training, the best
checkpoints by ``val/top1``, ``last.ckpt`` every epoch and on an exception, and a stop on a
non-finite loss. Then the ``callbacks=`` config group's (``cltrain.app.groups``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig

from cltrain.app.checkpoints import RunCheckpoint
from cltrain.app.config import Resolved
from cltrain.app.ema import EMA
from cltrain.app.finite import StopOnNonFinite
from cltrain.app.groups import build_callbacks
from cltrain.app.on_exception import KeepOnException
from cltrain.app.progress import MainAmpProgress, main_amp_progress_bar
from cltrain.app.signals import SignalStop

__all__ = ["RunCallbacks", "build_run_callbacks"]


@dataclass
class RunCallbacks:
    """The callbacks, in the Trainer's order, and the ones the run reads back when it reports.

    ``parts``: ``"channels_last"`` (the ``ChannelsLast`` callback), ``"best"`` and ``"last"``
    (the ``RunCheckpoint`` callbacks, ``cltrain.app.checkpoints``), ``"on_exception"``, each present only when built."""

    callbacks: list[Callback]
    progress: MainAmpProgress
    parts: dict[str, Any] = field(default_factory=dict)


def build_run_callbacks(cfg: DictConfig, resolved: Resolved, run_dir: Path, stop: SignalStop,
                        has_logger: bool = True) -> RunCallbacks:
    """Every callback of the run for ``cfg`` (checkpoints under ``run_dir/checkpoints``), ``stop`` among them: the
    run's own, then the ``callbacks=`` group's (a ``LearningRateMonitor`` only when ``has_logger``)."""
    bar = cfg.trainer.get("enable_progress_bar", False)  # one progress display: the bar or main_amp's lines
    progress = MainAmpProgress(print_freq=cfg.print_freq, warmup=cfg.throughput_warmup, lines=not bar)
    callbacks: list[Callback] = [progress]
    parts: dict[str, Any] = {}
    if cfg.channels_last:
        from cltrain.callback import ChannelsLast

        parts["channels_last"] = ChannelsLast(mode=cfg.channels_last_mode, layout=cfg.channels_last_layout)
        parts["channels_last"].session.pin_format = "channels_last_layout={}"  # the lines say the app's override
        callbacks.append(parts["channels_last"])
    # A progress bar fed from host values (nothing prog_bar=True per step: no per-step sync); EMA weights
    # when ema.enabled=true. The learning rate is logged by LearningRateMonitor (callbacks/lr_monitor.yaml, a default).
    if bar:
        callbacks.append(main_amp_progress_bar())
    if cfg.ema.enabled and not cfg.evaluate_only:
        callbacks.append(EMA(cfg.ema.decay, cfg.ema.warmup_steps, cfg.ema.every_n_steps))
    if cfg.data.get("bad_files") == "skip":  # counts what the DataModule's workers left out, per epoch
        from cltrain.data import SkippedFilesReport

        callbacks.append(SkippedFilesReport())
    if not cfg.evaluate_only:
        checkpoints = run_dir / "checkpoints"
        # The best k by val/top1, apart from last.ckpt: with a monitor, Lightning's save_last only
        # writes last.ckpt when the metric improves, so the latest state has its own checkpoint callback.
        parts["best"] = RunCheckpoint(dirpath=checkpoints, filename="best-epoch{epoch:03d}", monitor="val/top1",
                                      mode="max", save_top_k=cfg.checkpoint.save_top_k, auto_insert_metric_name=False)
        parts["last"] = RunCheckpoint(dirpath=checkpoints, filename="last", monitor=None, save_top_k=1,
                                      every_n_epochs=1, save_on_train_epoch_end=True, enable_version_counter=False)
        # signal or crash: the latest state (a signal during the save waits for it)
        parts["on_exception"] = KeepOnException(checkpoints, filename="last", holding=stop.holding)
        callbacks += [parts["best"], parts["last"], parts["on_exception"]]  # the DataModule adds ResumeMidEpoch
        # A NaN loss stops the run (checked where the progress line syncs anyway), before NaN weights are saved.
        try_amp = ", or amp=false" if resolved.precision != "32-true" else ""
        callbacks.append(StopOnNonFinite(every=cfg.print_freq, hint=f"; {checkpoints / 'last.ckpt'} (if written) keeps the "
                                                                     f"latest finite state. Try a lower optim.lr{try_amp}"))
    callbacks += build_callbacks(cfg.get("callbacks"), run_dir, has_logger=has_logger).values()
    # Last: a signal stops the run after every other callback's batch-end hook (the EMA's update among them),
    # so the state saved is the whole step's and a resumed run continues exactly.
    callbacks.append(stop)
    return RunCallbacks(callbacks, progress, parts)
