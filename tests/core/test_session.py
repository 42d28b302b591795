"""``cltrain.session.LayoutSession`` on its own: what every front door's session starts, guards, checks, races, keeps,
saves and resumes. The doors' own tests (the callback, the loops, the Hugging Face hook) run it inside real training;
``tests/core/test_doors.py`` runs every feature through every door."""

from __future__ import annotations

import logging
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

from cltrain.check.fallback import Fallback
from cltrain.check.plain_step import check_plain_step
from cltrain.check.result import LayoutCheck
from cltrain.guardrails import KNOWN_FAULTS
from cltrain.host import Host
from cltrain.layout import is_channels_last
from cltrain.platform import Platform
from cltrain.session import LayoutSession
from cltrain.timing import layout_race
from tests.helpers import warm


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


def _started(model: nn.Module, **kwargs) -> tuple[LayoutSession, nn.Module]:
    session = LayoutSession(**kwargs)
    return session, session.start(model, device="cpu")


def test_start_puts_the_model_in_its_layout_a_pinned_or_sharded_one_in_nchw_and_races_no_compiled_one(caplog) -> None:
    session, model = _started(_stem())
    assert session.layout == "channels_last" and is_channels_last(model[2].weight) and session.untimed is None
    session.close()
    pinned, model = _started(_stem(), layout="contiguous")
    assert pinned.layout == "contiguous" and model[2].weight.is_contiguous() and pinned.untimed == "pinned to contiguous"
    pinned.close()
    sharded = LayoutSession()
    model = sharded.start(_stem(), device="cpu", sharding="FSDP2")
    assert model[2].weight.is_contiguous() and not is_channels_last(model[2].weight) and sharded.untimed
    sharded.close()
    stem = _stem()
    compiled, model = _started(torch.compile(stem, backend="eager"))
    with caplog.at_level(logging.INFO):
        compiled.report_conversion("ChannelsLast", model)
    assert is_channels_last(stem[2].weight) and compiled.untimed == "torch.compile would compile both layouts"
    assert "not raced against NCHW (torch.compile would compile both layouts)" in caplog.text
    compiled.close()


def test_the_guardrails_cover_what_any_rank_found() -> None:
    # this rank's channel block is 8 (AVX2, the fixture): its 8-channel stem is safe here; another rank (AVX-512,
    # block 16) finds it hazardous, and its flag arrives in the sum over the ranks
    alone, _ = _started(_stem())
    assert alone.guardrails == []
    flags = torch.zeros(len(KNOWN_FAULTS), len(list(_stem().named_modules())))
    flags[0, 1] = 1  # fault 0 (the 1x1 stride-2 one) on module 1 ("0", the stem) of named_modules()
    united, model = _started(_stem(), host=OtherRank(flags=flags))
    assert [r.modules for r in united.guardrails] == [("0",)]
    assert model[0].weight.is_contiguous() and is_channels_last(model[2].weight)  # the guarded weight in NCHW
    unguarded, _ = _started(_stem(), guard=False, host=OtherRank(flags=flags))
    assert not unguarded.guardrails
    for session in (alone, united, unguarded):
        session.close()


def test_a_contiguous_verdict_guards_again_what_any_rank_finds() -> None:
    """Every rank applies the verdict at the same point: the guardrails of the NCHW model are united too."""
    model = nn.Sequential(nn.Conv3d(4, 8, 3, padding=1), nn.Conv3d(8, 8, 3, padding=1))
    flags = torch.zeros(len(KNOWN_FAULTS), len(list(model.named_modules())))
    flags[1, 2] = 1  # another rank finds the bf16 Conv3d fault (a hazard in both layouts) on module "1"
    session, model = _started(model, host=OtherRank(rank0=LayoutCheck("contiguous", reason="planted"), flags=flags))
    session.check("train", model, lambda: LayoutCheck("passed"))  # float32: this rank finds nothing itself
    assert session.layout == "contiguous" and [r.modules for r in session.guardrails] == [("1",)]
    assert session.untimed == "the check keeps the model in NCHW"  # nothing left to race
    session.close()


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
    host = Host(lambda line, warn: said.append((line, warn)), optimizers=lambda: [optimizer], copies=lambda: [average])
    session, model = _started(model, host=host)
    assert is_channels_last(average.module[2].weight)
    model(torch.randn(2, 8, 6, 6)).sum().backward()
    optimizer.step()
    session.check("train", model, lambda: LayoutCheck("contiguous", reason="planted"))
    assert session.layout == "contiguous" and model[2].weight.is_contiguous() and said[-1][1] is True
    assert average.module[2].weight.is_contiguous()
    assert optimizer.state[model[2].weight]["momentum_buffer"].is_contiguous()
    session.close()


