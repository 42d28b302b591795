"""scripts/bench/step_profile.py: one step's time by kind, from a profiler window over a real Trainer's steps."""

from __future__ import annotations

import json
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from scripts.bench.step_profile import DATA_WAIT, KINDS, StepProfile, breakdown_table, kind_of

FETCH_S = 0.05  # the loader's wait for each batch
PAUSE_S = 0.04  # host time in the step outside any op


class _SlowBatches(Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(FETCH_S)
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 4, (4,), generator=g)


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3),
                                 nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        time.sleep(PAUSE_S)
        images, targets = batch
        return nn.functional.cross_entropy(self.net(images), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def test_a_profiled_step_is_broken_down_by_kind_and_adds_up_to_its_wall_time(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    pl.Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False,
               callbacks=[StepProfile(str(path), first=2, steps=2)]).fit(
        _Net(), DataLoader(_SlowBatches(), batch_size=None))
    result = json.loads(path.read_text())
    assert result["device"] == "cpu" and result["steps"] == 2
    kinds, wall = result["kinds"], result["wall_ms"]
    assert set(kinds) == {*KINDS, DATA_WAIT}
    for kind in ("convolution forward", "convolution backward", "BatchNorm", "optimizer", "elementwise and other"):
        assert kinds[kind] > 0, (kind, kinds)
    # the window holds two whole steps: each step's batch wait and its pause outside any op, once each
    assert 1e3 * FETCH_S <= kinds[DATA_WAIT] < 1e3 * (2 * FETCH_S), kinds
    assert kinds["idle and launch gaps"] >= 1e3 * PAUSE_S, kinds
    assert wall >= 1e3 * (FETCH_S + PAUSE_S) and sum(kinds[k] for k in KINDS) == pytest_approx(wall)

    table = breakdown_table({"tiny net": result}).splitlines()
    assert table[0] == "| kind | tiny net |" and len(table) == 2 + len(KINDS) + 2
    assert table[-1].startswith("| step (wall) |") and table[-2].startswith(f"| {DATA_WAIT} (host, apart) |")


def pytest_approx(value: float):
    import pytest

    return pytest.approx(value, rel=0.02)


class _Event:
    def __init__(self, name: str, parent: _Event | None = None) -> None:
        self.name, self.cpu_parent = name, parent


def test_compiled_kernels_are_told_apart_by_the_ops_they_fuse() -> None:
    backward = _Event("autograd::engine::evaluate_function: CompiledFunctionBackward")
    zero_grad = _Event("Optimizer.zero_grad#SGD.zero_grad")
    assert kind_of(_Event("triton_red_fused__native_batch_norm_legit_functional_convert_element_type_1")) == \
        "BatchNorm"
    assert kind_of(_Event("triton_poi_fused__to_copy_convert_element_type_0")) == "elementwise and other"
    assert kind_of(_Event("triton_poi_fused_add_threshold_backward_7", backward)) == "elementwise and other"
    assert kind_of(_Event("aten::convolution_backward", backward)) == "convolution backward"
    assert kind_of(_Event("aten::empty", _Event("aten::convolution"))) == "convolution forward"
    assert kind_of(_Event("aten::zero_", zero_grad)) == "optimizer"
