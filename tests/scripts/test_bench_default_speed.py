"""scripts.bench.default_speed --tiny: the model in a process of its own, both variants fitted in interleaved rounds,
the table and the records written."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import REPO
from tests.helpers import warm


@pytest.mark.slow  # a process of its own, four real fits
def test_tiny_fits_both_variants_of_each_model_and_writes_the_table(tmp_path):
    proc = warm.run([sys.executable, "-m", "scripts.bench.default_speed", "--tiny", "--models", "resnet18",
                     "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600, nested=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "default_speed.jsonl").read_text().splitlines()]
    assert [(r["model"], r["precision"]) for r in records] == [("resnet18", "32-true")]
    for r in records:
        assert "error" not in r, r
        assert [(f["variant"], f["round"]) for f in r["fits"]] == [("nchw", 0), ("channels_last", 0),
                                                                   ("channels_last", 1), ("nchw", 1)]
        assert r["step_ratio"] == pytest.approx(r["nchw_step_s"] / r["cl_step_s"]) and r["verdict"] == "passed"
        assert r["layout"] == "channels_last" and all(f["device"] == "cpu" for f in r["fits"])
    table = (tmp_path / "default_speed.md").read_text()
    assert ("| model | precision | step NCHW (ms) | step default (ms) | step ratio | fit NCHW (s) | fit default (s) | "
            "fit ratio | check | trained in |") in table
    assert "| resnet18 | 32-true | " in table and "; flags " in table and table in proc.stdout
