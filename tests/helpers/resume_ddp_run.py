"""Run by tests/data/test_resume_state.py: two-process DDP fits (gloo), in one launch, for each data source given: the
uninterrupted fit with a checkpoint after every step, then a fresh Trainer, model and DataModule resumed from one of
those checkpoints.

    python -m tests.helpers.resume_ddp_run OUT_DIR KIND=SOURCE=STEP [KIND=SOURCE=STEP ...]

KIND: ``folder`` (ImageFolderDataModule, no workers), ``clips`` (ClipFolderDataModule, 2 workers per rank), ``shards``
(ShardsDataModule over a pack, 2 workers per rank) or ``stream`` (HFImageDataModule streaming a ``save_to_disk``
folder, 2 workers per rank). Every fit trains under ``ChannelsLast`` (its layout pinned: two fresh runs are equal bit
for bit in one layout). Every rank writes, per KIND, OUT_DIR/KIND/whole<R>.pt and resumed<R>.pt (its model's state,
its optimizer's state tensors); rank 0 the checkpoints in OUT_DIR/KIND/steps/ and OUT_DIR/KIND/said.json (the step
counts and the warnings of the resumed fit).
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

from cltrain import ChannelsLast
from cltrain.data import HFImageDataModule, ImageFolderDataModule, ShardsDataModule
from tests.helpers import warm


class Net(pl.LightningModule):
    def __init__(self, video: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        conv, norm, pool = (nn.Conv3d, nn.BatchNorm3d, nn.AdaptiveAvgPool3d) if video else \
            (nn.Conv2d, nn.BatchNorm2d, nn.AdaptiveAvgPool2d)
        self.net = nn.Sequential(conv(3, 8, 3, padding=1), norm(8), nn.ReLU(), nn.Dropout(0.3), pool(1),
                                 nn.Flatten(), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data(kind: str, source: Path) -> pl.LightningDataModule:
    common = dict(batch_size=2, image_size=24, val_resize_size=28)
    if kind == "stream":  # each rank's 2 workers share the stream
        return HFImageDataModule(source, num_workers=2, streaming=True, shuffle_buffer=4, **common)
    if kind == "clips":
        from cltrain.data.video import ClipFolderDataModule

        return ClipFolderDataModule(source, num_workers=2, persistent_workers=False, num_frames=3, frame_stride=1,
                                    **common)
    if kind == "shards":
        return ShardsDataModule(source, num_workers=2, persistent_workers=False, **common)
    return ImageFolderDataModule(source, num_workers=0, **common)


def _fit(kind: str, source: Path, steps: Path, ckpt: str | None) -> tuple[pl.Trainer, Net, list[str]]:
    pl.seed_everything(7, verbose=False)
    saves = [] if ckpt else [ModelCheckpoint(dirpath=steps, every_n_train_steps=1, save_top_k=-1, filename="{step}")]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, enable_checkpointing=not ckpt,
                         callbacks=[ChannelsLast(layout="channels_last"), *saves])
    module = Net(video=kind == "clips")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=_data(kind, source), ckpt_path=ckpt)
    return trainer, module, [str(w.message) for w in seen]


def main(out: Path, runs: list[str]) -> None:
    for run in runs:
        kind, source, step = run.split("=")
        where = out / kind
        whole, whole_module, _ = _fit(kind, Path(source), where / "steps", None)
        resumed, module, said = _fit(kind, Path(source), where / "steps", str(where / "steps" / f"step={step}.ckpt"))
        rank = resumed.global_rank
        for name, (m, t) in (("whole", (whole_module, whole)), ("resumed", (module, resumed))):
            state = {k: v.detach().cpu() for k, v in m.state_dict().items()}
            state.update({f"optimizer.{i}.{k}": v for i, s in enumerate(t.optimizers[0].state.values())
                          for k, v in s.items() if torch.is_tensor(v)})
            state["strides"] = [list(p.stride()) for p in m.parameters()]
            torch.save(state, where / f"{name}{rank}.pt")
        if rank == 0:
            (where / "said.json").write_text(json.dumps({"steps": [whole.global_step, resumed.global_step],
                                                         "said": said}))


if __name__ == "__main__":
    warm.lightning_ranks_forked()
    main(Path(sys.argv[1]), sys.argv[2:])
