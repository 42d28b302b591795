"""The race of the layouts around the code users write: gradient accumulation by hand (Lightning's manual
optimization, a plain or Accelerate loop), optimizers that wrap others, a model or an optimizer step compiled after
the run converted the model (not raced), epochs that end inside an accumulation cycle (by hand, or Lightning's),
and an averaged copy the user's own code keeps. (Each door's own accumulation is a column of the door table:
tests/core/test_doors.py.)"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from cltrain import ChannelsLast
from tests.helpers.door_battery import PAUSE, SlowStep, base, images
from tests.helpers.plain_modules import SlowIn

pytestmark = pytest.mark.usefixtures("steady")  # the race times SlowIn's pauses alone


class ManualAccumulation(pl.LightningModule):
    """Manual optimization stepping its (slow) optimizer every second batch, as Lightning's docs show it."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = SlowIn("contiguous", net=base(), seconds=0.03)  # NCHW's forward 0.03 s slower

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        self.manual_backward(F.cross_entropy(self(batch[0]), batch[1]) / 2)
        if (batch_idx + 1) % 2 == 0:
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        return SlowStep(self.parameters(), lr=1e-2)


def test_manual_optimization_accumulating_two_batches_is_timed_a_whole_step_at_a_time() -> None:
    callback = ChannelsLast()
    trainer = pl.Trainer(max_epochs=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[callback])
    trainer.fit(ManualAccumulation(), DataLoader(images(), batch_size=2))
    decision = callback.decision
    # each timed step holds one optimizer step; batch by batch, NCHW's timed batches held none and looked faster
    assert decision is not None and min(decision.seconds.values()) >= PAUSE, decision
    assert decision.layout == "channels_last", callback.session.decision_line(decision)
    check = callback.layout_checks["train"]  # the optimizer, with the race's step hook on it, copied for the check
    assert check.verdict == "passed" and not check.notes, check.line()


def test_a_loop_that_steps_another_optimizer_than_the_one_given_is_timed_batch_by_batch(monkeypatch, caplog) -> None:
    import logging

    import cltrain.session
    from cltrain.loops import ChannelsLastRun

    monkeypatch.setattr(cltrain.session, "UNSTEPPED_BATCHES", 8, raising=False)
    model = SlowIn("channels_last", net=base(), seconds=0.05)  # channels_last's forward 0.05 s slower
    given = torch.optim.SGD(model.parameters(), lr=0.01)
    stepped = torch.optim.SGD(model.parameters(), lr=0.01)  # made later, and not given to the run
    run = ChannelsLastRun(model, given, verify=False)
    with caplog.at_level(logging.INFO):
        for _ in range(4):
            for x, y in run.batches(DataLoader(images(), batch_size=2)):
                F.cross_entropy(model(x), y).backward()
                stepped.step()
                stepped.zero_grad()
    run.end()
    assert "none of the optimizers given stepped in 8 batches" in caplog.text
    # without the fallback every step stays open for good and the race never ends
    assert run.decision is not None and run.decision.layout == "contiguous", caplog.text


@pytest.fixture
def timed(monkeypatch) -> list[float]:
    """The seconds of every step the race records."""
    from cltrain.timing.layout_race import LayoutRace

    found: list[float] = []
    record = LayoutRace.record
    monkeypatch.setattr(LayoutRace, "record", lambda self, key, size, layout, seconds, **kw:
                        found.append(seconds) or record(self, key, size, layout, seconds, **kw))
    return found


@pytest.mark.parametrize("n", [12, 10])
def test_an_accelerate_loop_accumulating_by_hand_is_timed_a_whole_step_at_a_time(n, timed) -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from cltrain.integrations.accelerate import prepare_channels_last
    from cltrain.integrations.inputs_hook import ChannelsLastInputs

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True)  # no accumulation plugin: the loop counts its own batches
    model = prepare_channels_last(SlowIn("contiguous", net=base(), seconds=0.03), accelerator)
    wrapped, optimizer, loader = accelerator.prepare(model, SlowStep(model.parameters(), lr=1e-2),
                                                     DataLoader(images(n), batch_size=2))
    for _ in range(4):
        wrapped.train()
        for i, (x, y) in enumerate(loader):
            accelerator.backward(F.cross_entropy(wrapped(x), y) / 2)
            if (i + 1) % 2 == 0:
                optimizer.step()
                optimizer.zero_grad()
        wrapped.eval()  # the epoch's evaluation: with 10 images it ends a cycle before its optimizer step
        with torch.no_grad():
            wrapped(images(2)[0][0][None])
    session = ChannelsLastInputs.of(model).session
    decision = session.decision
    assert decision is not None and min(timed) >= PAUSE, (decision, timed)  # every timed step holds a step
    assert decision.layout == "channels_last", session.decision_line(decision)