def test_a_rank_that_does_not_decide_applies_rank_0s_verdict_without_running_the_check() -> None:
    ran = []
    session, model = _started(_stem(), host=OtherRank(rank0=LayoutCheck("fallback", fallbacks=(Fallback("module", "2"),))))
    result = session.check("train", model, lambda: ran.append(1) or LayoutCheck("passed"))
    assert ran == [] and result.verdict == "fallback" and model[2].weight.is_contiguous()
    assert is_channels_last(model[0].weight)
    session.close()


def test_a_model_with_syncbatchnorm_is_checked_on_several_ranks_with_local_statistics(tmp_path) -> None:
    """On several ranks the check runs on rank 0 alone: its copies of SyncBatchNorm compute their statistics on the
    checked samples (a copy waiting for ranks that never run it would hang under NCCL). A process group of one rank on
    the CPU shows it: SyncBatchNorm in training refuses CPU tensors there, so without the substitution the check fails
    instead of passing."""
    import torch.distributed as dist

    class Deciding(OtherRank):
        def deciding(self) -> bool:
            return True

        def broadcast(self, value: object) -> object:
            return value

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(_stem())
        session, model = _started(model, host=Deciding())
        batch = (torch.randn(4, 8, 8, 8),)
        result = session.check("train", model, lambda: check_plain_step(model, batch))
        assert result.verdict == "passed", result.line()
        assert "forward" not in vars(model[1])  # the real layer is left as it was
        alone, model = _started(nn.SyncBatchNorm.convert_sync_batchnorm(_stem()))  # one rank: no substitution
        control = alone.check("train", model, lambda: check_plain_step(model, batch))
        assert control.verdict == "not checked" and "GPU" in control.reason, control.line()
        session.close()
        alone.close()
    finally:
        dist.destroy_process_group()


def test_a_model_without_convolutions_is_said_once_whatever_the_front_door() -> None:
    said = []
    session = LayoutSession(host=Host(lambda line, warn: said.append((line, warn))))
    for _ in range(2):  # a second fit starts again
        session.start(nn.Sequential(nn.Linear(4, 4)), owner="ChannelsLast(mode='full')")
    warned = [line for line, warn in said if warn]
    assert warned == ["ChannelsLast: Sequential has no Conv2d/Conv3d/ConvTranspose layer, so channels_last has "
                      "nothing to speed up; remove it or keep it for the layout checks."]
    quiet = []
    other = LayoutSession(host=Host(lambda line, warn: quiet.append(warn)))
    other.start(_stem(), owner="convert_model")
    assert quiet == [False]
    session.close()
    other.close()


def test_the_train_and_eval_checks_say_different_lines_whatever_they_took() -> None:
    """A run checks its training and its evaluation step; equal timings must not print one line twice."""
    said = []
    session, model = _started(_stem(), host=Host(lambda line, warn: said.append(line)))
    said.clear()
    for kind in ("train", "eval"):
        session.check(kind, model, lambda: LayoutCheck("passed", seconds=0.2))
    assert len(set(said)) == 2, said
    assert "the first eval batch" in said[1] and "the first batch" in said[0]
    skipped = LayoutCheck("not checked", reason="planted")
    assert skipped.line("train") != skipped.line("eval")
    session.close()


def test_resume_restrides_the_restored_optimizer_state_and_puts_copies_in_the_layout() -> None:
    model, copies = nn.Conv2d(3, 4, 3), []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    session, model = _started(model, host=Host(optimizers=lambda: [optimizer], copies=lambda: copies))
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
    sharded.start(nn.Conv2d(3, 4, 3), sharding="FSDP2")
    sharded.resume()
    assert not is_channels_last(other[0].module.weight)
    session.close()
    sharded.close()


