"""`python train.py ...` as a user runs it: short errors with exit status 2 (a mistyped group option too), real DDP."""

from __future__ import annotations

import contextlib
import json
import re
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers import SMOKE, demo_overrides, warm


REPO = Path(__file__).resolve().parents[2]




def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)
    return warm.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True,
                    timeout=timeout, cwd=REPO, env=env)


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.batch_size=0", "cltrain: error: data.batch_size=0: must be a whole number > 0"),
        ("model.name=resnet5", "cltrain: error: model.name='resnet5': unknown model (allowed: a name from"),
        ("amp=fp16", "cltrain: error: amp='fp16': AMP on the CPU is bf16 autocast (allowed: auto, true, bf16"),
        ("data.image_size=512", "cltrain: error: data.val_resize_size=128: smaller than data.image_size=512, which "
                                "validation crops from it (allowed: data.val_resize_size=585 (the 0.875 crop ratio)"),
    ],
)
def test_bad_config_is_one_line_and_exit_status_2(tmp_path: Path, override: str, message: str) -> None:
    result = run(override, "device=cpu", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().startswith(message), result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("overrides,message", [
    (["device=gpu"], "cltrain: error: device='gpu': unknown device (allowed: auto, cpu, cuda, cuda:N, mps)"),
    (["channels_last=false", "channels_last_layout=channels_last"],
     "cltrain: error: channels_last_layout='channels_last': channels_last=false trains in NCHW without"),
])
def test_values_that_mean_nothing_together_or_anywhere_are_refused_before_the_run_folder(tmp_path: Path, overrides,
                                                                                       message: str) -> None:
    result = run(*overrides, f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2 and result.stderr.strip().startswith(message), result.stderr
    assert not (tmp_path / "run").exists()  # found with the command line's check, before Hydra made the folder


@pytest.mark.parametrize("override,message", [
    ("model=resnet5", "cltrain: error: model='resnet5': no model option of that name; did you mean model=resnet50"),
    ("+logger=cvs", "cltrain: error: logger='cvs': no logger option of that name; did you mean logger=csv?"),
])
def test_unknown_group_option_is_one_line_with_the_closest_and_exit_status_2(tmp_path: Path, override: str,
                                                                             message: str) -> None:
    result = run(override, f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().startswith(message), result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "run").exists()
    # the control: a group option that exists composes and reaches the checks after composition
    good = run(override.lstrip("+").replace("resnet5", "resnet50").replace("cvs", "csv"), "data.batch_size=0",
               f"hydra.run.dir={tmp_path / 'run'}")
    assert good.returncode == 2 and good.stderr.startswith("cltrain: error: data.batch_size=0:"), good.stderr


@pytest.mark.parametrize("strategy,reason", [
    ("fsdp", "The strategy `fsdp` requires a GPU accelerator"),
    ("model_parallel", "You selected an invalid strategy name: `strategy='model_parallel'`"),
])
def test_a_trainer_value_lightning_refuses_is_one_line_naming_the_key(demo_args: list[str], tmp_path: Path,
                                                                     strategy: str, reason: str) -> None:
    # was a 43-line traceback, exit status 1, ending "InstantiationException: Error in call to target ...Trainer"
    result = run(*SMOKE, *demo_args, "device=cpu", f"trainer.strategy={strategy}", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().startswith(f"cltrain: error: trainer.strategy='{strategy}': {reason}"), result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_run_directory_with_a_run_in_it_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.ckpt").write_bytes(b"old")
    result = run(*SMOKE, f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert "hydra.run.dir=" in result.stderr and "holds an earlier run (checkpoints)" in result.stderr
    assert not (tmp_path / "run" / ".hydra").exists()  # refused before Hydra wrote anything
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").read_bytes() == b"old"


def test_two_process_ddp_on_cpu_with_gradient_accumulation(demo_args: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "ddp"
    result = run(*SMOKE, *demo_args, "device=cpu", "trainer=ddp", "trainer.devices=2",
                 "trainer.max_epochs=2", "trainer.accumulate_grad_batches=2", "trainer.enable_progress_bar=false",
                 f"hydra.run.dir={run_dir}", timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Grad strides do not match" not in result.stderr + result.stdout
    assert " images/s, " in next(line for line in result.stdout.splitlines() if line.startswith("cltrain: val top-1"))
    metrics = json.loads((run_dir / "metrics.json").read_text())
    # 32 images / (2 ranks x batch 8) = 2 batches per rank per epoch; accumulating 2 -> 1 optimizer step per epoch
    assert (metrics["world_size"], metrics["global_batch"], metrics["global_step"]) == (2, 32, 2)
    assert metrics["config"]["channels_last"] is True and metrics["val_top1"] is not None
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert "cltrain: val top-1" in result.stdout
    # the progress line's epoch accuracy is every rank's, as the logs' (it was rank 0's: 95.8 against 81.2)
    last = [line for line in result.stdout.splitlines() if line.startswith("Epoch: [1]")][-1]
    assert abs(float(re.search(r"Prec@1 [\d.]+ \(([\d.]+)\)", last).group(1)) - metrics["train_top1"]) < 0.01, last


def test_a_bad_file_on_one_rank_ends_every_rank_with_one_line_each(demo_root: Path, tmp_path: Path) -> None:
    # One rank's error (here a truncated JPEG under data.bad_files=raise) made that rank save last.ckpt, whose barrier
    # met the other rank's next collective (DDP's buffer broadcast): both ranks waited, SIGTERM did not end them
    # (killed after 3 minutes). The failing rank now saves nothing; the other loses its peer and says so in one line.
    root = shutil.copytree(demo_root, tmp_path / "demo")
    bad = sorted((root / "train").rglob("*.jpg"))[0]
    bad.write_bytes(bad.read_bytes()[:300])
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)
    proc = warm.Popen([sys.executable, str(REPO / "train.py"), *SMOKE, *demo_overrides(root), "device=cpu",
                       "trainer=ddp", "trainer.devices=2", "trainer.max_epochs=3", "trainer.enable_progress_bar=false",
                       "data.bad_files=raise", "channels_last_layout=channels_last", f"hydra.run.dir={tmp_path / 'run'}"],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
                      start_new_session=True)
    try:
        output = proc.communicate(timeout=150)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):  # the other rank too, whatever the launching process did
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, output[-3000:]  # a data error's status, whichever rank read the file (was 1 on rank 1)
    assert f"cltrain: error: {bad}: cannot be read as an image" in output, output[-3000:]
    assert "cltrain: error: another rank stopped first (its error is above)" in output, output[-3000:]
    # which rank, and gloo's reason cut at a word (it ended "typically caused by a remote worker ")
    assert re.search(r"above\); rank [01]'s collective lost it \(\w+: [^\n]*[\w…]\)$", output, re.M), output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_files_skipped_on_rank_1_are_counted_and_listed_in_the_run_directorys_list(demo_root: Path,
                                                                                   tmp_path: Path) -> None:
    # A bad file that only rank 1 read was in rank1.skipped_files.tsv alone: no skipped_files.tsv to pass to
    # exclude_files, and no warning (rank 0 counted its own list)
    from cltrain.data.resume_state import ResumableSampler

    root = shutil.copytree(demo_root, tmp_path / "demo")
    files = sorted((root / "train").rglob("*.jpg"))  # the training set's order
    first_on_rank_1 = int(next(iter(ResumableSampler(len(files), seed=42, num_replicas=2, rank=1))))  # the app's seed
    bad = files[first_on_rank_1]
    bad.write_bytes(bad.read_bytes()[:300])
    bad_val = sorted((root / "val").rglob("*.jpg"))[0]  # every rank's check of the validation files meets it
    bad_val.write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "LOCAL_RANK")}
    run_dir = tmp_path / "run"
    result = warm.run([sys.executable, str(REPO / "train.py"), *SMOKE, *demo_overrides(root), "device=cpu",
                       "trainer=ddp", "trainer.devices=2", "trainer.enable_progress_bar=false", "data.bad_files=skip",
                       "trainer.max_epochs=1", "channels_last_layout=channels_last",
                       f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert str(bad) not in (run_dir / "rank0.skipped_files.tsv").read_text()  # the premise: rank 1 alone met it
    assert str(bad) in (run_dir / "rank1.skipped_files.tsv").read_text()
    assert sorted(line.split("\t")[:2] for line in (run_dir / "skipped_files.tsv").read_text().splitlines()) == \
        [["train", str(bad)], ["val", str(bad_val)]]
    said = " ".join(output.split())
    assert f"skipped 1 unreadable file(s) of 'train' in epoch 0; their paths are in {run_dir / 'skipped_files.tsv'}" \
        in said, output[-3000:]
    assert "skipped 1 unreadable file(s) of 'val'" in said, output[-3000:]  # once, not once per rank


def test_ddp_inside_a_sweep_is_refused(tmp_path: Path) -> None:
    result = run("-m", *SMOKE, "trainer=ddp", "device=cpu", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert result.returncode == 2
    assert "cltrain: error: trainer.devices=2: more than one process cannot be launched inside a -m sweep" in result.stderr
    assert not (tmp_path / "sweep").exists()  # refused with the command line's check, before Hydra made the sweep
    assert "Launching" not in result.stdout + result.stderr


def test_a_diverged_run_stops_says_so_and_keeps_the_finite_last_checkpoint(demo_args: list[str], tmp_path: Path) -> None:
    # Epoch 0 trains as usual; at epoch 1 the step schedule multiplies the lr by 1e30, so the loss turns
    # inf/NaN within the epoch. The run must stop there (not train on and end "completed"), exit 1 with one
    # line, say "failed" in metrics.json, and leave epoch 0's last.ckpt as it was (finite), not NaN weights.
    run_dir = tmp_path / "run"
    done = run(*SMOKE, *demo_args, f"run_dir={run_dir}", "device=cpu", "amp=false", "trainer.max_epochs=4",
               "optim.milestones=[1]", "optim.gamma=1e30", "optim.warmup_epochs=0", "print_freq=1",
               "trainer.enable_progress_bar=false")
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("cltrain: error:")]
    assert len(errors) == 1 and "training loss is" in errors[0] and "at epoch 1" in errors[0] and "optim.lr" in errors[0]
    assert "Traceback" not in done.stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "failed" and metrics["error"].startswith("NonFiniteLossError: training loss is")
    import torch

    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    steps_per_epoch = 32 // 8  # 32 images, batch 8 (experiment=smoke)
    assert state["global_step"] == steps_per_epoch and state["epoch"] == 0
    assert steps_per_epoch < metrics["global_step"] < 2 * steps_per_epoch  # stopped inside epoch 1
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())


def test_a_bad_file_met_in_a_worker_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    # The data errors of setup (an empty class folder, check_val's list) take the same path, in-process.
    from tests.helpers.data_fixtures import write_user_folder

    root = tmp_path / "images"
    write_user_folder(root, size=(40, 40))  # train/c0 holds every quirk, 5 of them unreadable; junk everywhere
    result = run(*SMOKE, "data=imagenet", f"data.root={root}", "data.batch_size=4", "device=cpu",
                 "data.num_workers=2", "data.decode_threads=1", "trainer.limit_train_batches=null",
                 f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Caught BadImageError" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]  # the worker's error, as a worker process raised it
    assert line.startswith(f"cltrain: error: {root / 'train' / 'c0'}/") and ": cannot be read as an image (" in line, line
    assert line.endswith("Replace or remove the file, or pass data.bad_files=skip to skip such files "
                         f"('cltrain-data-check {root}' lists them all, for data.exclude_files=<that list>)."), line
    logged = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert logged[-1].endswith(line), logged[-3:]  # the run's log ends with why it stopped
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    file_and_reason = line.removeprefix("cltrain: error: ").partition(". Replace")[0]  # the worker's own line
    assert metrics["status"] == "failed" and metrics["error"].startswith(f"BadImageError: {file_and_reason}"), metrics


@pytest.mark.parametrize("key", ["run_dir", "hydra.run.dir"])
def test_a_run_directory_that_cannot_be_created_is_one_line_and_exit_status_2(tmp_path: Path, key: str) -> None:
    # a file where a folder must be: as a read-only place, an OSError that was a traceback (exit status 1)
    (tmp_path / "afile").write_text("")
    where = tmp_path / "afile" / "run"
    result = run(*SMOKE, "device=cpu", f"hydra.run.dir={tmp_path / 'hydra'}", f"{key}={where}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (f"cltrain: error: {key}='{where}': cannot be created or written: a file is in "
                                     f"the way ({tmp_path / 'afile'}) (allowed: another {key}, in a folder you can "
                                     "write to)"), result.stderr[-3000:]


def test_a_logger_folder_that_cannot_be_written_is_one_line(demo_args: list[str], tmp_path: Path) -> None:
    # the CSV logger's own NotADirectoryError (a full disk's ENOSPC alike): a traceback, and no path in its last line
    (tmp_path / "afile").write_text("")
    result = run(*demo_args, f"hydra.run.dir={tmp_path / 'run'}", f"logger.csv.save_dir={tmp_path / 'afile'}")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"cltrain: error: {tmp_path / 'afile'}/csv: Not a directory (give the key that names it, run_dir or "
        "logger.<name>.save_dir, a folder"), result.stderr[-3000:]


def test_a_sweep_flag_after_an_override_is_read_and_with_cfg_is_one_line() -> None:
    # argparse's usage and "unrecognized arguments: seed=1,abc"; Hydra's ValueError traceback for -m with --cfg
    result = run(*SMOKE, "-m", "seed=1,abc")
    assert result.returncode == 2 and result.stderr.strip() == (
        "cltrain: error: seed='abc': must be a whole number (allowed: 0 .. 2**32-1)"), result.stderr[-3000:]
    result = run(*SMOKE, "-m", "seed=1,2", "--cfg", "job")
    assert result.returncode == 2 and result.stderr.strip().startswith(
        "cltrain: error: Only one of --run, --multirun, --cfg"), result.stderr[-3000:]
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_demo_data_pointed_at_a_users_folder_says_how_to_train_on_it(tmp_path: Path) -> None:
    # the line said "Pass another root, or delete it to have it written again": the user's images, deleted
    own = tmp_path / "own"
    for split in ("train", "val"):
        (own / split / "cat").mkdir(parents=True)
    result = run(*SMOKE, "device=cpu", f"data.root={own}", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.endswith(f"(allowed: data=imagenet data.root={own} to train on the images in it)"), line
    assert "delete" not in line and (own / "train" / "cat").is_dir()


def test_a_bad_config_dir_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "CLTRAIN_CONFIG_DIR": str(tmp_path / "none")}
    env.pop("LOCAL_RANK", None)
    result = warm.run([sys.executable, str(REPO / "train.py"), f"hydra.run.dir={tmp_path / 'run'}"],
                      capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().startswith(f"cltrain: error: CLTRAIN_CONFIG_DIR='{tmp_path / 'none'}': no config.yaml "
                                            "in that folder"), result.stderr[-3000:]
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_copy_of_train_py_reads_the_conf_folder_beside_it(tmp_path: Path) -> None:
    # a user's copy of train.py and conf/, edited: the installed package's configs were read instead, in silence
    import shutil

    shutil.copy(REPO / "train.py", tmp_path / "train.py")
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    smoke = tmp_path / "conf" / "experiment" / "smoke.yaml"
    smoke.write_text(smoke.read_text().replace("batch_size: 8", "batch_size: 4"))
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(smoke.read_text())
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for name in ("LOCAL_RANK", "CLTRAIN_CONFIG_DIR"):
        env.pop(name, None)
    for experiment in ("smoke", "mine"):
        result = warm.run([sys.executable, "train.py", f"experiment={experiment}", "--cfg", "job"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "  batch_size: 4\n" in result.stdout, result.stdout[:3000]


@pytest.mark.parametrize("override,shown", [
    ("model.pretrained='https://u:SECRETPW@h/w.pth'", "model.pretrained='https://***@h/w.pth': no such file"),
    ("ckpt_path='https://u:SECRETPW@h/w.ckpt'", "ckpt_path='https://***@h/w.ckpt': no such file"),
    ("+chanels_last='https://h/p?sig=SECRETPW'", "chanels_last='https://h/p?sig=***': unknown key"),
])
def test_a_bad_value_holding_a_secret_is_shown_without_it(tmp_path: Path, override: str, shown: str) -> None:
    result = run(override, "device=cpu", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(f"cltrain: error: {shown}"), result.stderr[-3000:]
    assert "SECRETPW" not in result.stderr + result.stdout


def test_a_folder_given_as_ckpt_path_is_said_to_be_a_folder(tmp_path: Path) -> None:
    result = run(f"ckpt_path={tmp_path}", "device=cpu", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(f"cltrain: error: ckpt_path='{tmp_path}': a folder, not a file"), result.stderr
    assert "checkpoints/last.ckpt" in result.stderr.splitlines()[0]


def test_a_missing_exclude_list_is_one_line_before_the_ranks_start(tmp_path: Path) -> None:
    # said by each rank at setup, after the ranks had started
    result = run(f"data.exclude_files={tmp_path / 'bad.tsv'}", "device=cpu", "trainer=ddp", "trainer.devices=2",
                 f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith(f"cltrain: error: data.exclude_files='{tmp_path / 'bad.tsv'}': no such file")
    assert result.stderr.count("cltrain: error:") == 1 and "skipped_files.tsv" in result.stderr, result.stderr


def test_a_data_errors_fix_names_the_apps_keys(tmp_path: Path) -> None:
    # check_val's refusal said exclude_files=<that list>, the DataModule's argument, not the key the app takes
    from cltrain.app.cli import as_keys
    from cltrain.data import ImageFolderDataModule
    from cltrain.data.errors import BadImageError, error_line
    from tests.helpers.data_fixtures import write_image_folder, write_odd_files

    root = write_image_folder(tmp_path / "data", classes=2, train=2, val=2, size=(48, 40))
    (root / "val" / "c1" / "cut.jpg").write_bytes(write_odd_files(tmp_path / "odd")["truncated"].read_bytes())
    dm = ImageFolderDataModule(root, batch_size=2, num_workers=0, image_size=32, val_resize_size=36)
    with pytest.raises(BadImageError) as refused:
        dm.setup("fit")
    line = as_keys(error_line(refused.value))
    assert f"List them all with 'cltrain-data-check {root}' and pass data.exclude_files=<that list>, or pass " \
           "data.bad_files=skip" in line, line
