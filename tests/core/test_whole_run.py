"""The layout for the whole run: what touches the model after the first batch (Lightning's ModelPruning, a hook
writing ``.data``, torch's flat-parameter utilities) keeps both the numbers of the run without cltrain and the
layout, under ``lightning`` and ``pytorch_lightning``."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from cltrain import ChannelsLast
from cltrain.check.copies import checking

PACKAGES = ["lightning.pytorch", "pytorch_lightning"]


def _pl(package: str):
    return importlib.import_module(package)


def _net() -> nn.Module:
    torch.manual_seed(0)
    # no bias before the BatchNorm: its gradient is rounding noise alone, which Adam scales up to the learning rate
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
                         nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 4))


def _module(package: str, optimizer: str = "sgd", nudge: float = 0.0, record: list | None = None):
    pl = _pl(package)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()
            with torch.no_grad():
                for p in self.net.parameters():
                    p.add_(nudge)

        def training_step(self, batch, batch_idx):
            if record is not None and not checking():  # the real steps, not the check's copies
                convs = [m for m in self.net if isinstance(m, nn.Conv2d)]
                opt = self.optimizers().optimizer
                weights = [getattr(c, "weight_orig", c.weight) for c in convs]
                record.append([(w.is_contiguous(memory_format=torch.channels_last),
                                all(v.stride() == w.stride() for v in opt.state.get(w, {}).values()
                                    if torch.is_tensor(v) and v.shape == w.shape)) for w in weights])
            return F.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            if optimizer == "adamw":
                return torch.optim.AdamW(self.parameters(), lr=1e-2)
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return Net()


def _fit(package: str, callbacks: list, module, epochs: int = 3):
    pl = _pl(package)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
    torch.manual_seed(2)
    pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
               num_sanity_val_steps=0).fit(module, DataLoader(data, batch_size=4))
    return module


def _weights(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _pruning(package: str, method: str, module=None, **kwargs):
    if module is not None and method == "ln_structured":  # structured pruning takes the convolutions' weights
        kwargs["parameters_to_prune"] = [(m, "weight") for m in module.net if isinstance(m, nn.Conv2d)]
    return getattr(_pl(package), "callbacks").ModelPruning(method, amount=0.3, verbose=0, **kwargs)


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("method,optimizer,kwargs", [
    ("l1_unstructured", "sgd", {}),  # ModelPruning's defaults: global, lottery ticket reset, permanent at the end
    ("random_unstructured", "adamw", {}),
    ("ln_structured", "adamw", {"pruning_dim": 0, "pruning_norm": 1, "use_global_unstructured": False}),
], ids=["l1-defaults", "random-global", "ln-structured"])
def test_model_pruning_trains_with_the_numbers_of_the_run_without_cltrain_and_keeps_the_layout(
        package, method, optimizer, kwargs, caplog):
    runs = {}
    for name, module in (("plain", _module(package, optimizer)), ("nudged", _module(package, optimizer, nudge=1e-7))):
        runs[name] = _fit(package, [_pruning(package, method, module, **kwargs)], module)
    plain, nudged, seen = runs["plain"], runs["nudged"], []
    module = _module(package, optimizer, record=seen)
    with caplog.at_level(logging.INFO, logger="cltrain"):
        # pinned: every step is recorded in channels_last (the default's race runs a few steps in NCHW)
        ours = _fit(package, [_pruning(package, method, module, **kwargs), ChannelsLast(layout="channels_last")],
                    module)
    # the same weights pruned: the zeros where the run without cltrain has them
    assert torch.equal(_weights(ours) == 0, _weights(plain) == 0)
    noise = (_weights(nudged) - _weights(plain)).abs().max()
    assert (_weights(ours) - _weights(plain)).abs().max() <= 10 * noise + 1e-6
    # every step in channels_last, the optimizer state in its parameters' strides; channels_last at the end
    assert len(seen) == 6 and all(all(cl and state for cl, state in step) for step in seen), seen
    assert all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in ours.net if isinstance(m, nn.Conv2d))
    said = [r.getMessage() for r in caplog.records if "prunes the weights in NCHW" in r.getMessage()]
    assert len(said) == 1 and "pytorch#96743" in said[0]


def _prune(m: nn.Module) -> None:
    from torch.nn.utils import prune

    prune.l1_unstructured(m, "weight", amount=0.3)


def _keep_output(m: nn.Module) -> None:
    m.kept = {}  # a forward hook keeping activations for a feature loss, with their graphs
    m.register_forward_hook(lambda mod, args, out: mod.kept.__setitem__("out", [out]))


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("wrap", [_prune, nn.utils.weight_norm, nn.utils.spectral_norm, _keep_output],
                         ids=["prune", "weight_norm", "spectral_norm", "kept-activations"])
def test_a_model_whose_weight_a_hook_computes_is_checked_and_trains_with_the_numbers_of_the_run_without_cltrain(
        package, wrap):
    # torch.nn.utils.prune's weight (weight_orig * weight_mask), the old-style weight_norm's and spectral_norm's (as
    # lightly's DINO head holds them), activations a hook keeps in a dict: no leaves after a forward; deepcopy refused
    # the check's copy and the check was skipped, so a step that assumes NCHW crashed the run instead of falling back
    def wrapped(nudge: float = 0.0):
        module = _module(package, "adamw", nudge=nudge)
        for m in module.net:
            if isinstance(m, nn.Conv2d):
                wrap(m)
        module.net(torch.zeros(1, 3, 16, 16))  # a forward: the hooks' weights are computed, with their graphs
        return module

    plain, nudged = _fit(package, [], wrapped()), _fit(package, [], wrapped(1e-7))
    callback = ChannelsLast(layout="channels_last")
    ours = _fit(package, [callback], wrapped())
    assert callback.layout_checks["train"].verdict == "passed", callback.layout_checks["train"]
    noise = (_weights(nudged) - _weights(plain)).abs().max()
    assert torch.equal(_weights(ours) == 0, _weights(plain) == 0)
    assert (_weights(ours) - _weights(plain)).abs().max() <= 10 * noise + 1e-6


def test_model_pruning_fails_without_the_workaround(monkeypatch):
    # the negative control: torch's pruning on channels_last weights, as ChannelsLast would hand it over
    import contextlib

    import cltrain.callback
    import cltrain.session

    monkeypatch.setattr(cltrain.callback, "guard_pruning", lambda *args: [])
    monkeypatch.setattr(cltrain.session, "torch_utilities", lambda say=None: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        _fit("lightning.pytorch", [_pruning("lightning.pytorch", "l1_unstructured"), ChannelsLast(layout="channels_last")],
             _module("lightning.pytorch"), epochs=2)


def _drifts(package: str, hook: str = "on_train_epoch_end"):
    pl = _pl(package)

    def write(self, trainer, pl_module):
        for m in pl_module.net:
            if isinstance(m, nn.Conv2d):
                m.weight.data = m.weight.data.contiguous()

    # a hook that writes weights through ``.data`` in NCHW (as a user's re-initialisation does)
    return type("WritesData", (pl.Callback,), {hook: write})()


@pytest.mark.parametrize("hook, when", [("on_train_epoch_end", "after epoch 0's end (WritesData ran then)"),
                                        ("on_train_start", "before the first training step")])
@pytest.mark.parametrize("package", PACKAGES)
def test_weights_a_hook_puts_in_nchw_are_back_in_channels_last_before_the_next_step(package, hook, when, caplog):
    seen: list = []
    with caplog.at_level(logging.INFO, logger="cltrain"):
        _fit(package, [_drifts(package, hook), ChannelsLast(layout="channels_last")], _module(package, record=seen))
    assert all(all(cl and state for cl, state in step) for step in seen), seen
    said = [r.getMessage() for r in caplog.records if "left their layout" in r.getMessage()]
    assert len(said) == 1 and when in said[0], said


def test_without_the_watch_a_hook_leaves_the_weights_in_nchw(monkeypatch):
    from cltrain.session import LayoutSession

    monkeypatch.setattr(LayoutSession, "boundary", lambda *args, **kwargs: [])
    seen: list = []
    _fit("lightning.pytorch", [_drifts("lightning.pytorch"), ChannelsLast(layout="channels_last")],
         _module("lightning.pytorch", record=seen))
    assert not any(cl for cl, _ in seen[-1])


def test_parameters_to_vector_and_back_take_channels_last_weights_in_a_run():
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    pl = _pl("lightning.pytorch")
    reference = parameters_to_vector(_net().parameters())
    seen = []

    class Flat(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0 and trainer.current_epoch == 0:
                vector = torch.nn.utils.parameters_to_vector(pl_module.parameters())
                seen.append(torch.equal(vector, reference))
                torch.nn.utils.vector_to_parameters(vector, pl_module.parameters())
                seen.append(all(m.weight.is_contiguous(memory_format=torch.channels_last)
                                for m in pl_module.net if isinstance(m, nn.Conv2d)))

    _fit("lightning.pytorch", [ChannelsLast(layout="channels_last"), Flat()], _module("lightning.pytorch"), epochs=1)
    assert seen == [True, True]
    assert parameters_to_vector is torch.nn.utils.parameters_to_vector  # torch's own again after the run
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="view size"):
        parameters_to_vector(conv.parameters())
    vector_to_parameters(torch.zeros(112), conv.parameters())  # torch's own leaves the weight in NCHW
    assert not conv.weight.is_contiguous(memory_format=torch.channels_last)



def test_each_stage_of_one_trainer_leaves_nothing_behind_in_the_session():
    # a notebook's evaluation loop: each trainer.validate on one Trainer left a finalizer, its closed ExitStack and
    # the session's bound method registered until the callback was collected (about 1.1 KB a call)
    import weakref

    pl = _pl("lightning.pytorch")
    module = _module("lightning.pytorch")
    module.validation_step = lambda batch, batch_idx: F.cross_entropy(module.net(batch[0]), batch[1])
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 4, (8,), generator=g)),
                      batch_size=4)
    callback = ChannelsLast(layout="channels_last")
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
                         num_sanity_val_steps=0)
    trainer.fit(module, data)
    trainer.validate(module, data, verbose=False)
    registered = len(weakref.finalize._registry)
    for _ in range(5):
        trainer.validate(module, data, verbose=False)
        assert torch.nn.utils.parameters_to_vector.__module__ == "torch.nn.utils.convert_parameters"  # given back
    assert len(weakref.finalize._registry) == registered
    assert all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in module.net if isinstance(m, nn.Conv2d))



def test_a_second_fit_on_one_trainer_says_the_races_decision_holds(caplog, steady):
    # the second fit's line said "model layout is contiguous; the first training steps race it against NCHW", and
    # no race came: the decision of the first fit held, as it should
    from tests.helpers.plain_modules import Classifier, SlowIn, loader

    pl = _pl("lightning.pytorch")
    torch.manual_seed(0)
    module, callback = Classifier(net=SlowIn("channels_last")), ChannelsLast()
    trainer = pl.Trainer(max_steps=24, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, callbacks=[callback],
                         num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, loader(4, 2))
    decided = callback.decision
    assert decided is not None and decided.layout == "contiguous"
    trainer.fit_loop.epoch_loop.max_steps = 28
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cltrain"):
        trainer.fit(module, loader(4, 2))
    lines = [r.getMessage() for r in caplog.records if "model layout is" in r.getMessage()]
    assert len(lines) == 1 and "the race's decision holds for the inputs it timed: NCHW" in lines[0], lines
    assert "race it" not in lines[0], lines
    assert callback.decision is decided and trainer.global_step == 28


@pytest.mark.parametrize("full", [False, True], ids=["1x1 and depthwise only", "with a 3x3"])
def test_vector_to_parameters_keeps_channels_last_on_1x1_and_depthwise_kernels(full):
    from cltrain.loops import ChannelsLastRun

    torch.manual_seed(0)  # (O, I, 1, 1) and (O, 1, kH, kW) kernels: contiguous to torch in channels_last as well
    net = nn.Sequential(*[nn.Conv2d(3, 8, 3)] * full, nn.Conv2d(8 if full else 3, 8, 1), nn.Conv2d(8, 8, 3, groups=8),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    run = ChannelsLastRun(net, torch.optim.SGD(net.parameters(), lr=0.1), layout="channels_last", verify=False)
    before = [p.detach().clone() for p in net.parameters()]
    vector = torch.nn.utils.parameters_to_vector(net.parameters())
    torch.nn.utils.vector_to_parameters(vector * 2, net.parameters())
    run.end()
    convs = [m.weight for m in net if isinstance(m, nn.Conv2d)]
    assert all(w.stride() == w.clone(memory_format=torch.channels_last).stride() for w in convs), \
        [w.stride() for w in convs]
    assert all(torch.equal(p, 2 * b) for p, b in zip(net.parameters(), before))


def _resumable_fit(tmp_path, module, callback, epochs: int, ckpt_path=None):
    pl = _pl("lightning.pytorch")
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, callbacks=[callback],
                         num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return trainer


def test_a_resumed_run_applies_the_checkpoints_verdict_and_checks_again_when_the_step_changed(tmp_path, caplog):
    first = _resumable_fit(tmp_path, _module("lightning.pytorch"), ChannelsLast(), epochs=1)
    ckpt = first.checkpoint_callback.best_model_path
    assert first.callbacks[0].layout_checks["train"].verdict == "passed"
    with caplog.at_level(logging.INFO, logger="cltrain"):
        same = ChannelsLast()
        _resumable_fit(tmp_path, _module("lightning.pytorch"), same, epochs=2, ckpt_path=ckpt)
    resumed = same.layout_checks["train"]
    assert resumed.verdict == "passed" and "verdict of the checkpoint" in resumed.line() and resumed.seconds == 0
    assert [r for r in caplog.records if "verdict of the checkpoint" in r.getMessage()]

    changed_module = _module("lightning.pytorch")
    step = type(changed_module).training_step

    class Changed(type(changed_module)):
        def training_step(self, batch, batch_idx):  # another step: the verdict does not carry over
            return step(self, batch, batch_idx) * 2

    changed_module.__class__ = Changed
    again = ChannelsLast()
    _resumable_fit(tmp_path, changed_module, again, epochs=2, ckpt_path=ckpt)
    assert again.layout_checks["train"].seconds > 0 and "checked again" in again.layout_checks["train"].line()


@pytest.mark.parametrize("stop", [6, 100], ids=["mid-race", "decided"])
def test_a_run_stopped_during_or_after_the_race_resumes_bit_for_bit(tmp_path, stop, caplog, steady):
    """The race's decision and its progress travel in the checkpoint: stopped in the middle of the race, the resumed
    run runs the same layouts at the same steps; stopped after it, the decision is kept (not raced again). The
    model's channels_last steps are slow (``SlowIn``), so every run decides alike; epochs of two steps, so each stop is
    at an epoch's end (a plain DataLoader does not resume within one)."""
    from tests.helpers.plain_modules import Classifier, SlowIn, loader

    pl = _pl("lightning.pytorch")

    def fit(folder, steps, ckpt_path=None, every=0):
        torch.manual_seed(0)
        module = Classifier(net=SlowIn("channels_last", seconds=0.3))  # far beyond a busy machine's noise
        saves = [pl.callbacks.ModelCheckpoint(dirpath=folder, every_n_train_steps=every, save_top_k=-1,
                                              filename="{step}")] if every else []
        callback = ChannelsLast()
        pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=bool(every), callbacks=[callback, *saves],
                   num_sanity_val_steps=0, limit_val_batches=0).fit(module, loader(4, 2), ckpt_path=ckpt_path)
        return module, callback

    whole, decided = fit(tmp_path / "whole", 24, every=1)
    assert decided.decision.layout == "contiguous"
    # the race's last step: 3 warm-up steps, the NCHW warm-up step, the timed ones (a busy machine takes more rounds)
    decided_at = 3 + 1 + sum(decided.decision.samples.values())
    stop = stop if stop < decided_at else decided_at + decided_at % 2  # at an epoch's end
    with caplog.at_level(logging.INFO, logger="cltrain"):
        resumed, again = fit(tmp_path / "again", 24, ckpt_path=str(tmp_path / "whole" / f"step={stop}.ckpt"))
    assert again.decision.layout == "contiguous"
    assert again.decision.how == ("restored" if stop >= decided_at else "timed"), (stop, decided_at)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))
    assert resumed.seen["train"][-1][:4] == torch.empty(2, 3, 32, 32).stride()


