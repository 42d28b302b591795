"""cltrain's DataModules under the standalone ``pytorch_lightning`` package's ``Trainer`` (its own process: the
package is imported there first, as a project on it does), which asks ``isinstance`` of its own
``LightningDataModule``: they train, and a run stopped mid-epoch resumes bit for bit."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import REPO, warm

pytest.importorskip("pytorch_lightning")

_RUN = """
import pickle, sys, torch, pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from cltrain import ChannelsLast
import cltrain.data.datamodules.base as base
from cltrain.data import ImageFolderDataModule, make_demo_dataset

if sys.argv[2] == "unmade":  # the negative control: the DataModule of lightning's package alone
    base.for_loaded_trainers = lambda cls: cls
root = make_demo_dataset(sys.argv[1] + "/demo", num_classes=2, train_per_class=6, val_per_class=1, image_size=(40, 32))

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    def training_step(self, batch, i):
        return F.cross_entropy(self.net(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

def fit(run, ckpt=None, every=False):
    pl.seed_everything(7, verbose=False)
    module = Net()
    dm = ImageFolderDataModule(root, batch_size=4, num_workers=2, image_size=24, val_resize_size=28,
                               persistent_workers=False)
    assert isinstance(pickle.loads(pickle.dumps(dm)), pl.LightningDataModule) or sys.argv[2] == "unmade"  # ddp_spawn
    saves = [ModelCheckpoint(dirpath=run, every_n_train_steps=1, save_top_k=-1, filename="{step}")] if every else []
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                         callbacks=[ChannelsLast(layout="channels_last"), *saves], default_root_dir=run)
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
    return module, trainer

whole, trainer = fit(sys.argv[1] + "/whole", every=True)
resumed, again = fit(sys.argv[1] + "/resumed", ckpt=sys.argv[1] + "/whole/step=2.ckpt")  # mid epoch 0 of 3 steps
same = all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))
print("RESULT", trainer.global_step, again.global_step, same)
"""


def _run(tmp_path, how: str):
    return warm.run([sys.executable, "-c", _RUN, str(tmp_path), how], cwd=REPO, capture_output=True, text=True,
                    timeout=300)


def test_a_datamodule_trains_under_pytorch_lightning_and_resumes_mid_epoch_bit_for_bit(tmp_path):
    proc = _run(tmp_path, "made")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "RESULT 6 6 True", proc.stdout[-2000:]
    unmade = _run(tmp_path / "unmade", "unmade")  # a DataModule of lightning's package alone: pytorch_lightning refuses it
    assert unmade.returncode != 0 and "Expected a parent" in unmade.stderr, unmade.stderr[-2000:]


_CLI = """
import sys, pytorch_lightning as pl
from pytorch_lightning.cli import LightningCLI
from cltrain.data import pl as by_class

cli = LightningCLI(pl.LightningModule, subclass_mode_data=True, run=False, args=[
    "--data", sys.argv[1], "--data.root", "/data", "--data.batch_size", "8", "--trainer.logger", "false"])
print("RESULT", type(cli.datamodule).__name__, isinstance(cli.datamodule, pl.LightningDataModule),
      cli.datamodule.batch_size, issubclass(by_class.ShardsDataModule, pl.LightningDataModule))
"""


def test_pytorch_lightnings_cli_takes_the_datamodules_by_their_classes(tmp_path):
    pytest.importorskip("jsonargparse")
    proc = warm.run([sys.executable, "-c", _CLI, "cltrain.data.pl.ImageFolderDataModule"], cwd=REPO,
                    capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip().splitlines()[-1:] == ["RESULT ImageFolderDataModule True 8 True"], proc.stderr[-3000:]
    plain = warm.run([sys.executable, "-c", _CLI, "cltrain.data.ImageFolderDataModule"], cwd=REPO,
                     capture_output=True, text=True, timeout=300)  # lightning's class: that CLI refuses it
    assert plain.returncode != 0 and "LightningDataModule" in plain.stderr, plain.stderr[-2000:]
