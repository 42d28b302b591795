"""Run by test_signals.py: a two-process DDP fit (gloo, Lightning's launcher) whose loader stops answering on every
rank at the fourth batch, as a store that stalls; ``DATA_GRACE`` 2 s.

    python -m tests.helpers.stall_ddp_run

Each rank prints ``stalling`` as its read stalls, and the launching rank ``stopped`` with the signal as its run ends;
exit 128 + the signal.
"""

import sys
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from cltrain.app import signals

signals.DATA_GRACE = 2.0


class Stalls(Dataset):
    def __init__(self) -> None:
        self.reads = 0

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        self.reads += 1
        if self.reads == 7:  # the fourth batch of 2
            print("stalling", flush=True)
            time.sleep(300)
        return torch.randn(2), torch.randn(1)


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    stop = signals.SignalStop()
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[stop])
    with stop:
        try:
            with stop.deferred():
                trainer.fit(Tiny(), DataLoader(Stalls(), batch_size=2))
        except signals.RunInterrupted as stopped:
            print(f"stopped by {stopped.signum}", flush=True)
            sys.exit(128 + stopped.signum)
