"""main_amp.py's progress line, and the images/second a run reports.

``MainAmpProgress`` prints every ``print_freq`` training batches::

    Epoch: [2][20/31]  Time 0.532 (0.541)  Speed 60.150 (59.121)  Loss 1.2034 (1.4310)  Prec@1 56.250 (48.125)  Prec@5 93.750 (90.625)

(time per batch and images/second over the last ``print_freq`` batches, the
running averages in brackets; loss and accuracy of the latest batch, epoch
averages in brackets; under several ranks, over every rank's batch, as apex reduces them
at its print points), and ``* Prec@1 ... Prec@5 ...`` after each validation.

It also measures the steady-state training throughput, data loading included: the wall time
between consecutive training batch ends, without the first ``warmup`` batches, the first batch
of every epoch and validation, images counted across all processes. On CUDA it synchronises
only where a timed window ends, as main_amp.py does at its print points.
``MainAmpProgressBar`` (Rich when installed, else tqdm) shows the latest print step's values,
already on the host, so the bar adds no device sync per step.

Example::

    >>> from lightning.pytorch import Trainer
    >>> progress = MainAmpProgress(print_freq=10, warmup=3)
    >>> trainer = Trainer(callbacks=[progress], logger=False)   # doctest: +SKIP
    >>> progress.summary()["images_per_second"]                  # after trainer.fit(...)   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from cltrain.app.module import stream_batches
from cltrain.timing.clock import Stopwatch

__all__ = ["MainAmpProgress", "MainAmpProgressBar", "Meter", "main_amp_progress_bar"]


class Meter:
    """Wall time and images between consecutive batch ends, with a warm-up left out."""

    def __init__(self, warmup: int = 0) -> None:
        self.warmup = warmup
        self.seen = 0  # batch ends seen, warm-up included
        self.seconds = 0.0
        self.images = 0
        self.intervals = 0
        self._watch: Stopwatch | None = None  # running from the last batch end (cltrain.timing's clock)

    def restart(self) -> None:
        """Forget the last timestamp: the next interval (epoch start, after validation) is not counted."""
        self._watch = None

    def tick(self, images: int) -> float | None:
        """Record a batch end; returns the interval it closed (seconds), if counted."""
        first, self.seen = self._watch is None, self.seen + 1
        if first:
            self._watch = Stopwatch().start()
            return None
        interval = self._watch.lap()
        if self.seen <= self.warmup:
            return None
        self.seconds += interval
        self.images += images
        self.intervals += 1
        return interval

    @property
    def images_per_second(self) -> float | None:
        return self.images / self.seconds if self.seconds > 0 else None

    @property
    def step_time(self) -> float | None:
        return self.seconds / self.intervals if self.intervals else None


class _Average:
    def __init__(self) -> None:
        self.sum, self.count = 0.0, 0

    def add(self, value: float, n: int = 1) -> None:
        self.sum += value * n
        self.count += n

    @property
    def avg(self) -> float:
        return self.sum / self.count if self.count else 0.0


class MainAmpProgress(Callback):
    """Print main_amp.py's periodic line and measure training/validation images per second.

    Args:
        print_freq: print every this many training batches (0: never).
        warmup: training batches left out of the throughput figure (at least the first is always out).
        lines: print the training lines; ``False``: only renew :attr:`bar_values` at print steps, for a
            progress bar that shows them instead (one progress display at a time).

    Raises:
        ValueError: ``print_freq`` or ``warmup`` negative.
    """

    def __init__(self, print_freq: int = 10, warmup: int = 3, lines: bool = True) -> None:
        if print_freq < 0 or warmup < 0:
            raise ValueError(f"print_freq and warmup must be >= 0, got {print_freq} and {warmup}")
        self.print_freq = print_freq
        self.lines = lines
        self.train = Meter(warmup)
        self.val = Meter(0)
        self._window: list[tuple[float, int]] = []  # (seconds, images) of the intervals since the last line
        #: ``trainer.global_step`` at the end of the latest validation (None before any).
        self.last_val_step: int | None = None
        self._time, self._speed = _Average(), _Average()
        self._loss, self._top1, self._top5 = _Average(), _Average(), _Average()
        #: host values of the latest print step, for ``MainAmpProgressBar``
        self.bar_values: dict[str, float] = {}

    def _sync(self, trainer: Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    @staticmethod
    def _images(batch: Any, trainer: Trainer) -> int:
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        return int(images.shape[0]) * trainer.world_size

    # --- training -------------------------------------------------------------------------------
    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.train.restart()
        self._window.clear()
        # every average of the line is the epoch's, as apex's meters are (made anew in each train())
        self._time, self._speed = _Average(), _Average()
        self._loss, self._top1, self._top5 = _Average(), _Average(), _Average()

    @staticmethod
    def _window_ends(trainer: Trainer, batch_idx: int, due: bool) -> bool:
        """Whether this training batch closes a timed window: a print step, the epoch's last batch,
        the run's last (``max_steps``, a stop request) or the one validation follows."""
        if due or batch_idx + 1 >= trainer.num_training_batches or trainer.should_stop:
            return True
        if 0 < trainer.max_steps <= trainer.global_step:
            return True
        every = trainer.val_check_batch
        return bool(trainer.enable_validation and isinstance(every, int) and every > 0 and (batch_idx + 1) % every == 0)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        last_of_epoch = batch_idx + 1 >= trainer.num_training_batches
        due = self.print_freq > 0 and ((batch_idx + 1) % self.print_freq == 0 or last_of_epoch)
        if self._window_ends(trainer, batch_idx, due):
            self._sync(trainer)  # the timestamp below then counts the work, not its launch
        images = self._images(batch, trainer)
        interval = self.train.tick(images)
        if interval is not None:
            self._window.append((interval, images))
        if due and isinstance(outputs, dict):
            self._print_line(trainer, pl_module, outputs, images, batch_idx)

    def _print_line(self, trainer: Trainer, pl_module: LightningModule, outputs: dict, images: int,
                    batch_idx: int) -> None:
        loss_ = outputs["loss"].detach()
        values = torch.stack([torch.as_tensor(v, device=loss_.device).detach().float().reshape(())
                              for v in (loss_, outputs.get("top1", 0.0), outputs.get("top5", 0.0))])
        n = images // trainer.world_size
        if trainer.world_size > 1:  # every rank's batch, as apex's reduce_tensor gives them and the logs count them
            values, n = trainer.strategy.reduce(values, reduce_op="mean"), images
        loss, top1, top5 = values.tolist()
        top1, top5 = 100 * top1, 100 * top5
        self._loss.add(loss, n)
        self._top1.add(top1, n)
        self._top5.add(top5, n)
        if self._window:
            seconds, count = sum(t for t, _ in self._window), len(self._window)
            batch_time, speed = seconds / count, sum(i for _, i in self._window) / seconds
            self._time.add(batch_time, count)
            self._speed.add(speed, seconds)  # weighted by time: the average is images / seconds, as apex prints it
            self._window.clear()
            timing = f"Time {batch_time:.3f} ({self._time.avg:.3f})  Speed {speed:.3f} ({self._speed.avg:.3f})  "
        else:
            timing = "Time - (warm-up)  Speed - (warm-up)  "
        self.bar_values = {"loss": round(loss, 4), "Prec@1": round(top1, 2)}
        if trainer.optimizers:
            self.bar_values["lr"] = float(trainer.optimizers[0].param_groups[0]["lr"])  # a host float already
        if self._speed.count:
            self.bar_values["img/s"] = round(self._speed.avg, 1)
        if not self.lines:
            return
        self._emit(pl_module,
                   f"Epoch: [{trainer.current_epoch}][{batch_idx + 1}/{_of_epoch(trainer)}]  {timing}"
                   f"Loss {loss:.4f} ({self._loss.avg:.4f})  Prec@1 {top1:.3f} ({self._top1.avg:.3f})  "
                   f"Prec@5 {top5:.3f} ({self._top5.avg:.3f})")

    # --- validation -----------------------------------------------------------------------------
    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.train.restart()  # validation time is not training time
        self.val.restart()

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if trainer.sanity_checking:
            return
        batches = trainer.num_val_batches
        total = batches[dataloader_idx] if isinstance(batches, list) and dataloader_idx < len(batches) else batches
        if batch_idx + 1 >= total:
            self._sync(trainer)  # the last validation timestamp counts the work, not its launch
        self.val.tick(self._images(batch, trainer))

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.last_val_step = trainer.global_step
        if self.print_freq == 0:
            return
        metrics = trainer.callback_metrics
        if "val/top1" in metrics:
            self._emit(pl_module, f" * Prec@1 {100 * float(metrics['val/top1']):.3f} "
                                  f"Prec@5 {100 * float(metrics.get('val/top5', float('nan'))):.3f}")

    @rank_zero_only
    def _emit(self, pl_module: LightningModule, line: str) -> None:
        pl_module.print(line)  # through the progress bar when there is one, so it is not torn

    def summary(self) -> dict[str, float | None]:
        """Throughput so far: training images/second and seconds per step, validation images/second."""
        return {
            "images_per_second": self.train.images_per_second,
            "step_time_s": self.train.step_time,
            "measured_steps": self.train.intervals,
            "val_images_per_second": self.val.images_per_second,
        }


