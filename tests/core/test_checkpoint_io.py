"""AtomicCheckpointIO with a real Trainer: every save and removal of ModelCheckpoint goes through it;
with $TMPDIR on another filesystem a poller never sees last.ckpt empty or partial (Lightning's own
CheckpointIO: it does); loads are weights_only, a payload never runs, a truncated file names the
checkpoints that load."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from tests.helpers.plain_modules import Classifier, loader

from cltrain.atomic import TEMP_PREFIX, _host_tag
from cltrain.checkpoint_io import (AtomicCheckpointIO, UnreadableCheckpointError, UnsafeCheckpointError,
                                   load_checkpoint_file)
from tests.helpers import warm

POLLER = Path(__file__).resolve().parents[1] / "helpers" / "checkpoint_poller.py"
OTHER_FS = Path("/dev/shm")


def _trainer(checkpoint: ModelCheckpoint, io: object | None, **kwargs) -> Trainer:
    return Trainer(callbacks=[checkpoint], plugins=[io] if io is not None else None, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, **kwargs)


class RecordingIO(AtomicCheckpointIO):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.calls.append(("save", Path(path).name))
        super().save_checkpoint(checkpoint, path, storage_options)

    def remove_checkpoint(self, path) -> None:
        self.calls.append(("remove", Path(path).name))
        super().remove_checkpoint(path)


class _Losing(Classifier):
    """Logs a loss that only grows, so ModelCheckpoint(mode="max") keeps the newest and removes the previous."""

    def training_step(self, batch, batch_idx):
        self.log("score", float(self.global_step))
        return super().training_step(batch, batch_idx)


def test_model_checkpoint_saves_and_removes_through_the_plugin(tmp_path: Path) -> None:
    io = RecordingIO()
    best = ModelCheckpoint(dirpath=tmp_path, filename="step{step}", monitor="score", mode="max", save_top_k=1,
                           every_n_train_steps=1, save_last=True, auto_insert_metric_name=False)
    trainer = _trainer(best, io, max_steps=3)
    trainer.fit(_Losing(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))), loader(n=12))
    assert trainer.strategy.checkpoint_io is io
    assert io.calls == [("save", "step1.ckpt"), ("save", "last.ckpt"),
                        ("save", "step2.ckpt"), ("remove", "step1.ckpt"), ("save", "last.ckpt"),
                        ("save", "step3.ckpt"), ("remove", "step2.ckpt"), ("save", "last.ckpt")]
    trainer.save_checkpoint(tmp_path / "manual.ckpt")
    assert io.calls[-1] == ("save", "manual.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "manual.ckpt", "step3.ckpt"]
    assert load_checkpoint_file(tmp_path / "last.ckpt")["global_step"] == 3


def _other_filesystem_tmpdir(tmp_path: Path) -> Path:
    if not OTHER_FS.is_dir() or not os.access(OTHER_FS, os.W_OK):
        pytest.skip(f"no second writable filesystem for $TMPDIR ({OTHER_FS} is missing or read-only)")
    if os.stat(OTHER_FS).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip(f"{OTHER_FS} and {tmp_path} are one filesystem: the save stays a rename there")
    return Path(tempfile.mkdtemp(dir=OTHER_FS, prefix="cltrain-tmpdir-"))


def _wide_net() -> torch.nn.Module:
    """Fast steps, a 37 MB checkpoint (weights and momentum): the time goes to saving."""
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 1500), torch.nn.Linear(1500, 4))


def _poll_while_saving(tmp_path: Path, io: object | None, monkeypatch: pytest.MonkeyPatch, steps: int = 8) -> dict:
    """Train, saving last.ckpt every step, with $TMPDIR on another filesystem; a separate process
    polls last.ckpt all along."""
    tmpdir = _other_filesystem_tmpdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))  # what Lightning's fsspec transaction stages in
    last, stop = tmp_path / "checkpoints" / "last.ckpt", tmp_path / "stop"
    poller = warm.Popen([sys.executable, str(POLLER), str(last), str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        assert poller.stdout.readline().strip() == "polling"
        checkpoint = ModelCheckpoint(dirpath=last.parent, filename="last", every_n_train_steps=1,
                                     enable_version_counter=False)
        _trainer(checkpoint, io, max_steps=steps).fit(Classifier(_wide_net()), loader(n=2 * steps, batch_size=2))
    finally:
        stop.touch()
        counts = json.loads(poller.communicate(timeout=60)[0].splitlines()[-1])
        leftovers = list(tmpdir.iterdir())
        shutil.rmtree(tmpdir, ignore_errors=True)
    counts["final_size"] = last.stat().st_size
    counts["tmpdir_leftovers"] = len(leftovers)
    print(f"\n{type(io).__name__ if io else 'TorchCheckpointIO'}: {counts}")
    return counts


def test_last_ckpt_is_never_empty_or_partial_with_tmpdir_on_another_filesystem(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _poll_while_saving(tmp_path, AtomicCheckpointIO(), monkeypatch)
    assert counts["complete"] > 100 and counts["empty"] == 0 and counts["partial"] == 0
    assert counts["min_size"] >= counts["final_size"] - 4096  # every file seen was a whole checkpoint
    assert counts["tmpdir_leftovers"] == 0 and not any(p.name.startswith(TEMP_PREFIX) for p in
                                                       (tmp_path / "checkpoints").iterdir())


def test_lightnings_own_checkpoint_io_shows_partial_files_there(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control of the test above: the same run with Lightning's TorchCheckpointIO."""
    counts = _poll_while_saving(tmp_path, None, monkeypatch)
    assert counts["empty"] + counts["partial"] > 0
    assert counts["min_size"] < counts["final_size"] // 2


