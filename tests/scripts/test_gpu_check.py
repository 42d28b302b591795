"""``python -m scripts.gpu_check --tiny`` on the CPU: one Markdown table with every part's rows and columns, the parts that
need CUDA skipped with the reason, and the runs this CPU can make trained with finite losses and no host sync."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
COLUMNS = ["part", "configuration", "status", "precision", "img/s", "step (ms)", "finite losses", "host syncs/step",
           "notes"]
E2E = {"`channels_last=true amp=fp16`": "16-mixed", "`channels_last=false amp=fp16`": "16-mixed",
       "`channels_last=true amp=bf16`": "bf16-mixed", "`channels_last=false amp=bf16`": "bf16-mixed",
       "`channels_last=true amp=false`": "32-true", "`channels_last=false amp=false`": "32-true",
       "`channels_last=true amp=auto compile.enabled=true`": None}


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


@pytest.mark.long  # train.py and the main_amp matrix end to end (about 40 s): run it before a GPU session
def test_tiny_gpu_check_writes_one_table_with_every_part(tmp_path: Path) -> None:
    # conftest hides the GPU from this subprocess: what needs CUDA must be a "skipped" row, not a failure
    result = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--tiny", "--out", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = (tmp_path / "gpu_check.md").read_text()
    assert text in result.stdout
    lines = text.splitlines()
    assert all(line.startswith("| ") or line.startswith("|---") for line in lines)  # the table and nothing else
    assert _cells(lines[0]) == COLUMNS and all(len(_cells(line)) == len(COLUMNS) for line in lines[2:])
    rows = [dict(zip(COLUMNS, _cells(line))) for line in lines[2:]]
    assert [r["part"] for r in rows] == ["machine", "command", "data", "cuda tests", "default train.py",
                                         *["main_amp e2e"] * len(E2E)]
    machine, command, _, cuda_tests, newcomer, *e2e = rows
    assert "logical cores" in machine["notes"] and "torch " in machine["notes"]
    assert "python -m scripts.gpu_check --tiny --out" in command["configuration"]
    assert cuda_tests["status"] == "skipped: no CUDA"

    assert newcomer["status"] == "completed" and newcomer["configuration"].startswith("`python train.py")
    finite, logged = re.fullmatch(r"(\d+)/(\d+) logged", newcomer["finite losses"]).groups()
    assert finite == logged != "0"

    assert [r["configuration"] for r in e2e] == list(E2E)
    trained = 0
    for r in e2e:
        precision = E2E[r["configuration"]]
        if precision == "16-mixed":
            assert r["status"] == "skipped: no CUDA"
        elif precision is None:
            assert r["status"].startswith("skipped: --tiny")
        elif r["status"] != "skipped: no bf16 on this CPU":
            assert r["status"] == "completed" and r["precision"] == precision, r
            assert r["finite losses"] == "3/3" and r["host syncs/step"] == "0", r
            assert float(r["img/s"].replace(",", "")) > 0 and float(r["step (ms)"].replace(",", "")) > 0
            trained += 1
    assert trained >= 2  # fp32 in both layouts, everywhere
    metrics = sorted(p.name for p in tmp_path.glob("*.metrics.json"))  # each run's, copied beside the table
    assert "default_train.metrics.json" in metrics and len(metrics) == trained + 1
