"""Channels_last in a plain PyTorch loop or a Lightning Fabric loop, and a contiguous copy for export.

``ChannelsLastRun`` is the door for a loop you write yourself: everything the Lightning callback does, mapped onto
the loop's own events (``cltrain.session.LayoutSession`` runs it). Made before ``fabric.setup`` / DDP /
``torch.compile``, it converts the model (the channels-last format of each parameter's rank, the kernel guardrails);
``run.batches(loader)`` hands out each batch with the model's inputs converted (targets and masks keep their
layout), checks the first batch in both layouts with your step (where your code assumes NCHW, that part runs in
NCHW, in one line), times the first steps in both layouts and keeps the faster, and puts back at each epoch's end
what moved a parameter's layout (a pruning, a hook writing ``.data``), with the optimizer state.
``run.state_dict()`` goes into your checkpoint (``fabric.save`` takes the run itself), and ``run.load_state_dict``
on resume keeps the check's verdict and the race's decision and gives the restored optimizer state its parameters'
strides. Under several ranks (``fabric.launch()``, ``torchrun``) every rank makes the run; rank 0 checks and times,
every rank applies the same.

The same steps by hand, for a loop that prefers to call each: ``convert_model`` (what the run does first),
``verify_layout`` (the first-batch check), ``convert_batch`` (a batch's inputs). ``contiguous_copy`` gives an NCHW
copy of a trained model for ``torch.onnx.export``, ``torch.export`` and TorchScript, whose graphs should not depend on
how training strided the weights.

Example (Fabric; a plain loop is the same without the ``fabric`` lines)::

    from lightning.fabric import Fabric
    from cltrain.loops import ChannelsLastRun

    fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    model = torchvision.models.resnet18()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = ChannelsLastRun(model, optimizer, step=lambda m, b: F.cross_entropy(m(b[0]), b[1]), dtype=torch.bfloat16,
                          log=fabric.log_dict)
    model, optimizer = fabric.setup(model, optimizer)
    for epoch in range(epochs):
        for x, y in run.batches(fabric.setup_dataloaders(loader)):
            fabric.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        fabric.save("last.ckpt", {"model": model, "optimizer": optimizer, "cltrain": run})
    run.end()
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from cltrain.check.budget import DEFAULT_SAMPLES
from cltrain.check.compare import LayoutCheck
from cltrain.check.plain_step import check_plain_step
from cltrain.check.resume import run_fingerprint
from cltrain.host import Host, shown
from cltrain.layout import to_contiguous
from cltrain.layout.batches import Inputs, check_inputs, restride_batch
from cltrain.layout.optimizer_state import own_hook
from cltrain.options import (check_callable, check_copies, check_device, check_dtype, check_flags, check_layout_choice,
                             check_mode, check_module, check_optimizers, check_positive)
from cltrain.session import LayoutSession, SessionResults, stepping_optimizer
from cltrain.sharding import sharding_of

__all__ = ["ChannelsLastRun", "contiguous_copy", "convert_batch", "convert_model", "verify_layout"]

log = logging.getLogger(__name__)
B = TypeVar("B")
M = TypeVar("M", bound=nn.Module)


def _say(message: str, warn: bool) -> None:
    shown(log).log(logging.WARNING if warn else logging.INFO, message)


def _engine(model: nn.Module, sharded: bool) -> str | None:
    engine = sharding_of(model)
    return engine if engine is not None else "" if sharded else None  # "": an engine not named yet


class ChannelsLastRun(SessionResults):
    """A plain or Fabric training loop in channels_last, with every feature of the Lightning callback.

    Args:
        model: the model, before ``fabric.setup``, DDP, ``fully_shard`` or ``torch.compile`` wrap it; converted in
            place (its ``Parameter`` objects are kept: an optimizer made before still works). A DDP already made
            (or Fabric's module holding one) is taken for the model inside it, whose DDP builds its gradient buckets
            again after the conversion.
        optimizer: the loop's optimizer(s) (or later: ``run.optimizers = [...]``): their state follows every change
            of a parameter's layout, and the check runs your step's optimizer on copies.
        step: ``step(model, batch) -> loss`` (or the outputs, reduced by a fixed random projection whose backward is
            checked too): the loop's forward and loss code, for the first-batch check (its backward is run for you);
            default: the model on the batch's input, its outputs reduced by a
            fixed random projection.
        mode: ``"full"`` restrides every 4-D/5-D parameter and buffer; ``"conv"`` only convolution weights.
        layout: ``"auto"`` races channels_last against NCHW on the first training steps and keeps the faster;
            ``"channels_last"`` or ``"contiguous"`` pins one (the run's line says how to pin what it chose).
        device: where the model trains (default: where its parameters are); the guardrails depend on it.
        dtype: the loop's autocast dtype (``torch.bfloat16``, ``torch.float16``) or ``None`` for float32.
        guard: apply the kernel guardrails (``cltrain.guardrails``).
        verify: check the first training batch (and the first evaluation batch) in both layouts.
        inputs: which tensors of a batch are the model's inputs (``cltrain.layout.batches``).
        convert_inputs: put the model's inputs in its layout; ``False``: only the model is converted (its first
            convolution converts the activations) and the batches stay as they come.
        check_samples: the check runs on this many samples of the batch; ``None``: the whole batch.
        sharded: the model will be sharded (``fully_shard``, FSDP, DeepSpeed), which keeps the weights NCHW: only the
            inputs are channels_last (``cltrain.sharding``); a model sharded already is treated so.
        log: ``log(metrics)``: where both layouts' step times go (``fabric.log_dict``, a logger's ``log_metrics``).
        copies: the model's copies that should follow its layout (an EMA's ``AveragedModel``): a module, a list, or a
            function giving them, asked at each change of layout.

    Attributes:
        session: the ``cltrain.session.LayoutSession`` that runs it all; its results are the run's attributes too
            (``cltrain.session.SessionResults``: ``layout``, ``decision``, ``layout_checks``, ``guardrails``, ...).

    Raises:
        ValueError: a bad ``optimizer``, ``mode``, ``layout``, ``inputs``, ``check_samples``, ``dtype``, ``device``,
            ``step``, ``log`` or flag.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2))
        >>> run = ChannelsLastRun(model, layout="channels_last", verify=False)
        >>> for x, y in run.batches([(torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))]):
        ...     x.is_contiguous(memory_format=torch.channels_last)
        True
        >>> run.end()
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
                 *, step: Callable[[nn.Module, Any], Any] | None = None, mode: str = "full", layout: str = "auto",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, guard: bool = True,
                 verify: bool = True, inputs: Inputs = None, convert_inputs: bool = True,
                 check_samples: int | None = DEFAULT_SAMPLES, sharded: bool = False,
                 log: Callable[[dict[str, float]], Any] | None = None,
                 copies: Callable[[], Iterable[nn.Module]] | nn.Module | Sequence[nn.Module] | None = None) -> None:
        check_module("ChannelsLastRun", model)
        check_mode("ChannelsLastRun", mode)
        check_layout_choice("ChannelsLastRun", layout)
        check_flags("ChannelsLastRun", guard=guard, verify=verify, convert_inputs=convert_inputs, sharded=sharded)
        check_positive("ChannelsLastRun", "check_samples", check_samples, optional=True)
        check_dtype("ChannelsLastRun", "dtype", dtype)
        check_device("ChannelsLastRun", device)
        check_callable("ChannelsLastRun", "step(model, batch) -> loss", step=step)
        check_callable("ChannelsLastRun", "log(metrics), such as fabric.log_dict", log=log)
        model = _inside_ddp(model)
        self.model, self.step, self.dtype, self.verify = model, step, dtype, verify
        self.inputs, self.check_samples = check_inputs(inputs, owner="ChannelsLastRun"), check_samples
        self.optimizers = check_optimizers("ChannelsLastRun", optimizer)
        mine = {id(p) for p in model.parameters()}
        for optimizer_given in self.optimizers:  # another module's: its steps are not the loop's, in silence
            if mine and not any(id(p) in mine for group in optimizer_given.param_groups for p in group["params"]):
                _say(f"ChannelsLastRun: the {type(optimizer_given).__name__} given holds none of the model's "
                     "parameters, so its steps are not the loop's: give the optimizer your loop steps (made from "
                     "model.parameters()).", True)
        host = Host(_say, optimizers=lambda: self.optimizers, copies=check_copies("ChannelsLastRun", copies), log=log)
        self.session = LayoutSession(mode, layout=layout, guard=guard, verify=verify, inputs=self.inputs,
                                     check_samples=check_samples, convert_inputs=convert_inputs, host=host)
        self.session.fingerprint = lambda: run_fingerprint(
            model, precision=str(dtype), device=str(self.session.device.type), code=[step])
        self.session.autocast_unseen = True  # a loop's own autocast, or Fabric's
        self.session.start(model, device=device, dtype=dtype, sharding=_engine(model, sharded),
                           owner=f"ChannelsLastRun(mode={mode!r})")
        self._resumed = False
        self.session.watch_optimizers = True  # a step is the batches up to the loop's optimizer step

    def batches(self, loader: Iterable[B], *, train: bool = True) -> Iterator[B]:
        """Each batch of ``loader`` (on the model's device) with its model inputs in the model's layout, in place;
        the step you run on it ends when you ask for the next one, after the optimizer's step (under gradient
        accumulation, the batches up to it are one step). The first batch of training (``train``) and of evaluation
        is checked; training steps are timed while the layouts race; at the end of the loader, whatever moved a
        parameter's layout is put back."""
        check_flags("ChannelsLastRun.batches", train=train)
        if not isinstance(loader, Iterable):
            raise ValueError(f"ChannelsLastRun.batches(loader={loader!r}): expected the loop's batches (a "
                             "DataLoader or any iterable).")
        kind = "train" if train else "eval"
        if train and self._resumed:
            self._resumed = False
            self.session.resume()
        self.session.optimizer_stepped()  # a step the loop ran after the last pass is not this pass's
        for batch in loader:
            batch = self.session.batch(kind, batch, self.model, (lambda b=batch: self._check(b, train))
                                       if self.verify else None)
            try:
                yield batch
            except GeneratorExit:  # the loop broke out: the step is not counted
                self.session.batch_end(completed=False)
                self.session.step_end(self.model, completed=False)
                raise
            self.session.batch_end()
            if not train or self.session.optimizer_stepped():
                self.session.step_end(self.model)
        self.session.step_end(self.model, completed=False)  # a cycle the loader ended before its optimizer step
        self.session.boundary(self.model, after="after a pass over the loader")

    def _check(self, batch: Any, train: bool) -> LayoutCheck:
        optimizer = list(self.optimizers) if train else None
        grad = torch.enable_grad() if train else torch.no_grad()
        with grad, _real_steps_undone(self.optimizers, self.model):
            return check_plain_step(self.model, batch, self.step, inputs=self.inputs, autocast_dtype=self.dtype,
                                    optimizer=optimizer, samples=self.check_samples,
                                    convert_inputs=self.session.convert_inputs)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the run: the checks' verdicts (with what they hold for) and the race's
        decisions; ``fabric.save`` calls it for a run in its state."""
        self.session.close_stepped(self.model)
        return self.session.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the verdicts apply without checking again (same model, step and precision), the decisions are
        not raced again, and the optimizer state takes its parameters' strides at the next training batch.

        Raises:
            ValueError: ``state`` is not what ``state_dict`` gave (a whole checkpoint, a model's state dict)."""
        known = {"layout_checks", "fingerprint", "race"}
        if isinstance(state, dict) and not set(state) - known and not (
                isinstance(state.get("layout_checks", {}), dict) and isinstance(state.get("race", {}), dict)):
            raise ValueError(f"ChannelsLastRun.load_state_dict: the entry is not what run.state_dict() gave "
                             f"({ {k: type(v).__name__ for k, v in state.items()} }): pass the entry you saved it "
                             "under, unchanged.")
        if not isinstance(state, dict) or set(state) - known:
            what = sorted(map(str, state))[:4] if isinstance(state, dict) else f"a {type(state).__name__}"
            entries = [k for k, v in state.items() if isinstance(v, dict) and not set(v) - known] \
                if isinstance(state, dict) else []
            entry = f"checkpoint[{entries[0]!r}]" if len(entries) == 1 else "the entry you saved run.state_dict() under"
            raise ValueError(f"ChannelsLastRun.load_state_dict: expected what run.state_dict() gave (keys among "
                             f"{sorted(known)}), got {what}: pass the run's own entry ({entry}).")
        self.session.load_state_dict(state, model=self.model)
        self._resumed = True

    def end(self) -> None:
        """The run ends: the layout kept a last time, torch's own utilities given back."""
        self.session.end(self.model)

    def __enter__(self) -> ChannelsLastRun:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.end()
        else:
            self.session.close()


