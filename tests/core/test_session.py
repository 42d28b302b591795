"""``cltrain.session.LayoutSession`` on its own: what every front door's session converts, guards, decides and keeps.
The front doors' own tests (the callback, the loops, the Hugging Face hook) run it inside real training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cltrain.check.result import LayoutCheck
from cltrain.layout import is_channels_last
from cltrain.platform import Platform
from cltrain.session import LayoutSession, process_group_sum


class UserConv2d(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def _stem() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(UserConv2d(8, 16, 1, stride=2), nn.BatchNorm2d(16), nn.Conv2d(16, 16, 3, padding=1))


def test_convert_puts_the_model_in_its_layout_and_a_sharded_one_in_nchw() -> None:
    session = LayoutSession()
    model = session.convert(_stem(), device="cpu")
    assert session.layout == "channels_last" and is_channels_last(model[2].weight)
    assert session.conversion_line("owner", model).startswith("owner: model layout is channels_last; ")
    sharded = LayoutSession()
    model = sharded.convert(_stem(), device="cpu", sharding="FSDP2")
    assert model[2].weight.is_contiguous() and not is_channels_last(model[2].weight)
    back = LayoutSession().convert(LayoutSession().convert(_stem(), device="cpu"), device="cpu", layout="contiguous")
    assert back[2].weight.is_contiguous()


def test_the_guardrails_cover_what_any_rank_found(monkeypatch: pytest.MonkeyPatch) -> None:
    # this rank's channel block is 8 (AVX2): its 8-channel stem is safe here; another rank (AVX-512, block 16)
    # finds it hazardous, and its flag arrives in the sum over the ranks
    monkeypatch.setattr(Platform, "channel_block", property(lambda self: 8))
    alone = LayoutSession()
    alone.convert(_stem(), device="cpu")
    assert alone.guardrails == []

    def with_the_other_rank(flags: torch.Tensor) -> torch.Tensor:
        other = torch.zeros_like(flags)
        other[0, 1] = 1  # fault 0 (the 1x1 stride-2 one) on module 1 ("0", the stem) of named_modules()
        return flags + other

    united = LayoutSession()
    model = united.convert(_stem(), device="cpu", sum_over_ranks=with_the_other_rank)
    assert [r.modules for r in united.guardrails] == [("0",)]
    assert model[0].weight.is_contiguous() and is_channels_last(model[2].weight)  # the guarded weight in NCHW
    unguarded = LayoutSession(guard=False)
    unguarded.convert(_stem(), device="cpu", sum_over_ranks=with_the_other_rank)
    assert not unguarded.guardrails


def test_process_group_sum_is_none_without_several_ranks(tmp_path) -> None:
    import torch.distributed as dist

    assert process_group_sum() is None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert process_group_sum() is None  # one rank: nothing to unite
    finally:
        dist.destroy_process_group()


def test_a_contiguous_verdict_puts_the_model_in_nchw_and_a_rank_without_a_result_needs_a_broadcast() -> None:
    session = LayoutSession()
    model = session.convert(_stem(), device="cpu")
    said = []
    session.say = lambda line, warn: said.append((line, warn))
    session.check("train", model, lambda: LayoutCheck("contiguous", reason="planted"))
    assert session.layout == "contiguous" and model[2].weight.is_contiguous() and said[-1][1] is True
    with pytest.raises(ValueError, match="no result on this rank and no broadcast"):
        LayoutSession().check("train", model, None)
    shared = LayoutSession()
    shared.convert(_stem(), device="cpu")
    assert shared.check("train", model, None, broadcast=lambda mine: LayoutCheck("passed"), report=False).verdict == \
        "passed"


def test_the_train_and_eval_checks_say_different_lines_whatever_they_took() -> None:
    """A run checks its training and its evaluation step; equal timings must not print one line twice."""
    session = LayoutSession()
    model = session.convert(_stem(), device="cpu")
    said = []
    session.say = lambda line, warn: said.append(line)
    for kind in ("train", "eval"):
        session.check(kind, model, lambda: LayoutCheck("passed", seconds=0.2))
    assert len(set(said)) == 2, said
    assert "the first eval batch" in said[1] and "the first batch" in said[0]
    skipped = LayoutCheck("not checked", reason="planted")
    assert skipped.line("train") != skipped.line("eval")


def test_resume_restrides_the_restored_optimizer_state_and_puts_copies_in_the_layout() -> None:
    model, session = nn.Conv2d(3, 4, 3), LayoutSession()
    session.convert(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.weight.grad = torch.randn_like(model.weight)
    optimizer.step()
    optimizer.state[model.weight]["momentum_buffer"] = optimizer.state[model.weight]["momentum_buffer"].contiguous()
    average = torch.optim.swa_utils.AveragedModel(nn.Conv2d(3, 4, 3))  # an EMA's copy, made after the conversion
    session.resume([optimizer], [average])
    assert optimizer.state[model.weight]["momentum_buffer"].stride() == model.weight.stride()
    assert is_channels_last(average.module.weight)
    # a sharding engine owns both: nothing moves
    sharded = LayoutSession()
    sharded.convert(nn.Conv2d(3, 4, 3), sharding="FSDP2")
    other = torch.optim.swa_utils.AveragedModel(nn.Conv2d(3, 4, 3))
    sharded.resume([], [other])
    assert not is_channels_last(other.module.weight)
