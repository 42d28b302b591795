"""Run by tests/core/test_doors.py: every feature of cltrain through one front door, as a user of that door writes
the loop, in this process; prints one JSON line ``{feature: [ok, detail]}``.

    python -m tests.helpers.door_battery DOOR OUT_DIR [--control]

DOOR is ``lightning``, ``plain``, ``fabric``, ``hf`` or ``accelerate``. The features:

* ``converts``: the model's conv weights and the inputs its first convolution gets are channels_last;
* ``checked``: a head that calls ``view`` on a channels_last tensor is found by the first-batch check, falls back, and
  training goes on;
* ``auto``: a model whose channels_last steps are slow (``SlowIn``) is switched to NCHW by the race, and its inputs
  follow;
* ``averaged``: in ``auto``'s run, an EMA copy of the model (``AveragedModel``, updated after each step; Lightning's
  ``EMAWeightAveraging``), made channels_last beside it and given to the door as it takes copies, is switched to NCHW
  with the model by the race;
* ``accumulated``: under gradient accumulation (2 batches a step, in the door's own way), the race times whole
  steps, each with its optimizer step: a model faster in channels_last whose optimizer step is slow keeps
  channels_last;
* ``kept``: the user's own ``torch.nn.utils.prune.l1_unstructured`` on a channels_last conv, and a 1x1 weight written
  back in NCHW with ``.data =``, between epochs: the weights, the pruning's mask and the optimizer state are
  channels_last again by the next epoch's end;
* ``resumed``: a run saved in the door's own checkpoint format (safetensors for the Hugging Face Trainer) and resumed
  by a new process's objects keeps the check's verdict (not checked again, its fallback applied) and the race's
  decision, with the optimizer state in its parameters' strides.

``--control`` runs the same code with each feature's mechanism taken away (no door, ``verify=False``, the layout
pinned, no copies given, every batch a step, no boundary and torch's own pruning, the door's state not restored: the
last only where the door takes it apart from the rest, a plain or Fabric loop): every cell must fail.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cltrain.check.copies import checking
from cltrain.layout import is_channels_last
from tests.helpers.plain_modules import SlowIn, pause, steady_clock

FEATURES = ("converts", "checked", "auto", "averaged", "accumulated", "kept", "resumed")
RANKS = 1  # 2: each door runs in two DDP processes (tests.helpers.door_ddp)
SIZE, CLASSES = 8, 4


def base() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 1),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, CLASSES))


class ViewHead(nn.Module):
    """A head written for NCHW: ``view`` on the convolution's output raises on a channels_last one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * SIZE * SIZE, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        return self.fc(h.view(h.size(0), -1))


def slow(net: nn.Module | None = None) -> nn.Module:
    return SlowIn("channels_last", net=net or base(), seconds=0.15)


PAUSE = 0.1  # SlowStep's step: a large model's optimizer step, beside a small batch's forward and backward


class SlowStep(torch.optim.AdamW):
    """AdamW whose step takes ``PAUSE`` seconds more (torch's step hooks still run around it)."""

    def step(self, closure=None):
        pause(PAUSE)
        return super().step(closure)


def images(n: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 3, SIZE, SIZE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    return [(x[i], y[i]) for i in range(n)]


class Seen:
    """What the model's first convolution got, in the real steps (not the check's copies)."""

    def __init__(self, model: nn.Module) -> None:
        self.inputs: list[bool] = []
        conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
        conv.register_forward_pre_hook(lambda m, args: None if checking() else self.inputs.append(
            is_channels_last(args[0])))


def prune_and_move(model: nn.Module) -> None:
    """The user's code between epochs: torch's own pruning, and a 1x1 weight written back in NCHW."""
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    torch.nn.utils.prune.l1_unstructured(convs[0], "weight", amount=0.3)
    one = next(m for m in convs if m.kernel_size == (1, 1))
    one.weight.data = one.weight.data.clone(memory_format=torch.contiguous_format)


def average_of(model: nn.Module) -> nn.Module:
    """An EMA copy of ``model``, as a user makes it after the door converted the model: in its layout."""
    return torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)).to(memory_format=torch.channels_last)


