"""The first-batch layout check covers the whole training step as the Trainer runs it: the code after the
backward (optimizer, clipping), compiled modules, every instance of a faulty class, steps that read the
Trainer; and it leaves no trace in the real optimizer or a compiled module."""

from __future__ import annotations

import pickle


import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cltrain import ChannelsLast
from cltrain.check import checking, is_check_copy
from tests.helpers.user_code import (STEP_PATTERNS, FirstBatchSnapshot, Heatmaps, assert_trains_like_nchw,
                                     run_variants)


# pattern -> (what the line must name, the fix it must give, how the unchecked run fails)
EXPECTED = {
    "optimizer_view": ("the code after the backward", "torch.flatten(x, 1)", "raises"),
    "optimizer_raw_memory": ("the code after the backward", "p.grad", "diverges"),
    "clipping_view": ("the code after the backward", "torch.flatten(x, 1)", "raises"),
    # torch's SGD updates alike in any layout: the line names the hook before it (user_code.py), not torch/optim
    "hook_raw_memory": ("(update at tests/helpers/user_code.py:", "p.grad", "diverges"),
    # torch's AdamW, whose step runs a pre-step hook of the user's: the step runs on the copies
    "step_hook_view": ("(update at tests/helpers/user_code.py:", "torch.flatten(x, 1)", "raises"),
    "compiled_view_head": ("`net`", "torch.flatten(x, 1)", "raises"),
    "compiled_submodule": ("`net._orig_mod`", "torch.flatten(x, 1)", "raises"),
    "class_wide": ("`net.blocks.0.1` and 3 more `SplitNorm`", "torch.flatten(x, 1)", "raises"),
    "reads_datamodule": ("the step code", "torch.flatten(x, 1)", "raises"),
}


@pytest.mark.parametrize("pattern", sorted(EXPECTED))
def test_code_around_the_step_that_assumes_nchw_trains_like_nchw_under_the_callback(pattern: str) -> None:
    assert set(EXPECTED) == set(STEP_PATTERNS)
    # no step ran on the real module: the same BatchNorm statistics as the run without the callback
    assert_trains_like_nchw(run_variants(pattern), *EXPECTED[pattern], statistics=True)


# ---- no trace in the real optimizer and a compiled module; what the copies see ----------------------------------


_COPIES: list[bool] = []  # checking() in each step run on a check copy


