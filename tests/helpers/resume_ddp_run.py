"""Run by tests/data/test_resume_state.py: a two-process DDP fit (gloo) of ImageFolderDataModule (or, for a folder
written by ``save_to_disk``, of HFImageDataModule streaming it with 2 workers per rank) with a checkpoint after every
step, or resumed from one.

    python -m tests.helpers.resume_ddp_run OUT_DIR FOLDER [CKPT]

Rank 0 writes OUT_DIR/final.pt (the model's state) and OUT_DIR/said.json (the warnings it saw).
"""

import json
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F

from cltrain.data import HFImageDataModule, ImageFolderDataModule


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main(out: Path, folder: Path, ckpt: str | None) -> None:
    pl.seed_everything(7, verbose=False)
    if (folder / "dataset_dict.json").exists():  # a Hugging Face dataset: streamed, each rank's 2 workers share it
        data = HFImageDataModule(folder, batch_size=2, num_workers=2, image_size=24, val_resize_size=28, streaming=True,
                                 shuffle_buffer=4)
    else:
        data = ImageFolderDataModule(folder, batch_size=2, num_workers=0, image_size=24, val_resize_size=28)
    saves = [] if ckpt else [ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_top_k=-1, filename="{step}")]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, enable_checkpointing=not ckpt, callbacks=saves)
    module = Net()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    if trainer.global_rank == 0:
        torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, out / "final.pt")
        (out / "said.json").write_text(json.dumps({"steps": trainer.global_step,
                                                   "said": [str(w.message) for w in seen]}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