def test_a_boundary_judges_a_1x1_weight_strictly_and_puts_it_back_with_to() -> None:
    """A 1x1 kernel that something left in NCHW (``make_pruning_permanent``, ``.data =``) counts as channels_last
    for torch's loose ``is_contiguous(memory_format=...)`` and ``contiguous(memory_format=...)`` leaves it: judged by
    ``is_channels_last``, it is restrided for real, with its optimizer state."""
    model = nn.Sequential(nn.Conv2d(8, 16, 1), nn.Conv2d(16, 16, 3))
    optimizer = torch.optim.Adam(model.parameters())
    session, model = _started(model, layout="channels_last", host=Host(optimizers=lambda: [optimizer]))
    session.expect(model)
    model(torch.randn(2, 8, 6, 6)).sum().backward()
    optimizer.step()
    model[0].weight.data = model[0].weight.data.clone(memory_format=torch.contiguous_format)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)  # torch's loose judgement: "fine"
    assert not is_channels_last(model[0].weight)
    assert session.boundary(model, after="a test") == ["0.weight"]
    assert is_channels_last(model[0].weight)
    assert optimizer.state[model[0].weight]["exp_avg"].stride() == model[0].weight.stride()
    session.close()


# ---- the race -------------------------------------------------------------------------------------------------------


class ScriptedClock:
    """Stands in for ``cltrain.timing.clock.StepTimer``: each step takes the seconds scripted for its layout (a real clock's
    decision is a benchmark's business; here the session's handling of a decision is under test)."""

    times = {"channels_last": 0.3, "contiguous": 0.2}
    session: LayoutSession | None = None

    def __init__(self, device: object) -> None:
        pass

    def start(self) -> None:
        self.layout = ScriptedClock.session.layout

    def stop(self) -> float:
        return ScriptedClock.times[self.layout]


def _race_run(monkeypatch, host: Host, times: dict[str, float], steps: int = 12, sizes: tuple[int, ...] = (4,),
              batches: int = 1, evaluate: int = 0):
    """``steps`` training steps of ``batches`` batches each (gradient accumulation), the batch sizes cycling through
    ``sizes``; every ``evaluate``-th step (0: none) has an evaluation batch between its batches."""
    import cltrain.session

    monkeypatch.setattr(cltrain.session, "StepTimer", ScriptedClock)
    monkeypatch.setattr(ScriptedClock, "times", times)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    host._optimizers = lambda: [optimizer]
    session = LayoutSession(host=host)
    ScriptedClock.session = session
    session.start(model, device="cpu")
    layouts = []
    for step in range(steps):
        for k in range(batches):
            if k and evaluate and step % evaluate == 0:
                with torch.no_grad():
                    model(session.batch("eval", (torch.randn(2, 3, 8, 8),), model)[0])
                session.batch_end()
            batch = (torch.randn(sizes[step % len(sizes)], 3, 8, 8),)
            batch = session.batch("train", batch, model)
            if k == 0:
                layouts.append((session.layout, is_channels_last(model[0].weight), is_channels_last(batch[0])))
            else:  # the step's batches all run in its layout
                assert layouts[-1] == (session.layout, is_channels_last(model[0].weight), is_channels_last(batch[0]))
            model(batch[0]).sum().backward()
            session.batch_end()
        optimizer.step()
        optimizer.zero_grad()
        session.step_end(model)
    session.end(model)
    return session, model, optimizer, layouts


