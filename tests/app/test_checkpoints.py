"""A run resumed into a new run directory keeps the record of the run's best checkpoints (``RunCheckpoint``): its
best is the run's, the earlier run's best file is linked into the new folder, and the earlier folder is left as it
was. Lightning's own ``ModelCheckpoint`` is the negative control: it forgets them."""

from __future__ import annotations

import filecmp
import os
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from cltrain.app.checkpoints import RunCheckpoint


class _Scripted(pl.LightningModule):
    """Validation reports ``scores[epoch]`` as ``val/top1``."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = scores
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        self.log("val/top1", torch.tensor(self.scores[self.current_epoch]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(cls: type, folder: Path, epochs: int, scores: list[float], ckpt_path: Path | None = None) -> ModelCheckpoint:
    """The app's two checkpoint callbacks (``cltrain.app.callbacks``), of class ``cls``, in ``folder``."""
    best = cls(dirpath=folder, filename="best-epoch{epoch:03d}", monitor="val/top1", mode="max", save_top_k=1,
               auto_insert_metric_name=False)
    last = cls(dirpath=folder, filename="last", monitor=None, save_top_k=1, every_n_epochs=1,
               save_on_train_epoch_end=True, enable_version_counter=False)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, callbacks=[best, last], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    data = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)
    trainer.fit(_Scripted(scores), data, data, ckpt_path=ckpt_path)
    return best


@pytest.mark.parametrize("cls", [RunCheckpoint, ModelCheckpoint])
@pytest.mark.parametrize("scores", [[0.5, 0.3, 0.2], [0.3, 0.2, 0.5]], ids=["best-before-the-stop", "best-after"])
def test_a_run_resumed_into_a_new_folder_keeps_its_best(tmp_path: Path, cls: type, scores: list[float]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _fit(cls, a, 2, scores)
    before = {name: (a / name).stat().st_mtime_ns for name in os.listdir(a)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        best = _fit(cls, b, 3, scores, ckpt_path=a / "last.ckpt")
    run_best = max(range(3), key=scores.__getitem__)
    if cls is ModelCheckpoint:  # the negative control: the earlier epochs' best is forgotten
        assert float(best.best_model_score) == pytest.approx(scores[2]) and any("dirpath has changed" in str(w.message) for w in caught)
        return
    assert not any("dirpath has changed" in str(w.message) for w in caught)
    assert float(best.best_model_score) == pytest.approx(scores[run_best])
    assert Path(best.best_model_path) == b / f"best-epoch{run_best:03d}.ckpt"
    assert sorted(os.listdir(b)) == sorted([f"best-epoch{run_best:03d}.ckpt", "last.ckpt"])
    if run_best < 2:  # the earlier run's file, linked: the same bytes
        assert filecmp.cmp(a / f"best-epoch{run_best:03d}.ckpt", b / f"best-epoch{run_best:03d}.ckpt", shallow=False)
    assert {name: (a / name).stat().st_mtime_ns for name in os.listdir(a)} == before  # the earlier folder as it was
    saved = torch.load(b / "last.ckpt", weights_only=False)["callbacks"]
    assert all(key.startswith("ModelCheckpoint{") for key in saved)  # loadable by Lightning's own class too
