"""Every value a user can type: one table, each bad value a one-line ConfigError naming the key and
what to use; a few through the real command line (exit status 2, one stderr line, nothing left behind)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cltrain.app.cli import compose_config
from cltrain.app.config import ConfigError, validate
from cltrain.app.rundir import claim_run_dir
from cltrain.app.train import train
from cltrain.data import make_demo_dataset
from tests.helpers import SMOKE, warm

REPO = Path(__file__).resolve().parents[2]

# (overrides, key named, text the message must hold)
TABLE = [
    (["label_smoothing=abc"], "label_smoothing", "0 <= value < 1"),
    (["seed=abc"], "seed", "whole number"),
    (["seed=-1"], "seed", "0 .. 2**32-1"),
    (["throughput_warmup=-5"], "throughput_warmup", ">= 0"),
    (["print_freq=-1"], "print_freq", ">= 0"),
    (["trainer.max_epochs=abc"], "trainer.max_epochs", "-1 for no limit"),
    (["trainer.max_steps=abc"], "trainer.max_steps", "-1 for no limit"),
    (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches", "> 0"),
    (["trainer.gradient_clip_val=abc"], "trainer.gradient_clip_val", ">= 0"),
    (["trainer.gradient_clip_algorithm=l2"], "trainer.gradient_clip_algorithm", "norm, value, or null"),
    (["trainer.val_check_interval=1.5"], "trainer.val_check_interval", "'DD:HH:MM:SS'"),
    (["trainer.check_val_every_n_epoch=0"], "trainer.check_val_every_n_epoch", "> 0"),
    (["trainer.limit_test_batches=-1"], "trainer.limit_test_batches", "0.0 .. 1.0"),
    (["trainer.limit_train_batches=1.5"], "trainer.limit_train_batches", "0.0 .. 1.0"),
    (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps", "> 0"),
    (["trainer.devices=0"], "trainer.devices", "auto"),
    (["trainer.enable_progress_bar=maybe"], "trainer.enable_progress_bar", "true, false"),
    (["trainer.deterministic=maybe"], "trainer.deterministic", "true, false, warn"),
    (["trainer.benchmark=maybe"], "trainer.benchmark", "true, false, or null"),
    # Lightning's other Trainer arguments pass through with +, typed by Trainer's own signature
    (["trainer.min_steps=2"], "trainer.min_steps", "+trainer.min_steps=2"),
    (["+trainer.min_steps=abc"], "trainer.min_steps", "must be a whole number or null"),
    (["+trainer.overfit_batches=abc"], "trainer.overfit_batches", "must be a number"),
    (["data.num_workers=-1"], "data.num_workers", ">= 0"),
    (["data.val_resize_size=0"], "data.val_resize_size", "> 0"),
    (["data.image_size=abc"], "data.image_size", "> 0"),
    (["data.allow_missing_val_classes=maybe"], "data.allow_missing_val_classes", "true, false"),
    (["data.interpolation=nearest"], "data.interpolation", "bilinear, bicubic"),
    (["data.scale=[0.5,0.1]"], "data.scale", "[0.08, 1.0]"),
    (["data.demo.num_classes=0"], "data.demo.num_classes", "> 0"),
    (["data=video_demo", "data.num_frames=abc"], "data.num_frames", "> 0"),
    (["data=shards", "data.root=/tmp", "data.shuffle_window=0"], "data.shuffle_window", "> 0"),
    (["optim.momentum=2"], "optim.momentum", "0 <= value <= 1"),
    (["optim.weight_decay=-1"], "optim.weight_decay", ">= 0"),
    (["optim.lr=abc"], "optim.lr", "> 0"),
    (["optim.name=lamb"], "optim.name", "optim=sgd, optim=adamw"),
    (["optim.schedule=linear"], "optim.schedule", "step, cosine"),
    (["optim.gamma=0"], "optim.gamma", "> 0"),
    (["optim.warmup_epochs=abc"], "optim.warmup_epochs", ">= 0"),
    (["optim.milestones=[a]"], "optim.milestones", "[30, 60, 80]"),
    (["optim=adamw", "optim.betas=[0.9]"], "optim.betas", "[0.9, 0.999]"),
    (["checkpoint.save_top_k=-2"], "checkpoint.save_top_k", "-1 keeps all"),
    (["tf32=maybe"], "tf32", "true, false"),
    (["amp=fast"], "amp", "auto, true, false, bf16, fp16"),
    (["channels_last_mode=half"], "channels_last_mode", "full, conv"),
    (["compile=yes"], "compile", "compile.enabled=true"),
    (["compile.enabled=maybe"], "compile.enabled", "true, false"),
    (["ema=true"], "ema", "ema.enabled=true"),
    (["ema.decay=1.5"], "ema.decay", "0 <= value < 1"),
    (["ema.every_n_steps=0"], "ema.every_n_steps", "> 0"),
    (["~ema"], "ema", "drop ~ema"),
    (["model.kwargs=abc"], "model.kwargs", "mapping"),
    # unknown keys: the close key suggested
    (["+chanels_last=false"], "chanels_last", "did you mean channels_last?"),
    (["chanels_last=false"], "chanels_last", "did you mean channels_last?"),
    (["optim.lrr=0.1"], "optim.lrr", "did you mean optim.lr?"),
    (["ema.decy=0.9"], "ema.decy", "did you mean ema.decay?"),
    (["sync_bn=true"], "sync_bn", "did you mean trainer.sync_batchnorm?"),
    (["cudnn_benchmark=false"], "cudnn_benchmark", "did you mean trainer.benchmark?"),
    (["amp_dtype=bf16"], "amp_dtype", "did you mean amp?"),
    (["+trainer.max_epoch=3"], "trainer.max_epoch", "did you mean trainer.max_epochs"),
    (["+data.batchsize=4"], "data.batchsize", "did you mean data.batch_size"),
    (["+optim.lrr=0.1"], "optim.lrr", "did you mean optim.lr"),
    (["+model.pretrain=w.pth"], "model.pretrain", "did you mean model.pretrained"),
    (["+foo=1"], "foo", "unknown key"),
    # keys the app sets itself: the key to use instead
    (["+trainer.precision=64-true"], "trainer.precision", "use amp"),
    (["trainer.precision=64-true"], "trainer.precision", "use amp"),
    (["+trainer.accelerator=gpu"], "trainer.accelerator", "use device"),
    (["+trainer.logger=false"], "trainer.logger", "logger=csv|tensorboard|mlflow|wandb|none"),
    (["+trainer.callbacks=[]"], "trainer.callbacks", "+callbacks.<name>._target_=<class>"),
    (["+trainer.plugins=[]"], "trainer.plugins", "checkpoint IO"),
    (["+trainer.sync_batchnorm=true"], "trainer.sync_batchnorm", "set it without the +"),
    (["+trainer.default_root_dir=/tmp"], "trainer.default_root_dir", "use run_dir"),
    (["+trainer.enable_checkpointing=false"], "trainer.enable_checkpointing", "checkpoint.save_top_k"),
    # a typo'd data.root with the demo data: never a demo set generated there
    (["data.root=/no/such/imagnet"], "data.root", "data=imagenet data.root=<your folder>"),
    # a pack's root: what a pack is, and a URL with a slash missing
    (["data=shards", "data.root=/no/such/pack"], "data.root", "a pack (cltrain-pack IMAGEFOLDER OUT) as a folder"),
    (["data=litdata", "data.num_classes=2", "data.root=/no/such/lit"], "data.root", "LitData optimized datasets, or its URL"),
    (["data=shards", "data.root=s3:/bucket/pack"], "data.root", "one slash after 's3:') (allowed: s3://bucket/pack)"),
    # an HF dataset in a bucket: downloaded first (cltrain-pack takes image folders, not HF datasets)
    (["data=hf", "data.root=s3://bucket/hf"], "data.root", "a local folder: download it first (e.g. `aws s3 sync"),
]


@pytest.mark.parametrize("overrides,key,text", TABLE, ids=[" ".join(t[0]) for t in TABLE])
def test_every_bad_value_is_one_line_naming_the_key(overrides: list[str], key: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(compose_config([*overrides, "device=cpu"]))
    message = str(info.value)
    assert info.value.key == key and message.startswith(f"{key}="), message
    assert text in message and "\n" not in message and len(message) < 300, message


def _checkpoint(path: Path, **state) -> Path:
    torch.save({"state_dict": {}, "global_step": 4, "hyper_parameters": {"optimizer": "sgd"},
                "optimizer_states": [{"state": {}, "param_groups": []}], **state}, path)
    return path


def test_checkpoint_mistakes_before_anything_is_built(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "sgd.ckpt")
    err = pytest.raises(ConfigError, validate, compose_config([f"ckpt_path={ckpt}", "optim=adamw", "device=cpu"])).value
    assert err.key == "optim.name" and "trained with optim=sgd" in str(err) and "optim=sgd" in err.allowed
    weights = tmp_path / "w.pth"
    torch.save({"conv.weight": torch.zeros(1)}, weights)
    err = pytest.raises(ConfigError, validate, compose_config([f"ckpt_path={weights}", "device=cpu"])).value
    assert err.key == "ckpt_path" and "not a Lightning checkpoint" in str(err)
    (tmp_path / "junk.ckpt").write_text("not a checkpoint")
    err = pytest.raises(ConfigError, validate, compose_config([f"ckpt_path={tmp_path / 'junk.ckpt'}", "device=cpu"])).value
    assert err.key == "ckpt_path" and "not a readable checkpoint" in str(err)


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_dataset(tmp_path_factory.mktemp("data") / "demo", num_classes=2, train_per_class=2,
                             val_per_class=1, image_size=[40, 30])


def _smoke(root: Path, run_dir: Path, *overrides: str):
    return compose_config([*SMOKE, "data=imagenet", f"data.root={root}", f"run_dir={run_dir}",
                           "device=cpu", *overrides])


def test_run_dir_that_is_a_file_or_foreign_folder(demo_root: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"^run_dir='.*file': is a file, not a directory"):
        train(_smoke(demo_root, tmp_path / "file"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"not empty and not a cltrain run \(holds notes.txt\)"):
        train(_smoke(demo_root, tmp_path / "mine"))


def test_data_layout_mistakes_are_config_errors(demo_root: Path, tmp_path: Path) -> None:
    import shutil

    no_val = tmp_path / "no_val"
    shutil.copytree(demo_root / "train", no_val / "train")
    with pytest.raises(ConfigError) as info:
        train(_smoke(no_val, tmp_path / "run1"))
    assert info.value.key == "data.root" and "val" in str(info.value) and "\n" not in str(info.value)

    empty_class = tmp_path / "empty_class"
    shutil.copytree(demo_root, empty_class)
    (empty_class / "train" / "zebra").mkdir()
    (empty_class / "val" / "zebra").mkdir()
    with pytest.raises(ConfigError) as info:
        train(_smoke(empty_class, tmp_path / "run2"))
    assert info.value.key.startswith("data") and "zebra" in str(info.value) and "\n" not in str(info.value)

    train_only = tmp_path / "train_only"
    shutil.copytree(demo_root, train_only)
    shutil.copytree(next((train_only / "train").iterdir()), train_only / "train" / "zebra")
    with pytest.raises(ConfigError) as info:
        train(_smoke(train_only, tmp_path / "run3"))
    assert "1 training class(es) have no val/ folder (zebra)" in str(info.value)
    assert "data.allow_missing_val_classes=true" in str(info.value)

    # a class folder copied from macOS (NFD) beside its Linux twin (NFC): the line said to add the folder first
    twins = tmp_path / "twins"
    shutil.copytree(demo_root, twins)
    first = next((twins / "train").iterdir()).name
    (twins / "train" / first).rename(twins / "train" / "caf\u00e9")
    (twins / "val" / first).rename(twins / "val" / "cafe\u0301")
    with pytest.raises(ConfigError) as info:
        train(_smoke(twins, tmp_path / "run4"))
    assert "in other Unicode code points" in str(info.value) and "rename the val/ folder" in str(info.value)
    assert "\n" not in str(info.value) and "allow_missing_val_classes" not in str(info.value), str(info.value)


def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)
    return warm.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True,
                    timeout=300, cwd=cwd, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("override,message", [  # refused before Hydra makes the directory, and after
    ("trainer.max_epochs=abc", "cltrain: error: trainer.max_epochs='abc': must be a whole number >= -1"),
    ("data.root=/no/such/imagnet", "cltrain: error: data.root='/no/such/imagnet': no such directory; the demo set"),
])
def test_cli_exit_2_one_line_and_the_directory_stays_usable(tmp_path: Path, override: str, message: str) -> None:
    run_dir = tmp_path / "run"
    result = _cli(*SMOKE, "device=cpu", override, f"hydra.run.dir={run_dir}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().startswith(message) and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (run_dir / "csv").exists() and not (run_dir / "checkpoints").exists()
    assert claim_run_dir(run_dir, "hydra.run.dir") == run_dir  # a retry may use the same directory


@pytest.mark.slow
def test_cli_run_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("x")
    result = _cli(*SMOKE, "device=cpu", f"hydra.run.dir={tmp_path / 'taken'}")
    assert result.returncode == 2 and "is a file, not a directory" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_another_librarys_error_keeps_the_secrets_out_of_every_output_and_file(tmp_path: Path) -> None:
    # an MLflow server that is not there, its password in the tracking URI: MLflow's error names the URI
    pytest.importorskip("mlflow")
    from tests.helpers.s3 import free_port

    run_dir = tmp_path / "run"
    uri = f"http://alice:Pw-in-uri-1234@127.0.0.1:{free_port()}"
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    try:
        result = _cli(*SMOKE, "device=cpu", "logger=mlflow", f"logger.mlflow.tracking_uri={uri}",
                      f"hydra.run.dir={run_dir}")
    finally:
        del os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("cltrain: error: MlflowException"), result.stderr[-2000:]
    assert "Pw-in-uri-1234" not in result.stdout + result.stderr and "http://***@127.0.0.1" in result.stderr
    assert not [p for p in run_dir.rglob("*") if p.is_file() and b"Pw-in-uri-1234" in p.read_bytes()]
