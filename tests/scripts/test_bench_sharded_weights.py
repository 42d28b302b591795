"""scripts.bench.sharded_weights --quick --fsdp --dtype fp32: the table's rows, and the layout each variant's first
convolution computes in (channels_last activations with NCHW weights run the NHWC kernel; the NCHW rows are the
control)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import REPO
from tests.helpers import warm

VARIANTS = ["contiguous", "channels_last", "cl_activations", "fsdp2 contiguous", "fsdp2 cl_activations"]


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_quick_prints_every_variant_and_cl_activations_runs_nhwc(device):
    # fp32: what is checked is each variant's layout, and bf16 is emulated (slow) on CPUs without native bf16
    proc = warm.run([sys.executable, "-m", "scripts.bench.sharded_weights", "--quick", "--fsdp", "--dtype", "fp32", "--device", device],
                    cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = proc.stdout.rstrip().split("\n\n")[-1].splitlines()  # the whole run's table, printed last
    assert final[0].startswith("| model | weights / input | img/s (median) |")
    rows = {}
    for line in final[2:]:
        model, variant, rate, spread, ratio, first_conv = (c.strip() for c in line.strip("|").split("|"))
        assert model == "resnet18" and float(rate.replace(",", "")) > 0 and ratio.endswith("x"), line
        rows[variant] = (ratio, first_conv)
    assert list(rows) == VARIANTS
    assert rows["contiguous"] == ("1.00x", "NCHW")
    assert {v: rows[v][1] for v in VARIANTS} == {
        "contiguous": "NCHW", "channels_last": "NHWC", "cl_activations": "NHWC",
        "fsdp2 contiguous": "NCHW", "fsdp2 cl_activations": "NHWC"}
    assert "CPU" in proc.stdout.splitlines()[0] and "torch" in proc.stdout.splitlines()[0]  # the machine line
