"""The app's checkpoints, as a user meets them: ``python train.py`` with $TMPDIR on another
filesystem never shows a half-written last.ckpt; kill -9 at any moment leaves one that loads and
resumes; a full disk (a real EFBIG from RLIMIT_FSIZE, a real ENOSPC on a small tmpfs) ends the run
with one line and keeps the previous last.ckpt; a payload checkpoint never runs; a truncated one
names the checkpoints that load."""

from __future__ import annotations

import csv
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from cltrain.app.cli import compose_config
from cltrain.app.config import ConfigError, validate
from cltrain.app.train import train
from cltrain.atomic import TEMP_PREFIX
from cltrain.checkpoint_io import load_checkpoint_file
from tests.helpers import SMOKE, warm

REPO = Path(__file__).resolve().parents[2]
POLLER = Path(__file__).resolve().parents[1] / "helpers" / "checkpoint_poller.py"
OTHER_FS = Path("/dev/shm")




def _smoke(demo_args: list[str], *overrides: str, resnet18: bool = False) -> list[str]:
    """The smoke experiment on the tiny demo set, on the CPU: on timm's test_resnet at 32 px (a 3 MB checkpoint), or
    on its own ResNet-18 (``resnet18``: an 89 MB checkpoint, whose save lasts long enough to be caught or killed)."""
    return [*(["experiment=smoke"] if resnet18 else SMOKE), *demo_args, "device=cpu", "amp=false",
            "trainer.enable_progress_bar=false", "print_freq=0", *overrides]


