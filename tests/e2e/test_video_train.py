"""`python train.py experiment=video` end to end, in process, on a tiny moving-shapes demo: the app's
ImageClassifier, progress meter and ChannelsLast on 5-D (N, C, T, H, W) batches."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from cltrain.app.cli import compose_config
from cltrain.app.module import ImageClassifier
from cltrain.app.train import train
from cltrain.check import checking
from tests.helpers import warm

CL3D = torch.channels_last_3d
REPO = Path(__file__).resolve().parents[2]
DEMO = {"num_classes": 2, "train_per_class": 4, "val_per_class": 2, "num_frames": 6, "frame_size": 32}


def tiny_video(root: Path, run_dir: Path, *overrides: str) -> dict:
    demo = [f"data.demo.{k}={v}" for k, v in DEMO.items()]
    cfg = compose_config(["experiment=video", f"data.root={root}", *demo, "data.demo.any_root=true", f"run_dir={run_dir}", "device=cpu",
                          "data.batch_size=2", "data.num_workers=0", "data.num_frames=4", "data.frame_stride=1",
                          "data.image_size=32", "data.val_resize_size=32", "trainer=debug", "trainer.max_epochs=1", "trainer.limit_train_batches=2",
                          "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false", "print_freq=1",
                          "throughput_warmup=0", *overrides])
    return train(cfg)


@pytest.mark.parametrize("channels_last", [True, False])
def test_experiment_video_trains_with_the_toggles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture, channels_last: bool) -> None:
    seen: list[tuple[tuple[int, ...], bool, torch.dtype]] = []
    step = ImageClassifier.training_step

    def spy(self, batch, batch_idx):
        if not checking():  # not the first-batch layout check's copies
            seen.append((tuple(batch[0].shape), batch[0].is_contiguous(memory_format=CL3D), batch[0].dtype))
        return step(self, batch, batch_idx)

    monkeypatch.setattr(ImageClassifier, "training_step", spy)
    metrics = tiny_video(tmp_path / "demo", tmp_path / "run", f"channels_last={channels_last}", "amp=false")

    assert metrics["model"] == "r3d_18" and metrics["precision"] == "32-true"
    assert seen == [((2, 3, 4, 32, 32), channels_last, torch.float32)] * 2
    assert metrics["global_step"] == 2 and metrics["images_per_second"] > 0  # the progress meter counts clips
    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cltrain: val top-1")]
    assert len(summary) == 1 and " clips/s, " in summary[0] and "images/s" not in summary[0]
    assert 0 <= metrics["val_top1"] <= 100
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["config"]["data"]["num_frames"] == 4
    state = torch.load(metrics["last_checkpoint"], map_location="cpu", weights_only=True)["state_dict"]
    weight = state["model.layer1.0.conv1.0.weight"]
    assert weight.dim() == 5 and weight.is_contiguous(memory_format=CL3D) is channels_last
    assert (tmp_path / "demo" / "train" / "00_right").is_dir()  # the video demo, generated on first use


def test_amp_on_the_cpu_with_conv3d_guards_the_shallow_convs_and_runs_bf16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # bf16 Conv3d weight gradients on this CPU are wrong or not finite for inputs shallower than the kernel
    # (4-frame clips reach depth 2 in layer2): the guardrail computes those calls in fp32, so the run completes
    # in bf16-mixed, its batches channels_last_3d through bf16 autocast.
    seen: list[tuple[bool, torch.dtype]] = []
    step = ImageClassifier.training_step

    def spy(self, batch, batch_idx):
        if not checking():  # not the first-batch layout check's copies
            seen.append((batch[0].is_contiguous(memory_format=CL3D), self.model(batch[0]).dtype))
        return step(self, batch, batch_idx)

    monkeypatch.setattr(ImageClassifier, "training_step", spy)
    with caplog.at_level(logging.INFO):
        tiny_video(tmp_path / "demo", tmp_path / "run", "amp=true")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["precision"] == "bf16-mixed" and metrics["status"] == "completed"
    assert "onednn-bf16-conv3d-weight-grad" in caplog.text
    assert "onednn-bf16-conv3d-weight-grad" in {g["fault"] for g in metrics["guardrails"]}  # recorded for the run
    assert seen and all(s == (True, torch.bfloat16) for s in seen)


def test_the_other_video_models_by_name(tmp_path: Path) -> None:
    metrics = tiny_video(tmp_path / "demo", tmp_path / "run", "model=mc3_18", "trainer.limit_train_batches=1")
    assert metrics["model"] == "mc3_18" and metrics["global_step"] == 1


@pytest.mark.slow
@pytest.mark.long
def test_the_video_demo_learns_motion_well_above_chance(tmp_path: Path) -> None:
    """The README's command as a user runs it (about 3 minutes here): ``python train.py experiment=video``
    from an empty folder, the demo written to ``data/video_demo`` there. Six motions, chance 16.7 %;
    this recipe reached 84-92 % on this machine (seeds 1 and 42). The first demo (class = shape x
    direction) reached 35 %, and 40.6 % with this recipe: r3d_18 learnt the direction and never the shape;
    this test fails on it (checked)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)
    done = warm.run([sys.executable, str(REPO / "train.py"), "experiment=video", "device=cpu", "run_dir=run",
                     "trainer.enable_progress_bar=false"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    raced = metrics["layout_decisions"]  # the layout is the race's choice on this machine (channels_last untimed)
    assert metrics["model"] == "r3d_18" and metrics["epochs"] == 5
    assert metrics["layout"] == (raced[-1]["layout"] if raced else "channels_last"), (metrics["layout"], raced)
    assert metrics["val_top1"] >= 3 * 100 / 6, metrics["val_top1"]  # at least 3x chance


def test_an_unreadable_clip_is_named_or_skipped_and_listed(tmp_path: Path) -> None:
    from cltrain.data.video import ClipFolderDataModule, make_demo_videos

    root = make_demo_videos(tmp_path / "demo", **DEMO)
    bad = sorted((root / "train" / "00_right").iterdir())[1]
    (bad / "002.jpg").write_bytes(b"not a jpeg")  # one broken frame in one training clip
    with pytest.raises(ValueError, match=r"ClipFolderDataModule: bad_files='ignore' must be one of \('raise', 'skip'\)"):
        ClipFolderDataModule(root, bad_files="ignore")
    small = "model.name=mc3_18"  # a third of r3d_18's weights: this test is about the clips
    with pytest.raises(Exception, match=r"00_right.*cannot be read as a clip.*bad_files='skip'"):
        tiny_video(root, tmp_path / "raise", small, "trainer.limit_train_batches=null")
    # skip: the run goes on in real worker processes; the clip is listed in the run directory, once per epoch
    metrics = tiny_video(root, tmp_path / "skip", small, "data.bad_files=skip", "data.num_workers=2",
                         "trainer.limit_train_batches=null", "trainer.max_epochs=2")
    assert metrics["status"] == "completed" and metrics["global_step"] == 2 * (2 * 4 // 2)
    lines = (tmp_path / "skip" / "skipped_files.tsv").read_text().splitlines()
    assert lines and {tuple(line.split("\t")[:2]) for line in lines} == {("train", str(bad))}
    assert "002.jpg" in lines[0]  # the reason names the frame
