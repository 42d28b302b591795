"""Run by test_data_hf.py: a real two-process DDP fit on CPU (gloo) from a Hugging Face dataset, 2 workers per rank.

    python -m tests.helpers.hf_ddp_run ROOT OUT_DIR STREAMING [EPOCHS]

Each row of the dataset is its own class, so the targets of a batch are its row ids. Every rank writes
OUT_DIR/rank<N>.json with, per training and validation step, the epoch and the row ids of the batch.
"""

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn

from cltrain.data import HFImageDataModule


class Recorder(LightningModule):
    def __init__(self, classes: int):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, classes))
        self.seen = {"train": [], "val": []}

    def _record(self, split, batch):
        images, targets = batch
        assert images.is_contiguous(memory_format=torch.channels_last) and images.dtype == torch.float32
        self.seen[split].append({"epoch": self.current_epoch, "ids": targets.tolist()})
        return nn.functional.cross_entropy(self.net(images), targets)

    def training_step(self, batch, batch_idx):
        return self._record("train", batch)

    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking:
            self._record("val", batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(root: Path, out: Path, streaming: bool, epochs: int) -> None:
    seed_everything(0)
    dm = HFImageDataModule(root, batch_size=3, num_workers=2, image_size=24, val_resize_size=28, streaming=streaming)
    module = Recorder(dm.num_classes)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm)
    result = {"rank": trainer.global_rank, "world_size": trainer.world_size, "steps": trainer.global_step, **module.seen}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]) if len(sys.argv) > 4 else 2)
