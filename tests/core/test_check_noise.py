"""The noise reference (an NCHW run with nudged weights) measures only the events the check needs: a second fault
that shows only after the first one's fallback still gets its own noise measured and is found, not passed as noise;
on the reference's values (``cltrain.check.isolation``) both show in the first run and one noise run serves both."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cltrain.check.compare as compare
from cltrain import to_channels_last
from tests.helpers.user_code import SpaceToDepth


class TwoFaults(nn.Module):
    """Two hand-written NCHW readers, one after the other: without the reference's values the second shows only
    once the first runs in NCHW."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = SpaceToDepth()
        self.mid = nn.Conv2d(32, 8, 3, padding=1)
        self.b = SpaceToDepth()
        self.body = nn.Conv2d(32, 16, 3, padding=1)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b(self.mid(self.a(self.stem(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.body(x)), 1), 1))


@pytest.mark.parametrize("isolate", [True, False])
def test_each_fault_gets_its_noise_and_the_noise_runs_measure_only_what_is_compared(monkeypatch, isolate) -> None:
    monkeypatch.setattr(compare, "_ISOLATE", isolate)
    torch.manual_seed(0)
    model = to_channels_last(TwoFaults())
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    runs: list[tuple[bool, int | None, int]] = []
    execute = compare.execute

    def counted(*args, **kwargs):
        run = execute(*args, **kwargs)
        only = kwargs.get("only")
        runs.append((bool(kwargs.get("perturb")), None if only is None else len(only), len(run.signatures)))
        return run

    monkeypatch.setattr(compare, "execute", counted)

    def step(m: nn.Module, layout: str) -> torch.Tensor:
        inputs = x if layout == "contiguous" else x.contiguous(memory_format=torch.channels_last)
        return F.cross_entropy(m(inputs), y)

    result = compare.check_layout(model, step, time_fallbacks=False)
    assert result.verdict == "fallback"
    assert {f.module for f in result.fallbacks} == {"a", "b"}, [f.describe() for f in result.fallbacks]
    full = max(events for perturbed, _, events in runs if not perturbed)
    noise = [(only, events) for perturbed, only, events in runs if perturbed]
    # on the reference's values each fault shows in the first run; otherwise the second asks for its own noise
    assert len(noise) == 1 if isolate else len(noise) >= 2, noise
    assert all(only is not None and events < full for only, events in noise), (noise, full)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_float64_model_of_torchs_own_layers_passes(dtype) -> None:
    # precision="64-true": the signatures are float32 sums, judged against a float64 noise floor (1.4e-14): torch's
    # own Conv2d and BatchNorm2d "diverged in channels_last only" and whole models fell back to NCHW
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(16, 32, 4, 2, 1), nn.BatchNorm2d(32),
                        nn.LeakyReLU(0.2), nn.Conv2d(32, 64, 4, 2, 1), nn.BatchNorm2d(64), nn.LeakyReLU(0.2),
                        nn.Flatten(), nn.Linear(64 * 8 * 8, 1)).to(dtype)
    x = torch.randn(4, 3, 64, 64, dtype=dtype)
    model, xcl = to_channels_last(net), x.contiguous(memory_format=torch.channels_last)
    result = compare.check_layout(model, lambda m, layout: F.softplus(-m(x if layout == "contiguous" else xcl)).mean())
    assert result.verdict == "passed", result
