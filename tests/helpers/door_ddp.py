"""Run by tests/core/test_doors.py: one front door's run under DDP, two processes on the CPU (gloo); every rank writes
``OUT_DIR/rank<N>.json`` with its layout, the race's decision, the check's verdict and its conv weights' strides.

    python -m tests.helpers.door_ddp lightning|fabric OUT_DIR                   # they start their own processes
    python -m tests.helpers.torchrun --standalone --nproc_per_node 2 -m tests.helpers.door_ddp plain|hf|accelerate OUT

The model's channels_last steps are slow (``SlowIn``: DDP's all-reduce gives every rank the slowest rank's step), and
each step accumulates 2 batches in the door's own way: every rank switches to NCHW at the same step (a step's end is
where the optimizer stepped), on rank 0's decision, with DDP's gradient buckets built again.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from tests.helpers import door_battery
from tests.helpers import warm
from tests.helpers.plain_modules import steady_clock


def main(door: str, out: Path) -> None:
    door_battery.RANKS = 2
    if door == "plain":  # a plain DDP script starts its process group first
        torch.distributed.init_process_group("gloo")
    model = door_battery.slow()
    session, _ = door_battery.DOORS[door](model, 14, door=True, layout="auto", verify=True, accumulate=2)
    rank = int(os.environ.get("RANK", getattr(door_battery.lightning, "rank", 0)))
    if torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    decision = session.decision
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "layout": session.layout, "decision": decision.as_dict() if decision else None,
        "check": session.layout_checks["train"].verdict,
        "strides": {n: list(m.weight.stride()) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}}))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    warm.lightning_ranks_forked()
    with steady_clock():
        main(sys.argv[1], Path(sys.argv[2]))
