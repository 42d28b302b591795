"""Per-iteration LR schedulers (issue 10.3): values, LearningRateMonitor, resume, refused tuners."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningDataModule, Trainer
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from torch import nn

from cltrain.app.cli import compose_config
from cltrain.app.config import ConfigError
from cltrain.app.module import ImageClassifier
from cltrain.app.schedule import StepScheduler, cosine_lr_at, lr_at, make_scheduler
from cltrain.app.train import train
from cltrain.data import make_demo_dataset
from tests.helpers.plain_modules import loader
from tests.helpers.trainer_probes import Crash
from tests.helpers import SMOKE

DEMO = {"num_classes": 4, "train_per_class": 8, "val_per_class": 2, "image_size": [48, 40]}


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data") / "demo"
    make_demo_dataset(root, **DEMO)
    return root


def _sgd(lr: float = 0.4) -> torch.optim.SGD:
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=lr, momentum=0.9)


def _walk(scheduler: StepScheduler, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


def test_step_schedule_is_lr_at_step_by_step() -> None:
    optimizer = _sgd()
    scheduler = make_scheduler(optimizer, "step", steps_per_epoch=7, total_steps=35, warmup_epochs=1.5,
                               milestones=(1, 3), gamma=0.2)
    expected = [lr_at(s, 7, 0.4, 1.5, (1, 3), 0.2) for s in range(35)]
    assert _walk(scheduler, 35) == expected  # exactly: the same closed form
    assert expected[0] == pytest.approx(0.4 / 10.5) and expected[-1] == pytest.approx(0.4 * 0.04)


def test_cosine_schedule_warms_up_then_falls_to_its_floor() -> None:
    scheduler = make_scheduler(_sgd(), "cosine", steps_per_epoch=10, total_steps=50, warmup_epochs=1, min_lr_ratio=0.1)
    rates = _walk(scheduler, 60)
    assert rates[:10] == pytest.approx([0.4 * (s + 1) / 10 for s in range(10)])
    assert rates[10] == pytest.approx(0.4) and rates[30] == pytest.approx(0.04 + 0.5 * 0.36 * (1 + math.cos(math.pi / 2)))
    assert all(a >= b for a, b in zip(rates[10:], rates[11:])) and rates[50:] == pytest.approx([0.04] * 10)
    assert rates == [cosine_lr_at(s, 50, 0.4, 10, 0.1) for s in range(60)]


def test_scheduler_state_is_the_position_only() -> None:
    scheduler = make_scheduler(_sgd(), "step", steps_per_epoch=5, total_steps=20, warmup_epochs=1, milestones=(2,))
    _walk(scheduler, 12)
    state = scheduler.state_dict()
    assert state == {"last_epoch": 12, "_step_count": 13}
    # a new config (other milestones) resumed at that position: the rate is the new rule's at step 12
    optimizer = _sgd()
    resumed = make_scheduler(optimizer, "step", steps_per_epoch=5, total_steps=20, warmup_epochs=1, milestones=(1,))
    resumed.load_state_dict(state)
    assert optimizer.param_groups[0]["lr"] == lr_at(12, 5, 0.4, 1, (1,))
    with pytest.raises(ValueError, match="unknown schedule 'linear'"):
        make_scheduler(_sgd(), "linear", 5, 20)


def _lr_rows(run_dir: Path) -> dict[int, float]:
    rows = csv.DictReader(open(run_dir / "csv" / "metrics.csv"))
    return {int(r["step"]): float(r["lr-SGD"]) for r in rows if r.get("lr-SGD")}


def _cfg(demo_root: Path, run_dir: Path, *overrides: str):
    demo = [f"data.demo.{k}={v}".replace(" ", "") for k, v in DEMO.items()]
    return compose_config([*SMOKE, f"data.root={demo_root}", *demo, f"run_dir={run_dir}", "device=cpu",
                           "amp=false", "trainer.enable_progress_bar=false", "print_freq=0", *overrides])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["step", "cosine"])
def test_resume_after_a_crash_continues_the_lr_sequence(demo_root: Path, tmp_path: Path, schedule: str) -> None:
    """LearningRateMonitor writes lr-SGD to the CSV each step; a run that crashed at step 6 (mid-epoch) and resumed
    from the last.ckpt the crash left logs the same rates as an uninterrupted run."""
    common = ("trainer.max_epochs=3", f"optim.schedule={schedule}", "optim.milestones=[1,2]", "optim.min_lr_ratio=0.1")
    whole = train(_cfg(demo_root, tmp_path / "whole", *common))
    assert whole["global_step"] == 12
    expected = _lr_rows(tmp_path / "whole")
    assert sorted(expected) == list(range(12))
    if schedule == "step":
        assert list(expected.values()) == [lr_at(s, 4, whole["lr"], 1, (1, 2)) for s in range(12)]
    else:
        assert list(expected.values()) == pytest.approx([cosine_lr_at(s, 12, whole["lr"], 4, 0.1) for s in range(12)])

    with pytest.raises(Crash):
        train(_cfg(demo_root, tmp_path / "crashed", *common, "trainer._target_=tests.helpers.trainer_probes.CrashingTrainer",
                   "+trainer.crash_at_step=6"))
    checkpoint = tmp_path / "crashed" / "checkpoints" / "last.ckpt"  # written by the on-exception checkpoint
    assert torch.load(checkpoint, weights_only=True)["global_step"] == 6
    resumed = train(_cfg(demo_root, tmp_path / "resumed", *common, f"ckpt_path={checkpoint}"))
    assert resumed["global_step"] == 12
    # The rates, in order, are the uninterrupted run's from step 6 on. (The CSV's step column of a run resumed
    # from a mid-epoch exception checkpoint is Lightning's logging counter, one ahead here; the rates are not.)
    rows = _lr_rows(tmp_path / "resumed")
    assert [rows[k] for k in sorted(rows)] == [expected[s] for s in range(6, 12)]


class _Data(LightningDataModule):
    batch_size = 4  # what BatchSizeFinder would tune

    def train_dataloader(self):
        return loader(n=8, batch_size=self.batch_size)


@pytest.mark.parametrize("finder", [LearningRateFinder, BatchSizeFinder])
def test_lr_and_batch_size_finders_are_refused(tmp_path: Path, finder: type) -> None:
    module = ImageClassifier(nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 4)), num_classes=4, lr=0.1)
    trainer = Trainer(callbacks=[finder()], max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match=rf"callbacks='{finder.__name__}': not supported"):
        trainer.fit(module, datamodule=_Data())


@pytest.mark.parametrize("finder", [LearningRateFinder, BatchSizeFinder])
def test_the_app_refuses_the_finders_before_the_run_writes_anything(tmp_path: Path, finder: type) -> None:
    from omegaconf import OmegaConf

    from cltrain.app.groups import build_callbacks

    group = OmegaConf.create({"tune": {"_target_": f"lightning.pytorch.callbacks.{finder.__name__}"}})
    with pytest.raises(ConfigError, match=rf"^callbacks.tune='lightning.pytorch.callbacks.{finder.__name__}': not "):
        build_callbacks(group, tmp_path)  # inside fit, it left a last.ckpt and a "failed" metrics.json behind
    assert not list(tmp_path.iterdir())
