"""A model's channels_last run, whatever runs it: the core behind every front door (the Lightning callback
``ChannelsLast``, ``cltrain.loops`` for plain loops and Fabric, the Hugging Face callback and the Accelerate helper).

A front door lends the session a host (``cltrain.host``: say a line, which rank decides, a broadcast and a sum over
the ranks, the optimizers, the model's copies, a logger) and maps its framework's events onto the session's
lifecycle; every feature lives here, so every door has it:

* ``start(model)``: choose the layout (pinned, or raced), convert the model and its copies (the channels-last format
  of each parameter's rank; contiguous weights under a sharding engine), apply the kernel guardrails (the modules any
  rank finds hazardous), say what was done, and hold the fixes for torch's utilities that ``view`` a channels_last
  weight (``cltrain.nchw_code.torch_utilities``);
* ``batch(kind, batch, model, check)`` / ``batch_end()`` / ``step_end(model)``: one batch, one training step. The
  model's inputs in the layout (``cltrain.batch_inputs``); the first batch of each kind checked on the deciding rank
  (``check`` is the door's step runner) and the verdict applied on every rank; each training step (from its first
  batch to ``step_end``, after the optimizer step) timed while the layouts race (``cltrain.timing.layout_race``): the
  faster is kept, in one line, and both step times go to the host's logger;
* ``boundary(model, what)``: put back what moved the layout (a pruning, a hook writing ``.data``), with the optimizer
  state;
* ``state_dict`` / ``load_state_dict`` / ``resume``: the checks' verdicts (with the fingerprint that says whether they
  still hold) and the race's decisions travel in the checkpoint; the optimizer state takes its parameters' strides;
* ``end(model)``: the layout kept a last time, torch's utilities given back.

A verdict has one meaning each: ``"passed"`` / ``"not checked"`` change nothing; ``"fallback"``: the named parts run in
NCHW (``cltrain.check.fallback``), in the model and in its copies; ``"contiguous"``: the whole model in NCHW, its
inputs put in NCHW at its entry. Every change of a parameter's layout gives the optimizer state its parameter's
strides. Every line starts with ``ChannelsLast`` and is the same from every door.

Example (what a front door does; ``cltrain.loops.ChannelsLastRun`` is the shortest one)::

    session = LayoutSession(host=Host(optimizers=lambda: [optimizer]))
    session.start(model, owner="ChannelsLastRun")
    for batch in loader:
        session.batch("train", batch, model, check=lambda: check_plain_step(model, batch, step))
        step(model, batch)
        session.batch_end()
        session.step_end(model)
    session.end(model)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from cltrain.batch_inputs import BatchInputs
from cltrain.check.budget import DEFAULT_SAMPLES
from cltrain.check.copies import half_dtype
from cltrain.check.fallback import Fallback, apply_fallbacks
from cltrain.check.localise import first_line
from cltrain.check.result import REACHED_REAL, LayoutCheck, describe_fallbacks
from cltrain.check.resume import restored_check, saved_check
from cltrain.ddp import blocker, rebuild_buckets, wrappers
from cltrain.devices import device_of
from cltrain.guardrails import GuardRecord, apply_guardrails, arm_autocast_guards, find_hazards, hazards_over_ranks
from cltrain.host import Host
from cltrain.layout import CONV_TYPES, has_convolutions, is_channels_last, layout_summary, memory_format_for, \
    to_channels_last, to_contiguous
from cltrain.layout.batches import Inputs, first_image_list, first_image_tensor
from cltrain.layout.optimizer_state import restride_optimizer_state
from cltrain.layout.tensors import compiled_frames, is_compiled, is_materialized, nchw
from cltrain.nchw_code import aliases_follow, relayout, torch_utilities
from cltrain.precision import say_bf16_emulated
from cltrain.sharding import not_checked_reason, sharded_line, sharding_of
from cltrain.timing.clock import StepTimer
from cltrain.timing.layout_race import LayoutDecision, LayoutRace

__all__ = ["LayoutSession", "SessionResults", "stepping_optimizer"]

_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}
_COMPILED = "torch.compile would compile both layouts"
_IMAGE_LIST = ("images",)  # a race's key for a detector's lists of 3-D images, whatever their sizes
_UNASKED = object()


@contextlib.contextmanager
def no_autotune() -> Iterator[None]:
    """``cudnn.benchmark`` off inside: the check's runs are once-only, at the check's batch size, in float32 and
    both layouts, so autotuning each of their convolutions only adds to the check's time; the run's own steps
    autotune as the user set."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


#: Training batches without a step of any watched optimizer, none ever seen, after which a door stops waiting for one.
UNSTEPPED_BATCHES = 256


class _StepCounter:
    """An optimizer step hook that counts the steps of the optimizers it was registered on. A copy of such an
    optimizer (the check's, ``copy.deepcopy``, a pickle) carries this counter inert: its steps are not the run's."""

    cltrain_own = True  # not a step hook of the user's (``user_step_hooks``)

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.steps = 0

    def __call__(self, optimizer: Any, *args: Any) -> None:
        if id(optimizer) in self.ids:
            self.steps += 1

    def __deepcopy__(self, memo: dict[int, Any]) -> _StepCounter:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return _StepCounter, ()


def _inert(module: Any, args: Any) -> None:
    return None


class _OneShot:
    """A forward pre-hook of cltrain's that a copy of its module (an EMA's ``AveragedModel``, ``torch.save`` of the
    whole module) carries as a no-op that pickles, not as the session's closure."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    def __call__(self, module: Any, args: Any) -> Any:
        return self.hook(module, args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _inert

    def __reduce__(self) -> tuple[Any, ...]:
        return _inert_hook, ()


def _inert_hook() -> Callable[..., None]:
    return _inert


#: Where an optimizer wrapper holds the optimizer it steps: Accelerate's and Lightning's wrappers, timm's Lookahead,
#: SAM's implementations.
_WRAPPED = ("optimizer", "_optimizer", "_base_optimizer", "base_optimizer")


def stepping_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The optimizer whose step hooks tell that ``optimizer`` stepped: the innermost one it wraps (a wrapper may skip
    its inner step, as Accelerate's does while gradients accumulate) whose class runs torch's step hooks (a class
    that does not call ``Optimizer.__init__``, as timm's Lookahead, takes hooks and never runs them); ``None``: none."""
    found, seen = None, set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        hooked = getattr(getattr(type(optimizer), "step", None), "hooked", False)
        if hooked and hasattr(optimizer, "_optimizer_step_post_hooks"):
            found = optimizer
        optimizer = next((inner for name in _WRAPPED
                          if isinstance(inner := getattr(optimizer, name, None), torch.optim.Optimizer)), None)
    return found


