"""Hydra sweepers and launchers on the real app: an Optuna search, joblib jobs, a submitit job.

Each is a real ``python train.py -m ...`` process on a tiny demo folder (``experiment=smoke``);
``cltrain-sweep-report`` then reads what the sweep wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cltrain.data import make_demo_dataset
from tests.helpers import SMOKE, TINY_DEMO as DEMO
from tests.helpers import warm

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = make_demo_dataset(tmp_path_factory.mktemp("data") / "demo", **DEMO)
    return [*SMOKE, f"data.root={root}", *(f"data.demo.{k}={v}".replace(" ", "") for k, v in DEMO.items()),
            "device=cpu", "trainer.enable_progress_bar=false", "print_freq=0", "trainer.limit_train_batches=2",
            "trainer.limit_val_batches=1"]


def _sweep(args: list[str], timeout: int = 600, status: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = warm.run([sys.executable, str(REPO / "train.py"), "-m", *args], capture_output=True, text=True,
                      timeout=timeout, cwd=REPO, env=env)
    assert result.returncode == status, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _report(sweep: Path) -> str:
    report = warm.run([sys.executable, "-m", "cltrain.tools.sweep_report", str(sweep)],
                      capture_output=True, text=True, timeout=120, cwd=REPO)
    assert report.returncode == 0, report.stderr
    return (sweep / "report.md").read_text()


def _runs(sweep: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(sweep.rglob("metrics.json"))]


def test_optuna_search_maximises_val_top1(demo_args: list[str], tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "optuna"
    _sweep([*demo_args, "hparams_search=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.n_startup_trials=2",
            f"hydra.sweep.dir={sweep}"])
    runs = _runs(sweep)
    assert len(runs) == 2
    lrs = {r["config"]["optim"]["lr"] for r in runs}
    assert len(lrs) == 2 and all(0.005 <= lr <= 0.5 for lr in lrs)  # the sampler chose them, not the config
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_value"] == max(r["val_top1"] for r in runs)  # the value train.py returned
    table = _report(sweep)
    assert table.count("| test_resnet |") == 2 and "Optuna best" in table


@pytest.mark.parametrize("sweeper", ["basic", "optuna"])
def test_a_failed_job_does_not_stop_the_sweep(demo_args: list[str], tmp_path: Path, sweeper: str) -> None:
    # each job's one line ended the whole sweep: a SystemExit, which Hydra's sweepers let through
    sweep = tmp_path / sweeper
    if sweeper == "optuna":  # seed 11: the sampler draws the diverging lr first
        pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
        lrs = ["hparams_search=optuna", "hydra.sweeper.n_trials=2", "optim.lr=choice(1e30,0.05)",
               "optim.weight_decay=1e-4", "label_smoothing=0.0", "seed=11"]
    else:
        lrs = ["optim.lr=1e30,0.05"]
    result = _sweep([*demo_args, *lrs, f"hydra.sweep.dir={sweep}"], status=1 if sweeper == "basic" else 0)
    statuses = [run["status"] for run in _runs(sweep)]
    assert statuses == ["failed", "completed"], statuses
    assert "Traceback" not in result.stderr and "training loss is nan" in result.stderr, result.stderr[-3000:]
    if sweeper == "basic":  # then Hydra's HYDRA_FULL_ERROR hint
        assert f"its line is in {sweep / '0' / 'train.log'}); " in result.stderr  # not in sight under submitit
        assert f"cltrain-sweep-report {sweep} tables them" in result.stderr
    else:
        assert yaml.safe_load((sweep / "optimization_results.yaml").read_text())["best_params"] == {"optim.lr": 0.05}


def test_joblib_launcher_runs_jobs_in_parallel_processes(demo_args: list[str], tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    sweep = tmp_path / "joblib"
    _sweep([*demo_args, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "channels_last=true,false",
            f"hydra.sweep.dir={sweep}"])
    runs = _runs(sweep)
    assert {r["channels_last"] for r in runs} == {True, False}
    assert len({r["run_dir"] for r in runs}) == 2
    assert _report(sweep).count("| test_resnet |") == 2


def test_submitit_local_executor_runs_the_job(demo_args: list[str], tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "submitit"
    _sweep([*demo_args, "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10", "amp=false",
            f"hydra.sweep.dir={sweep}"])
    runs = _runs(sweep)
    assert [r["precision"] for r in runs] == ["32-true"]
    assert list((sweep / ".submitit").glob("*/*_result.pkl")), "submitit ran the job and kept its result"
    assert _report(sweep).count("| test_resnet |") == 1


def test_slurm_preset_composes_for_the_trainer_shape() -> None:
    from cltrain.app.cli import compose_config

    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir

    from cltrain.app.config import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "trainer=ddp", "trainer.devices=4",
                                           "trainer.num_nodes=2"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.tasks_per_node, launcher.gpus_per_node, launcher.nodes) == (4, 4, 2)
    assert compose_config(["trainer=ddp"]).trainer.strategy == "ddp"
