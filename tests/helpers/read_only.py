"""``ReadOnlyCheckpoints``: a Lightning callback that makes the run's ``checkpoints/`` folder read-only (a bind mount
of it over itself, remounted read-only) when epoch ``epoch`` starts, as a folder taken away from the run's user
mid-run is; the test unmounts it. Needs the right to mount."""

from __future__ import annotations

import subprocess
from pathlib import Path

import lightning.pytorch as pl


class ReadOnlyCheckpoints(pl.Callback):
    def __init__(self, folder: str, epoch: int = 1) -> None:
        self.folder, self.epoch = str(Path(folder)), epoch

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            subprocess.run(["mount", "--bind", self.folder, self.folder], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", self.folder], check=True)
