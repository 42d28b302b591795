"""Picking the mixed precision by measurement: real training steps in each candidate, the faster that trains kept."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from cltrain.precision import PrecisionChoice, autocast_dtype, autocast_for
from cltrain.timing.precision import PrecisionTrial, choose_precision, time_precisions


class SlowUnder(nn.Module):
    """Identity that sleeps when autocast computes in ``dtype``: a precision without a fast kernel."""

    def __init__(self, dtype: torch.dtype | None, seconds: float = 0.05) -> None:
        super().__init__()
        self.dtype, self.seconds = dtype, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None) == self.dtype:
            time.sleep(self.seconds)
        return x


def _step_for(slow: torch.dtype | None, lr: dict[str, float] | None = None):
    """A step builder: a conv net trained by SGD under each flag's autocast, as the recipe's step does."""
    calls: list[str] = []

    def step_for(flag: str):
        if flag not in ("bf16-mixed", "32-true"):
            raise ValueError(f"no CPU step for {flag}")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), SlowUnder(slow), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=(lr or {}).get(flag, 0.01), momentum=0.9)
        x, y = torch.randn(4, 3, 12, 12), torch.tensor([0, 1, 2, 3])

        def step() -> torch.Tensor:
            calls.append(flag)
            with autocast_for("cpu", autocast_dtype(flag)):
                loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            return loss
        return step

    return step_for, calls


@pytest.mark.parametrize(("slow", "expected"), [(torch.bfloat16, "32-true"), (None, "bf16-mixed")])
def test_the_faster_precision_that_trains_is_picked(slow, expected):
    step_for, calls = _step_for(slow)
    trials = time_precisions(step_for, ["bf16-mixed", "32-true"], device="cpu", warmup=1, steps=2, rounds=3)
    assert [t.flag for t in trials] == ["bf16-mixed", "32-true"] and all(t.trained and t.steps == 7 for t in trials)
    slower = next(t for t in trials if t.flag != expected)
    assert slower.seconds_per_step > 0.05 > next(t for t in trials if t.flag == expected).seconds_per_step
    choice = choose_precision(trials)
    assert choice.flag == expected and "x faster" in choice.reason and "finite losses over 7 steps" in choice.reason
    # warm-up, then rounds in alternating order: A A B B, A A B B, then B B A A, A A B B
    assert calls[2:] == ["bf16-mixed"] * 2 + ["32-true"] * 2 + ["32-true"] * 2 + ["bf16-mixed"] * 2 + \
        ["bf16-mixed"] * 2 + ["32-true"] * 2


def test_a_precision_whose_loss_diverges_or_that_cannot_run_is_not_picked():
    # fp32 is the fast one here, but its learning rate sends the loss to inf/NaN within a few steps
    step_for, _ = _step_for(torch.bfloat16, lr={"32-true": 1e30})
    trials = time_precisions(step_for, ["16-mixed", "bf16-mixed", "32-true"], device="cpu", warmup=2, steps=2, rounds=1)
    fp16, bf16, fp32 = trials
    assert fp16.error.startswith("ValueError: no CPU step") and fp16.seconds_per_step is None and not fp16.trained
    assert bf16.trained and not fp32.finite and fp32.seconds_per_step is not None
    choice = choose_precision(trials)
    assert choice.flag == "bf16-mixed"
    assert "only one that trained" in choice.reason and "fp32 gave a non-finite loss" in choice.reason
    assert "fp16 + loss scaling failed (ValueError" in choice.reason


def test_bf16_wins_within_the_margin_and_a_fallback_when_nothing_trains():
    close = [PrecisionTrial("bf16-mixed", 0.0505, True, 9), PrecisionTrial("16-mixed", 0.0500, True, 9)]
    assert choose_precision(close).flag == "bf16-mixed"
    assert "within 3% of the fastest" in choose_precision(close).reason
    assert choose_precision(close, margin=0.0).flag == "16-mixed"
    apart = [PrecisionTrial("bf16-mixed", 0.056, True, 9), PrecisionTrial("16-mixed", 0.045, True, 9)]
    assert "fp16 + loss scaling, 1.24x faster (bf16 56.0 ms/step, fp16 + loss scaling 45.0 ms/step)" in \
        choose_precision(apart).reason
    none = [PrecisionTrial("bf16-mixed", None, False, 0, "OutOfMemoryError: CUDA out of memory"),
            PrecisionTrial("16-mixed", 0.04, False, 9)]
    choice = choose_precision(none, fallback=PrecisionChoice("bf16-mixed", "compute capability 9.0"))
    assert choice.flag == "bf16-mixed" and "bf16 failed (OutOfMemoryError" in choice.reason
    assert choice.reason.endswith("compute capability 9.0")
    with pytest.raises(ValueError, match="need trials"):
        choose_precision([])