class _BNNet(pl.LightningModule):
    """BatchNorm, Adam with state from a step already taken, a hook after the backward, counted calls."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
        self.calls = {"step": 0, "after_backward": 0}

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if is_check_copy(self):
            _COPIES.append(checking())
        else:
            self.calls["step"] += 1
        return F.cross_entropy(self(batch[0]), batch[1])

    def on_after_backward(self) -> None:
        if not is_check_copy(self):
            self.calls["after_backward"] += 1

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        for p in self.parameters():  # state as after a resume: moments and a step count
            optimizer.state[p] = {"step": torch.tensor(5.0), "exp_avg": torch.full_like(p, 0.1),
                                  "exp_avg_sq": torch.full_like(p, 0.2)}
        return optimizer


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g)),
                      batch_size=4)


def _fit(module, callbacks, max_steps: int = 1) -> pl.Trainer:
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, _loader())
    return trainer


def test_a_model_compiled_before_the_loops_door_is_checked_on_eager_copies() -> None:
    from torch._dynamo.utils import counters

    from cltrain.loops import ChannelsLastRun

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = ChannelsLastRun(torch.compile(model, backend="eager"), optimizer, layout="channels_last",
                          step=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    frames = counters["frames"]["ok"]
    batches = run.batches(_loader())
    next(batches)  # the first batch, checked
    assert counters["frames"]["ok"] == frames  # the check's copies compiled nothing (dynamo traced the check's hooks)
    assert run.layout_checks["train"].verdict == "passed"
    batches.close()
    run.end()


@pytest.mark.parametrize("compiled", [False, True])
def test_the_check_leaves_no_trace_in_the_optimizer_or_a_compiled_module(compiled: bool) -> None:
    before, after, callback = FirstBatchSnapshot(), FirstBatchSnapshot(), ChannelsLast()
    torch.manual_seed(0)
    module = _BNNet()
    _COPIES.clear()
    _fit(torch.compile(module, backend="eager") if compiled else module, [before, callback, after])
    check = callback.layout_checks["train"]
    assert check.verdict == "passed", check.line()
    a, b = before.state, after.state
    assert torch.equal(a["rng"], b["rng"])
    for key, value in a["tensors"].items():  # weights and BatchNorm statistics (num_batches_tracked too)
        assert torch.equal(value, b["tensors"][key]), key
    assert all(g is None for g in b["grads"])
    for (ka, sa), (kb, sb) in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].items()):
        assert ka == kb and all(torch.equal(sa[k], sb[k]) for k in sa), ka  # moments and state['step']
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    # The copies ran the step (and said so); the real module's own counters did not move.
    assert a["calls"]["step"] == b["calls"]["step"] == 0 and a["calls"]["after_backward"] == 0
    assert len(_COPIES) >= 2 and all(_COPIES)
    assert module.calls["step"] == 1 and module.calls["after_backward"] == 1
    assert module.net[1].num_batches_tracked.item() == 1
    assert not checking() and not is_check_copy(module)


_SEEN: list[tuple] = []  # what each run of the step read from the trainer


class _TrainerReads(pl.LightningModule):
    """A step that reads what torchgeo's read from the trainer (and the loop), and one that sets the trainer."""

    def __init__(self, sets_trainer: bool) -> None:
        super().__init__()
        self.net = Heatmaps()
        self.sets_trainer = sets_trainer

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        t = self.trainer
        _SEEN.append((is_check_copy(self), t.current_epoch, t.global_step, t.world_size, t.training, t.datamodule,
                      t.estimated_stepping_batches, len(t.callbacks), t.fit_loop.epoch_progress.current.completed))
        if is_check_copy(self):  # the copy's logger is a stand-in that writes nothing
            self.logger.experiment.add_image("x", batch[0])
        x = batch[0][:, :, ::2, ::2]  # a tensor the batch does not hold
        out = self(x)
        if self.sets_trainer:
            self.trainer.should_stop = False
        return F.mse_loss(out.reshape(len(x), -1), torch.zeros(len(x), 4 * x.shape[2] * x.shape[3]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_step_reading_the_trainer_is_checked_through_the_step_and_the_model_alone_on_what_it_was_given() -> None:
    callback = ChannelsLast()
    _SEEN.clear()
    _fit(_TrainerReads(sets_trainer=False), [callback])
    assert callback.layout_checks["train"].verdict == "passed", callback.layout_checks["train"].line()
    copies, real = _SEEN[:-1], _SEEN[-1]
    assert copies and all(seen[0] for seen in copies) and not real[0]
    assert all(seen[1:] == real[1:] for seen in copies)  # every value read as on the real run
    # A step that sets the trainer cannot run on a copy: the model alone is checked on what the step gave it.
    callback = ChannelsLast()
    _fit(_TrainerReads(sets_trainer=True), [callback])
    check = callback.layout_checks["train"]
    assert check.verdict == "passed", check.line()
    assert "the model alone, on the inputs the step gave it" in check.line(), check.line()
    assert "trainer.should_stop cannot be set" in check.line(), check.line()


def test_verify_layout_with_the_optimizer_keeps_a_plain_loop_training() -> None:
    from cltrain.loops import convert_batch, convert_model, verify_layout
    from tests.helpers.user_code import FilterNormSGD, ViewHeadFlat

    torch.manual_seed(0)
    model = convert_model(ViewHeadFlat())
    optimizer = FilterNormSGD(model.parameters())
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    result = verify_layout(model, (x, y), step=lambda m, b: F.cross_entropy(m(b[0]), b[1]), optimizer=optimizer)
    assert result.verdict in ("fallback", "contiguous") and result.findings[0].phase == "update", result.line()
    assert optimizer.state == {} and all(p.grad is None for p in model.parameters())
    batch = convert_batch((x.clone(), y))
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    optimizer.step()  # the conv gradients have NCHW strides now
    # The negative control: without the optimizer the check does not see its code, and the step raises.
    unchecked = convert_model(ViewHeadFlat())
    assert verify_layout(unchecked, (x, y), step=lambda m, b: F.cross_entropy(m(b[0]), b[1])).verdict == "passed"
    F.cross_entropy(unchecked(batch[0]), batch[1]).backward()
    with pytest.raises(RuntimeError, match="view size"):
        FilterNormSGD(unchecked.parameters()).step()


def test_the_copy_of_an_optimizer_steps_the_copied_parameters_only_also_with_an_lr_scheduler() -> None:
    from cltrain.check.copies import copy_optimizer
    from cltrain.check.copies import eager_copy

    model = nn.Conv2d(3, 4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.optim.lr_scheduler.StepLR(optimizer, 1)  # patches optimizer.step with a wrapper calling the original
    memo: dict = {}
    clone = eager_copy(model, memo)
    copied = copy_optimizer(optimizer, memo)
    for p, q in zip(model.parameters(), clone.parameters()):
        p.grad, q.grad = torch.zeros_like(p), torch.ones_like(q)
    weight = model.weight.detach().clone()
    copied.step()
    assert not torch.equal(clone.weight, weight) and len(copied.state) == 2
    assert torch.equal(model.weight, weight) and len(optimizer.state) == 0 and not getattr(optimizer, "_opt_called", 0)


@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD])
def test_an_optimizer_deepcopy_refuses_is_rebuilt_from_what_its_constructor_takes(kind) -> None:
    import threading

    from cltrain.check.copies import copy_optimizer
    from cltrain.check.copies import eager_copy

    model = nn.Conv2d(3, 4, 3)
    optimizer = kind(model.parameters(), lr=0.1)
    optimizer.lock = threading.Lock()  # a user's attribute deepcopy cannot copy
    model.weight.grad, model.bias.grad = torch.ones_like(model.weight), torch.ones_like(model.bias)
    optimizer.step()
    memo: dict = {}
    clone = eager_copy(model, memo)
    copied = copy_optimizer(optimizer, memo)  # AdamW's defaults hold `decoupled_weight_decay`, its __init__ does not
    assert type(copied) is kind and copied.param_groups[0]["params"][0] is clone.weight
    assert copied.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]


