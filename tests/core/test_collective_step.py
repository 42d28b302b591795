"""A step that calls a ``torch.distributed`` collective itself (a contrastive loss's ``all_gather``), under two gloo
processes: the first-batch check runs on rank 0 alone, where the collective waited for ever for rank 1 (both doors hung,
2 runs of 2). It raises in the check's runs now, and the check takes the model alone."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tests.helpers import warm


@pytest.mark.parametrize("door,on", [("plain", "the batch's image tensor"), ("lightning", "the inputs the step gave it")])
def test_a_step_with_its_own_collective_is_checked_on_the_model_alone(door: str, on: str) -> None:
    try:
        result = warm.run([sys.executable, "-m", "tests.helpers.collective_step", door], capture_output=True,
                          text=True, timeout=150, fresh=True)
    except subprocess.TimeoutExpired:
        pytest.fail("the two ranks hung")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "FINISHED rank 0" in output and "FINISHED rank 1" in output, output[-3000:]
    assert f"layout check passed: the first batch computes the same in channels_last as in NCHW; the model alone, on " \
           f"{on}: the step raised on the check's NCHW copy (RuntimeError: torch.distributed's all_gather is a " \
           "collective" in output, output[-3000:]