def test_the_race_switches_to_the_faster_nchw_with_the_optimizer_state_and_logs_both_times(monkeypatch) -> None:
    said, logged = [], []
    host = Host(lambda line, warn: said.append(line), log=logged.append)
    session, model, optimizer, layouts = _race_run(monkeypatch, host, {"channels_last": 0.3, "contiguous": 0.2})
    # 3 warm-up steps and two rounds of 2 channels_last, 2 NCHW (a switch wants two): then NCHW for good
    assert [layout for layout, _, _ in layouts] == ["channels_last"] * 5 + ["contiguous"] * 2 + ["channels_last"] * 2 \
        + ["contiguous"] * 3
    assert all(weight == batch == (layout == "channels_last") for layout, weight, batch in layouts)
    decision = session.decision
    assert decision.layout == "contiguous" and decision.how == "timed" and round(decision.ratio, 2) == 1.5
    assert model[0].weight.is_contiguous() and all(
        v.stride() == p.stride() for p, s in optimizer.state.items() for v in s.values() if v.dim() == 4)
    line = [s for s in said if "faster here" in s]
    assert line == ["ChannelsLast: NCHW 1.50x faster here (fp32, cpu, 8x8 px): switched, the model and its optimizer "
                    "state moved once (timed 4 step(s) in channels_last, 3 step(s) in NCHW; the race cost 0.40 s; pin "
                    "it with layout='contiguous')."]
    assert logged == [{"channels_last/step_seconds_channels_last": 0.3, "channels_last/step_seconds_contiguous": 0.2}]
    # the decision travels in the checkpoint: a resumed session takes the layout at once and never races again
    fresh = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))
    resumed_said = []
    resumed = LayoutSession(host=Host(lambda line, warn: resumed_said.append(line)))
    resumed.start(fresh, device="cpu")
    resumed.load_state_dict(session.state_dict(), model=fresh)
    assert resumed.layout == "contiguous" and fresh[0].weight.is_contiguous()
    # an evaluation before any training step (a fresh trainer.validate of the checkpoint) keeps it: it went back to
    # channels_last, the layout measured slower
    batch = resumed.batch("eval", (torch.randn(4, 3, 8, 8),), fresh)
    resumed.batch_end()
    assert resumed.layout == "contiguous" and fresh[0].weight.is_contiguous() and batch[0].is_contiguous()
    for _ in range(2):
        resumed.batch("train", (torch.randn(4, 3, 8, 8),), fresh)
        resumed.batch_end()
        resumed.step_end(fresh)
    assert resumed._step is None and resumed.decision.how == "restored"
    # the conversion line said the race would run: one line says the checkpoint's decision holds instead
    assert [line for line in resumed_said if "checkpoint" in line] == [
        "ChannelsLast: the checkpoint's race decision holds here (fp32, cpu, 8x8 px): NCHW, 1.50x faster when timed "
        "(pin it with layout='contiguous')."]
    resumed.close()
    # a layout pinned at resume wins over the checkpoint's decision, in one line; the decision stays in the checkpoint
    pinned_said, pinned_model = [], nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    pinned = LayoutSession(layout="channels_last", host=Host(lambda line, warn: pinned_said.append(line)))
    pinned.start(pinned_model, device="cpu")
    pinned.load_state_dict(session.state_dict(), model=pinned_model)
    for _ in range(2):
        batch = pinned.batch("train", (torch.randn(4, 3, 8, 8),), pinned_model)
        assert is_channels_last(batch[0]) and is_channels_last(pinned_model[0].weight)
        pinned.batch_end()
        pinned.step_end(pinned_model)
    pinned.end(pinned_model)
    assert pinned.layout == "channels_last" and pinned.decision is None
    assert [line for line in pinned_said if "checkpoint" in line] == [
        "ChannelsLast: the checkpoint's race decision (NCHW) is not used: layout='channels_last' pins channels_last."]
    assert pinned.state_dict()["race"] == session.state_dict()["race"]
    pinned.close()


@pytest.mark.parametrize("seconds, said", [
    ({"channels_last": 0.2, "contiguous": 0.3}, "channels_last, 1.50x faster when timed"),
    ({"channels_last": 0.201, "contiguous": 0.2}, "channels_last, when timed within 2% of NCHW"),
    ({"channels_last": 0.254, "contiguous": 0.2}, "channels_last, when timed NCHW 1.27x faster by the medians, too "
                                                  "noisy to tell"),
])
def test_a_restored_decision_says_which_layout_was_faster_when_timed(seconds, said) -> None:
    # a noisy race keeps channels_last where NCHW led by the medians: the resumed run's line must not call it faster
    session = LayoutSession(host=Host())
    decision = layout_race.LayoutDecision(((3, 32, 32), "bf16", "cpu"), "channels_last", "restored", seconds,
                                          {"channels_last": 10, "contiguous": 9})
    assert session.decision_line(decision) == ("ChannelsLast: the checkpoint's race decision holds here (bf16, cpu, "
                                               f"32x32 px): {said} (pin it with layout='channels_last').")


