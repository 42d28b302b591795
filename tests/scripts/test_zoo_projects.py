"""scripts.zoo.projects: every run is a real subprocess, a crash or a missing library is a row, and the page
says what each run did (loss parity, layout kept, the check's lines)."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from scripts import harness
from scripts.zoo import pages, projects
from scripts.zoo.project_cases import CASES, Built, Case
from tests.helpers import warm


class FlattenHead(LightningModule):
    """A conv and a LeNet-style head: ``h.view(h.size(0), -1)`` merges C with H and W, legal in NCHW only."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.conv(x).relu()
        return nn.functional.cross_entropy(self.fc(h.view(h.size(0), -1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def flatten_head(tmp: Path) -> Built:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 2, (8,), generator=g))
    return Built(FlattenHead(), train_dataloaders=DataLoader(data, batch_size=4))


def aborts(tmp: Path) -> Built:
    os.abort()


FLATTEN = Case("test:flatten_head", None, "a conv and a view-flattening head", f"{__name__}:flatten_head")
ABORT = Case("test:abort", None, "os.abort() while building", f"{__name__}:aborts")
MISSING = Case("test:missing", "no_such_library_for_cltrain", "a library that is not installed", f"{__name__}:aborts")


@pytest.mark.slow  # 4 child processes, each importing torch and Lightning: ~35 s of CPU
def test_runs_in_subprocesses_and_a_crash_or_a_missing_library_is_a_row(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "subprocess", warm.forking_subprocess)  # each run still a process of its own
    monkeypatch.setattr(projects, "CASES", [FLATTEN, ABORT, MISSING])
    out = tmp_path / "projects.md"
    common = ["--out", str(out), "--log-dir", str(tmp_path / "logs"), "--timeout", "120"]
    assert projects.main(common) == 0  # every case, as the whole sweep runs them
    rows = {r["key"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    flat = rows["test:flatten_head"]
    nc, cl = flat["contiguous"], flat["channels_last"]
    assert flat["status"] == "ok" and nc["trained"] and cl["trained"], (nc, cl)
    assert pages.rel_diff(nc["first_loss"], cl["first_loss"]) < 1e-5
    assert nc["conv_weights_cl"] == "0/1" and "layout_checks" not in nc
    assert cl["layout_checks"]["train"]["verdict"] in ("fallback", "contiguous")
    assert any("test_zoo_projects.py" in line for line in cl["lines"])  # the check names the user's line

    crash = rows["test:abort"]
    assert crash["status"] == "see runs"
    assert all(crash[layout]["status"].startswith("crashed (SIGABRT)") for layout in projects.LAYOUTS)
    assert rows["test:missing"]["status"] == "skipped: no_such_library_for_cltrain is not installed"

    page = out.read_text()
    assert "| test | " not in page and "`flatten_head` a conv and a view-flattening head | yes / yes | " in page
    assert "NO (crashed (SIGABRT)" in page and "skipped: no_such_library_for_cltrain" in page
    assert f"python -m scripts.zoo.projects {' '.join(common)}" in page and "3 cases: 2 ran, 1 skipped" in page

    # a rerun of some cases keeps the other rows and both commands
    assert projects.main(["--only", "test:missing", *common]) == 0
    saved = json.loads(out.with_suffix(".json").read_text())
    assert [r["key"] for r in saved["rows"]] == ["test:flatten_head", "test:abort", "test:missing"]
    command = f"python -m scripts.zoo.projects {' '.join(common)}"
    rerun = command.replace("projects ", "projects --only test:missing ")
    assert [r["command"] for r in saved["runs"]] == [command, rerun]


def test_row_cells_shorten_paths_and_compare_metrics():
    run = {"trained": True, "first_loss": 2.0, "metrics": {"val_loss": 1.0}, "conv_weights_cl": "1/1", "lines": []}
    repo = pages.REPO
    row = {"key": "lib:task", "library": "lib", "task": "a task", "status": "ok",
           "contiguous": run, "channels_last": {**run, "first_loss": 2.002, "metrics": {"val_loss": 1.1},
                                                "layout_kept": "channels_last", "fallbacks": 1,
                                                "layout_checks": {"train": {"verdict": "fallback"}},
                                                "lines": [f"ChannelsLast layout check: x at {repo}/lib/a.py:3 "
                                                          "and /venv/lib/python3.11/site-packages/lib/b.py:9"]}}
    cells = pages.project_cells(row)
    assert cells[2:5] == ["yes / yes", "2 / 2.002: 1.0e-03", "9.1e-02 (`val_loss`, 1 compared)"]
    assert cells[5].startswith("channels_last + 1 NCHW fallback(s)") and cells[6] == "train: fallback"
    assert cells[7] == "ChannelsLast layout check: x at lib/a.py:3 and lib/b.py:9"


@pytest.mark.slow
@pytest.mark.parametrize("key", projects.FAST)
def test_a_real_library_case(tmp_path, key):
    case = next(c for c in CASES if c.key == key)
    if importlib.util.find_spec(case.library) is None:
        pytest.skip(f"{case.library} is not installed (pip install -e '.[projects]')")
    row = projects.run_case(case, tmp_path, timeout=600)
    assert row["contiguous"]["trained"] and row["channels_last"]["trained"], row
