"""cltrain.check.untouched: what a copy still reaches of the real model, and the real tensors given back."""

from __future__ import annotations

import copy

import torch
from torch import nn

from cltrain.check.untouched import RealState, describe, reaching_path


def test_restore_gives_back_values_storage_and_gradients_and_names_what_changed() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).to(memory_format=torch.channels_last)
    net(torch.randn(2, 3, 6, 6)).sum().backward()
    weight, grad = net[0].weight.detach().clone(), net[0].weight.grad.clone()
    state = RealState(net)
    assert state.restore() == []  # nothing changed: nothing named
    with torch.no_grad():
        net[0].weight.add_(1.0)  # in place
    net[0].bias.data = torch.zeros(4)  # another storage
    net[0].weight.grad.mul_(3)
    net(torch.randn(2, 3, 6, 6))  # BatchNorm's statistics
    changed = state.restore()
    assert {"0.weight", "0.bias", "1.running_mean", "0.weight (gradient)"} <= set(changed), changed
    assert torch.equal(net[0].weight, weight) and torch.equal(net[0].weight.grad, grad)
    assert net[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert describe(["a", "b", "c", "d", "e"]) == "a, b, c and 2 more"


def test_a_copy_whose_code_still_holds_the_real_model_is_found() -> None:
    real = nn.Conv2d(3, 4, 3)
    clean = copy.deepcopy(real)
    assert reaching_path(real, clean) is None
    holding = copy.deepcopy(real)
    holding.register_forward_hook(lambda module, args, out: real(args[0]))  # a closure over the real model
    assert reaching_path(real, holding) is not None
