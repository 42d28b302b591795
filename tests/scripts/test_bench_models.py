"""scripts.bench.models: runs in quick mode on tiny models and writes sane CSV and markdown."""

import csv
import sys

import pytest
import torch

from cltrain.layout import to_channels_last_1d
from scripts.bench import models as bench
from tests.helpers import REPO
from tests.helpers import warm


def _check_rows(rows: list[dict], device: str = "cpu") -> None:
    for r in rows:
        assert r["device"] == device and "CPU" in r["machine"] and int(r["steps"]) >= 1
        for layout in ("contiguous", "channels_last"):
            median, low, high = (float(r[f"{layout}_{k}"]) for k in ("img_s", "min", "max"))
            assert 0 < low <= median <= high
        assert float(r["speedup"]) == pytest.approx(float(r["channels_last_img_s"]) / float(r["contiguous_img_s"]), rel=0.02)
        winner = "channels_last" if float(r["channels_last_img_s"]) > float(r["contiguous_img_s"]) else "contiguous"
        assert r["measured_winner"] == winner


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_quick_run_writes_checked_csv_and_markdown(tmp_path, device):
    out = tmp_path / "bench"
    amp = "fp16" if device == "cuda" else "bf16"
    proc = warm.run(
        [sys.executable, "-m", "scripts.bench.models", "--quick", "--device", device, "--models", "tinycnn", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=True,
    )
    assert "Machine: CPU" in proc.stdout and "torch " in proc.stdout

    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["kind"], r["dtype"]) for r in rows] == [("tinycnn", "image", "fp32"), ("tinycnn", "image", amp)]
    _check_rows(rows, device)
    for r in rows:
        assert r["batch_size"] == "2" and r["input_shape"] == "2x3x64x64" and r["steps"] == "1"
        for layout in ("contiguous", "channels_last"):
            assert float(r[f"auto_{layout}_ms"]) > 0
        assert r["auto_pick"] in ("channels_last", "contiguous")
        assert r["auto_matches"] == str(r["auto_pick"] == r["measured_winner"])

    markdown = (out / "results.md").read_text()
    assert "Machine: CPU" in markdown and "#### Images, 4-D" in markdown and "#### Video" not in markdown
    assert ("| model | input | dtype | contiguous img/s | channels_last img/s | speed-up | auto picks | matches winner |"
            in markdown)
    assert markdown.count("| tinycnn | 2x3x64x64 |") == 2


@pytest.mark.slow
def test_quick_run_times_a_video_model_and_the_1d_model(tmp_path):
    rows = bench.main(["--quick", "--device", "cpu", "--models", "mc3_18,m5", "--dtypes", "fp32", "--out", str(tmp_path)])
    by_model = {r["model"]: r for r in rows}
    assert (by_model["mc3_18"]["kind"], by_model["mc3_18"]["input_shape"]) == ("video", "2x3x4x32x32")
    assert (by_model["m5"]["kind"], by_model["m5"]["input_shape"]) == ("audio", "2x1x8000")
    _check_rows(rows)
    assert by_model["mc3_18"]["auto_pick"] in ("channels_last", "contiguous")
    if by_model["m5"]["auto_pick"] == "n/a":  # a cltrain whose auto mode does not time rank 3
        assert by_model["m5"]["auto_matches"] == "" and "| n/a | n/a |" in (tmp_path / "results.md").read_text()
    else:
        assert by_model["m5"]["auto_pick"] in ("channels_last", "contiguous")
    markdown = (tmp_path / "results.md").read_text()
    assert "#### Video clips, 5-D" in markdown and "channels_last_3d clips/s" in markdown
    assert "#### Audio, 1-D" in markdown and "| m5 | 2x1x8000 | fp32 |" in markdown
    assert "#### Images" not in markdown


def test_channels_last_1d_strides_for_activations_and_conv1d_weights():
    for shape in [(2, 1, 7), (2, 5, 7), (1, 5, 7)]:  # C == 1 and N == 1 too: `transpose().contiguous()` misses C == 1
        x = torch.randn(shape)
        y = to_channels_last_1d(x)
        n, c, length = shape
        assert y.stride() == (c * length, 1, c) and torch.equal(x, y)
        assert to_channels_last_1d(y) is y and to_channels_last_1d(x).stride() == y.stride()
    model = to_channels_last_1d(bench.m5(num_classes=10, channels=4))
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv1d)]
    assert len(convs) == 4
    for conv in convs:
        out_c, in_c, k = conv.weight.shape
        assert conv.weight.stride() == (in_c * k, 1, in_c)
    x = to_channels_last_1d(torch.randn(2, 1, 8000))
    assert model(x).shape == (2, 10)


def test_defaults_fit_the_device_and_quick_shrinks_them():
    args = bench.parse_args(["--device", "cpu"])
    assert (args.batch_size, args.image_size, args.warmup, args.steps, args.min_window) == (16, 160, 1, 2, 0.1)
    assert (args.clip_batch_size, args.frames, args.clip_size, args.audio_batch_size) == (4, 8, 112, 16)
    assert args.models == bench.ALL_MODELS and len(bench.ALL_MODELS) == 25
    assert {"vit_b_16", "r3d_18", "mc3_18", "r2plus1d_18", "s3d", "m5"} <= set(bench.ALL_MODELS)
    quick = bench.parse_args(["--device", "cpu", "--quick", "--models", "resnet18,tinycnn"])
    assert (quick.batch_size, quick.image_size, quick.steps, quick.min_window, quick.models) == (
        2, 64, 1, 0.0, ["resnet18", "tinycnn"])
    assert bench.input_shape("s3d", args) == ((4, 3, 16, 224, 224), "needs >= 16x224x224")
    assert bench.input_shape("r3d_18", args) == ((4, 3, 8, 112, 112), "")
    assert bench.input_shape("m5", args) == ((16, 1, 16000), "")


def test_rejects_vit_sizes(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--models", "vit_b_16", "--image-size", "100"])
    assert "multiple of 16" in capsys.readouterr().err
    model = bench.build_model("vit_b_16", 64)
    assert model.image_size == 64