@contextmanager
def _info_lines() -> Iterator[list[str]]:
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    from lightning.pytorch.utilities.rank_zero import rank_zero_module, rank_zero_only

    # rank_zero_info writes to the logger the last imported Lightning package named (pytorch_lightning, imported by
    # another test in this process, renames it); another test can also leave its level higher, it disabled (a logging
    # dictConfig) or this process's rank other than 0: each would drop the info line
    logger = rank_zero_module.log
    saved = logger.level, logger.disabled, getattr(rank_zero_only, "rank", 0)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.disabled, rank_zero_only.rank = False, 0
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.disabled, rank_zero_only.rank = saved[1], saved[2]


def _dead_pid() -> int:
    proc = warm.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_first_save_into_a_directory_removes_leftovers_of_killed_runs(tmp_path: Path) -> None:
    leftover = tmp_path / f"{TEMP_PREFIX}{_dead_pid()}-{_host_tag()}-0000-last.ckpt"
    leftover.write_bytes(b"half a checkpoint")
    with _info_lines() as lines:
        _trainer(ModelCheckpoint(dirpath=tmp_path, filename="last"), AtomicCheckpointIO(), max_steps=1).fit(
            Classifier(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))), loader(n=4))
    assert not leftover.exists() and (tmp_path / "last.ckpt").is_file()
    said = [line for line in lines if "temporary file" in line]
    assert said == [f"AtomicCheckpointIO: removed 1 temporary file(s) left in {tmp_path} by a run that was stopped "
                    f"while saving: {leftover.name}"]


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _payload_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """A Lightning-looking checkpoint whose unpickling runs a shell command (creates ``marker``)."""
    marker, path = tmp_path / "payload-ran", tmp_path / "downloaded.ckpt"
    torch.save({"state_dict": {}, "global_step": 0, "epoch": 0, "pytorch-lightning_version": "2.6.6",
                "hyper_parameters": {"note": _Payload(marker)}}, path)
    return path, marker


