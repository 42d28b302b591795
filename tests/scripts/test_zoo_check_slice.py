"""scripts.zoo.check_slice: the check on a slice of the batch against the check on the whole batch, a model per
process, one table."""

from __future__ import annotations

import sys

from tests.helpers import REPO
from tests.helpers import warm


def test_a_planted_fault_is_found_on_the_slice_as_on_the_whole_batch():
    proc = warm.run([sys.executable, "-m", "scripts.zoo.check_slice", "--models", "planted:view_head", "--batch", "4",
                     "--samples", "2"], cwd=REPO, capture_output=True, text=True, timeout=300, nested=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| planted:view_head |")]
    assert len(rows) == 1 and rows[0].startswith("| planted:view_head | yes | fallback | raised forward 'net.head' |")
    assert proc.stdout.rstrip().splitlines()[-1].startswith("CPU ")