def kept_in(model: nn.Module, optimizer: Any, layout: str) -> tuple[bool, str]:
    """Every 4-D weight, mask and pruning original in ``layout``, and the optimizer state in its parameters'."""
    want = (lambda t: is_channels_last(t)) if layout == "channels_last" else (lambda t: t.is_contiguous())
    tensors = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()] if t.dim() == 4}
    wrong = [n for n, t in tensors.items() if not want(t)]
    opt = getattr(optimizer, "optimizer", optimizer)
    states = [v for p, s in opt.state.items() for v in s.values() if torch.is_tensor(v) and v.shape == p.shape
              and v.dim() == 4 and v.stride() != p.stride()]
    return not wrong and not states, f"{layout}: wrong {wrong}, {len(states)} state tensor(s) off"


# ---- the doors: train ``model`` ``steps`` steps (epochs of ``per_epoch``), between epochs run ``between``; save the
# ---- run at the end to ``save`` or resume from ``resume``; return the door's session and the optimizer


def lightning(model, steps, *, door, layout, verify, between=None, save=None, resume=None, restore=True, accumulate=1,
              optimizer=None, averaged=None):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from cltrain import ChannelsLast

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return (optimizer or torch.optim.AdamW)(self.parameters(), lr=1e-2)

    class Between(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if between is not None and trainer.current_epoch == 0:
                between(pl_module.net)

    callback = ChannelsLast(layout=layout, verify=verify)
    averaging = []
    if averaged is not None:  # the averaged copy is Lightning's: the callback finds it
        from lightning.pytorch.callbacks import EMAWeightAveraging

        averaging = [EMAWeightAveraging(decay=0.9)]
    ranks = {"devices": 2, "strategy": "ddp"} if RANKS == 2 else {}
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, **ranks,
                         accumulate_grad_batches=accumulate,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[Between(), *averaging, *([callback] if door else [])])
    module = Module()
    # two ranks: 4 batches a rank an epoch, so that an epoch ends no accumulation window short (Lightning steps on
    # such a window too, and the race does not time it)
    trainer.fit(module, DataLoader(images(16 if RANKS == 2 else 12), batch_size=2), ckpt_path=resume)
    if averaged is not None:
        averaged.append(averaging[0]._average_model)
    lightning.rank = trainer.global_rank
    if save:
        trainer.save_checkpoint(save)
    return callback.session, trainer.optimizers[0]


def _loop(model, steps, *, door, layout, verify, between=None, save=None, resume=None, restore=True, fabric=None,
          accumulate=1, optimizer=None, averaged=None):
    from torch.utils.data import DataLoader

    from cltrain.loops import ChannelsLastRun

    optimizer = (optimizer or torch.optim.AdamW)(model.parameters(), lr=1e-2)
    copies = (lambda: averaged) if averaged is not None else tuple
    run = ChannelsLastRun(model, optimizer, step=lambda m, b: F.cross_entropy(m(b[0]), b[1]), layout=layout,
                          verify=verify, copies=copies) if door else None
    if averaged is not None:
        averaged.append(average_of(model))
    if resume:
        state = {"model": model, "optimizer": optimizer, **({"cltrain": run} if door and restore else {})}
        if fabric is not None:
            fabric.load(resume, state, strict=False)
        else:
            saved = torch.load(resume, weights_only=True)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            if door and restore:
                run.load_state_dict(saved["cltrain"])
    wrapped, opt = (fabric.setup(model, optimizer) if fabric is not None else (model, optimizer))
    loader = DataLoader(images(), batch_size=2)
    if fabric is not None:
        loader = fabric.setup_dataloaders(loader)
    elif RANKS == 2:  # torchrun's two processes
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data.distributed import DistributedSampler

        wrapped = DistributedDataParallel(model)
        loader = DataLoader(images(), batch_size=2, sampler=DistributedSampler(images(), shuffle=False))
    done, epoch = 0, 0
    while done < steps:
        for i, (x, y) in enumerate(run.batches(loader) if door else loader):
            loss = F.cross_entropy(wrapped(x), y) / accumulate
            fabric.backward(loss) if fabric is not None else loss.backward()
            if (i + 1) % accumulate:  # gradient accumulation: the optimizer steps every `accumulate` batches
                continue
            opt.step()
            opt.zero_grad()
            for copy in averaged or ():
                copy.update_parameters(model)
            done += 1
            if done == steps:
                break
        if between is not None and epoch == 0:
            between(model)
        epoch += 1
    if save:
        if fabric is not None:
            fabric.save(save, {"model": model, "optimizer": optimizer, **({"cltrain": run} if door else {})})
        else:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "cltrain": run.state_dict() if door else {}}, save)
    if door:
        run.end()
    return (run.session if door else None), optimizer


def plain(model, steps, **kw):
    return _loop(model, steps, **kw)