def test_an_optimizer_a_session_watches_is_copied_whole_and_its_copy_steps_uncounted() -> None:
    from cltrain.check.copies import copy_optimizer
    from cltrain.check.copies import eager_copy
    from cltrain.host import Host
    from cltrain.session import LayoutSession

    class Mine(torch.optim.AdamW):  # a user's subclass: rebuilt from its defaults it would not construct
        pass

    model = nn.Sequential(nn.Conv2d(3, 4, 3))
    optimizer = Mine(model.parameters(), lr=0.1)
    session = LayoutSession(host=Host(optimizers=lambda: [optimizer]))
    session.watch_optimizers = True
    session.start(model, device="cpu")
    session.batch("train", (torch.randn(2, 3, 8, 8),), model)
    memo: dict = {}
    clone = eager_copy(model, memo)
    copied = copy_optimizer(optimizer, memo)  # deep-copied with the session's step hook on it
    for p in clone.parameters():
        p.grad = torch.ones_like(p)
    copied.step()
    assert session.optimizer_stepped() is False  # the copy's step is not the run's
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert session.optimizer_stepped() is True and session.optimizer_stepped() is False
    session.close()
    pickle.loads(pickle.dumps(copied.__dict__["_optimizer_step_post_hooks"]))  # the hook pickles, inert