@pytest.mark.parametrize("control", [False, True], ids=["", "control"])
@pytest.mark.parametrize("compiled", ["model", "optimizer step"])
def test_a_loop_that_runs_compiled_code_is_not_raced(compiled, control, monkeypatch, caplog) -> None:
    import logging

    from torch._dynamo.utils import counters

    import cltrain.session
    from cltrain.loops import ChannelsLastRun

    if control:  # no count of dynamo's frames: the race switches, and each switch compiles the step again
        monkeypatch.setattr(cltrain.session, "compiled_frames", lambda: 0)
    model = base()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    run = ChannelsLastRun(model, optimizer)  # compiled after the run converted it, as the docs say
    forward = torch.compile(model, backend="eager") if compiled == "model" else model
    step = torch.compile(optimizer.step, backend="eager") if compiled == "optimizer step" else optimizer.step
    layouts, frames = [], []
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            for x, y in run.batches(DataLoader(images(), batch_size=2)):
                layouts.append(run.layout)
                F.cross_entropy(forward(x), y).backward()
                step()
                optimizer.zero_grad()
                frames.append(counters["frames"]["ok"])
    run.end()
    assert len(layouts) == 12
    if control:  # the race's first NCHW step is the 6th
        assert "contiguous" in layouts and frames[-1] > frames[4], (layouts, frames)
        return
    assert set(layouts) == {"channels_last"} and frames[-1] == frames[2], (layouts, frames)
    assert run.decision is None
    assert run.session.untimed == "torch.compile compiled the training step"
    assert "torch.compile compiled code in the training steps, so the layouts are not raced" in caplog.text


class _Unhooked(torch.optim.Optimizer):
    """A wrapper of the user's own that, as timm's Lookahead, does not call ``Optimizer.__init__`` (so its step runs no
    hooks) and holds the optimizer it steps under a name of its own: nothing tells when it steps."""

    def __init__(self, params) -> None:
        self.fast = SlowStep(params, lr=1e-2)
        self.param_groups, self.state, self.defaults = self.fast.param_groups, self.fast.state, self.fast.defaults
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    def step(self, closure=None):
        return self.fast.step(closure)


def _accumulating_loop(optimizer, model, caplog) -> Any:
    import logging

    from cltrain.loops import ChannelsLastRun

    run = ChannelsLastRun(model, optimizer, verify=False)  # the check's copy of the optimizer would, too
    with caplog.at_level(logging.INFO):
        for _ in range(4):
            for i, (x, y) in enumerate(run.batches(DataLoader(images(), batch_size=2))):
                (F.cross_entropy(model(x), y) / 2).backward()
                if (i + 1) % 2 == 0:
                    optimizer.step()
                    model.zero_grad()  # (the optimizer's own zero_grad would have torch patch its class's step)
    run.end()
    return run


def test_a_wrapping_optimizer_whose_own_step_runs_no_hooks_is_watched_through_the_one_it_wraps(caplog) -> None:
    timm_optim = pytest.importorskip("timm.optim")
    model = SlowIn("contiguous", net=base(), seconds=0.03)  # NCHW's forward 0.03 s slower
    # timm's Lookahead does not call Optimizer.__init__: it takes step hooks and never runs them
    run = _accumulating_loop(timm_optim.Lookahead(SlowStep(model.parameters(), lr=1e-2)), model, caplog)
    assert run.decision is not None and min(run.decision.seconds.values()) >= PAUSE, run.decision
    assert run.decision.layout == "channels_last", run.session.decision_line(run.decision)
    assert "cannot be watched" not in caplog.text


def test_an_optimizer_nothing_can_watch_is_timed_batch_by_batch_and_says_so(caplog) -> None:
    model = SlowIn("contiguous", net=base(), seconds=0.03)
    run = _accumulating_loop(_Unhooked(model.parameters()), model, caplog)
    assert "the steps of _Unhooked cannot be watched" in caplog.text
    assert run.decision is not None, caplog.text  # batch by batch: the race still ends


def test_a_cycle_the_epoch_ends_before_its_optimizer_step_is_not_timed(timed) -> None:
    callback = ChannelsLast()
    trainer = pl.Trainer(max_epochs=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[callback])
    # 5 batches an epoch, the optimizer stepping every second: each epoch's last batch is a cycle with no step
    trainer.fit(ManualAccumulation(), DataLoader(images(10), batch_size=2))
    assert timed and min(timed) >= PAUSE, timed  # every timed step holds an optimizer step