def convert_model(
    model: M,
    mode: str = "full",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    guard: bool = True,
    sharded: bool = False,
) -> M:
    """Put ``model`` in channels_last, in place, with the kernel guardrails: the first thing ``ChannelsLastRun`` does.

    Args:
        model: the model, before ``fabric.setup``, DDP, ``fully_shard`` or ``torch.compile`` wrap it.
        mode: ``"full"`` restrides every 4-D/5-D parameter and buffer (``channels_last`` for
            4-D, ``channels_last_3d`` for 5-D); ``"conv"`` only convolution weights.
        sharded: the model will be sharded (``fully_shard``, FSDP, DeepSpeed), which keeps parameters
            contiguous: its parameters and buffers are put in NCHW instead and only the inputs
            (``convert_batch``) are channels_last, so the convolutions still run NHWC kernels. A model
            sharded already is treated so, and not restrided.
        device: where the model will train (the guardrails depend on the backend); default
            the device of its parameters.
        dtype: the dtype its convolutions will compute in: the autocast dtype
            (``torch.bfloat16``, ``torch.float16``), or ``None`` for fp32.
        guard: apply ``cltrain.guardrails.apply_guardrails`` (one log line per known
            kernel fault worked around); ``False`` trains the bare kernels. Where a ``torch.distributed`` group
            of several ranks is initialised (``fabric.launch()``), the guardrails cover the modules any rank finds
            hazardous, so every rank calls ``convert_model`` (as every rank builds its model).

    Returns:
        ``model`` itself (its ``Parameter`` objects are kept: an optimizer made before still works).

    Raises:
        ValueError: ``mode`` is not ``"full"`` or ``"conv"``, ``guard`` or ``sharded`` is not a bool, or a bad
            ``dtype`` or ``device``.

    Example::

        >>> model = convert_model(torch.nn.Conv2d(3, 8, 3))
        >>> model.weight.is_contiguous(memory_format=torch.channels_last)
        True
        >>> convert_model(torch.nn.Conv2d(3, 8, 3), sharded=True).weight.is_contiguous()  # then fully_shard
        True
    """
    check_module("convert_model", model)
    check_mode("convert_model", mode)
    check_flags("convert_model", guard=guard, sharded=sharded)
    check_dtype("convert_model", "dtype", dtype)
    check_device("convert_model", device)
    session = LayoutSession(mode, layout="channels_last", guard=guard, host=Host(_say))
    session.autocast_unseen = True  # a loop's own autocast, or Fabric's
    session.start(model, device=device, dtype=dtype, sharding=_engine(model, sharded),
                  owner=f"convert_model(mode={mode!r})")
    session.close()  # nothing of the run is held: the hand-wired loop calls each step itself
    return model


