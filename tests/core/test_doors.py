"""Every front door gives every feature: the door x feature table of docs/guides/doors.md, each cell a real run.

Each door runs ``tests.helpers.door_battery`` in a process of its own (converts, checked, auto, kept, resumed) and
``tests.helpers.door_ddp`` in two DDP processes (gloo); the plain loop runs the battery once more with each feature's
mechanism taken away, and every cell must then fail. The table in the docs is the one these runs give:
``CLTRAIN_WRITE_DOORS=1 python -m pytest tests/core/test_doors.py -n 0`` writes it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, warm
from tests.helpers.door_battery import FEATURES

pytestmark = pytest.mark.slow

DOORS = {"lightning": "the Lightning callback `ChannelsLast`", "plain": "a plain loop, `ChannelsLastRun`",
         "fabric": "a Fabric loop, `ChannelsLastRun`", "hf": "the Hugging Face `Trainer`, `ChannelsLastCallback`",
         "accelerate": "an Accelerate loop, `prepare_channels_last`"}
SPAWNS_ITS_RANKS = ("lightning", "fabric")  # the others start under torchrun, as their users start them
PAGE = REPO / "docs" / "guides" / "doors.md"
BEGIN, END = "<!-- the door x feature table: tests/core/test_doors.py -->", "<!-- end of the table -->"
SYNC_BATCHNORM = "checked (1)"


def _battery(door: str, out: Path, control: bool = False) -> dict[str, list]:
    proc = warm.run([sys.executable, "-m", "tests.helpers.door_battery", door, str(out), *(["--control"] * control)],
                    cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ddp(door: str, out: Path) -> list[dict]:
    launch = [] if door in SPAWNS_ITS_RANKS else ["-m", "tests.helpers.torchrun", "--standalone", "--nproc_per_node", "2"]
    proc = warm.run([sys.executable, *launch, "-m", "tests.helpers.door_ddp", door, str(out)],
                    cwd=REPO, capture_output=True, text=True, timeout=600,
                    env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _ddp_holds(ranks: list[dict]) -> tuple[bool, str]:
    # a model slower in channels_last: every rank switches to NCHW at the same step on rank 0's decision, DDP's
    # buckets built again (the Hugging Face Trainer's DDP, which finds unused parameters, with a new reducer); each
    # step's gradient: tests/core/test_ddp_grads.py
    same = ranks[0] == ranks[1]
    decided = ranks[0]["decision"] is not None and ranks[0]["layout"] == "contiguous"
    return same and decided and ranks[0]["check"] == "passed", json.dumps(ranks[0])[:200]


@pytest.fixture(scope="module")
def cells(tmp_path_factory) -> dict[str, dict[str, list]]:
    found = {}
    for door in DOORS:
        out = tmp_path_factory.mktemp(door)
        found[door] = _battery(door, out)
        found[door]["DDP"] = list(_ddp_holds(_ddp(door, out / "ddp")))
    return found


def table(cells: dict[str, dict[str, list]]) -> str:
    """The docs' table from the runs' cells."""
    columns = [*FEATURES, "DDP", "SyncBatchNorm"]
    lines = ["| door | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for door, name in DOORS.items():
        marks = ["✓" if cells[door][feature][0] else "✗" for feature in (*FEATURES, "DDP")]
        lines.append(f"| {name} | " + " | ".join([*marks, SYNC_BATCHNORM]) + " |")
    return "\n".join(lines)


def test_every_door_gives_every_feature(cells) -> None:
    failed = {(door, feature): cell[1] for door, row in cells.items() for feature, cell in row.items() if not cell[0]}
    assert not failed, failed


def test_without_its_mechanism_each_feature_fails(tmp_path) -> None:
    control = _battery("plain", tmp_path, control=True)
    assert not [feature for feature, (ok, _) in control.items() if ok], control


def test_the_docs_table_is_the_one_the_runs_give(cells) -> None:
    made = table(cells)
    text = PAGE.read_text()
    if os.environ.get("CLTRAIN_WRITE_DOORS"):
        head, _, rest = text.partition(BEGIN)
        PAGE.write_text(f"{head}{BEGIN}\n{made}\n{END}{rest.partition(END)[2]}")
        text = PAGE.read_text()
    assert f"{BEGIN}\n{made}\n{END}" in text, made