class _TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers and two schedulers, written as GAN projects write it: the step
    unpacks ``self.optimizers()`` and ``self.lr_schedulers()``, expects ``LightningOptimizer``s, toggles."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 3, 1))
        self.disc = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(8, 1))

    def forward(self, x):
        return self.gen(x)

    def training_step(self, batch, batch_idx):
        from lightning.pytorch.core.optimizer import LightningOptimizer

        optimizers, schedulers = self.optimizers(), self.lr_schedulers()
        if len(optimizers) != len(schedulers):  # what such projects check
            raise ValueError("When using more than one optimizer, we need as many schedulers as optimizers!")
        (opt_g, opt_d), (sch_g, sch_d) = optimizers, schedulers
        assert isinstance(opt_g, LightningOptimizer) and isinstance(opt_d, torch.optim.Adam)
        x = batch[0]
        with opt_g.toggle_model():
            fake = self(x)
            loss_g = F.softplus(-self.disc(fake)).mean() + F.mse_loss(fake, x)
            opt_g.zero_grad()
            self.manual_backward(loss_g)
            opt_g.step()
        with opt_d.toggle_model():
            loss_d = F.softplus(self.disc(fake.detach())).mean() + F.softplus(-self.disc(x)).mean()
            opt_d.zero_grad()
            self.manual_backward(loss_d)
            opt_d.step()
        sch_g.step()
        sch_d.step()

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.gen.parameters(), lr=1e-3)
        opt_d = torch.optim.Adam(self.disc.parameters(), lr=1e-3)
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, 1, 0.5),
                                torch.optim.lr_scheduler.StepLR(opt_d, 1, 0.5)]


def test_a_manual_step_with_two_optimizers_and_schedulers_is_checked_and_steps_nothing_real() -> None:
    callback = ChannelsLast()
    torch.manual_seed(0)
    module = _TwoOptimizers()
    trainer = _fit(module, [callback], max_steps=2)
    check = callback.layout_checks["train"]
    assert check.verdict == "passed", check.line()
    assert "raised" not in check.line() and "skipped" not in check.line()
    # the real schedulers stepped once per real step only (two optimizer steps per training step)
    assert [c.scheduler.last_epoch for c in trainer.lr_scheduler_configs] == [1, 1]
    assert [o.param_groups[0]["lr"] for o in trainer.optimizers] == [5e-4, 5e-4]