@pytest.mark.parametrize("how, seconds, said", [
    ("noisy", {"channels_last": 1.76, "contiguous": 2.0}, "channels_last, when timed channels_last 1.14x faster by the "
                                                          "medians, too noisy to tell"),
    ("tie", {"channels_last": 0.2, "contiguous": 0.203}, "channels_last, when timed within 2% of NCHW"),
    ("timed", {"channels_last": 0.2, "contiguous": 0.3}, "channels_last, 1.09x faster when timed"),
])
def test_a_restored_decision_says_what_the_race_said_when_resumed_and_saved_again(how, seconds, said) -> None:
    # a noisy race's "channels_last 1.14x faster by the medians, too noisy to tell" came back from the checkpoint as
    # "channels_last, 1.09x faster when timed" (the paired steps' lead, stated as sure); a tie as a lead
    decision = layout_race.LayoutDecision(((3, 8, 8), "fp32", "cpu"), "channels_last", how, seconds,
                                          {"channels_last": 8, "contiguous": 8}, judged=1.09)
    restored = layout_race.LayoutDecision.from_dict(decision.as_dict())
    again = layout_race.LayoutDecision.from_dict(restored.as_dict())  # a checkpoint of the resumed run
    assert restored.as_dict()["restored"] and not decision.as_dict()["restored"]  # as metrics.json tells it
    for d in (restored, again):
        assert f"holds here (fp32, cpu, 8x8 px): {said} (pin" in LayoutSession().decision_line(d)


@pytest.mark.parametrize("how", ["a last, smaller batch each epoch", "evaluations inside accumulated steps"])
def test_the_race_decides_with_partial_batches_and_evaluations_inside_steps(monkeypatch, how) -> None:
    # a last, smaller batch first timed became the race's batch size and every full one was left out: no decision,
    # NCHW steps for ever; an evaluation inside a step switched its later batches to channels_last
    kwargs = {"sizes": (4, 4, 4, 2)} if how.startswith("a last") else {"batches": 2, "evaluate": 3}
    session, model, _, _ = _race_run(monkeypatch, Host(), {"channels_last": 0.3, "contiguous": 0.2}, steps=40, **kwargs)
    assert session.decision is not None and session.decision.layout == "contiguous", session.race.state_dict()
    assert model[0].weight.is_contiguous()
    assert session.decision.judged > 1 + session.race.margin  # the lead the rule switched for, said in the line


def test_a_race_that_cannot_time_both_layouts_ends_at_its_last_round_in_channels_last(monkeypatch) -> None:
    said = []
    # an evaluation inside every step: no step's time is its own
    session, model, _, layouts = _race_run(monkeypatch, Host(lambda line, warn: said.append(line)),
                                           {"channels_last": 0.3, "contiguous": 0.2}, steps=110, batches=2, evaluate=1)
    assert session.decision.how == "untimed" and session.decision.layout == "channels_last"
    assert [layout for layout, _, _ in layouts[-5:]] == ["channels_last"] * 5 and is_channels_last(model[0].weight)
    assert any("were not timed apart here" in line and "kept channels_last" in line for line in said), said


def test_the_race_keeps_channels_last_where_it_is_faster_and_a_pinned_layout_never_races(monkeypatch) -> None:
    session, model, _, layouts = _race_run(monkeypatch, Host(), {"channels_last": 0.2, "contiguous": 0.3})
    assert [layout for layout, _, _ in layouts] == ["channels_last"] * 5 + ["contiguous"] * 2 + ["channels_last"] * 5
    assert session.decision.layout == "channels_last" and is_channels_last(model[0].weight)


def test_a_switch_says_the_lead_the_rule_judged_not_the_medians() -> None:
    # the medians 1.01x apart, the paired steps 1.03x: "NCHW 1.01x faster: switched" read as a switch under the 2% rule
    decision = layout_race.LayoutDecision(((3, 8, 8), "fp32", "cpu"), "contiguous", "timed",
                                          {"channels_last": 0.202, "contiguous": 0.2},
                                          {"channels_last": 8, "contiguous": 8}, judged=1.03)
    assert "NCHW 1.03x faster here (fp32, cpu, 8x8 px): switched" in LayoutSession().decision_line(decision)
    restored = layout_race.LayoutDecision.from_dict(decision.as_dict())
    assert restored.judged == 1.03
    assert "NCHW, 1.03x faster when timed" in LayoutSession().decision_line(restored)  # not the medians' 1.01x
    restored = replace(restored, seconds={"channels_last": 0.2, "contiguous": 0.21})  # the medians the other way
    assert "NCHW, 1.03x faster when timed" in LayoutSession().decision_line(restored)