@pytest.fixture(scope="module")
def trained(demo_args: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    run = tmp_path_factory.mktemp("trained") / "run"
    return train(compose_config(_smoke(demo_args, f"run_dir={run}")))


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("LOCAL_RANK", None)
    return env


def _train_py(args: list[str], env: dict[str, str] | None = None, file_size_limit: int | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess:
    return warm.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True, cwd=REPO,
                    env=env or _env(), timeout=timeout, file_size_limit=file_size_limit)


def _temps(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{TEMP_PREFIX}*"))


def _first_step(run: Path) -> int:
    rows = [r for r in csv.DictReader(open(run / "csv" / "metrics.csv")) if r.get("train/loss")]
    return min(int(r["step"]) for r in rows)


# --- checkpoints cannot run code ---------------------------------------------------------------


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _payload_checkpoint(path: Path, marker: Path, trained: dict) -> Path:
    """A real checkpoint of the app with one extra object whose unpickling runs a shell command."""
    state = load_checkpoint_file(trained["last_checkpoint"])
    state["hyper_parameters"]["note"] = _Payload(marker)
    torch.save(state, path)
    return path


def test_the_app_saves_only_types_weights_only_loads(demo_args: list[str], tmp_path: Path) -> None:
    metrics = train(compose_config(_smoke(demo_args, f"run_dir={tmp_path / 'run'}", "ema.enabled=true", "optim=adamw",
                                          "callbacks=[default,early_stopping]")))
    for path in (metrics["last_checkpoint"], metrics["best_checkpoint"]):
        assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []  # nothing to allow-list
        assert load_checkpoint_file(path)["global_step"] == 4


@pytest.mark.slow
def test_a_payload_checkpoint_does_not_run_through_train_py(demo_args: list[str], trained: dict, tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    payload = _payload_checkpoint(tmp_path / "downloaded.ckpt", marker, trained)
    done = _train_py(_smoke(demo_args, f"ckpt_path={payload}", f"hydra.run.dir={tmp_path / 'run'}"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"cltrain: error: ckpt_path='{payload}': refused to load: it holds posix.system, which no checkpoint written "
        "by train.py holds; unpickling it could run code (allowed: a .ckpt file written by train.py)")
    assert "Traceback" not in done.stderr and not marker.exists()
    # Negative control: loaded as the app's pre-check did before (weights_only=False), the payload runs.
    warm.run([sys.executable, "-c", f"import torch; torch.load({str(payload)!r}, weights_only=False)"],
             check=True, capture_output=True)
    assert marker.exists()


def test_a_payload_as_pretrained_weights_does_not_run(demo_args: list[str], trained: dict, tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    payload = _payload_checkpoint(tmp_path / "weights.pth", marker, trained)
    with pytest.raises(ConfigError, match=rf"^model.pretrained='{payload}': refused to load: it holds posix.system"):
        train(compose_config(_smoke(demo_args, f"model.pretrained={payload}", f"run_dir={tmp_path / 'run'}")))
    assert not marker.exists()


def test_resuming_from_a_truncated_checkpoint_names_the_ones_that_load(demo_args: list[str], trained: dict,
                                                                       tmp_path: Path) -> None:
    source = Path(trained["last_checkpoint"]).parent
    copy = tmp_path / "checkpoints"
    copy.mkdir()
    for p in source.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    data = (copy / "last.ckpt").read_bytes()
    (copy / "last.ckpt").write_bytes(data[: len(data) // 3])  # cut short by some other tool (a full disk, rsync)
    with pytest.raises(ConfigError) as err:
        validate(compose_config(_smoke(demo_args, f"ckpt_path={copy / 'last.ckpt'}")))
    assert str(err.value) == (
        f"ckpt_path='{copy / 'last.ckpt'}': not a readable checkpoint (incomplete: the file ends before the checkpoint "
        f"does); checkpoints in {copy} that load: best-epoch000.ckpt (allowed: a .ckpt file written by train.py)")


# --- a full disk ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_file_size_limit_ends_the_run_with_one_line(demo_args: list[str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = _train_py(_smoke(demo_args, f"hydra.run.dir={run}"), file_size_limit=1_000_000)  # below the 3 MB checkpoint
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cltrain: error: cannot write best-epoch000.ckpt in {run / 'checkpoints'}: the file is "
                           "larger than the filesystem or this process's file size limit allows (ulimit -f: "
                           "1,000,000 bytes); it needs 3,")
    assert last.endswith("free; no best-epoch000.ckpt was written") and "Traceback" not in done.stderr
    assert list((run / "checkpoints").iterdir()) == []  # the temporary file went with the error
    assert json.loads((run / "metrics.json").read_text())["status"] == "failed"


@pytest.fixture
def tmpfs_for_one_checkpoint(trained: dict, tmp_path: Path):
    """A tmpfs with room for one checkpoint and a half: the second save cannot fit beside the first."""
    mount = tmp_path / "disk"
    mount.mkdir()
    size = Path(trained["last_checkpoint"]).stat().st_size * 3 // 2
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'}); "
                    "test_a_file_size_limit_ends_the_run_with_one_line covers EFBIG")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_resuming_a_finished_run_with_the_same_limits_is_one_line_not_a_silent_no_op(demo_args: list[str],
                                                                                      trained: dict, tmp_path: Path):
    # the fit trained nothing, wrote no checkpoint, said nothing, and the run's status was "completed"
    epochs = load_checkpoint_file(trained["last_checkpoint"])["loops"]["fit_loop"]["epoch_progress"]["current"]
    again = _train_py(_smoke(demo_args, f"ckpt_path={trained['last_checkpoint']}", f"hydra.run.dir={tmp_path / 'a'}"))
    assert again.returncode == 2, again.stderr[-3000:]
    line = again.stderr.strip().splitlines()[-1]
    assert f"has trained {epochs['processed']} epoch(s), trainer.max_epochs={epochs['processed']} already: nothing " \
           "is left to train" in line and "(allowed: trainer.max_epochs above" in line, line


def test_a_full_disk_keeps_the_previous_last_ckpt_and_it_resumes(demo_args: list[str], tmpfs_for_one_checkpoint: Path,
                                                                 tmp_path: Path) -> None:
    run = tmpfs_for_one_checkpoint / "run"
    done = _train_py(_smoke(demo_args, f"hydra.run.dir={run}", "checkpoint.save_top_k=0", "trainer.max_epochs=3",
                            "trainer.limit_train_batches=1"))
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    print(f"\n{last}")
    assert last.startswith(f"cltrain: error: cannot write last.ckpt in {run / 'checkpoints'}: no space left on the "
                           "device; it needs 3,")
    assert last.endswith("free; last.ckpt keeps its previous content") and "Traceback" not in done.stderr
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["last.ckpt"]
    assert load_checkpoint_file(run / "checkpoints" / "last.ckpt")["global_step"] == 1  # epoch 0's, whole

    resumed = _train_py(_smoke(demo_args, f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "trainer.max_epochs=2",
                               "trainer.limit_train_batches=1", f"hydra.run.dir={tmp_path / 'resumed'}"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["global_step"] == 2 and _first_step(tmp_path / "resumed") == 1


def test_a_checkpoint_folder_made_read_only_mid_run_is_one_line(demo_args: list[str], tmp_path: Path) -> None:
    # 106 lines: the save's PermissionError, then the exception-time save's into the same folder, chained, the last
    # line naming that second save's temporary file
    probe = tmp_path / "probe"
    probe.mkdir()
    if subprocess.run(["mount", "--bind", str(probe), str(probe)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here (needs the right to mount)")
    subprocess.run(["umount", str(probe)], check=False)
    run = tmp_path / "run"
    try:
        done = _train_py(_smoke(demo_args, f"hydra.run.dir={run}", "checkpoint.save_top_k=0", "trainer.max_epochs=3",
                                "trainer.limit_train_batches=1",
                                "+callbacks.ro._target_=tests.helpers.read_only.ReadOnlyCheckpoints",
                                f"+callbacks.ro.folder={run / 'checkpoints'}"))
    finally:
        subprocess.run(["umount", str(run / "checkpoints")], check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"cltrain: error: cannot write last.ckpt in {run / 'checkpoints'}: read-only file system for this process; "
        "last.ckpt keeps its previous content; make the folder writable, or write elsewhere")
    assert load_checkpoint_file(run / "checkpoints" / "last.ckpt")["global_step"] == 1  # epoch 0's, whole
    assert json.loads((run / "metrics.json").read_text())["status"] == "failed"


# --- another filesystem for $TMPDIR, and kill -9 ---------------------------------------------------


@pytest.fixture
def other_fs_tmpdir(tmp_path: Path):
    if not OTHER_FS.is_dir() or not os.access(OTHER_FS, os.W_OK):
        pytest.skip(f"no second writable filesystem for $TMPDIR ({OTHER_FS} is missing or read-only)")
    if os.stat(OTHER_FS).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip(f"{OTHER_FS} and {tmp_path} are one filesystem: a save there is a rename anyway")
    tmpdir = Path(tempfile.mkdtemp(dir=OTHER_FS, prefix="cltrain-tmpdir-"))
    yield tmpdir
    shutil.rmtree(tmpdir, ignore_errors=True)


_WITH_LIGHTNINGS_IO = ("import sys; import cltrain.app.train as t; from lightning.fabric.plugins import TorchCheckpointIO; "
                       "t.AtomicCheckpointIO = TorchCheckpointIO; sys.argv[0] = 'train.py'; "
                       "from cltrain.app.cli import main; main()")


def _poll_app(demo_args: list[str], run: Path, tmpdir: Path, lightnings_io: bool, epochs: int = 6) -> dict:
    """train.py saving last.ckpt every epoch (one step each) with $TMPDIR on ``tmpdir``; a poller watches it."""
    last, stop = run / "checkpoints" / "last.ckpt", run.parent / f"{run.name}.stop"
    poller = warm.Popen([sys.executable, str(POLLER), str(last), str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        assert poller.stdout.readline().strip() == "polling"
        command = [sys.executable, "-c", _WITH_LIGHTNINGS_IO] if lightnings_io else [sys.executable, str(REPO / "train.py")]
        done = warm.run([*command, *_smoke(demo_args, f"hydra.run.dir={run}", f"trainer.max_epochs={epochs}",
                                           "trainer.limit_train_batches=1", resnet18=True)],
                        capture_output=True, text=True, cwd=REPO, env=_env(TMPDIR=str(tmpdir)), timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        stop.touch()
        counts = json.loads(poller.communicate(timeout=60)[0].splitlines()[-1])
    counts["final_size"] = last.stat().st_size
    print(f"\n{'TorchCheckpointIO' if lightnings_io else 'AtomicCheckpointIO'} (python train.py, {epochs} saves, "
          f"TMPDIR={tmpdir}, run dir {run}): {counts}")
    return counts


@pytest.mark.slow
def test_train_py_never_shows_an_empty_or_partial_last_ckpt(demo_args: list[str], other_fs_tmpdir: Path,
                                                           tmp_path: Path) -> None:
    atomic = _poll_app(demo_args, tmp_path / "atomic", other_fs_tmpdir, lightnings_io=False)
    assert atomic["complete"] > 0 and atomic["empty"] == 0 and atomic["partial"] == 0
    assert atomic["min_size"] >= atomic["final_size"] - 4096
    assert _temps(tmp_path / "atomic" / "checkpoints") == [] and list(other_fs_tmpdir.iterdir()) == []
    # Negative control: the same run with Lightning's own CheckpointIO.
    plain = _poll_app(demo_args, tmp_path / "lightning", other_fs_tmpdir, lightnings_io=True)
    assert plain["empty"] + plain["partial"] > 0 and plain["min_size"] < plain["final_size"] // 2


def _start(demo_args: list[str], run: Path, tmpdir: Path, *overrides: str) -> subprocess.Popen:
    return warm.Popen([sys.executable, str(REPO / "train.py"),
                       *_smoke(demo_args, f"hydra.run.dir={run}", "trainer.max_epochs=1000",
                               "trainer.limit_train_batches=1", *overrides, resnet18=True)],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                      env=_env(TMPDIR=str(tmpdir)))


def _kill_at_some_moment(proc: subprocess.Popen, checkpoints: Path, mid_save: bool, rng: random.Random) -> None:
    deadline = time.monotonic() + 240
    while not (checkpoints / "last.ckpt").exists():  # one save done
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.02)
    if mid_save:  # while a save's temporary file is being written
        while not _temps(checkpoints):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(rng.uniform(0.0, 0.05))
    else:
        time.sleep(rng.uniform(0.0, 3.0))
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)


@pytest.mark.slow
def test_kill_9_at_random_moments_leaves_a_last_ckpt_that_resumes(demo_args: list[str], other_fs_tmpdir: Path,
                                                                  tmp_path: Path) -> None:
    rng = random.Random(19)
    source: Path | None = None
    left = 0
    for attempt in range(2):  # a kill in the middle of a save, then one at any moment of the resumed run
        run = tmp_path / f"run{attempt}"
        resume = [f"ckpt_path={source / 'checkpoints' / 'last.ckpt'}"] if source else []
        proc = _start(demo_args, run, other_fs_tmpdir, *resume)
        _kill_at_some_moment(proc, run / "checkpoints", mid_save=attempt != 1, rng=rng)
        state = load_checkpoint_file(run / "checkpoints" / "last.ckpt")  # whole, whatever the moment
        assert state["global_step"] >= 1 and state["optimizer_states"]
        left += len(_temps(run / "checkpoints"))
        if source is not None:  # it resumed: its first step is the checkpoint's
            assert _first_step(run) == load_checkpoint_file(source / "checkpoints" / "last.ckpt")["global_step"]
        source = run
    print(f"\nkill -9: 2 kills, {left} in the middle of a save; every last.ckpt loaded and resumed")
    assert left >= 1  # at least one kill landed in the middle of a save

    step = load_checkpoint_file(source / "checkpoints" / "last.ckpt")["global_step"]
    leftover = _temps(source / "checkpoints")
    until = [f"trainer.max_epochs={step + 1}", "trainer.limit_train_batches=1"]
    final = _train_py(_smoke(demo_args, f"ckpt_path={source / 'checkpoints' / 'last.ckpt'}", *until,
                             f"hydra.run.dir={tmp_path / 'final'}", resnet18=True), env=_env(TMPDIR=str(other_fs_tmpdir)))
    assert final.returncode == 0, final.stderr[-3000:]
    metrics = json.loads((tmp_path / "final" / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["global_step"] == step + 1
    assert _first_step(tmp_path / "final") == step
    # killed twice (once inside a save) and resumed, it ends bit for bit where the run never killed ends
    whole = _train_py(_smoke(demo_args, *until, f"hydra.run.dir={tmp_path / 'whole'}", resnet18=True))
    assert whole.returncode == 0, whole.stderr[-3000:]
    a, b = (load_checkpoint_file(tmp_path / r / "checkpoints" / "last.ckpt") for r in ("final", "whole"))
    assert a["global_step"] == b["global_step"] == step + 1
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in b["state_dict"])
    for run in tmp_path.glob("run*"):  # each killed run's temporary file, removed by the run resuming from it
        assert _temps(run / "checkpoints") == []
    if leftover:
        assert (f"AtomicCheckpointIO: removed 1 temporary file(s) left in {source / 'checkpoints'} by a run that was "
                f"stopped while saving: {leftover[0].name}") in final.stdout + final.stderr
    assert list(other_fs_tmpdir.iterdir()) == []  # nothing staged in $TMPDIR
