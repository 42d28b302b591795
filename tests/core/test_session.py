"""``cltrain.session.LayoutSession`` on its own: what every front door's session converts, guards, decides and keeps.
The front doors' own tests (the callback, the loops, the Hugging Face hook) run it inside real training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cltrain.check.fallback import Fallback
from cltrain.check.result import LayoutCheck
from cltrain.guardrails import KNOWN_FAULTS
from cltrain.layout import is_channels_last
from cltrain.platform import Platform
from cltrain.host import Host
from cltrain.session import LayoutSession


class UserConv2d(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class OtherRank(Host):
    """Rank 1 of two: rank 0's value arrives by the broadcast, and another rank's flags join the sum."""

    def __init__(self, rank0: object = None, flags: torch.Tensor | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rank0, self.flags, self.said = rank0, flags, []

    def several(self) -> bool:
        return True

    def deciding(self) -> bool:
        return False

    def say(self, message: str, warn: bool = False) -> None:
        self.said.append(message)

    def broadcast(self, value: object) -> object:
        return self.rank0

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + self.flags if self.flags is not None else tensor


@pytest.fixture(autouse=True)
def _avx2_channel_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stem's 8-channel 1x1 stride-2 conv is safe where oneDNN's channel block is 8 (AVX2) and guarded where it is
    16 (AVX-512, AMX): every test here runs as on an AVX2 machine, whatever this CPU is."""
    monkeypatch.setattr(Platform, "channel_block", property(lambda self: 8))


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


def test_the_guardrails_cover_what_any_rank_found() -> None:
    # this rank's channel block is 8 (AVX2, the fixture): its 8-channel stem is safe here; another rank (AVX-512,
    # block 16) finds it hazardous, and its flag arrives in the sum over the ranks
    alone = LayoutSession()
    alone.convert(_stem(), device="cpu")
    assert alone.guardrails == []

    flags = torch.zeros(len(KNOWN_FAULTS), len(list(_stem().named_modules())))
    flags[0, 1] = 1  # fault 0 (the 1x1 stride-2 one) on module 1 ("0", the stem) of named_modules()
    united = LayoutSession(host=OtherRank(flags=flags))
    model = united.convert(_stem(), device="cpu")
    assert [r.modules for r in united.guardrails] == [("0",)]
    assert model[0].weight.is_contiguous() and is_channels_last(model[2].weight)  # the guarded weight in NCHW
    unguarded = LayoutSession(guard=False, host=OtherRank(flags=flags))
    unguarded.convert(_stem(), device="cpu")
    assert not unguarded.guardrails


def test_a_contiguous_verdict_guards_again_what_any_rank_finds() -> None:
    """Every rank applies the verdict at the same point: the guardrails of the NCHW model are united too."""
    model = nn.Sequential(nn.Conv3d(4, 8, 3, padding=1), nn.Conv3d(8, 8, 3, padding=1))
    flags = torch.zeros(len(KNOWN_FAULTS), len(list(model.named_modules())))
    flags[1, 2] = 1  # another rank finds the bf16 Conv3d fault (a hazard in both layouts) on module "1"
    session = LayoutSession(host=OtherRank(rank0=LayoutCheck("contiguous", reason="planted"), flags=flags))
    session.convert(model, device="cpu")  # float32: this rank finds nothing itself
    session.check("train", model, lambda: LayoutCheck("passed"))
    assert session.layout == "contiguous" and [r.modules for r in session.guardrails] == [("1",)]


def test_a_process_group_of_one_rank_decides_and_keeps_its_own_values(tmp_path) -> None:
    import torch.distributed as dist

    host = Host()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        flags = torch.ones(2, 3)
        assert not host.several() and host.deciding() and host.broadcast("mine") == "mine"
        assert host.sum(flags) is flags  # one rank: nothing to unite
    finally:
        dist.destroy_process_group()