@pytest.mark.parametrize("seconds,how,layout,said", [
    ({"channels_last": 0.2, "contiguous": 0.3}, "timed", "channels_last", "channels_last 1.50x faster here"),
    ({"channels_last": 0.206, "contiguous": 0.2}, "noisy", "channels_last",
     "NCHW 1.03x faster by the medians here (fp32, cpu, 8x8 px), too noisy to tell: kept channels_last"),
    ({"channels_last": 1.76, "contiguous": 3.18}, "noisy", "channels_last",  # a load between the layouts' steps
     "channels_last 1.81x faster by the medians here (fp32, cpu, 8x8 px), too noisy to tell: kept channels_last"),
    ({"channels_last": 0.3, "contiguous": 0.2}, "timed", "contiguous", "NCHW 1.50x faster here"),
])
def test_the_line_names_the_layout_the_medians_put_ahead(seconds, how, layout, said) -> None:
    decision = layout_race.LayoutDecision(((3, 8, 8), "fp32", "cpu"), layout, how, seconds,
                                          {"channels_last": 2, "contiguous": 1})
    line = LayoutSession().decision_line(decision)
    assert said in line and f"pin it with layout={layout!r}" in line
    assert ("channels_last 1.03x" not in line) and (", too noisy" in line) == (how == "noisy")
    assert "were noisy" not in line  # said once


def test_a_rank_that_does_not_decide_follows_rank_0s_decision(monkeypatch) -> None:
    # no DDP holds this model (cltrain.ddp finds none): rank 0's decision arrives by the broadcast and is applied, on
    # this rank's own times saying the opposite (tests/core/test_ddp_grads.py: under DDP, with its gradients); across
    # ranks one race covers every input size (the ranks' sizes may differ at a step)
    rank0 = layout_race.LayoutDecision(((), "fp32", "cpu"), "contiguous", "timed",
                                       {"channels_last": 0.3, "contiguous": 0.2}, {"channels_last": 2, "contiguous": 1})
    session, model, _, layouts = _race_run(monkeypatch, OtherRank(rank0=rank0), {"channels_last": 0.1, "contiguous": 0.9})
    assert session.decision is rank0 and [layout for layout, _, _ in layouts][-1] == "contiguous"
    assert model[0].weight.is_contiguous() and session.untimed is None
    assert "(fp32, cpu, every rank's input sizes)" in session.decision_line(rank0)


class Rank0Of2(Host):
    """Rank 0 of two ranks: it decides, and its values are every rank's."""

    def several(self) -> bool:
        return True


def _resumed(state: dict, host: Host, steps: int, size: int = 8) -> tuple[LayoutSession, nn.Module, list[str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))
    said = []
    host.say = lambda line, warn=False: said.append(line)
    session = LayoutSession(host=host)
    ScriptedClock.session = session
    session.start(model, device="cpu")
    session.load_state_dict(state, model=model)
    for _ in range(steps):
        session.batch("train", (torch.randn(4, 3, size, size),), model)
        session.batch_end()
        session.step_end(model)
    session.end(model)
    return session, model, said


