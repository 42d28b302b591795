"""scripts.bench.hf_trainer --tiny times both layouts under a real Trainer and prints the table."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from scripts.bench import hf_trainer as bench  # noqa: E402


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_tiny_run_times_both_layouts_and_prints_the_table(capsys: pytest.CaptureFixture[str], device: str) -> None:
    rows = bench.main(["--tiny", "--models", "resnet", "--precision", "fp32", "--device", device])
    assert [row["model"] for row in rows] == ["resnet"]
    rate = rows[0]["rate"]
    assert rate["contiguous"] > 0 and rate["channels_last"] > 0
    assert rows[0]["ratio"] == pytest.approx(rate["channels_last"] / rate["contiguous"])
    assert all(len(r) == 1 for r in rows[0]["rounds"].values())
    out = capsys.readouterr().out
    assert out.startswith("Machine: CPU") and "| resnet |" in out and "channels_last / NCHW" in out
    assert f"\n{device}, fp32, batch " in out or f" {device}, fp32, batch " in out, out


def test_unknown_models_are_refused() -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "resnet,alexnet"])
