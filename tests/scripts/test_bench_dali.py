"""scripts.bench.dali runs end to end at tiny settings (the figures are taken by hand, see docs/performance.md)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import REPO
from tests.helpers import warm


@pytest.mark.slow
def test_bench_dali_prints_every_loader_and_the_ratios(tmp_path):
    pytest.importorskip("timm")
    pytest.importorskip("sklearn")
    pytest.importorskip("skimage")
    pytest.importorskip("nvidia.dali", reason="pip install nvidia-dali-cuda130")
    out = warm.run([sys.executable, "-m", "scripts.bench.dali", "--quick", "--work", str(tmp_path),
                    "--sets", "photos", "500x375", "--levers"],
                   cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    table = [line for line in out.stdout.splitlines() if line.startswith("| folder | threads | DALI |")]
    assert table == ["| folder | threads | DALI | cltrain float | cltrain uint8 | cltrain N proc | torchvision | timm | "
                     "decode | lever: normalize() after | lever: whole-image decode | lever: batch by batch |"]
    for row in ("| photos 333-800 px | 1 | ", "| photos 333-800 px | 2 | ", "| 500x375 | 1 | ", "| 500x375 | 2 | "):
        assert out.stdout.count(row) == 2, row  # the rates (median, lowest-highest), and the ratios
    assert "| float / DALI | uint8 / decode |" in out.stdout and "; flags " in out.stdout
