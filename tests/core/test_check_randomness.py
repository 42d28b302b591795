"""cltrain.check.randomness: a random op draws in the logical order whatever the strides, and every RNG the step can
read is set and restored."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cltrain.check.randomness import SameRandomness, rng_state, set_rng_state

CL = torch.channels_last


def _drawn(op, x: torch.Tensor, same: bool) -> torch.Tensor:
    torch.manual_seed(0)
    if not same:
        return op(x)
    with SameRandomness():
        return op(x)


@pytest.mark.parametrize("op", [lambda x: F.dropout(x, 0.5), lambda x: F.dropout2d(x, 0.5),
                                lambda x: x.clone().bernoulli_(0.5), lambda x: F.dropout(x.clone(), 0.5, inplace=True),
                                lambda x: torch.rand_like(x)],
                         ids=["dropout", "dropout2d", "bernoulli_", "dropout inplace", "rand_like"])
def test_a_random_op_draws_the_nchw_values_on_a_channels_last_tensor_and_keeps_its_strides(op):
    x = torch.randn(4, 8, 6, 6)
    nchw = _drawn(op, x, same=False)
    kept = _drawn(op, x.to(memory_format=CL), same=True)
    assert torch.equal(kept, nchw) and kept.is_contiguous(memory_format=CL)


def test_without_it_a_kernel_fills_the_mask_in_memory_order():
    # the negative control: the same seed gives another mask on a channels_last tensor
    x = torch.randn(4, 8, 6, 6)
    assert not torch.equal(_drawn(lambda t: F.dropout(t, 0.5), x.to(memory_format=CL), same=False),
                           _drawn(lambda t: F.dropout(t, 0.5), x, same=False))


def test_an_in_place_draw_writes_into_the_tensor_it_was_given():
    x = torch.randn(2, 3, 4, 4).to(memory_format=CL)
    with SameRandomness():
        out = x.bernoulli_(0.5)
    assert out is x and set(x.unique().tolist()) <= {0.0, 1.0}


def test_rng_state_sets_back_every_generator_the_step_can_read():
    state = rng_state()
    first = (torch.rand(3), random.random(), np.random.rand())
    set_rng_state(state)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


class _Checkpointed(torch.nn.Module):
    """A block with dropout under torch's recommended activation checkpointing (non-reentrant): its forward runs again
    in the backward, where torch runs no function mode."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.norm, self.head = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.Linear(8, 2)

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(F.relu(self.norm(self.conv(x))), p=0.3, training=self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self._block, x, use_reentrant=False).mean((2, 3)))


def test_a_checkpointed_block_with_dropout_draws_its_mask_again_in_the_same_order():
    from cltrain.loops import convert_model, verify_layout

    model = convert_model(_Checkpointed())
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 3, 16, 16, generator=g).to(memory_format=CL), torch.randint(0, 2, (4,), generator=g))
    result = verify_layout(model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                           optimizer=torch.optim.AdamW(model.parameters()), report=False)
    assert result.verdict == "passed", result.line()  # it saw a fault in the model's own backward: a false alarm