class _HostValuesBar:
    """Adds ``MainAmpProgress.bar_values`` (host floats, renewed at print steps) to a progress bar."""

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)  # type: ignore[misc]  # sync-free: no per-step prog_bar logs
        for callback in trainer.callbacks:
            if isinstance(callback, MainAmpProgress):
                items.update(callback.bar_values)
        return items


class MainAmpRichProgressBar(_HostValuesBar, RichProgressBar):
    """Lightning's Rich progress bar showing the latest main_amp print-step values."""


class MainAmpTQDMProgressBar(_HostValuesBar, TQDMProgressBar):
    """Lightning's tqdm progress bar showing the latest main_amp print-step values."""


MainAmpProgressBar = MainAmpRichProgressBar if _RICH_AVAILABLE else MainAmpTQDMProgressBar


def main_amp_progress_bar() -> ProgressBar:
    """The progress bar Lightning would pick (Rich when installed, else tqdm), fed from host values."""
    return MainAmpProgressBar()


def _of_epoch(trainer: Trainer) -> str:
    """The epoch's batches as the progress line gives them: ``~7`` for a stream whose samples per epoch are given (it
    ends where its shards do), ``?`` for one whose are not."""
    batches = stream_batches(trainer)
    if batches is None:
        return "?"
    return str(batches) if trainer.num_training_batches != float("inf") else f"~{batches}"
