"""train(cfg) end to end, in process, on a tiny demo folder: toggles, resume, evaluate-only, compile, seeds.

The configs are the real ones (``experiment=smoke`` on timm's ``test_resnet`` at 32 px, 4 training batches of 8),
composed with Hydra's compose API and shrunk further with overrides.
"""

from __future__ import annotations

import csv
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch

from cltrain import is_channels_last
from cltrain.app.cli import compose_config
from cltrain.app.config import ConfigError
from cltrain.app.module import ImageClassifier
from cltrain.app.schedule import lr_at
from cltrain.app.train import train
from cltrain.check import checking
from tests.helpers import SMOKE, TINY_DEMO as DEMO





def tiny(demo_root: Path, run_dir: Path, *overrides: str) -> dict:
    """Compose the smoke experiment on the tiny demo folder and train it."""
    demo = [f"data.demo.{k}={v}".replace(" ", "") for k, v in DEMO.items()]
    cfg = compose_config([*SMOKE, f"data.root={demo_root}", *demo, f"run_dir={run_dir}", "device=cpu",
                          "trainer.enable_progress_bar=false", *overrides])
    return train(cfg)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _state(ckpt: str | Path) -> dict:
    return torch.load(ckpt, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("amp", [True, False])
def test_toggles_train_end_to_end(demo_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  channels_last: bool, amp: bool) -> None:
    seen: list[tuple[bool, torch.dtype]] = []
    step = ImageClassifier.training_step

    def spy(self, batch, batch_idx):
        if not checking():  # not the first-batch layout check's copies
            seen.append((is_channels_last(batch[0]), batch[0].dtype))
        return step(self, batch, batch_idx)

    monkeypatch.setattr(ImageClassifier, "training_step", spy)
    metrics = tiny(demo_root, tmp_path / "run", f"channels_last={channels_last}", f"amp={amp}")

    assert metrics["precision"] == ("bf16-mixed" if amp else "32-true")
    assert seen == [(channels_last, torch.float32)] * 4  # the NHWC data path, or the plain NCHW baseline
    assert metrics["global_step"] == 4 and metrics["images_per_second"] > 0 and metrics["step_time_s"] > 0
    assert 0 <= metrics["val_top1"] <= 100 and metrics["val_top5"] == 100.0  # 4 classes: top-5 is top-4
    checks = metrics["layout_check"]
    assert (checks["train"]["verdict"], checks["eval"]["verdict"]) == ("passed", "passed") if channels_last else checks == {}
    on_disk = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert on_disk["val_top1"] == metrics["val_top1"] and on_disk["config"]["channels_last"] is channels_last
    weight = _state(metrics["last_checkpoint"])["state_dict"]["model.layer1.0.conv1.weight"]
    assert is_channels_last(weight) is channels_last


def test_resume_continues_step_count_schedule_and_layout(demo_root: Path, tmp_path: Path) -> None:
    first = tiny(demo_root, tmp_path / "a", "trainer.max_epochs=1")
    assert (first["global_step"], first["epochs"]) == (4, 1)
    second = tiny(demo_root, tmp_path / "b", f"ckpt_path={first['last_checkpoint']}", "trainer.max_epochs=2",
                  "optim.milestones=[1]")
    assert (second["global_step"], second["epochs"]) == (8, 2)

    # The schedule went on from step 4: the lr logged at steps 4..7 is lr_at(step) (warm-up 1 epoch, x0.1 from epoch 1).
    rows = [r for r in csv.DictReader(open(tmp_path / "b" / "csv" / "metrics.csv")) if r.get("lr-SGD")]
    logged = {int(r["step"]): float(r["lr-SGD"]) for r in rows}  # LearningRateMonitor's column
    assert min(logged) == 4
    for s, lr in logged.items():
        assert lr == pytest.approx(lr_at(s, 4, second["lr"], warmup_epochs=1, milestones=[1]))

    state = _state(second["last_checkpoint"])
    assert is_channels_last(state["state_dict"]["model.layer1.0.conv1.weight"])
    momentum = [s["momentum_buffer"] for s in state["optimizer_states"][0]["state"].values() if s["momentum_buffer"].dim() == 4]
    assert momentum and all(is_channels_last(m) for m in momentum)


def test_evaluate_only_from_a_checkpoint_and_from_weights(demo_root: Path, tmp_path: Path) -> None:
    trained = tiny(demo_root, tmp_path / "a")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        evaluated = tiny(demo_root, tmp_path / "b", "evaluate_only=true", f"ckpt_path={trained['last_checkpoint']}")
    assert not [w for w in said if "dirpath has changed" in str(w.message)]  # no checkpoint callback took its state
    assert evaluated["global_step"] == 0 and evaluated["images_per_second"] is None
    assert evaluated["val_top1"] == trained["val_top1"] and evaluated["val_images_per_second"] > 0
    assert not (tmp_path / "b" / "checkpoints").exists()

    weights = tmp_path / "weights.pth"
    torch.save({k.removeprefix("model."): v for k, v in _state(trained["last_checkpoint"])["state_dict"].items()
                if k.startswith("model.")}, weights)
    from_weights = tiny(demo_root, tmp_path / "c", "evaluate_only=true", f"model.pretrained={weights}")
    assert from_weights["val_top1"] == trained["val_top1"]


def test_compile_after_the_layout_conversion(demo_root: Path, tmp_path: Path) -> None:
    seen = _Records()  # the eager backend names the compile options it was handed and ignores
    logging.getLogger("torch._dynamo.backends.debugging").addHandler(seen)
    try:
        metrics = tiny(demo_root, tmp_path / "run", "compile.enabled=true", "compile.backend=eager",
                       "compile.mode=max-autotune-no-cudagraphs")
    finally:
        logging.getLogger("torch._dynamo.backends.debugging").removeHandler(seen)
    assert "{'mode': 'max-autotune-no-cudagraphs'}" in " ".join(seen.messages)
    assert metrics["global_step"] == 4 and metrics["compile"] is True
    state = _state(metrics["last_checkpoint"])["state_dict"]
    assert not any("_orig_mod" in k for k in state)  # compiled in place: checkpoints load into a plain model
    assert is_channels_last(state["model.conv1.0.weight"])


def test_seed_and_deterministic_runs_repeat(demo_root: Path, tmp_path: Path) -> None:
    runs = [tiny(demo_root, tmp_path / f"run{i}", "trainer.deterministic=true", "seed=7", "amp=false") for i in range(2)]
    assert runs[0]["val_loss"] == runs[1]["val_loss"] and runs[0]["train_top1"] == runs[1]["train_top1"]
    # a real number, the one the csv logger holds (logged per epoch only: "train/top1", with no "_epoch" suffix)
    rows = [r for r in csv.DictReader(open(tmp_path / "run0" / "csv" / "metrics.csv")) if r.get("train/top1")]
    assert 0 <= runs[0]["train_top1"] <= 100 and runs[0]["train_top1"] == round(100 * float(rows[-1]["train/top1"]), 3)


def test_an_existing_run_directory_is_never_overwritten(demo_root: Path, tmp_path: Path) -> None:
    tiny(demo_root, tmp_path / "run")
    before = (tmp_path / "run" / "metrics.json").read_bytes()
    with pytest.raises(ConfigError, match=r"run_dir=.*holds an earlier run \(checkpoints, csv, metrics.json\)"):
        tiny(demo_root, tmp_path / "run")
    assert (tmp_path / "run" / "metrics.json").read_bytes() == before


def test_a_missing_split_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "data" / "val" / "a").mkdir(parents=True)
    cfg = compose_config([*SMOKE, "data=imagenet", f"data.root={tmp_path / 'data'}",
                          f"run_dir={tmp_path / 'run'}", "device=cpu"])
    with pytest.raises(ConfigError, match=r"data.root=.*train"):
        train(cfg)