class _Bf16Head(pl.LightningModule):
    """A step whose own code needs the Trainer's autocast: a bfloat16 head applied in the step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Parameter(torch.randn(5, 8, dtype=torch.bfloat16))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(F.linear(self(batch[0]), self.head).float(), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_step_that_needs_autocast_is_checked_whole_in_the_training_precision() -> None:
    # float32 first; where the step raises there, the step again under the Trainer's bf16 autocast, and only where
    # that raises too the model alone.
    callback = ChannelsLast()
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", precision="bf16-mixed", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback])
    trainer.fit(_Bf16Head(), _loader())
    check = callback.layout_checks["train"]
    assert check.verdict == "passed" and "model alone" not in check.line(), check.line()


def test_an_error_in_a_line_is_cut_at_a_word_with_an_ellipsis() -> None:
    # "... If you were attempting to deepcopy a module, this may b)": torch's message cut at 160 characters
    from cltrain.check.localise import first_line

    long = ("Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol at the moment.  If "
            "you were attempting to deepcopy a module, this may be because of a torch.nn.utils.weight_norm usage")
    line = first_line(RuntimeError(long + "\nsecond line"))
    assert line.endswith("this may…") and len(line) <= len("RuntimeError: ") + 160
    assert first_line(ValueError("short\nmore")) == "ValueError: short"


class _Bf16True(pl.LightningModule):
    def __init__(self, faulty: bool, cast: bool = False) -> None:
        super().__init__()
        from tests.helpers.plain_modules import NCHWBackwardNet

        self.net, self.cast = NCHWBackwardNet(faulty), cast

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0].bfloat16() if self.cast else batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-3)


def test_a_bf16_true_run_is_checked_in_float32() -> None:
    # Lightning's bf16-true makes the default dtype bfloat16 in the step: the check's own vectors stay float32 (an
    # addmv of float32 and bfloat16 made it "not checked"), and the copies compute in float32, where the fault shows
    torch.manual_seed(0)
    module = _Bf16True(faulty=True)
    data = TensorDataset(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))
    callback = ChannelsLast(layout="channels_last")
    trainer = pl.Trainer(accelerator="cpu", precision="bf16-true", max_steps=1, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(data, batch_size=8))
    assert callback.layout_checks["train"].verdict in ("fallback", "contiguous"), callback.layout_checks["train"]
    # a step that casts to bfloat16 itself cannot run on float32 copies: checked in the training precision
    callback = ChannelsLast(layout="channels_last")
    trainer = pl.Trainer(accelerator="cpu", precision="bf16-true", max_steps=1, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_Bf16True(faulty=False, cast=True), DataLoader(data, batch_size=8))
    assert callback.layout_checks["train"].verdict == "passed", callback.layout_checks["train"]


class _Net(pl.LightningModule):
    def __init__(self, view: bool) -> None:
        super().__init__()
        self.body, self.fc, self.view = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), nn.Linear(4 * 6 * 6, 2), view

    def training_step(self, batch, batch_idx):
        f = self.body(batch[0])
        return F.cross_entropy(self.fc(f.view(f.size(0), -1) if self.view else f.flatten(1)), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-3)


def test_a_callback_given_to_a_second_trainer_checks_its_model_afresh() -> None:
    # one callback, two fits (a search's trials, a reused callback list): the second model's view was not checked (the
    # first model's verdict held) and raised in the Trainer
    callback = ChannelsLast(layout="channels_last")
    data = DataLoader(TensorDataset(torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 0, 1])), batch_size=4)
    flat, view = _Net(view=False), _Net(view=True)
    checks = []
    for model in (flat, view, view):
        trainer = pl.Trainer(accelerator="cpu", max_steps=1, callbacks=[callback], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, data)
        checks.append(callback.layout_checks["train"])
    assert [c.verdict for c in checks] == ["passed", "fallback", "fallback"], checks
    assert checks[2] is checks[1]  # the same model fitted again keeps its verdict, not checked again


def test_checking_is_true_in_every_step_run_on_a_copy_also_while_the_fallbacks_are_timed() -> None:
    # the steps timing a whole-model fallback against channels_last ran outside the check's flag: a side effect
    # guarded with `if not checking():` ran for each of them
    from cltrain.loops import convert_model, verify_layout

    class FilterNormAdamW(torch.optim.AdamW):
        @torch.no_grad()
        def step(self, closure=None):
            for p in (p for group in self.param_groups for p in group["params"] if p.grad is not None):
                if p.dim() == 4:
                    p.grad.div_(p.grad.view(p.shape[0], -1).norm(dim=1).clamp_min(1e-6).view(-1, 1, 1, 1))
            return super().step(closure)

    seen: list[tuple[bool, bool]] = []

    def step(m, b):
        seen.append((checking(), is_check_copy(m)))
        return F.cross_entropy(m(b[0]), b[1])

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(8, 5))
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g))
    net = convert_model(net)
    result = verify_layout(net, batch, step, optimizer=FilterNormAdamW(net.parameters()), report=False)
    assert result.timings is not None, result.line()  # the whole model's fallback was timed
    assert seen and all(flag == copy for flag, copy in seen), seen


def test_torchs_own_step_hook_is_not_the_users_but_a_global_hook_of_the_users_is() -> None:
    # KINETO_USE_DAEMON (on-demand tracing, set cluster-wide on some sites): `import torch.profiler` registers its
    # `_optimizer_post_hook` for every optimizer, and every check re-ran torch's optimizers as if it were the user's
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torch.profiler import _optimizer_post_hook

    from cltrain.layout.optimizer_state import user_step_hooks

    optimizer = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    handles = [register_optimizer_step_post_hook(_optimizer_post_hook)]
    try:
        assert not user_step_hooks(optimizer)
        handles.append(register_optimizer_step_pre_hook(lambda o, args, kwargs: None))
        assert user_step_hooks(optimizer)
    finally:
        for handle in handles:
            handle.remove()


def test_a_step_hook_on_torchs_optimizer_is_checked_in_a_plain_loop_too() -> None:
    from cltrain.loops import convert_model, verify_layout
    from tests.helpers.user_code import _filter_clipping

    torch.manual_seed(0)
    net = convert_model(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten(), nn.Linear(8, 5)))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    optimizer.register_step_pre_hook(_filter_clipping)  # per-filter clipping written with view
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g))
    result = verify_layout(net, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]), optimizer=optimizer,
                           report=False)
    assert result.verdict in ("fallback", "contiguous") and "the code after the backward raised" in result.line(), \
        result.line()
    assert optimizer.state == {}  # the real optimizer did not step
