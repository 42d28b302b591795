"""scripts/bench_dali.py runs end to end at tiny settings (the figures are taken by hand, see docs/performance.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.slow
def test_bench_dali_prints_every_loader_and_the_ratios(tmp_path):
    pytest.importorskip("timm")
    pytest.importorskip("sklearn")
    pytest.importorskip("skimage")
    pytest.importorskip("nvidia.dali", reason="pip install nvidia-dali-cuda130")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(SCRIPTS / "bench_dali.py"), "--quick", "--work", str(tmp_path),
                          "--sets", "photos", "500x375", "--levers"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for row in ("| DALI |", "| cltrain float |", "| cltrain uint8 |", "| cltrain 2 proc |", "| torchvision |", "| timm |",
                "| decode |", "| lever: normalize() after |", "| lever: whole-image decode |"):
        assert row in out.stdout, row
    assert "### photos 333-800 px, 2 thread(s)" in out.stdout and "### 500x375, 1 thread(s)" in out.stdout
    assert "| photos 333-800 px | " in out.stdout and "flags:" in out.stdout