def test_a_payload_checkpoint_is_refused_and_does_not_run(tmp_path: Path) -> None:
    path, marker = _payload_checkpoint(tmp_path)
    with pytest.raises(UnsafeCheckpointError, match=rf"^{path}: refused to load: it holds posix.system outside") as err:
        _trainer(ModelCheckpoint(dirpath=tmp_path / "c"), AtomicCheckpointIO(), max_steps=1).fit(
            Classifier(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))), loader(n=4),
            ckpt_path=path)
    assert err.value.types == ["posix.system"] and "\n" not in str(err.value)
    assert not marker.exists()
    # Negative control: the same file loaded as the app's pre-check used to (weights_only=False) runs the payload.
    warm.run([sys.executable, "-c", f"import torch; torch.load({str(path)!r}, weights_only=False)"], check=True,
             capture_output=True)
    assert marker.exists()


def test_a_truncated_checkpoint_names_the_ones_that_load(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.zeros(1000)}}, tmp_path / "best-epoch000.ckpt")
    io.save_checkpoint({"global_step": 2, "state_dict": {"w": torch.zeros(1000)}}, tmp_path / "last.ckpt")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    torch.save({"w": torch.zeros(3)}, tmp_path / "weights.pt")  # a model's weights: loads, resumes nothing
    data = (tmp_path / "last.ckpt").read_bytes()
    (tmp_path / "last.ckpt").write_bytes(data[: len(data) // 2])  # cut by some other tool
    with pytest.raises(UnreadableCheckpointError) as err:
        io.load_checkpoint(tmp_path / "last.ckpt")
    assert str(err.value) == (f"{tmp_path / 'last.ckpt'}: not a readable checkpoint (incomplete: the file ends before "
                              f"the checkpoint does); checkpoints in {tmp_path} that load: best-epoch000.ckpt")
    assert err.value.loadable == [tmp_path / "best-epoch000.ckpt"]
    (tmp_path / "best-epoch000.ckpt").write_bytes(b"")
    with pytest.raises(UnreadableCheckpointError, match=rf"the file is empty\); no other checkpoint in {tmp_path} loads"):
        io.load_checkpoint(tmp_path / "best-epoch000.ckpt")


@pytest.mark.parametrize("mmap", [False, True])
def test_a_text_file_is_not_a_checkpoint_and_a_legacy_one_loads_mapped_or_not(tmp_path: Path, mmap: bool) -> None:
    # mapped, torch's line was "mmap can only be used with files saved with torch.save(_use_new_zipfile_...)";
    # unmapped, the weights_only unpickler's "Unsupported operand 110"
    from cltrain.checkpoint_io import load_checkpoint_file

    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(UnreadableCheckpointError, match=r"notes\.txt: not a readable checkpoint \(not a file written by "
                                                        r"torch\.save\); no other checkpoint"):
        load_checkpoint_file(tmp_path / "notes.txt", mmap=mmap)
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert torch.equal(load_checkpoint_file(tmp_path / "legacy.pt", mmap=mmap)["w"], torch.ones(2))


def test_weights_only_false_is_the_callers_explicit_choice(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    io.save_checkpoint({"when": __import__("datetime").date(2025, 1, 1)}, tmp_path / "a.ckpt")
    with pytest.raises(UnsafeCheckpointError, match="datetime.date"):
        io.load_checkpoint(tmp_path / "a.ckpt")
    assert io.load_checkpoint(tmp_path / "a.ckpt", weights_only=False)["when"].year == 2025


def test_remote_paths_keep_lightnings_fsspec_behaviour() -> None:
    import fsspec

    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 5}, "memory://cltrain-test/last.ckpt")
    fs = fsspec.filesystem("memory")
    assert fs.exists("/cltrain-test/last.ckpt")
    assert io.load_checkpoint("memory://cltrain-test/last.ckpt")["global_step"] == 5
    io.remove_checkpoint("memory://cltrain-test/last.ckpt")
    assert not fs.exists("/cltrain-test/last.ckpt")