def test_last_checkpoint_is_the_final_step_when_validation_stops_improving(demo_root: Path, tmp_path: Path) -> None:
    # lr ~ 0: validation top-1 never improves after epoch 0 (BatchNorm's running statistics still move: seed 3
    # gives crops where they do not lift it; asserted below), so the best checkpoint stays at step 2;
    # last.ckpt must still hold the final step (Lightning's save_last with a monitor would leave it at step 2).
    metrics = tiny(demo_root, tmp_path / "run", "trainer.max_epochs=3", "trainer.limit_train_batches=2",
                   "optim.lr=1e-12", "amp=false", "tf32=false", "trainer.benchmark=false", "seed=3")
    assert metrics["status"] == "completed" and metrics["global_step"] == 6
    assert Path(metrics["best_checkpoint"]).name == "best-epoch000.ckpt"  # the stall really happened
    assert list(metrics["best_checkpoints"]) == [metrics["best_checkpoint"]]  # checkpoint.save_top_k=1
    assert metrics["last_checkpoint"] == str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert _state(metrics["last_checkpoint"])["global_step"] == 6
    assert _state(metrics["best_checkpoint"])["global_step"] == 2
    # The CUDA math switches are applied process-wide and recorded (issue 9).
    assert (metrics["tf32"], metrics["cudnn_benchmark"], metrics["float32_matmul_precision"]) == (False, False, "highest")
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cudnn.benchmark
    on = tiny(demo_root, tmp_path / "on", "trainer.max_steps=1")
    assert (on["tf32"], on["cudnn_benchmark"], on["float32_matmul_precision"]) == (True, True, "high")
    assert torch.backends.cudnn.allow_tf32 and torch.get_float32_matmul_precision() == "high"