def _outside_inference(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` run outside ``torch.inference_mode`` where it moves the model (Lightning validates, tests and
    predicts inside it): a weight restrided there would be an inference tensor, which no later training step can
    save for its backward."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return method(*args, **kwargs)

    return run


class LayoutSession:
    """A model's channels_last run: see the module docstring.

    Args:
        mode: ``"full"`` restrides every 4-D/5-D parameter and buffer; ``"conv"`` only convolution weights.
        layout: ``"auto"`` (the default) races channels_last and NCHW on the run's first training steps and keeps
            the faster; ``"channels_last"`` or ``"contiguous"`` pins one (no race: two runs pinned alike are
            bit for bit equal).
        guard: apply ``cltrain.guardrails.apply_guardrails`` after every conversion.
        verify: run the first-batch check of each kind of batch (``"train"``, ``"eval"``).
        inputs: which tensors of a batch are the model's inputs (``cltrain.layout.batches``).
        check_samples: the check runs on this many samples of the batch (``cltrain.check.budget``).
        convert_inputs: put the model's inputs in its layout (``False``: the first convolution converts them).
        host: what the front door lends (``cltrain.host``; default: one process or ``torch.distributed``'s group).
        race: the ``LayoutRace`` that decides ``layout="auto"`` (default: its defaults).

    Attributes:
        layout: the layout the model is in now (``"channels_last"`` or ``"contiguous"``; during a race, the step's);
            ``None`` before ``start``.
        decisions: the race's ``LayoutDecision`` of each kind of batch (``race.decisions``).
        sharding: the engine holding the parameters (``cltrain.sharding``), which then stay contiguous, or ``None``.
        guardrails: the ``GuardRecord`` of each known fault worked around (``None`` with ``guard=False``).
        fallbacks: the ``Fallback``s the checks chose (a ``"contiguous"`` verdict is ``Fallback("module", "")``).
        layout_checks: the ``LayoutCheck`` of each kind of batch checked (``"train"``, ``"eval"``).
        summary: ``cltrain.layout_summary`` of the model's parameters and buffers once converted.
        device: where the model trains; dtype: the dtype its convolutions compute in (``None``: float32).
        untimed: why the layouts are not raced (a pinned layout, a sharded or compiled model, a verdict), or ``None``.
    """

    def __init__(self, mode: str = "full", *, layout: str = "auto", guard: bool = True, verify: bool = True,
                 inputs: Inputs = None, check_samples: int | None = DEFAULT_SAMPLES, convert_inputs: bool = True,
                 host: Host | None = None, race: LayoutRace | None = None) -> None:
        self.mode, self.pinned, self.convert_inputs = mode, None if layout == "auto" else layout, convert_inputs
        self._pin = self.pinned  # the user's (a "contiguous" verdict pins too)
        self._model: weakref.ref | None = None  # the model started last
        self.guard, self.verify, self.check_samples = guard, verify, check_samples
        self.host = host or Host()
        self.race = race or LayoutRace()
        self.inputs = BatchInputs(self.say, inputs)
        self.layout: str | None = None
        self.sharding: str | None = None
        self.guardrails: list[GuardRecord] | None = None
        #: the door cannot see the step's autocast, and was told no dtype (a loop: Fabric's ``bf16-mixed``, its own
        #: ``torch.autocast``): the guardrails for bf16 autocast alone are applied too
        self.autocast_unseen = False
        #: the one-shot hook that looks at the first training forward's autocast (``False``: looked for already)
        self._autocast_probe: Any = None
        self._said_layout = ""  # the conversion line said last, for this model
        self.fallbacks: list[Fallback] = []
        self.layout_checks: dict[str, LayoutCheck] = {}
        self.summary: dict[str, int] | None = None
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self.untimed: str | None = None
        self.unnamed_images = False  # a door saw image-like arguments under names it does not convert
        self.fingerprint: Callable[[], str] | None = None
        self._hazards: dict[str, dict[str, list[str]]] = {}
        self._expected: dict[str, torch.memory_format | None] | None = None
        self._trained = False  # a training step has started
        self._restored: dict[str, Any] = {}
        self._told: set[str] = set()
        self._utilities: contextlib.ExitStack | None = None
        self._finalizer: weakref.finalize | None = None  # gives them back where the session is collected unclosed
        self._step: tuple[tuple[Any, ...], int, StepTimer] | None = None
        self._step_layout, self._step_disturbed = "channels_last", False  # the open step's layout; an evaluation in it
        self._key: tuple[Any, ...] | None = None
        self._watched: dict[int, Any] = {}  # id(optimizer) -> its step hook's handle
        self._examined: set[int] = set()  # the host's optimizers looked at by _watch
        self._counter, self._steps_seen, self._unstepped = _StepCounter(), 0, 0
        self._frames: int | None = None  # torch.compile's count at the start, until the race's first switch
        self._ddp_blocker: Any = _UNASKED  # why DDP's buckets cannot follow a switch (cltrain.ddp), once asked
        self._ddps: list[weakref.ref] = []  # the DDPs holding the model, once found
        self._judging = False  # a step recorded whose round the race has not judged yet (step_end's judge=False)
        self._lazy = False  # the model held a lazy module's parameters before their first forward at the start
        self._race_shapes: dict[Any, tuple[int, ...]] = {}  # each race's first input shape on this rank
        #: a door whose step ends where the loop's optimizer stepped sets this: the host's optimizers are then watched
        self.watch_optimizers = False
        #: how the door's user pins a layout, for the lines that say so (the app: ``"channels_last_layout={}"``)
        self.pin_format = "layout={!r}"

    def say(self, message: str, warn: bool = False) -> None:
        """One line, through the host."""
        self.host.say(message, warn)

    @property
    def decisions(self) -> dict[Any, LayoutDecision]:
        """The race's decision of each kind of batch."""
        return self.race.decisions

    @property
    def decision(self) -> LayoutDecision | None:
        """The decision for the kind of batch trained on last (``None``: not decided)."""
        return self.race.decisions.get(self._key) if self._key is not None else None

    # ---- start -----------------------------------------------------------------------------------------------------

    @_outside_inference
    def start(self, model: nn.Module, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
              sharding: str | None = None, owner: str | None = None, training: bool = True,
              compiles: bool = False) -> nn.Module:
        """Put ``model`` in the session's layout, in place, with the guardrails, the fallbacks chosen so far and the
        host's copies of it; hold torch's utilities that take channels_last weights until ``end``. In a run of several
        ranks (every rank calls here) the guardrails cover the modules any rank finds hazardous.

        Args:
            device: where it trains (default: its parameters' device); the guardrails depend on the backend.
            dtype: the dtype its convolutions compute in (the autocast dtype; ``None``: its weights' 16-bit dtype, else
                float32).
            sharding: the engine that shards it or will (``cltrain.sharding.sharding_of``): parameters contiguous.
            owner: the front door, as the line names it (``"ChannelsLast(mode='full')"``); ``None``: nothing said.
            training: the model will train (``False``: it only evaluates, and the line promises no race).
            compiles: the front door's host compiles the model later (the Hugging Face ``Trainer``'s
                ``torch_compile``): not raced, as a model compiled already.
        """
        if self._model is not None and self._model() is not model:
            self._forget()  # another model (a callback reused by a second Trainer, a search's trials): checked afresh
        self._model = weakref.ref(model)
        if dtype is None:  # weights cast to 16 bits (model.to(torch.bfloat16), "bf16-true"): convolutions compute in it
            dtype = half_dtype(model)
        self.device, self.dtype = torch.device(device) if device is not None else device_of(model), dtype
        held = sharding_of(model)  # sharded already: the engine owns the parameters' layout
        self.sharding = sharding if sharding is not None else held
        if self.layout is None:
            self.layout = self.pinned or "channels_last"
        self.untimed = self._why_untimed(model, compiles)
        self._lazy = bool(_uninitialized(model))
        self._frames, self._ddp_blocker, self._ddps = compiled_frames(), _UNASKED, []
        self._hazards.clear()
        records = self._put_in_layout(model, self.layout, held=held is not None)
        if self.guard:
            self.guardrails = records
        apply_fallbacks(model, self.fallbacks)  # a later fit: the conversion restrided their weights
        if self.sharding is None:  # a door made after DDP wrapped the model (its buckets: the strides before)
            self._buckets_follow(model, "the conversion")
        self.summary = layout_summary(model, buffers=True)
        try:
            copies = self.host.copies()
        except Exception:  # noqa: BLE001 - copies=lambda: [ema] with the EMA made after the door: a copy of the
            copies = []  # converted model then, asked again at the next change of layout
        self.convert_copies(copies)
        if self._utilities is None:
            utilities = contextlib.ExitStack()
            utilities.enter_context(torch_utilities(self.say))
            self._utilities = utilities
            self._finalizer = weakref.finalize(self, utilities.close)  # a run ended by an exception too
        if not self._lazy and self.sharding is None:
            self.expect(model)  # what user code moves before the first training step (on_train_start) is put back
        if owner is not None:
            self.report_conversion(owner, model, training)
        return model

    def _forget(self) -> None:
        """What the session learnt of another model: its checks' verdicts and fallbacks, a pin a verdict made, its
        hazards, its race and a checkpoint's state for it."""
        race = self.race
        self.race = LayoutRace(warmup=race.warmup, margin=race.margin, budget=race.budget, max_rounds=race.max_rounds,
                               z=race.z, max_keys=race.max_keys)
        self.layout, self.pinned, self.fallbacks, self.layout_checks = None, self._pin, [], {}
        self.guardrails = self.summary = self._expected = self._key = self._step = None
        self._trained = False
        self._hazards, self._restored, self._race_shapes = {}, {}, {}
        self._said_layout = ""

    def _why_untimed(self, model: nn.Module, compiles: bool = False) -> str | None:
        if self.pinned is not None:
            return f"pinned to {self.pinned}"
        if self.sharding is not None:
            return f"{self.sharding} keeps the weights NCHW"
        if compiles or is_compiled(model):
            return _COMPILED
        if not has_convolutions(model):
            return "the model has no convolution"  # both layouts would time the same steps
        return None

    def _put_in_layout(self, model: nn.Module, layout: str, held: bool = False) -> list[GuardRecord]:
        """``model`` in ``layout``, guarded: the guardrails cover what any rank finds (every rank calls here at the
        same point; each layout's hazards are found once)."""
        if self.sharding is not None:
            if not held:  # FSDP2 refuses channels_last parameters; the others flatten them contiguous
                to_contiguous(model)
        elif layout == "channels_last":
            to_channels_last(model, mode="conv" if self.mode == "conv" else "full")
        else:  # NCHW, even for a model that arrived channels_last
            to_contiguous(model)
            for p in model.parameters():  # a gradient kept across the switch (accumulation) follows its parameter
                if p.grad is not None and p.grad.dim() in (4, 5) and not p.grad.is_contiguous():
                    p.grad = nchw(p.grad)
        if not self.guard:
            return []
        key = "held" if self.sharding is not None else layout
        if key not in self._hazards:
            found = find_hazards(model, device=self.device, dtype=self.dtype,
                                 layout="contiguous" if self.sharding is not None else layout)
            if self.host.several():
                found = hazards_over_ranks(model, found, self.host.sum)
            self._hazards[key] = found
        # After every conversion: converting again would undo a guarded weight's layout.
        records = apply_guardrails(model, device=self.device, dtype=self.dtype, hazards=self._hazards[key])
        if self.autocast_unseen and self.dtype is None:  # their hooks act only under bf16 autocast: inert in fp32
            records += arm_autocast_guards(model, device=self.device)
        return records

    @_outside_inference
    def convert_copies(self, copies: Iterable[nn.Module]) -> None:
        """Put copies of the model (an EMA's ``AveragedModel``, SWA's) in its layout, with its fallbacks."""
        if self.layout is None or self.sharding is not None:
            return
        for copy_ in copies:
            if self.layout == "channels_last":
                to_channels_last(copy_, mode="conv" if self.mode == "conv" else "full")
            else:
                to_contiguous(copy_)
            if self.guard:
                apply_guardrails(copy_, device=self.device, dtype=self.dtype, layout=self.layout)
            _apply_to_copy(copy_, self.fallbacks)

    def report_conversion(self, owner: str, model: nn.Module, training: bool = True) -> None:
        """Say the conversion line, the guardrails applied, and (once) that a model without convolutions gains
        nothing."""
        if not has_convolutions(model) and "no convolutions" not in self._told:
            self._told.add("no convolutions")
            self.say(f"{owner.partition('(')[0]}: {type(model).__name__} has no Conv2d/Conv3d/ConvTranspose layer, so "
                     "channels_last has nothing to speed up; remove it or keep it for the layout checks.", True)
        if self.sharding is not None:
            self.say(f"{owner}: {sharded_line(self.sharding, self.convert_inputs)}", not self.convert_inputs)
        else:
            counts = ", ".join(f"{n} {k.replace('rank', '') + '-d' if k.startswith('rank') else k}"  # not a process's rank
                               for k, n in (self.summary or {}).items())
            kept = sorted({_name(d.layout) for d in self.race.decisions.values()})  # an earlier fit's, on this model
            raced = ""
            if self.untimed == _COMPILED:
                raced = f"; not raced against NCHW ({self.untimed})"
            elif training and not self.untimed:
                raced = f"; the race's decision holds for the inputs it timed: {' / '.join(kept)} (others are raced)" \
                    if kept else "; the first training steps race it against NCHW"
            line = f"{owner}: model layout is {self.layout}{raced}; parameters and buffers: {counts}."
            if line != self._said_layout:  # said once for the model while it holds (each validate, test, fit)
                self._said_layout = line
                self.say(line, False)
        if self.guardrails:
            self.say("ChannelsLast: worked around known kernel faults: "
                     + "; ".join(r.line() for r in self.guardrails), False)
        if training and self.dtype == torch.bfloat16 and self.device is not None and self.device.type == "cpu":
            say_bf16_emulated(lambda line: self.say(line, True), "ChannelsLast: training in bf16",
                              "Training in fp32 is faster here.")

    # ---- a step ----------------------------------------------------------------------------------------------------

    def batch(self, kind: str, batch: Any, model: nn.Module, check: Callable[[], LayoutCheck] | None = None, *,
              in_place: bool = True) -> Any:
        """A step of ``kind`` (``"train"`` or ``"eval"``) starts on ``batch``: the model in the step's layout (a race
        may switch it), the model's inputs in that layout (in place, or in a new structure that is returned), the
        first batch of ``kind`` checked with ``check()`` (the door's step runner on this batch) and its verdict
        applied, the forward traced; a training step's clock started. Returns the batch to run."""
        if self.layout is None:
            return batch
        if kind == "train":
            if not self._trained:
                self._trained = True
                self.boundary(model, after="before the first training step")
            if self.watch_optimizers:
                self._watch()
            if self._step is None:
                self._begin_training_step(batch, model)
            elif self.layout != self._step_layout:  # an evaluation inside the step (gradient accumulation) switched
                self._switch(model, self._step_layout)
        else:
            self._step_disturbed = self._step is not None  # its time holds the evaluation's: not a sample of the race
            if self.layout != self._settled() and not self.host.evaluates_alone():
                self._switch(model, self._settled())  # an evaluation in the middle of a race runs in the default
                # (not on one rank alone: each switch has DDP's buckets built again, which every rank must join)
        if check is not None:
            self.check(kind, model, check)  # a "contiguous" verdict puts the model, and so its inputs, in NCHW
        if self.convert_inputs:
            batch = self.inputs.convert(batch, kind, model, self.layout, in_place=in_place)
        if kind == "train" and self._expected is None:  # a lazy model, made by its first forward
            self.expect(model)
        self.inputs.start_trace(model, self.layout)
        if kind == "train" and self._autocast_probe is None:  # after the check: its copies would copy the hook
            self._look_for_autocast(model)
        return batch

    def _watch(self) -> None:
        """Count the steps of the host's optimizers (those that appear later too), for ``optimizer_stepped``."""
        optimizers = self.host.optimizers()
        if not optimizers and self.untimed is None and "no optimizer" not in self._told:  # (no race: nothing timed)
            self._told.add("no optimizer")
            self.say("ChannelsLast: no optimizer given: each batch is timed as a step (give the run the optimizer your "
                     "loop steps: under gradient accumulation a step is then the batches up to its step)")
        for optimizer in optimizers:
            if id(optimizer) in self._examined:
                continue
            self._examined.add(id(optimizer))
            stepping = stepping_optimizer(optimizer)
            if stepping is None:
                self.say(f"ChannelsLast: the steps of {type(optimizer).__name__} cannot be watched (its step runs no "
                         "step hooks): under gradient accumulation each batch is timed as a step")
                continue
            if id(stepping) not in self._watched:
                self._counter.ids.add(id(stepping))
                self._watched[id(stepping)] = stepping.register_step_post_hook(self._counter)

    def optimizer_stepped(self) -> bool:
        """Whether one of the host's optimizers stepped since the last call (always where none is watched: see
        ``watch_optimizers``): a door whose loop steps the optimizer itself ends a training step there, so under
        gradient accumulation a step is the batches up to the optimizer's step."""
        stepped = not self._watched or self._counter.steps != self._steps_seen
        self._steps_seen = self._counter.steps
        self._unstepped = 0 if stepped else self._unstepped + 1
        if self._unstepped >= UNSTEPPED_BATCHES and self._counter.steps == 0:  # not the optimizer the loop steps
            self.watch_optimizers = False
            self._unwatch()
            self.say(f"ChannelsLast: none of the optimizers given stepped in {UNSTEPPED_BATCHES} batches: each "
                     "batch is timed as a step from here (give the run the optimizer your loop steps)", warn=True)
        return stepped

    def _unwatch(self) -> None:
        for handle in self._watched.values():
            handle.remove()
        self._watched.clear()
        self._examined.clear()
        self._counter.ids.clear()

    def forward_done(self, completed: bool = True) -> None:
        """The traced forward ended (at the backward, or the forward's own end)."""
        self.inputs.end_trace(completed)

    def batch_end(self, *, restore: bool = True, completed: bool = True) -> None:
        """A batch's forward and backward ended: the trace left (judged where ``completed``) and the loader's tensors
        given back (``restore``; not where the door handed the model new tensors)."""
        self.inputs.end_trace(completed)
        if self._autocast_probe:  # a forward that reached no convolution: not looked at again
            self._autocast_probe.remove()
        if restore:
            self.inputs.restore()

    def _look_for_autocast(self, model: nn.Module) -> None:
        """A door that cannot see the step's autocast and was given no dtype (a loop under Fabric's ``bf16-mixed`` or
        its own ``torch.autocast``): the first training forward's first convolution says whether it runs under
        autocast (a one-shot pre-hook; a model compiled in place is not hooked), and one line gives the dtype to pass:
        the first-batch check, the guardrails' line and the race's name for the steps take the dtype given."""
        self._autocast_probe = False  # looked for once
        if not self.autocast_unseen or self.dtype is not None or is_compiled(model):
            return
        conv = next((m for m in model.modules() if isinstance(m, CONV_TYPES)), None)
        if conv is None:
            return

        def look(module: nn.Module, args: Any) -> None:
            self._autocast_probe.remove()  # a copy made meanwhile holds _OneShot's no-op instead
            device = args[0].device.type if args and isinstance(args[0], torch.Tensor) else "cpu"
            if not torch.is_autocast_enabled(device):
                return
            seen = torch.get_autocast_dtype(device)
            name = _PRECISION.get(seen, str(seen))
            self.say(f"ChannelsLast: the model's forward runs under {name} autocast, but the run was given no dtype: "
                     f"pass dtype=torch.{str(seen).partition('.')[2]}: the first-batch check, the guardrails' line and "
                     "the race's name for the steps take the dtype given.", False)
            if seen == torch.bfloat16 and device == "cpu":
                say_bf16_emulated(lambda line: self.say(line, True), "ChannelsLast: training in bf16",
                                  "Training in fp32 is faster here.")

        # eager under a compile wrapper; a copy made meanwhile (an EMA's) carries a no-op that pickles
        self._autocast_probe = conv.register_forward_pre_hook(_OneShot(torch.compiler.disable(look)))

    def step_end(self, model: nn.Module, *, completed: bool = True, judge: bool = True) -> None:
        """The training step opened by the first training ``batch`` since the last ``step_end`` ended (its
        optimizer step included; several batches under gradient accumulation): its time recorded (not where it did
        not complete). Where a round of the race ends, the deciding rank judges, every rank applies the same, one
        line says it and the host logs both step times: here, or (``judge=False``: a step that an evaluation on this
        rank alone ends, where no other rank joins a broadcast) at the start of the next training step."""
        if self._lazy:
            self._adopt_materialized(model)
        if self._step is None:
            return
        key, size, clock = self._step
        self._step = None
        if not completed:
            return
        self.race.record(key, size, self.layout, clock.stop(), timed=not self._step_disturbed)
        self._judging = True
        if judge:
            self._judge(model)

    def _adopt_materialized(self, model: nn.Module) -> None:
        """A lazy module's parameters and buffers, made in NCHW by their first forward, put in the session's layout
        with their optimizer state (once every one is made)."""
        if _uninitialized(model) or self._expected is None:
            return
        self._lazy = False
        convert = self.layout == "channels_last" and self.sharding is None and not self.fallbacks
        modules = dict(model.named_modules())
        for name, t in _named_tensors(model):
            if _stands_for(name) not in self._expected:
                owner = modules.get(name.rpartition(".")[0])
                if convert and (self.mode != "conv" or isinstance(owner, CONV_TYPES)):
                    relayout(t, torch.channels_last)
                self._expected[_stands_for(name)] = _layout_of(t)
        restride_optimizer_state(self.host.optimizers())

    def close_stepped(self, model: nn.Module) -> None:
        """A checkpoint is taken inside a loop's step, after its optimizer stepped (a loop that saves before it asks
        for its next batch): the step ends now, so the checkpoint holds it (and the resumed race does not run it
        again); its judgement waits for the next step's start, where every rank joins it."""
        if self._step is not None and (not self._watched or self._counter.steps != self._steps_seen):
            self.optimizer_stepped()
            self.step_end(model, judge=False)

    def _judge(self, model: nn.Module) -> None:
        """Where the step recorded last ended a round of the race: the deciding rank's judgement, on every rank."""
        self._judging = False
        if not self.race.due():
            return
        decision = self.host.broadcast(self.race.judge() if self.host.deciding() else None)
        if decision is not None:
            self.race.settle(decision)
            self._decided(model, decision)

    def _begin_training_step(self, batch: Any, model: nn.Module) -> None:
        """The race's layout for this step (a switch where it differs) and the step's clock."""
        if self._judging:
            self._judge(model)
        image = first_image_tensor(batch, self.inputs.inputs)
        images = first_image_list(batch) if image is None else None
        if image is None and images is None:
            if self.untimed is None and not self.race.racing() and not self.race.decisions \
                    and "no image tensor" not in self._told:
                self._told.add("no image tensor")
                why = ("hold no image tensor or list of 3-D images" if first_image_tensor(batch, "all") is None
                       and not self.unnamed_images else
                       "hold no model input cltrain knows (name it with inputs=KEY or inputs=INDEX, a list for several)")
                self.say(f"ChannelsLast: the training batches {why}, so the layouts are not raced: the model stays "
                         f"{self.layout}; {self.pin_format.format('contiguous')} pins NCHW.")
            return
        # a detector's list of 3-D images (of any sizes: the model resizes them) is one kind of batch
        sample = tuple(image.shape[1:]) if image is not None else _IMAGE_LIST
        # several ranks: one race for every input size, as the ranks' sizes may differ at a step (multi-scale
        # training) and every rank must switch at the same steps (each switch rebuilds DDP's buckets, with them all)
        shape = () if self.host.several() else sample
        weight = next(model.parameters(), None)  # a model in float64 ("64-true") computes in it: not fp32's race
        precision = "fp64" if self.dtype is None and weight is not None and weight.dtype == torch.float64 else \
            _PRECISION.get(self.dtype, str(self.dtype))
        key = (shape, precision, self.device.type)
        self._key = key
        if self._restored.get("race"):  # a checkpoint of another number of ranks keys its decision by every rank's
            # sizes, or by one rank's: it holds
            self.race.carry(key, lambda k: k[1:] == key[1:] and (k[0] == ()) != (shape == ()))
        if key in self.race.decisions:
            want = self.race.decisions[key].layout
            if self.race.decisions[key].how == "restored" and ("restored", key) not in self._told:
                self._told.add(("restored", key))
                self.say(self.decision_line(self.race.decisions[key]), False)
        elif self.untimed is not None:
            want = self.layout  # nothing to race: pinned, sharded, compiled, or the check kept the model in NCHW
        else:
            want = self.race.next_layout(key)
            if want != self.layout and self._compiles():
                want = self.layout
        if want != self.layout and self.host.grouped():  # DDP's gradient buckets must follow the switch
            want = self._ranks_hold(model, want)
        if want != self.layout:
            self._switch(model, want)
        if key not in self.race.decisions and self.untimed is None:
            self._step = (key, int(image.shape[0]) if image is not None else len(images), StepTimer(self.device))
            # several ranks, one race for every size: only the steps of the size this rank's race began with are its
            # samples (sizes changing in step with the race's rounds timed every channels_last step at one size and
            # every NCHW step at another, and switched to the slower layout); the rounds go on alike on every rank
            own = self._race_shapes.setdefault(key, sample)
            self._step_layout, self._step_disturbed = self.layout, own != sample
            self._step[2].start()  # the inputs' conversion is part of the step: NCHW pays it with NHWC batches

    def _compiles(self) -> bool:
        """Asked once, before the race's first switch: whether code that ``torch.compile`` compiled ran since the start
        (the deciding rank's view). A model compiled after the door saw it (the Hugging Face ``Trainer``'s
        ``torch_compile``, Accelerate's ``dynamo_backend``, ``torch.compile`` after ``ChannelsLastRun``), or a compiled
        optimizer step (it guards on its state tensors, which a switch replaces), would then be compiled again at
        every switch, and past dynamo's recompile limit run eagerly: the layouts are not raced."""
        if self._frames is None:
            return False
        seen, self._frames = compiled_frames() != self._frames, None
        if self.host.broadcast(seen if self.host.deciding() else None) is not True:
            return False
        self.untimed = "torch.compile compiled the training step"
        self.race.stop()
        self.say(f"ChannelsLast: torch.compile compiled code in the training steps, so the layouts are not raced (each "
                 f"switch would compile it again): {self.layout} kept; {self.pin_format.format('contiguous')} pins NCHW.")
        return True

    def _ranks_hold(self, model: nn.Module, want: str) -> str:
        """Under several ranks a switch needs the gradient buckets of the DDP holding the model built again
        (``cltrain.ddp``: a parameter restrided under buckets built with other strides gets wrong gradients). Where
        they cannot be, the model keeps its layout, said once, and the race stops; the same answer on every rank
        (DDP's settings are every rank's)."""
        if self._ddp_blocker is _UNASKED:
            self._ddp_blocker = blocker(self._wrappers(model))
        if self._ddp_blocker is None:
            return want
        if self.race.racing() or self.untimed is None:
            self.untimed = f"several ranks: {self._ddp_blocker}"
            self.race.stop()
            self.say(f"ChannelsLast: the layouts are not raced across the ranks ({self._ddp_blocker}; a parameter "
                     f"restrided under DDP's buckets gets wrong gradients): {self.layout} kept; "
                     f"{self.pin_format.format('contiguous')} pins NCHW.")
        return self.layout

    def _buckets_follow(self, model: nn.Module, what: str) -> None:
        """After ``what`` restrided parameters, in a process group (a DDP of one rank too): the DDP holding the
        model builds its gradient buckets again now (every rank calls here at the same step). Where it cannot, one
        line."""
        if not self.host.grouped():
            return
        reason = rebuild_buckets(self._wrappers(model))
        if reason is not None and "ddp buckets" not in self._told:
            self._told.add("ddp buckets")
            self.say(f"ChannelsLast: {what} restrided parameters after DDP wrapped the model, and {reason}: their "
                     "gradients are permuted (wrong) from here; pin "
                     f"{self.pin_format.format('contiguous')} so the model is NCHW before DDP wraps it.", True)

    def _wrappers(self, model: nn.Module) -> list[nn.Module]:
        """The DDPs holding ``model`` (``cltrain.ddp.wrappers``: a garbage collection and a walk), found once a
        start, at the first change of layout after DDP wrapped it (at the same point on every rank)."""
        alive = [d for d in (ref() for ref in self._ddps) if d is not None]
        if not alive:
            alive = wrappers(model)
            self._ddps = [weakref.ref(d) for d in alive]
        return alive

    def _settled(self) -> str:
        decided = self.decision
        if decided is None and self._key is None and not self.pinned:  # no training step yet: a checkpoint's
            held = {d.layout for d in self.race.decisions.values()}  # decisions, where they agree (an evaluation
            if len(held) == 1:  # of the checkpoint alone)
                return held.pop()
        return decided.layout if decided is not None else self.pinned or "channels_last"

    def _switch(self, model: nn.Module, layout: str) -> None:
        """The model (its parameters, gradients and buffers, with the guardrails and fallbacks), its optimizer state
        in ``layout``; every rank switches at the same step."""
        self.layout = layout
        with aliases_follow(model, self.host.aliases()):
            records = self._put_in_layout(model, layout)
        if self.guard:
            self.guardrails = records
        if layout == "channels_last":
            apply_fallbacks(model, self.fallbacks)
        restride_optimizer_state(self.host.optimizers())
        self._buckets_follow(model, "the switch of the layouts")
        if self._expected is not None:
            self.expect(model)

    def put_back(self, model: nn.Module) -> None:
        """``model`` back in the session's layout, with its optimizer state, after code that ran it in another (the
        trial steps of Lightning's finders, in NCHW)."""
        self._switch(model, self.layout)

    def _decided(self, model: nn.Module, decision: LayoutDecision) -> None:
        if decision.layout != self.layout:
            self._switch(model, decision.layout)
        self.convert_copies(self.host.copies())
        self.summary = layout_summary(model, buffers=True)
        self.say(self.decision_line(decision), False)
        if decision.seconds:
            self.host.log({f"channels_last/step_seconds_{k}": v for k, v in decision.seconds.items()})

    def decision_line(self, decision: LayoutDecision) -> str:
        """The one line that says what the race kept, by how much, and how to pin it."""
        shape, precision, device = decision.key
        size = "lists of images" if shape == _IMAGE_LIST else f"{'x'.join(map(str, shape[1:]))} px" if shape else \
            "every rank's input sizes"
        where = f"({precision}, {device}, {size})"
        timed = ", ".join(f"{n} step(s) in {'NCHW' if k == 'contiguous' else k}" for k, n in decision.samples.items())
        cost = f"; the race cost {decision.extra_seconds:.2f} s" if decision.extra_seconds > 0 else ""
        pin = f"pin it with {self.pin_format.format(decision.layout)}"
        if decision.how == "restored":
            name = _name(decision.layout)
            timed = ""
            if len(decision.seconds) == 2:
                faster = min(decision.seconds, key=decision.seconds.__getitem__)
                was = decision.timed_how  # the race's own words where the checkpoint kept them
                # a switch to NCHW was judged faster (paired steps) whatever the medians say
                timed = f", when timed within {100 * self.race.margin:.0f}% of NCHW" if was == "tie" else \
                    f", {decision.judged or decision.ratio:.2f}x faster when timed" \
                    if decision.layout == "contiguous" or faster == decision.layout and was != "noisy" else \
                    f", when timed within {100 * self.race.margin:.0f}% of NCHW" \
                    if decision.ratio <= 1 + self.race.margin else \
                    f", when timed {_name(faster)} {decision.ratio:.2f}x faster by the medians, too noisy to tell"
            return f"ChannelsLast: the checkpoint's race decision holds here {where}: {name}{timed} ({pin})."
        seconds = decision.seconds
        nchw_ahead = len(seconds) == 2 and seconds["contiguous"] < seconds["channels_last"]
        hedged = len(seconds) == 2 and decision.how != "tie" and decision.layout == "channels_last" and (
            nchw_ahead or decision.how == "noisy")
        if len(seconds) < 2:  # "untimed"
            head = (f"the layouts were not timed apart here {where} in {self.race.max_rounds} rounds (steps of other "
                    "batch sizes, or evaluations, in each): kept channels_last")
        elif decision.how == "tie":
            head = f"channels_last and NCHW within {100 * self.race.margin:.0f}% here {where}: kept channels_last"
        elif hedged:  # a lead not beyond doubt
            head = (f"{'NCHW' if nchw_ahead else 'channels_last'} {decision.ratio:.2f}x faster by the medians here "
                    f"{where}, too noisy to tell: kept channels_last")
        elif decision.layout == "channels_last":  # the lead the rule judged (paired steps), not the medians'
            head = f"channels_last {decision.judged or decision.ratio:.2f}x faster here {where}: kept"
        else:
            head = f"NCHW {decision.judged or decision.ratio:.2f}x faster here {where}: switched, the model and its " \
                   "optimizer state moved once"
        noisy = "; the steps' times were noisy" if decision.how == "noisy" and not hedged else ""
        return f"ChannelsLast: {head}{noisy} (timed {timed}{cost}; {pin})."

    # ---- the first-batch check -------------------------------------------------------------------------------------

    def check(self, kind: str, model: nn.Module, run: Callable[[], LayoutCheck], *, report: bool = True) -> LayoutCheck:
        """The first-batch check of ``kind``, once per kind: ``run()`` (a step runner: ``cltrain.check.plain_step``,
        ``cltrain.check.lightning_step``) on the host's deciding rank, its result shared with every rank, applied to
        ``model``, the host's copies and its optimizers' state, and said in one line (``report``). A checkpoint's
        verdict for the same model, step and precision (``fingerprint``) is applied without running it. A failure of
        the check itself is reported as not checked: it never ends the run."""
        if kind in self.layout_checks:
            return self.layout_checks[kind]
        saved = self._restored.get("layout_checks", {}).get(kind)
        same = saved is not None and self.fingerprint is not None \
            and self._restored.get("fingerprint") == self.fingerprint()
        if not same and (not self.verify or self.layout != "channels_last"):
            return LayoutCheck("not checked", reason="not asked" if not self.verify else "the model runs in NCHW")
        result, shared = None, True
        if self.sharding is not None:
            self.sharding = self.sharding or sharding_of(model) or ""  # "": announced (sharded=True), named once it is
            result = LayoutCheck("not checked", reason=not_checked_reason(self.sharding))
        elif kind == "eval" and self.host.evaluates_alone():
            result, shared = LayoutCheck("not checked", reason="an evaluation forward may run on one rank alone here (a "
                                         "loop's or a callback's own), and the check's verdict is every rank's; the "
                                         "training step's check covers the model"), False
        elif same:
            result = restored_check(saved)
        elif lazy := _uninitialized(model):
            result = LayoutCheck("not checked", reason=f"the model's lazy modules are not made yet ({lazy}): run one "
                                 "forward on a batch before the run to check it")
        elif self.host.deciding():
            try:
                with no_autotune(), _sync_batchnorm_alone(model, self.host.several()):
                    result = run()
            except Exception as error:  # noqa: BLE001 - the check failing must not end the run
                result = LayoutCheck("not checked", reason=f"the check itself failed ({first_line(error)})")
            if saved is not None:
                note = "checked again: the model, its step or the precision changed since the checkpoint"
                result = dataclasses.replace(result, notes=(*result.notes, note))
        if shared:
            result = self.host.broadcast(result)
        earlier = [k for k, c in self.layout_checks.items() if c.verdict == "fallback"]
        if result.verdict == "passed" and earlier and self.fallbacks:  # it checked the model with their fallbacks on
            note = f"with the {' and '.join(earlier)} step's fallback on ({describe_fallbacks(tuple(self.fallbacks))})"
            result = dataclasses.replace(result, notes=(*result.notes, note))
        self.layout_checks[kind] = result
        self.apply(result, model)
        if report:
            unverified = (result.reason or "").startswith(REACHED_REAL)  # the user's code ran on the real model
            self.say(f"ChannelsLast {result.line(kind)}", result.verdict in ("fallback", "contiguous") or unverified)
        return result

    @_outside_inference
    def apply(self, result: LayoutCheck, model: nn.Module) -> None:
        """What ``result`` chose, on ``model`` and the host's copies (see the module docstring), and the host's
        optimizers' state in its parameters' strides."""
        strides = [p.stride() if is_materialized(p) else None for p in model.parameters()]
        if result.verdict == "fallback":
            chosen = list(result.fallbacks)
        elif result.verdict == "contiguous":  # the whole model, its inputs put in NCHW at its entry
            self.pinned = self.layout = "contiguous"
            self.untimed = "the check keeps the model in NCHW"
            records = self._put_in_layout(model, "contiguous")  # every rank applies the verdict here
            if self.guard:
                self.guardrails = records
            chosen = [Fallback("module", "")]
        else:
            return
        self.fallbacks += [f for f in chosen if f not in self.fallbacks]
        apply_fallbacks(model, self.fallbacks)
        convs = [m.weight for m in model.modules() if isinstance(m, CONV_TYPES) and is_materialized(m.weight)
                 and m.weight.dim() in (4, 5)]
        if self.untimed is None and convs and not any(is_channels_last(w) for w in convs):
            self.untimed = "the check keeps every convolution in NCHW"  # both layouts would time the same model
            self.race.stop()
        self.summary = layout_summary(model, buffers=True)
        self.convert_copies(self.host.copies())
        restride_optimizer_state(self.host.optimizers())
        if strides != [p.stride() if is_materialized(p) else None for p in model.parameters()]:
            self._buckets_follow(model, "the check's verdict")
        if self._expected is not None:
            self.expect(model)

    # ---- the layout for the whole run ------------------------------------------------------------------------------

    def expect(self, model: nn.Module) -> None:
        """Remember the layout of ``model``'s 4-D/5-D parameters and buffers as they are now (converted, guarded,
        the verdict applied), by name: what ``boundary`` puts back."""
        self._expected = {_stands_for(name): _layout_of(t) for name, t in _named_tensors(model)}

    @_outside_inference
    def boundary(self, model: nn.Module, *, after: str = "", line: str | None = None,
                 aliases: Iterable[torch.Tensor] = ()) -> list[str]:
        """Put back in their expected layout (``expect``) the parameters and buffers that something moved since,
        in place, and the host's optimizers' state in its parameters' strides; one line the first time, naming them
        and ``after`` (what ran), or ``line`` where given. A pruning's ``weight_orig`` and ``weight_mask`` and a
        parametrization's ``original`` are kept as the weight they stand for; a tensor of ``aliases`` that shares a
        moved tensor's data shares its new data (``cltrain.nchw_code.relayout``). Returns the names put back.

        It walks the parameters once a call: doors call it where something may have moved them (an epoch's or a
        validation's end, a pruning), never every step.

        Example::

            >>> session = LayoutSession(layout="channels_last")
            >>> model = session.start(torch.nn.Conv2d(3, 8, 3))
            >>> session.expect(model)
            >>> model.weight.data = model.weight.data.contiguous()   # a hook writes .data in NCHW
            >>> session.boundary(model, after="a test"), is_channels_last(model.weight)
            (['weight'], True)
        """
        expected = self._expected
        if expected is None or self.sharding is not None:
            return []
        moved, aliases = [], list(aliases)
        for name, t in _named_tensors(model):
            want = expected.get(_stands_for(name))
            if want is not None and _layout_of(t) != want:
                relayout(t, want, aliases)
                moved.append(name)
        restride_optimizer_state(self.host.optimizers())
        if moved and not {name for name, _ in model.named_parameters()}.isdisjoint(moved):
            self._buckets_follow(model, f"putting the layout back{after and ' ' + after}")
        if moved and (line or "") not in self._told:
            self._told.add(line or "")
            shown = ", ".join(moved[:3]) + (f" and {len(moved) - 3} more" if len(moved) > 3 else "")
            self.say(line or f"ChannelsLast: {len(moved)} parameter(s) and buffer(s) left their layout"
                     f"{after and ' ' + after} ({shown}); put back in {self.layout} with their optimizer state.", False)
        return moved

    @_outside_inference
    def end(self, model: nn.Module) -> None:
        """The run ends: a race not decided leaves the model in the default layout, the layout is kept a last time,
        and torch's utilities are given back."""
        self._step = None
        if self.race.racing() and self.untimed is None and self._key is not None \
                and "race ended" not in self._told:  # trained here (not evaluated only), said once (a validate after)
            self._told.add("race ended")
            self.say(f"ChannelsLast: training ended before the race of the layouts decided "
                     f"({self.race.steps_run()} step(s) of it run): {self._settled()} kept; a longer run decides (a race "
                     "under way goes on in a run resumed from a checkpoint).")
        if self.layout is not None and self.sharding is None and self.layout != self._settled():
            self._switch(model, self._settled())
        self.boundary(model, after="by the end of the run")
        self.close()

    def close(self) -> None:
        """Give torch's utilities back (``end`` does; a run that stopped on an exception calls this)."""
        self._unwatch()
        self.inputs.end_trace(completed=False)
        self.inputs.restore()
        if self._utilities is not None:
            if self._finalizer is not None:
                self._finalizer.detach()  # or each stage of a Trainer would leave one behind
            self._utilities.close()
            self._utilities = None

    # ---- a checkpoint ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint carries: the checks' verdicts and the fingerprint they hold for, and the race's
        decisions and progress (plain types)."""
        state: dict[str, Any] = {}
        restored = self._restored.get("layout_checks") or {}
        if self.layout_checks:
            state["layout_checks"] = {k: saved_check(r) for k, r in self.layout_checks.items()}
            state["fingerprint"] = self.fingerprint() if self.fingerprint is not None else None
            if restored and self._restored.get("fingerprint") == state["fingerprint"]:  # a kind not run since the load
                state["layout_checks"] = {**restored, **state["layout_checks"]}
        elif restored:  # saved again before a first batch: the loaded verdicts still hold for their fingerprint
            state["layout_checks"], state["fingerprint"] = dict(restored), self._restored.get("fingerprint")
        if self.race.decisions or self.race.racing():
            state["race"] = self.race.state_dict()
        elif self.pinned is not None and self._restored.get("race"):  # kept for a later run that does not pin
            state["race"] = self._restored["race"]
        return state

    @_outside_inference
    def load_state_dict(self, state: dict[str, Any] | None, model: nn.Module | None = None) -> None:
        """A checkpoint's state: its verdicts apply at the first batch of each kind where the fingerprint matches,
        its decisions are not raced again and a race under way goes on where it stopped; where the model is given and
        one decision is held, it takes that layout now (one process; several ranks switch at their first training step,
        the same on every rank). A pinned layout wins over the checkpoint's decisions, said in one line where they
        differ."""
        self._restored = dict(state or {})
        if self.pinned is not None:
            held = {LayoutDecision.from_dict(d).layout for d in self._restored.get("race", {}).get("decisions", ())}
            if held - {self.pinned}:
                self.say(f"ChannelsLast: the checkpoint's race decision ({', '.join(map(_name, sorted(held)))}) is not "
                         f"used: {self.pin_format.format(self.pinned)} pins {_name(self.pinned)}.")
            return
        self.race.load_state_dict(self._restored.get("race", {}))
        decided = {d.layout for d in self.race.decisions.values()}
        if model is not None and len(decided) == 1 and self.layout is not None and self.untimed is None \
                and not self.host.several():
            (layout,) = decided
            if layout != self.layout:
                self._switch(model, layout)

    @_outside_inference
    def resume(self) -> None:
        """After a checkpoint's optimizer state is restored, which keeps the strides it was saved with: every state
        tensor of the host's optimizers takes its parameter's strides, and the model's copies made since the
        conversion (an EMA's, SWA's) join its layout. A sharding engine owns both."""
        if self.layout is None or self.sharding is not None:
            return
        self.convert_copies(self.host.copies())
        restride_optimizer_state(self.host.optimizers())


@contextlib.contextmanager
def _sync_batchnorm_alone(model: nn.Module, several: bool) -> Iterator[None]:
    """In a run of several ranks, the check's copies of ``SyncBatchNorm`` layers compute their statistics on the
    checked samples alone (as ``BatchNorm``, both layouts alike): a copy must not wait for ranks that do not run it."""
    layers = [m for m in model.modules() if isinstance(m, nn.SyncBatchNorm)] if several else []
    forwards = [m.__dict__.get("forward") for m in layers]
    for m in layers:
        m.forward = _batchnorm_forward.__get__(m)  # copied with the module: the copies run it
    try:
        yield
    finally:
        for m, saved in zip(layers, forwards):
            if saved is None:
                del m.forward
            else:
                m.forward = saved


def _batchnorm_forward(self: nn.SyncBatchNorm, x: torch.Tensor) -> torch.Tensor:
    return nn.modules.batchnorm._BatchNorm.forward(self, x)


def _apply_to_copy(copy_: nn.Module, fallbacks: list[Fallback]) -> None:
    """The fallbacks on a copy of the model, whose names may sit under ``module.`` (``AveragedModel``)."""
    names = {name for name, _ in copy_.named_modules()}
    wanted = [f for f in fallbacks if f.kind != "model"]
    for prefix in ("", "module."):
        if all(f"{prefix}{f.module}".rstrip(".") in names for f in wanted):
            apply_fallbacks(copy_, [Fallback(f.kind, f"{prefix}{f.module}".rstrip(".")) for f in wanted])
            return


_STANDS_FOR = ("_orig", "_mask")  # torch.nn.utils.prune's reparametrisation of a weight


def _name(layout: str) -> str:
    """A layout as the lines name it: ``NCHW`` for ``contiguous``."""
    return "NCHW" if layout == "contiguous" else layout


def _stands_for(name: str) -> str:
    """The parameter a reparametrised tensor stands for: ``conv.weight_orig`` -> ``conv.weight``,
    ``conv.parametrizations.weight.original`` -> ``conv.weight``."""
    head, _, last = name.rpartition(".")
    for suffix in _STANDS_FOR:
        if last.endswith(suffix):
            return f"{head}.{last[:-len(suffix)]}" if head else last[:-len(suffix)]
    if last == "original" and ".parametrizations." in f".{head}":
        owner, _, weight = head.rpartition(".")
        owner = owner[:-len("parametrizations")].rstrip(".")
        return f"{owner}.{weight}" if owner else weight
    return name


def _layout_of(t: torch.Tensor) -> torch.memory_format | None:
    """The format ``t`` is in, judged strictly (``cltrain.layout.is_channels_last``, canonical NCHW strides);
    ``None`` where the two coincide (C == H == W == 1) or ``t`` is in neither."""
    fmt = memory_format_for(t)
    if fmt is None:
        return None
    channels_last, contiguous = is_channels_last(t), nchw(t) is t
    if channels_last == contiguous:
        return None
    return fmt if channels_last else torch.contiguous_format


def _uninitialized(model: nn.Module) -> str:
    """The first of ``model``'s parameters and buffers a lazy module has not made yet (``""``: none)."""
    return next((name for name, t in [*model.named_parameters(), *model.named_buffers()]
                 if not is_materialized(t)), "")


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if is_materialized(t) and t.dim() in (4, 5) and t.is_floating_point():
            yield name, t


class SessionResults:
    """What a front door's session did, as the door's own attributes (every door has ``session``)."""

    session: LayoutSession

    @property
    def layout(self) -> str | None:
        """The layout the model is in now (``"channels_last"`` or ``"contiguous"``); ``None`` before it starts."""
        return self.session.layout

    @property
    def decision(self) -> LayoutDecision | None:
        """The race's decision for the batches trained on last (``None``: not decided, or not raced)."""
        return self.session.decision

    @property
    def decisions(self) -> dict[Any, LayoutDecision]:
        """The race's decision of each kind of batch."""
        return self.session.decisions

    @property
    def timings(self) -> dict[str, float] | None:
        """The decision's median seconds per step of each layout (``None``: not timed)."""
        decision = self.session.decision
        return dict(decision.seconds) if decision is not None and decision.seconds else None

    @property
    def layout_checks(self) -> dict[str, LayoutCheck]:
        """The ``LayoutCheck`` of the first batch of each kind checked (``"train"``, ``"eval"``)."""
        return self.session.layout_checks

    @property
    def fallbacks(self) -> list[Fallback]:
        """The ``Fallback``s the checks applied to the model."""
        return self.session.fallbacks

    @property
    def guardrails(self) -> list[GuardRecord] | None:
        """The ``GuardRecord`` of each known fault worked around (``None`` before the start, with ``guard=False``)."""
        return self.session.guardrails

    @property
    def summary(self) -> dict[str, int] | None:
        """``cltrain.layout_summary`` of the model's parameters and buffers once converted."""
        return self.session.summary

    @property
    def sharding(self) -> str | None:
        """The engine holding the model's parameters (which then stay contiguous), or ``None``."""
        return self.session.sharding
