"""MainAmpProgress: honest timing (issue 9.4) and the host-fed progress bar, on real Trainers.

On CPU ``_sync`` is a no-op, so a subclass records each call, and a recording
``Meter`` records each timestamp: every timed window (a ``max_steps`` stop mid-epoch,
an epoch's last batch, a print step, the batch before a mid-epoch validation, the
last validation batch) must have a sync right before its closing timestamp.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

from cltrain.app.module import ImageClassifier
from cltrain.app.progress import MainAmpProgress, MainAmpProgressBar, Meter
from tests.helpers.plain_modules import loader
from torch import nn


class RecordingMeter(Meter):
    def __init__(self, events: list, name: str, warmup: int = 0) -> None:
        super().__init__(warmup)
        self.events, self.name = events, name

    def tick(self, images: int):
        self.events.append(("tick", self.name))
        return super().tick(images)


class RecordingProgress(MainAmpProgress):
    """Records ``_sync`` calls and meter timestamps in order."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.events: list[tuple[str, str]] = []
        self.train = RecordingMeter(self.events, "train", self.train.warmup)
        self.val = RecordingMeter(self.events, "val")

    def _sync(self, trainer) -> None:
        self.events.append(("sync", ""))
        super()._sync(trainer)


def _module() -> ImageClassifier:
    return ImageClassifier(nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 4)), num_classes=4, lr=0.1,
                           warmup_epochs=0)


def _synced_ticks(events: list[tuple[str, str]], meter: str) -> list[bool]:
    """For each tick of ``meter``: whether a sync came right before it."""
    return [i > 0 and events[i - 1][0] == "sync" for i, e in enumerate(events) if e == ("tick", meter)]


def _fit(tmp_path: Path, progress: MainAmpProgress, **trainer_kwargs) -> Trainer:
    trainer = Trainer(callbacks=[progress], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      num_sanity_val_steps=0, default_root_dir=tmp_path, **trainer_kwargs)
    trainer.fit(_module(), loader(n=40, batch_size=4), loader(n=12, batch_size=4))
    return trainer


def test_a_max_steps_stop_mid_epoch_syncs_before_the_last_timestamp(tmp_path: Path) -> None:
    progress = RecordingProgress(print_freq=0, warmup=0)
    trainer = _fit(tmp_path, progress, max_steps=6, limit_val_batches=0)
    assert trainer.global_step == 6
    # 10 batches per epoch, no prints, no validation: only the stop at step 6 ends a window
    assert _synced_ticks(progress.events, "train") == [False] * 5 + [True]


def test_validation_end_and_print_steps_sync_before_their_timestamps(tmp_path: Path) -> None:
    progress = RecordingProgress(print_freq=4, warmup=0)
    _fit(tmp_path, progress, max_epochs=1, val_check_interval=5)
    # training: print steps 4 and 8, validation after 5, the epoch's last batch 10
    assert _synced_ticks(progress.events, "train") == [False, False, False, True, True, False, False, True, False, True]
    # each validation run (after batch 5 and 10): 3 batches, the last one synced
    assert _synced_ticks(progress.events, "val") == [False, False, True] * 2
    assert progress.summary()["images_per_second"] > 0 and progress.summary()["val_images_per_second"] > 0


def test_the_progress_bar_shows_the_print_step_values(tmp_path: Path) -> None:
    progress, bar = MainAmpProgress(print_freq=5, warmup=0), MainAmpProgressBar()
    trainer = Trainer(callbacks=[progress, bar], logger=False, enable_checkpointing=False, max_steps=5,
                      limit_val_batches=0, default_root_dir=tmp_path)
    module = _module()
    trainer.fit(module, loader(n=40, batch_size=4))
    values = bar.get_metrics(trainer, module)
    assert set(values) >= {"loss", "Prec@1", "lr"} and values == {**values, **progress.bar_values}
    assert values["lr"] == pytest.approx(0.1) and isinstance(values["loss"], float)


def test_the_lines_average_speed_is_images_over_the_average_time_of_the_epoch(tmp_path: Path) -> None:
    # the mean of each window's speed overstated it (8.55 img/s where 8 / 1.568 s = 5.10); the times carried across
    # epochs where the losses did not
    import time

    from lightning.pytorch import Callback

    lines: list[str] = []

    class Lines(MainAmpProgress):
        def _emit(self, pl_module, line: str) -> None:
            lines.append(line)

    class Uneven(Callback):  # steps of 10 and 80 ms: a mean of speeds is far from images over the mean time
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            time.sleep(0.01 if batch_idx % 2 else 0.08)

    trainer = Trainer(callbacks=[Uneven(), Lines(print_freq=1, warmup=0)], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, num_sanity_val_steps=0, default_root_dir=tmp_path, max_epochs=2,
                      limit_val_batches=0)
    trainer.fit(_module(), loader(n=40, batch_size=4))
    pattern = re.compile(r"Epoch: \[(\d)\]\[(\d+)/10\]  Time ([\d.]+) \(([\d.]+)\)  Speed ([\d.]+) \(([\d.]+)\)")
    rows = [pattern.match(line) for line in lines if line.startswith("Epoch:") and "warm-up" not in line]
    assert len(rows) == 18 and all(rows), lines  # each epoch's first step starts its clock
    for row in rows:
        epoch, step, time_now, time_avg, speed_now, speed_avg = row.groups()
        low, high = 4 / (float(time_avg) + 5e-4), 4 / max(float(time_avg) - 5e-4, 1e-9)  # the time shown to 1 ms
        assert low * 0.999 <= float(speed_avg) <= high * 1.001, row.group(0)
        if step == "2":  # the epoch's first window: its averages are its own
            assert time_avg == time_now and speed_avg == speed_now, row.group(0)