def convert_batch(batch: B, inputs: Inputs = None, layout: str = "channels_last", model: nn.Module | None = None) -> B:
    """Put the model inputs of ``batch`` in ``layout``, in place, and return ``batch``.

    The same rules as ``ChannelsLast``: the batch when it is one tensor, the first element of a
    tuple/list batch, the image keys of a dict batch, or what ``inputs`` names (a key, an index, a
    list of them, ``"all"``); only floating 4-D/5-D tensors, and nothing is copied when they already
    are in ``layout``. The tensor objects stay the same (their ``.data`` is swapped).

    Args:
        batch: a tensor, or a tuple, list, dict, namedtuple or dataclass of them (nested).
        inputs: which tensors are the model's inputs; see ``cltrain.layout.batches``.
        layout: ``"channels_last"`` or ``"contiguous"``.
        model: the model that reads the batch: tells a 5-D stack of images ``(B, T, C, H, W)`` (each frame put
            channels_last) from a clip ``(N, C, T, H, W)`` (``channels_last_3d``) by its first convolution's
            input channels (``cltrain.layout.stacks``); without it, by the sizes.

    Returns:
        ``batch``.

    Raises:
        ValueError: a bad ``inputs`` or ``layout``, or a key or index named in ``inputs`` that ``batch`` lacks.

    Example::

        >>> x, heatmap = convert_batch((torch.randn(2, 3, 8, 8), torch.rand(2, 5, 8, 8)))
        >>> x.is_contiguous(memory_format=torch.channels_last), heatmap.is_contiguous()
        (True, True)
    """
    if layout not in ("channels_last", "contiguous"):
        raise ValueError(f"convert_batch(layout={layout!r}): expected 'channels_last' or 'contiguous'.")
    restride_batch(batch, layout, inputs=check_inputs(inputs, owner="convert_batch"), model=model)
    return batch