def test_parameters_to_vector_bound_by_name_before_the_run_works_during_it_and_is_named(tmp_path, monkeypatch,
                                                                                       caplog):
    """A module that did ``from torch.nn.utils import parameters_to_vector`` at its top holds torch's own function,
    which raises on channels_last weights: the run rebinds it for its duration, and one line names the module."""
    (tmp_path / "user_flat.py").write_text("from torch.nn.utils import parameters_to_vector\n\n\n"
                                           "def flat(module):\n    return parameters_to_vector(module.parameters())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_flat

    pl = _pl("lightning.pytorch")
    reference = user_flat.flat(_net())
    seen = []

    class Flat(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(torch.equal(user_flat.flat(pl_module.net), reference))

    with caplog.at_level(logging.INFO, logger="cltrain"):
        _fit("lightning.pytorch", [ChannelsLast(layout="channels_last"), Flat()], _module("lightning.pytorch"),
             epochs=1)
    assert seen[0] is True  # the first batch: the weights as built, read in their logical order
    said = [r.getMessage() for r in caplog.records if "bound torch.nn.utils.parameters_to_vector" in r.getMessage()]
    assert len(said) == 1 and "user_flat" in said[0]
    from torch.nn.utils import convert_parameters

    assert user_flat.parameters_to_vector is convert_parameters.parameters_to_vector  # torch's own again after it
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="view size"):  # the control: torch's own, outside a run
        user_flat.flat(conv)
