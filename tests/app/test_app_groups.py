"""logger= and callbacks= groups: real loggers write real files, read back with each tool's own reader."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, StochasticWeightAveraging

from cltrain.app.cli import compose_config
from cltrain.app.groups import build_callbacks, build_loggers
from cltrain.app.config import ConfigError
from cltrain.app.train import train
from tests.helpers import SMOKE, TINY_DEMO as DEMO






def _smoke(demo_root: Path, tmp_path: Path, *overrides: str):
    demo = [f"data.demo.{k}={v}".replace(" ", "") for k, v in DEMO.items()]
    return compose_config([*SMOKE, "device=cpu", f"run_dir={tmp_path / 'run'}", f"data.root={demo_root}",
                           *demo, "trainer.enable_progress_bar=false", *overrides])


@pytest.mark.slow
def test_four_loggers_at_once_each_readable(demo_root: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = train(_smoke(demo_root, tmp_path, "logger=[csv,tensorboard,mlflow,wandb]"))
    run = Path(metrics["run_dir"])

    rows = list(csv.DictReader(open(run / "csv" / "metrics.csv")))
    assert any(row.get("val/top1") for row in rows)

    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert "val/top1" in events.Tags()["scalars"]
    assert len(events.Scalars("train/loss")) >= 1

    client = mlflow.tracking.MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "cltrain"]
    (mlrun,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(mlrun.info.run_id, "val/top1")
    assert history and abs(history[-1].value * 100 - metrics["val_top1"]) < 1e-3

    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    assert list(offline[0].glob("run-*.wandb")), "the offline run holds its .wandb record file"


def test_logger_none_writes_no_log_folder(demo_root: Path, tmp_path: Path) -> None:
    metrics = train(_smoke(demo_root, tmp_path, "logger=none"))
    run = Path(metrics["run_dir"])
    assert (run / "metrics.json").is_file()
    assert not (run / "csv").exists()


def test_missing_logger_package_names_the_extra(tmp_path: Path) -> None:
    try:
        import comet_ml  # noqa: F401
        pytest.skip("comet_ml is installed here")
    except ImportError:
        pass
    group = {"comet": {"_target_": "lightning.pytorch.loggers.CometLogger"}}
    with pytest.raises(ConfigError, match=r"logger\.comet=.*comet_ml.*pip install 'cltrain\[comet\]'"):
        build_loggers(group, tmp_path)


def test_mlflow_defaults_to_a_local_sqlite_store_in_the_run_dir(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    (logger,) = build_loggers({"mlflow": {"_target_": "lightning.pytorch.loggers.MLFlowLogger",
                                          "experiment_name": "x", "tracking_uri": None}}, tmp_path)
    assert logger._tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_a_run_stopped_by_a_signal_is_killed_in_mlflow_not_failed(demo_root: Path, tmp_path: Path) -> None:
    mlflow = pytest.importorskip("mlflow")
    with pytest.raises(SystemExit) as stopped:
        train(_smoke(demo_root, tmp_path, "logger=mlflow", "+callbacks.stop._target_=tests.helpers.signals.SignalAtStep",
                     "+callbacks.stop.step=2"))
    assert stopped.value.code == 143
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "KILLED"


def test_callbacks_group_builds_lightning_callbacks(tmp_path: Path) -> None:
    cfg = compose_config(["callbacks=[default,early_stopping]",
                          "+callbacks.swa._target_=lightning.pytorch.callbacks.StochasticWeightAveraging",
                          "+callbacks.swa.swa_lrs=0.01"])
    built = build_callbacks(cfg.callbacks, tmp_path)
    assert isinstance(built["early_stopping"], EarlyStopping)
    assert isinstance(built["lr_monitor"], LearningRateMonitor)
    assert isinstance(built["swa"], StochasticWeightAveraging)


@pytest.mark.parametrize("group, match", [
    ({"x": {"patience": 3}}, r"callbacks\.x=.*needs a _target_"),
    ({"x": {"_target_": "lightning.pytorch.callbacks.NoSuchCallback"}}, r"callbacks\.x\._target_=.*cannot import"),
    ({"x": {"_target_": "lightning.pytorch.callbacks.EarlyStopping", "mode": "sideways"}}, r"callbacks\.x=.*"),
    (["early_stopping"], r"callbacks=.*group of named entries"),
    ({"x": {"_target_": "lightning.pytorch.callbacks.EarlyStopping", "patiense": 3}},
     r"callbacks\.x\.patiense=3: not an argument of EarlyStopping; did you mean callbacks\.x\.patience\?"),
])
def test_bad_callback_entries_are_one_line_errors(tmp_path: Path, group, match) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        build_callbacks(group, tmp_path)
    assert "\n" not in str(err.value)
