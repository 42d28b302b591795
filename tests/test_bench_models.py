"""scripts/bench_models.py: runs in quick mode on a tiny model and writes sane CSV, markdown and PNG."""

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_models.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_checked_csv_markdown_and_png(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--models", "tinycnn", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert "Machine: CPU" in proc.stdout and "torch " in proc.stdout

    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["dtype"]) for r in rows] == [("tinycnn", "fp32"), ("tinycnn", "bf16")]
    for r in rows:
        assert r["batch_size"] == "2" and r["image_size"] == "64" and r["device"] == "cpu" and "CPU" in r["machine"]
        for layout in ("contiguous", "channels_last"):
            median, low, high = (float(r[f"{layout}_{k}"]) for k in ("img_s", "min", "max"))
            assert 0 < low <= median <= high
            assert float(r[f"auto_{layout}_ms"]) > 0
        assert float(r["speedup"]) == pytest.approx(float(r["channels_last_img_s"]) / float(r["contiguous_img_s"]), rel=0.02)
        winner = "channels_last" if float(r["channels_last_img_s"]) > float(r["contiguous_img_s"]) else "contiguous"
        assert r["measured_winner"] == winner
        assert r["auto_pick"] in ("channels_last", "contiguous")
        assert r["auto_matches"] == str(r["auto_pick"] == winner)

    markdown = (out / "results.md").read_text()
    assert "Machine: CPU" in markdown
    assert "| model | dtype | contiguous img/s | channels_last img/s | speed-up | auto picks | matches winner |" in markdown
    assert markdown.count("| tinycnn |") == 2
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_defaults_fit_the_device_and_quick_shrinks_them():
    bench = load_script()
    args = bench.parse_args(["--device", "cpu"])
    assert (args.batch_size, args.image_size) == (16, 160) and args.models == bench.ALL_MODELS
    assert len(bench.ALL_MODELS) == 20 and "vit_b_16" in bench.ALL_MODELS
    quick = bench.parse_args(["--device", "cpu", "--quick", "--models", "resnet18,tinycnn"])
    assert (quick.batch_size, quick.image_size, quick.steps, quick.models) == (2, 64, 1, ["resnet18", "tinycnn"])


def test_rejects_unknown_models_and_vit_sizes(capsys):
    bench = load_script()
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--models", "resnet5"])
    assert "resnet5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--models", "vit_b_16", "--image-size", "100"])
    assert "multiple of 16" in capsys.readouterr().err
    model, _ = bench.build_model("vit_b_16", 64)
    assert model.image_size == 64
