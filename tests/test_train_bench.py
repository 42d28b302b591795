"""scripts/bench_train.py --quick runs both parts and reports ratios."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_train.py"


def test_bench_train_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--quick", "--device", "cpu", "--out", str(tmp_path / "bench.json")])
    assert result["overhead"]["ratio"] > 0 and len(result["overhead"]["rounds"]["plain"]) == 1
    assert [r["config"] for r in result["end_to_end"]] == ["contiguous fp32", "channels_last + AMP"]
    assert result["end_to_end"][0]["speedup"] == 1.0
    out = capsys.readouterr().out
    assert "ratio Lightning / plain" in out and "| channels_last + AMP | bf16-mixed |" in out
    ref = result["plain_step_reference"]
    assert ref["speedup"] == pytest.approx(
        ref["channels_last + AMP images_per_second"] / ref["contiguous fp32 images_per_second"])
    assert "of the plain step's speed-up" in out
    assert (tmp_path / "bench.json").is_file()