@pytest.mark.parametrize("saved_by,resumed_by", [("one rank", "two ranks"), ("two ranks", "one rank")])
def test_a_decision_or_a_race_holds_when_the_run_resumes_on_another_number_of_ranks(monkeypatch, saved_by,
                                                                                    resumed_by) -> None:
    # one rank keys a decision by its input's shape, several ranks by every rank's sizes: a checkpoint of one resumed
    # on the other raced again (and decided the other way), and its race under way was never finished
    ranks = {"one rank": Host, "two ranks": Rank0Of2}
    slower_cl = {"channels_last": 0.3, "contiguous": 0.2}
    decided, _, _, _ = _race_run(monkeypatch, ranks[saved_by](), slower_cl)
    assert decided.decision.layout == "contiguous"
    monkeypatch.setattr(ScriptedClock, "times", {"channels_last": 0.2, "contiguous": 0.3})  # another verdict if raced
    session, model, said = _resumed(decided.state_dict(), ranks[resumed_by](), steps=12)
    assert session.decision.layout == "contiguous" and session.decision.how == "restored"
    assert model[0].weight.is_contiguous() and not session.race.racing()
    assert [line for line in said if "holds here" in line] == [session.decision_line(session.decision)]
    assert not [line for line in said if "faster here" in line or "ended before" in line], said
    # stopped mid-race (its warm-up and a round run): the race goes on at its place and decides, nothing left over
    midway, _, _, _ = _race_run(monkeypatch, ranks[saved_by](), slower_cl, steps=5)
    assert midway.decision is None and midway.race.steps_run() == 5
    monkeypatch.setattr(ScriptedClock, "times", slower_cl)
    session, model, said = _resumed(midway.state_dict(), ranks[resumed_by](), steps=12)
    assert session.decision is not None and session.decision.layout == "contiguous", said
    assert not session.race.racing() and not [line for line in said if "ended before" in line], said
    assert model[0].weight.is_contiguous()


def test_an_undecided_race_leaves_the_model_in_channels_last_at_the_end(monkeypatch, caplog) -> None:
    with caplog.at_level(logging.INFO):
        session, model, _, layouts = _race_run(monkeypatch, Host(), {"channels_last": 0.2, "contiguous": 0.3},
                                               steps=6)
    assert layouts[-1][0] == "contiguous" and session.decision is None
    assert session.layout == "channels_last" and is_channels_last(model[0].weight)
    assert caplog.text.count("training ended before the race") == 1
    with caplog.at_level(logging.INFO):  # a validate after the fit ends the session again: said once
        session.end(model)
    assert caplog.text.count("training ended before the race") == 1


def test_a_session_collected_late_gives_back_its_own_hold_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # A session an earlier run left unclosed, in a reference cycle (a Trainer's), gives torch's utilities back when
    # the collector finds it: at any later moment, perhaps in another run that holds them too. conftest resets the
    # holds before each test, as the second run here starts after that reset.
    import gc
    import types

    from cltrain import nchw_code
    from tests.conftest import reset_torch_utilities

    user = types.ModuleType("user_flat_late")  # did `from torch.nn.utils import parameters_to_vector` at its top
    user.parameters_to_vector = nchw_code._original[0]
    monkeypatch.setitem(sys.modules, user.__name__, user)
    gc.collect()
    gc.disable()  # the earlier session lives until the collect below, as in a run between two collections
    try:
        earlier, _ = _started(_stem())
        earlier.cycle = earlier  # what keeps it for the collector
        del earlier
        reset_torch_utilities()  # between two tests
        session, model = _started(_stem())
        assert torch.nn.utils.parameters_to_vector is nchw_code.parameters_to_vector
        assert user.parameters_to_vector is nchw_code.parameters_to_vector
        gc.collect()  # the earlier session's finalizer gives back its hold
        assert torch.nn.utils.parameters_to_vector is nchw_code.parameters_to_vector
        assert user.parameters_to_vector is nchw_code.parameters_to_vector
        assert torch.nn.utils.parameters_to_vector(model.parameters()).numel() == sum(p.numel() for p in model.parameters())
        session.close()
        assert torch.nn.utils.parameters_to_vector is user.parameters_to_vector is nchw_code._original[0]
    finally:
        gc.enable()


LATE_INSIDE_A_HELD_SECTION = """
import gc
from torch import nn
from cltrain import nchw_code
from cltrain.session import LayoutSession
gc.collect()
gc.disable()
earlier = LayoutSession()
earlier.start(nn.Sequential(nn.Conv2d(3, 4, 3)), device="cpu")
earlier.cycle = earlier
del earlier
with nchw_code._lock:  # what an allocation inside any of nchw_code's held sections may do: collect
    gc.collect()
print(nchw_code.convert.parameters_to_vector is nchw_code._original[0], not nchw_code._holders)
"""