def fabric(model, steps, **kw):
    from lightning.fabric import Fabric

    runner = Fabric(accelerator="cpu", devices=RANKS, strategy="ddp" if RANKS == 2 else "auto")
    if RANKS == 2:
        runner.launch()
    return _loop(model, steps, fabric=runner, **kw)


class HFNet(nn.Module):
    """A plain ``nn.Module`` as the Hugging Face Trainer takes it: ``pixel_values`` and ``labels`` in, a loss out."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, pixel_values, labels=None):
        logits = self.net(pixel_values)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def hf(model, steps, *, door, layout, verify, between=None, save=None, resume=None, restore=True, accumulate=1,
       optimizer=None, averaged=None):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from cltrain.integrations.transformers import ChannelsLastCallback

    class Between(TrainerCallback):
        def on_epoch_end(self, args, state, control, model=None, **kwargs):
            if between is not None and round(state.epoch) == 1:
                between(model.net)

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            if averaged is not None:
                averaged.append(average_of(model.net))

        def on_step_end(self, args, state, control, model=None, **kwargs):
            for copy in averaged or ():
                copy.update_parameters(model.net)

    rows = [{"pixel_values": x, "labels": y} for x, y in images()]
    callback = ChannelsLastCallback(layout=layout, verify=verify, copies=lambda: averaged or ())
    out = Path(save or resume).parent / "hf" if (save or resume) else Path("hf-out")
    args = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-2,
                             save_strategy="steps" if save else "no", save_steps=steps, report_to="none",
                             use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, logging_steps=50,
                             gradient_accumulation_steps=accumulate,
                             **({"ddp_backend": "gloo"} if RANKS == 2 else {}))
    net = HFNet(model)
    trainer = Trainer(model=net, args=args, train_dataset=rows, callbacks=[Between(), *([callback] if door else [])],
                      optimizers=(optimizer(net.parameters(), lr=1e-2) if optimizer else None, None))
    trainer.train(resume_from_checkpoint=str(out / f"checkpoint-{steps - 2}") if resume else None)
    return (callback.session if door else None), trainer.optimizer


def accelerate(model, steps, *, door, layout, verify, between=None, save=None, resume=None, restore=True,
               accumulate=1, optimizer=None, averaged=None):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader

    from cltrain.integrations.accelerate import prepare_channels_last
    from cltrain.integrations.inputs_hook import ChannelsLastInputs

    AcceleratorState._reset_state(reset_partial_state=True)  # one state per process: each run asks for its own
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    if door:
        prepare_channels_last(model, accelerator, layout=layout, verify=verify, copies=lambda: averaged or ())
    if averaged is not None:
        averaged.append(average_of(model))
    optimizer = (optimizer or torch.optim.AdamW)(model.parameters(), lr=1e-2)
    wrapped, opt, loader = accelerator.prepare(model, optimizer, DataLoader(images(), batch_size=2))
    if resume:
        accelerator.load_state(resume)
    done, epoch = 0, 0
    while done < steps:
        wrapped.train()
        for x, y in loader:
            with accelerator.accumulate(wrapped):  # the optimizer steps where the gradients sync
                accelerator.backward(F.cross_entropy(wrapped(x), y))
                opt.step()
                opt.zero_grad()
            for copy in averaged or ():
                copy.update_parameters(model)
            done += accelerator.sync_gradients
            if done == steps:
                break
        if between is not None and epoch == 0:
            between(model)
        wrapped.eval()
        with torch.no_grad():  # the loop's evaluation: where a hand-written loop's epoch ends
            wrapped(images(2)[0][0][None])
        epoch += 1
    if save:
        accelerator.save_state(save)
    hook = ChannelsLastInputs.of(model)
    return (hook.session if hook is not None else None), optimizer


DOORS = {"lightning": lightning, "plain": plain, "fabric": fabric, "hf": hf, "accelerate": accelerate}


def battery(door: str, out: Path, control: bool) -> dict[str, list[Any]]:
    train = DOORS[door]
    on = not control
    cells: dict[str, list[Any]] = {}
    raced: list[Any] = [None, []]  # auto's run: its session and the averaged copy it was given

    def cell(name: str, run: Any) -> None:
        try:
            ok, detail = run()
        except Exception as error:  # noqa: BLE001 - a feature that raises is a failed cell, with the reason
            ok, detail = False, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        cells[name] = [bool(ok), detail]
        gc.collect()  # a run that raised gives torch's utilities back when its session goes

    def converts():
        model = base()
        seen = Seen(model)
        train(model, 3, door=on, layout="channels_last", verify=True)
        convs = [is_channels_last(m.weight) for m in model.modules() if isinstance(m, nn.Conv2d)]
        return all(convs) and all(seen.inputs), f"weights {convs}, inputs {seen.inputs}"

    def checked():
        session, _ = train(ViewHead(), 3, door=True, layout="channels_last", verify=on)
        check = session.layout_checks.get("train")
        return check is not None and check.verdict == "fallback", check.line() if check else "not checked"

    def auto():
        model, copies = slow(), []
        seen = Seen(model)
        session, _ = train(model, 14, door=True, layout="auto" if on else "channels_last", verify=True, averaged=copies)
        raced[:] = [session, copies]  # the averaged copy given to the door is judged by the next cell
        decision = session.decision
        ok = decision is not None and decision.layout == "contiguous" and not seen.inputs[-1] \
            and all(m.weight.is_contiguous() for m in model.modules() if isinstance(m, nn.Conv2d))
        return ok, session.decision_line(decision) if decision else "not decided"

    def averaged():
        from cltrain.host import Host

        session, copies = raced
        if control:  # the race switches, no copies given (auto's run was pinned)
            copies = []
            with _patched(Host, "copies", lambda self: []):
                session, _ = train(slow(), 14, door=True, layout="auto", verify=True, averaged=copies)
        decision = session.decision
        convs = [m.weight for copy in copies for m in copy.modules() if isinstance(m, nn.Conv2d)]
        ok = decision is not None and decision.layout == "contiguous" and len(copies) == 1 and convs \
            and all(w.is_contiguous() for w in convs)
        return ok, f"{session.decision_line(decision) if decision else 'not decided'}; averaged copy's convs " \
            f"{[is_channels_last(w) for w in convs]}"

    def accumulated():
        # NCHW's forward 0.03 s slower, the optimizer's step slow, 2 batches a step: each timed step must hold one
        # optimizer step, and channels_last stays (timed batch by batch, NCHW's steps without it would look faster)
        from cltrain.session import LayoutSession

        model = SlowIn("contiguous", net=base(), seconds=0.03)
        with contextlib.ExitStack() as stack:
            if control:  # every batch a step
                stack.enter_context(_patched(LayoutSession, "optimizer_stepped", lambda self: True))
            # 13 steps: two rounds of the race, where a loaded machine (a full test run) leaves the first in doubt
            session, _ = train(model, 13, door=True, layout="auto", verify=True, accumulate=2, optimizer=SlowStep)
        decision = session.decision
        ok = decision is not None and decision.layout == "channels_last" and min(decision.seconds.values()) >= PAUSE
        return ok, f"{session.decision_line(decision) if decision else 'not decided'}; {decision}"

    def kept():
        import cltrain.session
        from cltrain.session import LayoutSession

        model = base()
        with contextlib.ExitStack() as stack:
            if control:  # no boundary, and torch's own pruning
                stack.enter_context(_patched(LayoutSession, "boundary", lambda *a, **k: []))
                stack.enter_context(_patched(cltrain.session, "torch_utilities", lambda say=None: contextlib.nullcontext()))
            session, optimizer = train(model, 12, door=True, layout="channels_last", verify=True, between=prune_and_move)
        return kept_in(model, optimizer, session.layout)

    def resumed():
        first = out / "resumed"
        first.mkdir(parents=True, exist_ok=True)
        path = str(first / ("ckpt" if door in ("accelerate",) else "run.ckpt"))
        session, _ = train(slow(ViewHead()), 14, door=True, layout="auto", verify=True, save=path)
        assert session.decision is not None and session.layout_checks["train"].verdict == "fallback", "first run"
        model = slow(ViewHead())
        again, optimizer = train(model, 16, door=True, layout="auto", verify=True, resume=path, restore=on)
        check, decision = again.layout_checks.get("train"), again.decision
        ok = check is not None and "verdict of the checkpoint" in check.line() and decision is not None \
            and decision.how == "restored" and kept_in(model, optimizer, "contiguous")[0]
        return ok, f"{check.line() if check else 'not checked'}; {decision}"

    for name, run in zip(FEATURES, (converts, checked, auto, averaged, accumulated, kept, resumed)):
        cell(name, run)
    return cells


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    door, out = sys.argv[1], Path(sys.argv[2])
    with steady_clock():
        print(json.dumps(battery(door, out, "--control" in sys.argv)))
