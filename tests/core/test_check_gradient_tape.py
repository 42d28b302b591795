"""cltrain.check.gradient_tape: every run after the reference takes the reference's gradient values, in its strides."""

from __future__ import annotations

import copy

import torch
from torch import nn

from cltrain.check.gradient_tape import GradientTape


class _Keys:
    def __init__(self) -> None:
        self.keys: list = []

    def record(self, key, obj, context) -> None:
        self.keys.append(key)


def _backward(model: nn.Module, scale: float, tape: GradientTape, keys: _Keys) -> None:
    handles = tape.hooks(model, keys)
    try:
        (scale * model(torch.ones(2, 3, 5, 5)).square().sum()).backward()
    finally:
        for handle in handles:
            handle.remove()


def test_a_later_run_takes_the_reference_gradients_in_its_own_strides() -> None:
    torch.manual_seed(0)
    reference = nn.Conv2d(3, 4, 3)
    other = copy.deepcopy(reference).to(memory_format=torch.channels_last)
    tape, keys = GradientTape(), _Keys()
    _backward(reference, 1.0, tape, keys)
    tape.recording = False
    _backward(other, 2.0, tape, keys)  # another loss: its own gradients would be twice the reference's
    assert torch.equal(other.weight.grad, reference.weight.grad) and torch.equal(other.bias.grad, reference.bias.grad)
    assert other.weight.grad.is_contiguous(memory_format=torch.channels_last)
    assert {k.name for k in keys.keys} == {"weight", "bias"} and len(keys.keys) == 4  # each run's own, recorded

    control = copy.deepcopy(reference)  # the control: still recording, the run keeps its own gradients
    control.zero_grad(set_to_none=True)
    _backward(control, 2.0, GradientTape(), _Keys())
    assert torch.allclose(control.weight.grad, 2 * reference.weight.grad)
