"""Run directories: claimed atomically (concurrent real train.py processes from one folder), and
a file or a foreign non-empty folder refused with a one-line error naming what is there."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cltrain.app.config import ConfigError
from cltrain.app.rundir import CLAIM, claim_run_dir
from cltrain.data import make_demo_dataset
from tests.helpers import SMOKE, TINY_DEMO as DEMO
from tests.helpers import warm

REPO = Path(__file__).resolve().parents[2]


def test_a_taken_fixed_directory_is_refused_and_a_free_one_claimed(tmp_path: Path) -> None:
    mine = claim_run_dir(tmp_path / "new")
    assert mine.is_dir() and (mine / CLAIM).read_text().split()[0] == str(os.getpid())
    assert claim_run_dir(mine) == mine  # this process's own claim (the Hydra callback, then train())

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match=r"^run_dir='.*a-file': is a file, not a directory"):
        claim_run_dir(tmp_path / "a-file")
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.jpg").write_text("x")
    with pytest.raises(ConfigError, match=r"not empty and not a cltrain run \(holds cat.jpg\)"):
        claim_run_dir(tmp_path / "photos")
    (tmp_path / "old" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"holds an earlier run \(checkpoints\); it is never overwritten"):
        claim_run_dir(tmp_path / "old")

    # A claim left by a process that is gone (a config error, kill -9) is stale: the folder can be used.
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / CLAIM).write_text(f"{2**22 + 12345} {os.uname().nodename}\n")
    assert claim_run_dir(tmp_path / "stale") == tmp_path / "stale"


def test_same_pattern_takes_the_next_free_name(tmp_path: Path) -> None:
    first = claim_run_dir(tmp_path / "12-00-00", next_free=True)
    second = claim_run_dir(tmp_path / "12-00-00", next_free=True)
    third = claim_run_dir(tmp_path / "12-00-00", next_free=True)
    assert (first.name, second.name, third.name) == ("12-00-00", "12-00-00-1", "12-00-00-2")


@pytest.mark.slow
def test_concurrent_runs_from_one_folder_get_their_own_directories(tmp_path: Path) -> None:
    root = make_demo_dataset(tmp_path / "demo", **DEMO)
    demo = [f"data.demo.{k}={v}".replace(" ", "") for k, v in DEMO.items()]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)
    # The same time pattern for every run (day resolution, so they surely collide), from the same cwd.
    args = [sys.executable, str(REPO / "train.py"), *SMOKE, f"data.root={root}", *demo, "device=cpu",
            "amp=false", "trainer.enable_progress_bar=false", "print_freq=0", "hydra.run.dir=outputs/${now:%Y-%m-%d}"]
    procs = [warm.Popen([*args, f"seed={i}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)

    runs = sorted(p for p in (tmp_path / "outputs").iterdir())
    assert len(runs) == 2 and runs[1].name == runs[0].name + "-1"
    seeds = set()
    for run in runs:
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["run_dir"] == str(run) and metrics["status"] == "completed"
        assert metrics["last_checkpoint"] == str(run / "checkpoints" / "last.ckpt")
        assert metrics["best_checkpoint"].startswith(str(run / "checkpoints"))
        seeds.add(metrics["config"]["seed"])
        assert torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 4
        steps = [int(r["step"]) for r in csv.DictReader(open(run / "csv" / "metrics.csv")) if r.get("train/loss")]
        assert steps == [0, 1, 2, 3]  # one run's rows only
        assert (run / ".hydra" / "config.yaml").is_file() and f"seed: {metrics['config']['seed']}" in \
            (run / ".hydra" / "config.yaml").read_text()
    assert seeds == {0, 1}


def test_a_requeued_slurm_job_may_come_back_to_its_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "slurm-77"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.json").write_text("{}")
    (run / CLAIM).write_text("1 another-node\n")  # the first attempt ran elsewhere
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    with pytest.raises(ConfigError, match="holds an earlier run"):
        claim_run_dir(run)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(ConfigError, match="holds an earlier run"):  # nothing for Lightning to resume from
        claim_run_dir(run)
    (run / "hpc_ckpt_1.ckpt").write_bytes(b"x")
    assert claim_run_dir(run) == run and (run / CLAIM).read_text().split()[0] == str(os.getpid())


def test_the_slurm_tasks_after_the_first_share_its_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # srun starts every task with this command line: task 1 claimed the fixed directory task 0 held, and stopped
    run = tmp_path / "r-slurm-4250"
    run.mkdir()
    (run / CLAIM).write_text(f"1 {os.uname().nodename}\n")  # task 0's claim (pid 1: alive)
    for name, value in {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train", "SLURM_PROCID": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(ConfigError, match="in use by another run"):  # task 0 itself: a second run there
        claim_run_dir(run)
    monkeypatch.setenv("SLURM_PROCID", "1")
    assert claim_run_dir(run) == run and (run / CLAIM).read_text().split()[0] == "1"