def test_a_window_of_accumulation_the_epoch_cuts_short_is_not_timed(timed) -> None:
    # 5 batches an epoch accumulated 2 by 2: Lightning steps at the epoch's last batch too, a step of one batch, which
    # the race timed as a whole one (and switched on it)
    from tests.helpers.door_battery import pause

    class SlowBatches(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = base()

        def training_step(self, batch, batch_idx):
            pause(PAUSE / 2)  # each batch: a window of two holds PAUSE
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         accumulate_grad_batches=2, callbacks=[ChannelsLast()])
    trainer.fit(SlowBatches(), DataLoader(images(10), batch_size=2))
    assert len(timed) == 4 and min(timed) >= PAUSE, timed


@pytest.mark.parametrize("given", [True, False])
def test_the_lightning_door_takes_an_averaged_copy_the_users_code_keeps(given) -> None:
    from tests.helpers.door_battery import average_of, slow

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = slow()  # channels_last's forward slow: the race switches to NCHW

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def on_train_batch_end(self, outputs, batch, batch_idx):
            kept["ema"].update_parameters(self.net)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    module = Module()
    kept = {"ema": average_of(module.net)}  # held by the user's code, not by a callback or the module
    callback = ChannelsLast(copies=(lambda: [kept["ema"]]) if given else ())
    trainer = pl.Trainer(max_steps=14, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[callback])
    trainer.fit(module, DataLoader(images(), batch_size=2))
    assert callback.decision is not None and callback.decision.layout == "contiguous", callback.decision
    convs = [m.weight for m in kept["ema"].modules() if isinstance(m, torch.nn.Conv2d)]
    assert all(w.is_contiguous() for w in convs) is given  # not given: the copy stays channels_last


def test_a_run_given_no_optimizer_says_each_batch_is_timed_as_a_step_where_it_races(caplog) -> None:
    import logging

    from cltrain.loops import ChannelsLastRun

    for given, layout in ((False, "auto"), (True, "auto"), (False, "channels_last")):
        caplog.clear()
        model = base()
        run = ChannelsLastRun(model, [torch.optim.SGD(model.parameters(), lr=0.1)] * given, verify=False,
                              layout=layout)  # a pinned layout (or a sharded model) runs no race: nothing is timed
        with caplog.at_level(logging.INFO):
            for _ in run.batches(DataLoader(images(4), batch_size=2)):
                pass
        run.end()
        said = "no optimizer given: each batch is timed as a step" in caplog.text
        assert said is (not given and layout == "auto"), caplog.text


def test_a_copy_made_after_the_door_and_named_by_a_function_follows_the_model() -> None:
    from torch.optim.swa_utils import AveragedModel

    from cltrain.loops import ChannelsLastRun
    from tests.helpers.door_battery import slow

    model = slow()  # channels_last's forward slow: the race switches to NCHW
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = ChannelsLastRun(model, optimizer, copies=lambda: [ema])  # as the docs write it (a NameError before)
    ema = AveragedModel(model)  # made after the door converted the model: channels_last
    for _ in range(3):
        for x, y in run.batches(DataLoader(images(), batch_size=2)):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            ema.update_parameters(model)
    run.end()
    assert run.decision is not None and run.decision.layout == "contiguous", run.decision
    assert all(m.weight.is_contiguous() for m in ema.modules() if isinstance(m, torch.nn.Conv2d))


def test_evaluation_calls_do_not_count_as_batches_without_an_optimizer_step(monkeypatch, caplog, timed) -> None:
    import logging

    import cltrain.session

    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from cltrain.integrations.accelerate import prepare_channels_last

    monkeypatch.setattr(cltrain.session, "UNSTEPPED_BATCHES", 8, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True)
    model = prepare_channels_last(SlowIn("contiguous", net=base(), seconds=0.03), accelerator)
    wrapped, optimizer = accelerator.prepare(model, SlowStep(model.parameters(), lr=1e-2))
    with caplog.at_level(logging.INFO):
        for epoch in range(4):
            for i, (x, y) in enumerate(DataLoader(images(), batch_size=2)):
                accelerator.backward(F.cross_entropy(wrapped(x), y) / 2)
                if epoch == 0 and i == 0:  # an evaluation of more batches than the fallback waits for, before the
                    wrapped.eval()  # first optimizer step
                    with torch.no_grad():
                        for image, _ in images(10):
                            wrapped(image[None])
                    wrapped.train()
                if (i + 1) % 2 == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    assert "none of the optimizers given stepped" not in caplog.text
    assert timed and min(timed) >= PAUSE, timed  # whole steps, each with its optimizer step