def test_an_exception_mid_epoch_leaves_a_resumable_last_checkpoint(demo_root: Path, tmp_path: Path) -> None:
    # A huge learning rate turns the weights to inf after the first step; anomaly detection then raises
    # in the backward pass of a later step: a real error in the middle of an epoch.
    with pytest.raises(RuntimeError, match="nan|NaN|inf"):
        tiny(demo_root, tmp_path / "run", "optim.lr=1e30", "amp=false", "+trainer.detect_anomaly=true",
             "trainer.max_epochs=2")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["status"] == "failed" and "RuntimeError" in metrics["error"]
    state = _state(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert state["global_step"] == metrics["global_step"] >= 1 and state["optimizer_states"]


def test_a_pinned_nchw_layout_reports_the_layout_it_kept(demo_root: Path, tmp_path: Path) -> None:
    metrics = tiny(demo_root, tmp_path / "run", "channels_last_layout=contiguous", "trainer.max_steps=3")
    weight = _state(metrics["last_checkpoint"])["state_dict"]["model.conv1.0.weight"]
    kept = "channels_last" if is_channels_last(weight) else "contiguous"
    assert kept == "contiguous" and metrics["layout"] == kept and metrics["layout_decisions"] == []
    on_disk = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert on_disk["layout"] == kept


def test_weights_that_turn_non_finite_in_the_last_step_of_an_epoch_are_not_saved(demo_root: Path, tmp_path: Path) -> None:
    # One step per epoch and no print steps: the loss read at epoch 1's only step is still finite (it comes
    # from epoch 0's weights), then that step's update (lr x inf from epoch 1) makes the weights non-finite.
    # Only the epoch-end weight check sees it, before the epoch-end last.ckpt would save them.
    from cltrain.app.finite import NonFiniteLossError

    with pytest.raises(NonFiniteLossError, match=r"the weights are no longer finite at epoch 1, step 2"):
        tiny(demo_root, tmp_path / "run", "amp=false", "trainer.limit_train_batches=1", "trainer.max_epochs=3",
             "optim.milestones=[1]", "optim.gamma=inf", "optim.warmup_epochs=0", "print_freq=0")
    state = _state(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert state["global_step"] == 1 and state["epoch"] == 0
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["status"] == "failed"


def test_the_races_lines_name_the_apps_own_override(demo_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    from cltrain.timing.layout_race import LayoutDecision, LayoutRace

    with caplog.at_level(logging.INFO):
        short = tiny(demo_root, tmp_path / "short")  # 4 steps: the race has not decided when training ends
    assert "training ended before the race of the layouts decided (4 step(s) of it run): channels_last kept" \
        in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):  # its checkpoint holds the race under way; an evaluation trains nothing
        tiny(demo_root, tmp_path / "evaluated", "evaluate_only=true", f"ckpt_path={short['last_checkpoint']}")
    assert "training ended" not in caplog.text
    caplog.clear()
    monkeypatch.setattr(LayoutRace, "judge", lambda self: LayoutDecision(
        self._heats[self._last].key, "contiguous", "timed", {"channels_last": 0.2, "contiguous": 0.1},
        {"channels_last": 2, "contiguous": 1}))
    with caplog.at_level(logging.INFO):
        metrics = tiny(demo_root, tmp_path / "decided", "trainer.max_epochs=2")  # judged after the 7th step
    assert metrics["layout"] == "contiguous"
    assert "pin it with channels_last_layout=contiguous)" in caplog.text  # what `python train.py` takes
    assert "training ended before" not in caplog.text


def test_a_max_steps_stop_in_the_middle_of_an_epoch_resumes_there_bit_for_bit(demo_root: Path, tmp_path: Path) -> None:
    pin = "channels_last_layout=channels_last"  # the race times: two runs could keep different layouts
    whole = tiny(demo_root, tmp_path / "whole", pin, "trainer.max_epochs=2")
    stopped = tiny(demo_root, tmp_path / "stopped", pin, "trainer.max_epochs=2", "trainer.max_steps=3")
    assert stopped["global_step"] == 3 and whole["global_step"] == 8  # 4 batches an epoch
    assert (stopped["epochs"], whole["epochs"]) == (0, 2)  # the epochs trained to their end
    resumed = tiny(demo_root, tmp_path / "resumed", pin, "trainer.max_epochs=2", f"ckpt_path={stopped['last_checkpoint']}")
    # Lightning counted the stopped epoch as processed: the resumed run began epoch 1 and ended at step 7
    assert resumed["global_step"] == 8
    ours, theirs = _state(resumed["last_checkpoint"])["state_dict"], _state(whole["last_checkpoint"])["state_dict"]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_resuming_with_another_model_is_one_line_before_the_run_starts(demo_root: Path, tmp_path: Path) -> None:
    written = tiny(demo_root, tmp_path / "first", "trainer.max_steps=1")
    with pytest.raises(ConfigError) as raised:  # a traceback listing every mismatch from Lightning's load before
        tiny(demo_root, tmp_path / "second", "model.name=test_efficientnet", f"ckpt_path={written['last_checkpoint']}")
    assert "holds the weights of another model than model.name builds here (model." in str(raised.value)
    assert not (tmp_path / "second" / "checkpoints").exists()  # nothing written: the directory can be used again


def test_a_batch_of_one_that_batchnorm_refuses_is_the_batch_size_s_one_line(demo_root: Path, tmp_path: Path) -> None:
    # the smoke model at 32 px: its last BatchNorm sees a 1x1 map, one value per channel in a batch of one image
    with pytest.raises(ConfigError, match=r"^data\.batch_size=1: a BatchNorm layer .* \[1, \d+, 1, 1\].*"
                                          r"data\.batch_size=2 or more") as info:
        tiny(demo_root, tmp_path / "run", "data.batch_size=1")
    assert "\n" not in str(info.value)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["status"] == "failed"


def test_a_data_error_found_at_setup_leaves_no_checkpoint_and_the_retry_may_use_the_folder(demo_root: Path,
                                                                                          tmp_path: Path) -> None:
    import shutil

    from cltrain.data import BadImageError

    data = tmp_path / "data"
    shutil.copytree(demo_root, data)
    first_class = sorted(p for p in (data / "val").iterdir() if p.is_dir())[0]
    (first_class / "00_empty.jpg").write_bytes(b"")
    with pytest.raises(BadImageError, match="00_empty.jpg"):
        tiny(data, tmp_path / "run", "data.bad_files=raise", "channels_last_layout=channels_last")
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained: no step-0 checkpoint
    failed = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert failed["status"] == "failed" and failed["layout"] == "channels_last"  # the pin, though nothing converted
    again = tiny(data, tmp_path / "run", "data.bad_files=skip", "trainer.max_steps=1")  # the same folder
    assert again["status"] == "completed" and again["global_step"] == 1
    with pytest.raises(BadImageError, match="00_empty.jpg"):  # an evaluation's metrics.json says it failed too
        tiny(data, tmp_path / "eval", "evaluate_only=true", f"ckpt_path={again['last_checkpoint']}")
    failed = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert failed["status"] == "failed" and failed["layout"] is None  # "auto": not decided before the failure
    assert failed["channels_last"] is None  # nor contiguous (a sweep report said so)


def test_early_stopping_with_a_max_steps_stop_in_the_middle_of_an_epoch(demo_root: Path, tmp_path: Path) -> None:
    # the epoch a max_steps stop ends is not validated: the preset's check at an epoch's end raised for val/top1
    metrics = tiny(demo_root, tmp_path / "run", "callbacks=[default,early_stopping]", "trainer.max_steps=1")
    assert metrics["status"] == "completed" and metrics["global_step"] == 1 and metrics["val_top1"] is not None
