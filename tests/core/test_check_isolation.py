"""cltrain.check.isolation: a later run computes on the reference run's values, and its gradients pass unchanged."""

from __future__ import annotations

import torch

from cltrain.check.isolation import ReferenceOutputs


def test_a_later_call_hands_on_the_reference_values_in_its_own_strides_and_passes_the_gradient() -> None:
    outputs = ReferenceOutputs()
    reference = torch.arange(24.0).reshape(1, 2, 3, 4)
    assert outputs.pass_on("conv#0", reference) is reference  # recording: its own output, kept
    outputs.replay()
    mine = (reference + 0.5).contiguous(memory_format=torch.channels_last).requires_grad_()
    handed = outputs.pass_on("conv#0", mine)
    assert torch.equal(handed, reference) and handed.is_contiguous(memory_format=torch.channels_last)
    handed.mul(torch.arange(24.0).reshape(1, 2, 3, 4)).sum().backward()
    assert torch.equal(mine.grad, torch.arange(24.0).reshape(1, 2, 3, 4))  # unchanged through the substitution

    other = torch.zeros(1, 2, 3, 5)  # another shape: the call keeps its own values
    assert outputs.pass_on("conv#0", other) is other
    assert outputs.pass_on("never#0", mine) is mine  # a call the reference did not make


def test_a_tensor_that_is_several_calls_outputs_is_kept_once() -> None:
    outputs = ReferenceOutputs()
    shared = torch.ones(2, 2)
    outputs.keep("block#0", shared)
    outputs.keep("block.inner#0", shared)
    assert outputs.calls["block#0"][0] is outputs.calls["block.inner#0"][0]