def test_a_session_the_collector_finds_inside_a_held_section_gives_its_hold_back_without_a_deadlock() -> None:
    # the collector runs the late session's finalizer on the thread that holds the lock (a deadlock with a plain
    # lock: the CI's workers waited forever); in a process of its own, so a deadlock fails by the timeout
    proc = warm.run([sys.executable, "-c", LATE_INSIDE_A_HELD_SECTION], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "True"], proc.stdout + proc.stderr[-2000:]


class _RawBody(nn.Module):
    """Every convolution in one block whose forward reads its input's memory as NCHW."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(nn.Conv2d(12, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tests.helpers.user_code import SpaceToDepth

        return self.convs(SpaceToDepth()(x))


def test_a_fallback_that_keeps_every_convolution_in_nchw_stops_the_race() -> None:
    # the check puts `body` (every conv) in NCHW: racing would time the same NCHW model twice and say one layout
    # "faster" on noise; the race stops, nothing is decided or switched
    from cltrain.loops import ChannelsLastRun

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("body", _RawBody())
    model.add_module("head", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)))
    optimizer = torch.optim.AdamW(model.parameters())
    run = ChannelsLastRun(model, optimizer, step=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(12)]
    for x, y in run.batches(batches):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    run.end()
    assert run.layout_checks["train"].verdict == "fallback", run.layout_checks["train"].line("train")
    assert run.session.untimed == "the check keeps every convolution in NCHW"
    assert not run.session.race.decisions and not run.session.race.racing()


def test_under_several_ranks_the_race_times_only_the_steps_of_one_input_size(monkeypatch) -> None:
    # one race covers every size under several ranks: sizes changing in step with the race's rounds (16, 16, 8, 8 px
    # where it runs channels_last, channels_last, NCHW, NCHW) timed every channels_last step at 16 px and every NCHW
    # step at 8 px, and switched to NCHW, 1.5x slower at every size
    import cltrain.session

    class SizedClock(ScriptedClock):
        def start(self) -> None:
            self.layout, self.size = ScriptedClock.session.layout, size

        def stop(self) -> float:
            return {16: 1.0, 8: 0.25}[self.size] * {"channels_last": 1.0, "contiguous": 1.5}[self.layout]

    monkeypatch.setattr(cltrain.session, "StepTimer", SizedClock)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    session = LayoutSession(host=Rank0Of2())
    ScriptedClock.session = session
    session.start(model, device="cpu")
    for step in range(120):
        size = (16, 8, 8, 16)[step % 4]
        batch = session.batch("train", (torch.randn(2, 3, size, size),), model)
        model(batch[0]).sum().backward()
        session.batch_end()
        session.step_end(model)
    session.end(model)
    assert session.decision is not None and session.decision.layout == "channels_last", session.decision
    assert is_channels_last(model[0].weight)


def test_a_checkpoint_saved_again_before_a_kinds_first_batch_keeps_that_kinds_loaded_verdict() -> None:
    # a run loaded and saved again before its first batch wrote the race alone: the next resume checked again
    from cltrain.check.result import LayoutCheck

    first, model = _started(_stem(), layout="channels_last")
    first.fingerprint = lambda: "the same model, step and precision"
    for kind in ("train", "eval"):
        first.check(kind, model, lambda: LayoutCheck("passed", seconds=0.1), report=False)
    saved = first.state_dict()
    assert set(saved["layout_checks"]) == {"train", "eval"}
    again, model = _started(_stem(), layout="channels_last")
    again.fingerprint = first.fingerprint
    again.load_state_dict(saved, model=model)
    assert again.state_dict()["layout_checks"] == saved["layout_checks"]  # before any batch
    again.check("train", model, lambda: pytest.fail("the checkpoint's verdict holds"), report=False)
    kept = again.state_dict()["layout_checks"]
    assert kept["eval"] == saved["layout_checks"]["eval"] and kept["train"]["verdict"] == "passed"  # eval's beside
    other, model = _started(_stem(), layout="channels_last")  # another model: the loaded verdicts are not carried
    other.fingerprint = lambda: "another model"
    other.load_state_dict(saved, model=model)
    other.check("train", model, lambda: LayoutCheck("passed", seconds=0.1), report=False)
    assert set(other.state_dict()["layout_checks"]) == {"train"}
    for session in (first, again, other):
        session.close()