def verify_layout(
    model: nn.Module,
    batch: Any,
    step: Callable[[nn.Module, Any], Any] | None = None,
    *,
    inputs: Inputs = None,
    autocast_dtype: torch.dtype | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    samples: int | None = 4,
    report: bool = True,
) -> LayoutCheck:
    """Check one step in both layouts and apply what the check chooses to ``model``, in place: the first-batch check
    ``ChannelsLastRun`` runs, by hand.

    Call it once, after ``convert_model`` and before ``fabric.setup`` / DDP / ``fully_shard`` / ``torch.compile``,
    with a real batch; for a sharded run, on the model ``convert_model(model, sharded=True)`` gave (NCHW
    weights, channels_last inputs). A model sharded already cannot be copied: it is reported not checked.
    Where the code in the model or in ``step`` raises or diverges only in channels_last, the
    smallest part holding it runs in NCHW (``cltrain.check.fallback``); where that is the whole model, the
    model runs in NCHW (its inputs are put in NCHW on the way in, so the loop may keep converting batches).
    One log line says what was found and done. The model's weights, gradients and BatchNorm statistics
    and the RNG state are not changed. Where a ``torch.distributed`` group of several ranks is initialised
    (``fabric.launch()``), every rank calls it: rank 0 checks its batch and every rank applies what rank 0 chose
    (the check's copies of ``SyncBatchNorm`` layers then compute their statistics on the checked samples alone).

    Args:
        model: the model, converted by ``convert_model``.
        batch: one batch as the loop gets it (on the model's device).
        step: ``step(model, batch) -> loss`` (or the outputs, reduced by a fixed random projection whose backward is
            checked too): the forward and the loss code of the loop;
            by default the model is called on the batch's input (``inputs``) and its outputs reduced by a
            fixed random projection.
        inputs: which tensors of ``batch`` are the model's inputs (``convert_batch``'s rules).
        autocast_dtype: the loop's autocast dtype: the check runs the step in float32, and under autocast in
            this dtype only where it cannot run in float32.
        optimizer: the loop's optimizer: its step runs after the backward on a copy of it and its state (the
            optimizer itself is not touched), and the parameters' updates are compared too, on the same gradient
            values in both layouts; one of torch's elementwise optimizers
            (``cltrain.check.copies.ELEMENTWISE_OPTIMIZERS``: SGD, Adam, AdamW, ...), whose update is the same in
            any layout, is not re-run.
        samples: check the batch's first ``samples`` samples (``cltrain.check.budget``: the whole batch where
            the step cannot run on them, fewer where memory runs out); ``None``: the whole batch.
        report: log the result's line (``False``: the caller reports it in its own way).

    Returns:
        The ``cltrain.check.compare.LayoutCheck``.
    """
    check_module("verify_layout", model)
    inputs = check_inputs(inputs, owner="verify_layout")
    check_optimizers("verify_layout", optimizer, several=False)
    check_dtype("verify_layout", "autocast_dtype", autocast_dtype)
    check_callable("verify_layout", "step(model, batch) -> loss", step=step)
    check_positive("verify_layout", "samples", samples, optional=True)
    check_flags("verify_layout", report=report)
    if batch is None:
        raise ValueError("verify_layout(batch=None): expected one batch as the loop gets it (on the model's device).")
    host = Host(_say, optimizers=lambda: [optimizer] if optimizer is not None else [])
    session = LayoutSession(layout="channels_last", inputs=inputs, host=host)
    session.layout, session.dtype, session.sharding = "channels_last", autocast_dtype, sharding_of(model)
    run = lambda: check_plain_step(model, batch, step, inputs=inputs,  # noqa: E731
                                   autocast_dtype=autocast_dtype, optimizer=optimizer, samples=samples)
    with _real_steps_undone([optimizer] if optimizer is not None else [], model):  # the real optimizer put back
        return session.check("train", model, run, report=report)


