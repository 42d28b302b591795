"""Run by test_data_shards.py: a real two-process DDP fit on CPU (gloo) from a pack, 2 workers per rank.

    python -m tests.helpers.shards_ddp_run PACK OUT_DIR [EPOCHS]        # PACK: a folder or a URL (s3://...)

Every rank writes OUT_DIR/rank<N>.json with, per training and validation step, the epoch,
the sample ids of the batch and the worker process that read it.
"""

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import get_worker_info

from cltrain.data import ShardsDataModule, ShardsDataset
from tests.helpers import warm


class TaggedShards(ShardsDataset):
    """Batches carry their sample ids and the id of the worker that read them."""

    def __getitem__(self, index):
        images, targets, ids = super().__getitem__(index)
        info = get_worker_info()
        return images, targets, ids, torch.tensor(-1 if info is None else info.id)


class TaggedShardsDataModule(ShardsDataModule):
    def setup(self, stage):
        super().setup(stage)
        for ds in (self.train_set, self.val_set):
            if ds is not None:
                ds.__class__, ds.with_ids = TaggedShards, True


class Recorder(LightningModule):
    """Records, per step, the epoch, the sample ids (a batch's third field; without one, its targets) and the worker."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, classes))
        self.seen = {"train": [], "val": []}

    def _record(self, split, batch):
        images, targets, *tags = batch
        ids, worker = tags if tags else (targets, torch.tensor(-1))
        assert images.is_contiguous(memory_format=torch.channels_last) and images.dtype == torch.float32
        self.seen[split].append({"epoch": self.current_epoch, "ids": ids.tolist(), "worker": int(worker)})
        return nn.functional.cross_entropy(self.net(images), targets)

    def training_step(self, batch, batch_idx):
        return self._record("train", batch)

    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking:
            self._record("val", batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit_and_record(dm, module: Recorder, out: Path, epochs: int) -> None:
    """Fit on 2 CPU processes (DDP, gloo) and write each rank's record to ``out/rank<N>.json``."""
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm)
    result = {"rank": trainer.global_rank, "world_size": trainer.world_size, "steps": trainer.global_step, **module.seen}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main(pack: str, out: Path, epochs: int) -> None:
    torch.manual_seed(0)
    dm = TaggedShardsDataModule(pack, batch_size=4, num_workers=2, image_size=32, val_resize_size=36, seed=3)
    fit_and_record(dm, Recorder(), out, epochs)


if __name__ == "__main__":
    warm.lightning_ranks_forked()
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 2)