def test_a_contiguous_verdict_puts_the_model_and_the_hosts_copies_and_optimizer_state_in_nchw() -> None:
    model = _stem()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    average = torch.optim.swa_utils.AveragedModel(model)  # an EMA's copy, held by the host
    said = []
    session = LayoutSession(host=Host(lambda line, warn: said.append((line, warn)), optimizers=lambda: [optimizer],
                                      copies=lambda: [average]))
    session.convert(model, device="cpu")
    assert is_channels_last(average.module[2].weight)
    model(torch.randn(2, 8, 6, 6)).sum().backward()
    optimizer.step()
    session.check("train", model, lambda: LayoutCheck("contiguous", reason="planted"))
    assert session.layout == "contiguous" and model[2].weight.is_contiguous() and said[-1][1] is True
    assert average.module[2].weight.is_contiguous()
    assert optimizer.state[model[2].weight]["momentum_buffer"].stride() == model[2].weight.stride()


def test_a_rank_that_does_not_decide_applies_rank_0s_verdict_without_running_the_check() -> None:
    ran = []
    session = LayoutSession(host=OtherRank(rank0=LayoutCheck("fallback", fallbacks=(Fallback("module", "2"),))))
    model = session.convert(_stem(), device="cpu")
    result = session.check("train", model, lambda: ran.append(1) or LayoutCheck("passed"))
    assert ran == [] and result.verdict == "fallback" and model[2].weight.is_contiguous()
    assert is_channels_last(model[0].weight)


def test_a_model_with_syncbatchnorm_is_not_checked_on_several_ranks() -> None:
    """Its copies would call the other ranks' collectives from rank 0 alone (a hang under NCCL)."""
    model = nn.SyncBatchNorm.convert_sync_batchnorm(_stem())
    ran = []

    class Deciding(OtherRank):
        def deciding(self) -> bool:
            return True

        def broadcast(self, value: object) -> object:
            return value

    session = LayoutSession(host=Deciding())
    session.convert(model, device="cpu")
    result = session.check("train", model, lambda: ran.append(1) or LayoutCheck("passed"))
    assert ran == [] and result.verdict == "not checked" and "SyncBatchNorm" in result.reason
    alone = LayoutSession()  # one process: SyncBatchNorm runs as BatchNorm, and the check runs
    assert alone.check("train", alone.convert(model, device="cpu"), lambda: LayoutCheck("passed")).verdict == "passed"


def test_a_model_without_convolutions_is_said_once_whatever_the_front_door() -> None:
    said = []
    session = LayoutSession(host=Host(lambda line, warn: said.append((line, warn))))
    for _ in range(2):  # a second fit converts again
        session.convert(nn.Sequential(nn.Linear(4, 4)), owner="ChannelsLast(mode='full')")
    warned = [line for line, warn in said if warn]
    assert warned == ["ChannelsLast: Sequential has no Conv2d/Conv3d/ConvTranspose layer, so channels_last has "
                      "nothing to speed up; remove it or keep it for the layout checks."]
    quiet = []
    LayoutSession(host=Host(lambda line, warn: quiet.append(warn))).convert(_stem(), owner="convert_model")
    assert quiet == [False]


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
    model, copies = nn.Conv2d(3, 4, 3), []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    session = LayoutSession(host=Host(optimizers=lambda: [optimizer], copies=lambda: copies))
    session.convert(model)
    model.weight.grad = torch.randn_like(model.weight)
    optimizer.step()
    optimizer.state[model.weight]["momentum_buffer"] = optimizer.state[model.weight]["momentum_buffer"].contiguous()
    copies.append(torch.optim.swa_utils.AveragedModel(nn.Conv2d(3, 4, 3)))  # an EMA's copy, made after the conversion
    session.resume()
    assert optimizer.state[model.weight]["momentum_buffer"].stride() == model.weight.stride()
    assert is_channels_last(copies[0].module.weight)
    # a sharding engine owns both: nothing moves
    other = [torch.optim.swa_utils.AveragedModel(nn.Conv2d(3, 4, 3))]
    sharded = LayoutSession(host=Host(copies=lambda: other))
    sharded.convert(nn.Conv2d(3, 4, 3), sharding="FSDP2")
    sharded.resume()
    assert not is_channels_last(other[0].module.weight)
