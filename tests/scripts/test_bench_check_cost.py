"""scripts.bench.check_cost --tiny: two real runs in fresh processes, the ratios and the machine printed."""

import json
import math
import sys

import pytest

from tests.helpers import REPO
from tests.helpers import warm


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_tiny_prints_the_memory_ratio_the_check_in_steps_and_the_machine(tmp_path, device):
    out = tmp_path / "rows.json"
    proc = warm.run([sys.executable, "-m", "scripts.bench.check_cost", "--tiny", "--warm", "--json", str(out)],
                    cwd=REPO, capture_output=True, text=True, timeout=600, nested=True)  # the children fork too
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["model"] == "resnet18" and row["verdict"] == "passed" and row["device"].startswith(device)
    assert ("cuda_memory_ratio" in row) == (device == "cuda")  # the GPU's own peak memory, on CUDA
    assert row["rss_plain_mb"] > 0 and math.isclose(row["memory_ratio"], row["rss_check_mb"] / row["rss_plain_mb"])
    assert row["plain_step_s"] > 0 and row["check_s"] > 0 and row["warm_check_s"] > 0  # a second fit's check
    assert math.isclose(row["check_in_steps"], row["check_s"] / row["step_with_check_s"])
    assert math.isfinite(row["first_step_extra_in_steps"])
    lines = proc.stdout.splitlines()
    assert any(line.startswith("| resnet18 | 32 |") and f"{row['memory_ratio']:.2f}x" in line
               and f"(2nd fit {row['warm_check_s']:.2f} s)" in line for line in lines), proc.stdout
    assert row["optimizer"] == "adamw" and "adamw" in lines[0]
    assert "CPU" in lines[-1] and "torch" in lines[-1]
