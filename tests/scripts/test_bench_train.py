"""scripts.bench.train --quick runs both parts and reports ratios."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.bench import train as bench


def test_bench_train_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
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


def test_plain_step_scales_fp16_losses_and_uses_the_modules_optimizer() -> None:
    # The plain loop once ran fp16 autocast without a GradScaler while Lightning's 16-mixed had one:
    # the Lightning / plain ratio then held more than framework overhead.
    import torch
    from torch import nn

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    batches = [(torch.randn(2, 3, 8, 8), torch.tensor([1, 2]))]
    step = bench.PlainStep(model, "16-mixed", torch.device("cpu"), batches, num_classes=10)
    expected = torch.optim.SGD  # ImageClassifier's default
    assert isinstance(step.optimizer, expected) and step.optimizer.param_groups[0]["params"][0] is model[0].weight
    y = torch.tensor([1, 2])
    # Inputs this large overflow the scaled fp16 gradients: a scaled step is skipped and the scale halves.
    before = model[0].weight.detach().clone()
    loss = step(torch.full((2, 3, 8, 8), 1e4), y)
    assert loss.dtype == torch.float32 and step.autocast_dtype == torch.float16
    assert step.scaler.get_scale() == 2.0**15 and torch.equal(before, model[0].weight)
    step(torch.randn(2, 3, 8, 8), y)  # a normal batch is stepped
    assert not torch.equal(before, model[0].weight) and torch.isfinite(model[0].weight).all()
    plain = bench.PlainStep(model, "32-true", torch.device("cpu"), batches, num_classes=10)
    assert plain.scaler is None and plain.autocast_dtype is None