def contiguous_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every parameter and buffer in NCHW/NCDHW strides, for export.

    ``torch.onnx.export``, ``torch.export`` and TorchScript then see the layout every backend
    expects; the copy computes the same function (the layout changes strides, not values). A
    model wrapped by Fabric, DDP or ``torch.compile`` is unwrapped first. Train/eval mode is
    kept: call ``.eval()`` before exporting, as for any model. Gradients are not copied.

    Returns:
        The copy; ``model`` is not modified.

    Raises:
        ValueError: ``model`` is sharded (FSDP2, FSDP, DeepSpeed), which cannot be copied.

    Example::

        >>> trained = convert_model(torch.nn.Conv2d(3, 8, 3))
        >>> export_me = contiguous_copy(trained).eval()
        >>> export_me.weight.is_contiguous(), trained.weight.is_contiguous()
        (True, False)
    """
    check_module("contiguous_copy", model)
    bare = _unwrap(model)
    engine = sharding_of(bare)
    if engine is not None:
        raise ValueError(f"contiguous_copy: the model is sharded by {engine}, which cannot be copied; load its full "
                         "state dict (get_model_state_dict with full_state_dict=True) into an unsharded model instead.")
    grads = {p: p.grad for p in bare.parameters()}
    for p in grads:  # deepcopy would copy them, in the training layout
        p.grad = None
    try:
        clone = copy.deepcopy(bare)
    finally:
        for p, g in grads.items():
            p.grad = g
    return to_contiguous(clone)


@contextlib.contextmanager
def _real_steps_undone(optimizers: Sequence[torch.optim.Optimizer], model: nn.Module | None = None) -> Iterator[None]:
    """A ``step`` that steps the run's real optimizers (a whole training step passed as ``step``, on the real model:
    the check puts the model back) leaves their state as it was: taken at their first step in the check (copied only
    then), put back after it. Any optimizer holding ``model``'s own parameters counts (one not given to the run, too:
    under DDP only rank 0 checks, and a stepped state there would part the ranks); the check's copies hold copied
    parameters and are left alone. A global pre-step hook: it runs inside Fabric's and Accelerate's wrappers too."""
    real = {id(o) for o in map(stepping_optimizer, optimizers) if o is not None}
    mine = {id(p) for p in model.parameters()} if model is not None else set()
    saved: dict[int, Any] = {}

    def before(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) in saved:
            return
        if id(optimizer) in real or any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
            saved[id(optimizer)] = (optimizer, {p: {k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v)
                                                    for k, v in state.items()} for p, state in optimizer.state.items()},
                                    [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                                     for g in optimizer.param_groups])  # Lookahead's counter, Prodigy's d, lr

    handle = register_optimizer_step_pre_hook(own_hook(before))
    try:
        yield
    finally:
        handle.remove()
        for optimizer, state, groups in reversed(list(saved.values())):  # shared param_groups: the first taken last
            optimizer.state.clear()
            optimizer.state.update(state)
            for group, hyper in zip(optimizer.param_groups, groups):
                group.update(hyper)


def _inside_ddp(model: nn.Module) -> nn.Module:
    """The model a ``DistributedDataParallel`` or Fabric's wrapper holds: the door converts and checks it (a check of
    the wrapper would run DDP's collectives on the deciding rank alone, and Fabric's asks for ``fabric.backward``),
    and the loop goes on calling the wrapper; DDP's buckets follow the conversion (``cltrain.ddp``)."""
    forward = getattr(model, "_forward_module", model)  # Fabric's _FabricModule
    if isinstance(forward, nn.parallel.DistributedDataParallel):
        return forward.module
    return forward if isinstance(forward, nn.Module) else model


def _unwrap(model: nn.Module) -> nn.Module:
    # torch.compile's OptimizedModule keeps the model as `_orig_mod`; Fabric's wrapper and DDP as `.module`.
    from lightning.fabric.wrappers import is_wrapped

    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif is_wrapped(model) or isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model
