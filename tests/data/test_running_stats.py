"""``RunningStats``: the BatchNorm statistics before a step, held and put back, following buffers a move replaced."""

from __future__ import annotations

import torch
from torch import nn

from cltrain.data.running_stats import RunningStats


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm2d(4, affine=False)),
                         nn.BatchNorm2d(4, track_running_stats=False))


def test_the_statistics_before_a_forward_are_put_back_exactly() -> None:
    model, stats = _model(), RunningStats()
    model(torch.randn(2, 3, 8, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats.hold(model)
    model(torch.randn(2, 3, 8, 8))  # the step that raises: its forward moved the statistics
    changed = [k for k in before if not torch.equal(before[k], model.state_dict()[k])]
    assert changed == ["1.running_mean", "1.running_var", "1.num_batches_tracked", "2.0.running_mean",
                       "2.0.running_var", "2.0.num_batches_tracked"]
    held = stats.held()
    assert sorted(held) == sorted(changed)
    RunningStats.put_back(_model(), {})  # nothing held: nothing written
    RunningStats.put_back(model, held)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_model_whose_buffers_were_replaced_is_followed() -> None:
    model, stats = _model(), RunningStats()
    stats.hold(model)
    model.double()  # new buffer tensors
    model(torch.randn(2, 3, 8, 8, dtype=torch.float64))
    stats.hold(model)
    assert stats.held()["1.running_mean"].dtype == torch.float64
    assert torch.equal(stats.held()["1.running_mean"], model[1].running_mean)
