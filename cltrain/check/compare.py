"""Check one real step in both layouts, find where the user's code assumes NCHW, and choose the fallback.

``check_layout(model, step)`` runs ``step`` (the forward, the step code that consumes the outputs, the
backward and, given ``after_backward``, the hooks, clipping and optimizer step on copies of the optimizers)
on an NCHW copy and a channels_last copy of ``model``, with the same RNG state and with
random ops (dropout) drawn in the same logical order in both. Every module's inputs, outputs and output
gradients, the loss, every parameter's gradient and its update are compared as they happen; the first place that
raises only in channels_last, or differs beyond the layouts' own rounding noise, is the finding. Every module of a
channels_last run computes from the values the NCHW run recorded (``cltrain.check.isolation``): rounding carried
to a kink (a ReLU, a max) upstream is no difference. The noise is measured on the same batch: an NCHW run whose
every module output, and the gradient arriving at it, is perturbed by a few units in the last place of its dtype.
The runs compute float32 in full float32 (no TF32, ``cltrain.precision.full_float32``), and the code after the
backward starts from the NCHW run's gradient values in every run (``cltrain.check.gradient_tape.GradientTape``),
so updates are compared on identical gradients. A finding is then fixed by the smallest ``cltrain.check.fallback``
that makes the channels_last copy agree, tried in order (the outputs of the module just before the
faulty code, the module holding it, its parents, the weights, the whole model), each verified by running the step
again; a fault in a class's code is fixed in every instance of the class at once. The model itself, its gradients, BatchNorm statistics, optimizer and RNG state are not touched.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from cltrain import to_channels_last
    >>> from cltrain.check.compare import check_layout
    >>> class Head(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 6 * 6, 2)
    ...     def forward(self, x):
    ...         return self.fc(self.conv(x).view(x.size(0), -1))
    >>> model = to_channels_last(Head())
    >>> x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    >>> result = check_layout(model, lambda m, layout: m(x.contiguous() if layout == "contiguous" else x).sum())
    >>> result.verdict, [f.kind for f in result.fallbacks]
    ('fallback', ['outputs'])
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from cltrain.check.copies import mark_copy, running
from cltrain.check.fallback import Fallback, apply_fallbacks
from cltrain.check.localise import first_line, method_source, source_of, user_frame
from cltrain.check.events import Event
from cltrain.check.gradient_tape import GradientTape
from cltrain.check.randomness import rng_state, same_randomness, set_rng_state
from cltrain.check.record import Run, execute, loss_of
from cltrain.check.signature import Vectors, distance, projection_loss
from cltrain.check.result import REACHED_REAL, STEP_RAISED, Finding, LayoutCheck
from cltrain.check.search import FallbackSearch
from cltrain.check.isolation import ReferenceOutputs
from cltrain.check.untouched import RealState, describe, reaching_path
from cltrain.guardrails import guard_of
from cltrain.layout import to_contiguous
from cltrain.precision import full_float32

__all__ = ["Finding", "LayoutCheck", "check_layout", "projection_loss"]

# A finding differs from the NCHW run by more than RATIO times the measured noise at the same place, by more
# than FLOOR (relative), and by more than JUMP times the difference already in its inputs: a layout fault
# moves values to other places, which is O(1) at once.
RATIO = 10.0
FLOOR = 0.02
JUMP = 3.0
_ATTEMPTS = 8  # fallbacks tried before the whole model stays contiguous
_ISOLATE = True  # every channels_last run computes each module from the reference's values



def _upstream(key: Event, z: dict[Event, float], previous: float, index: dict[str, Any]) -> float:
    """The largest difference already present in what ``key``'s value is computed from: a module's
    inputs for its outputs; the gradients arriving at its outputs (and its inputs) for its input and
    parameter gradients; otherwise the event just before."""
    kind = key.kind
    if kind == "update":
        return 0.0  # every run's code after the backward starts from the reference's gradients (GradientTape)
    if kind == "forward-out":
        return z.get(Event("forward-in", key.name), 0.0)
    if kind == "grad-in":
        calls = [key.name]
    elif kind == "param":
        calls = index["calls"].get(key.module, [])
    else:
        return previous
    found = [z.get(Event("forward-in", c), 0.0) for c in calls]
    found += [z.get(k, 0.0) for c in calls for k in index["grad-out"].get(c, ())]
    return max(found, default=previous)


def _distances(ref: Run, run: Run) -> dict[Event, float]:
    return {key: distance(ref.signatures[key], run.signatures[key]) for key in ref.keys if key in run.signatures}


def _over_bar(ref: Run, z: dict[Event, float], floor: float) -> Iterator[tuple[int, Event, float, float]]:
    """``(position, key, difference, bar)`` of every event whose difference ``z`` (``_distances``) is above ``floor``
    and above ``JUMP`` times the difference already in what it is computed from (an ill-conditioned gradient grows
    step by step; a layout fault appears at once)."""
    index: dict[str, Any] = {"calls": {}, "grad-out": {}}
    for key in ref.keys:
        if key.kind == "forward-in":
            index["calls"].setdefault(key.module, []).append(key.name)
        elif key.kind == "grad-out":
            index["grad-out"].setdefault(key.name, []).append(key)
    previous = 0.0
    for position, key in enumerate(ref.keys):
        if key not in z:
            continue
        here = z[key]
        bar = max(floor, JUMP * _upstream(key, z, previous, index))
        previous = here
        if here > bar:
            yield position, key, here, bar


def _compare(ref: Run, noise: Run | None, run: Run, floor: float) -> tuple[int, Event, float, float] | None:
    """The first event (position, key, difference, noise) where ``run`` differs from ``ref``, or ``None``.

    An event differs when it is over the bar (``_over_bar``) and above ``RATIO`` times the noise there. The noise is
    ``nan`` where the noise run has not measured it (no noise run yet, or one that measured other events): the
    caller measures it there and asks again."""
    for position, key, here, bar in _over_bar(ref, _distances(ref, run), floor):
        if key.kind == "update":  # every run's update starts from the same gradients: no noise to measure
            z_noise = 0.0
        elif noise is None or noise.only is not None and key not in noise.only:
            return position, key, here, float("nan")
        else:
            z_noise = distance(ref.signatures[key], noise.signatures[key]) if key in noise.signatures else float("inf")
        if here > max(RATIO * z_noise, bar):
            return position, key, here, z_noise
    return None


def _wanted(ref: Run, run: Run, floor: float, noise: Run | None) -> set[Event]:
    """The events a noise run measures for comparing ``run``: those over the bar, the largest difference, and those
    the previous noise run ``noise`` measured (the runs before still compare against them)."""
    z = _distances(ref, run)
    wanted = {key for _, key, _, _ in _over_bar(ref, z, floor) if key.kind != "update"}
    if z:
        wanted.add(max(z, key=z.__getitem__))
    return wanted | (noise.only or set() if noise is not None else set())


def check_layout(
    model: nn.Module,
    step: Callable[[nn.Module, str], Any],
    *,
    step_owner: Any = None,
    copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy,
    floor: float = FLOOR,
    time_fallbacks: bool = True,
    after_backward: Callable[[nn.Module], Any] | None = None,
    updates: bool | None = None,
    update_owner: Any = None,
) -> LayoutCheck:
    """Run ``step`` in both layouts on copies of ``model`` and choose the NCHW fallbacks its code needs.

    Args:
        model: the model as it will train, already channels_last (not changed: the runs use copies).
        step: ``step(model_copy, layout) -> result`` runs one step's forward and step code on the copy and
            returns the loss (a scalar tensor, or a dict with ``"loss"``; its backward is run here) or, for a
            forward-only check, the outputs. ``layout`` is ``"contiguous"`` or ``"channels_last"``: the step
            puts the model's inputs in it.
        step_owner: the object whose method is the step code (a LightningModule), to name its file.
        copy_model: makes each copy (``cltrain.check.lightning_step.lightning_copy`` for a LightningModule).
        floor: the smallest relative difference that counts as a finding.
        time_fallbacks: where the fault is not isolated inside the model, time the fallback against the
            whole model contiguous and keep the faster; ``False`` keeps the fallback (a model already
            wrapped by DDP, whose gradient buckets keep the parameters' layout).
        after_backward: ``after_backward(model_copy)`` runs after the backward: the code between it and the
            update (hooks, clipping) and the optimizer step, on optimizers built for the copy.
        updates: compare every parameter's change over the run too (default: with ``after_backward``).
        update_owner: the object whose ``step`` runs after the backward (the optimizer), or ``(object, method)``:
            the code a divergence after the backward is in, to name its file.

    Returns:
        A ``LayoutCheck``; ``"not checked"`` where a copy would still run the real model (a closure over it that
        cannot be pointed at the copy) or where the step changed the real model anyway (put back, and named).
    """
    start = time.perf_counter()
    real = RealState(model)
    try:
        with _old_objects_frozen():
            result = _check_layout(model, step, start, step_owner=step_owner, copy_model=copy_model, floor=floor,
                                   time_fallbacks=time_fallbacks, after_backward=after_backward, updates=updates,
                                   update_owner=update_owner)
    finally:
        changed = real.restore()
    if changed:
        return LayoutCheck("not checked", reason=f"{REACHED_REAL} ({describe(changed)}; put back as it was; "
                           "channels_last kept unverified: make that code reach the model through what the step is "
                           "given: `self` in a LightningModule, the model argument of a loop's `step`)",
                           seconds=time.perf_counter() - start)
    return result


@contextlib.contextmanager
def _old_objects_frozen() -> Iterator[None]:
    """The objects that exist before the check are left out of the garbage collections inside it (``gc.freeze``): a
    full collection set off by the copies scanned the whole process (half a million objects in a Lightning run, a
    sixth of the check's time on a small model). The check's own garbage (copies held in cycles) is collected at
    the end, before the step's activations need the memory: a collection of what the check made alone. Not where
    something else froze objects already (``gc.unfreeze`` would undo its freeze too)."""
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        gc.unfreeze()


def _check_layout(model: nn.Module, step: Callable[[nn.Module, str], Any], start: float, *, step_owner: Any,
                  copy_model: Callable[[nn.Module], nn.Module], floor: float, time_fallbacks: bool,
                  after_backward: Callable[[nn.Module], Any] | None, updates: bool | None,
                  update_owner: Any) -> LayoutCheck:
    vectors = Vectors()
    rng = rng_state()
    updates = after_backward is not None if updates is None else updates
    tape = GradientTape(keep=updates)

    def run_on(trial: nn.Module, layout: str, perturb: bool = False, outputs: ReferenceOutputs | None = None,
               only: set[Event] | None = None) -> Run:
        # The noise run stops at the gradients: the code after the backward starts from the reference's gradients
        # in every run (the tape), so its updates would be the reference's.
        with running(), full_float32():
            return execute(trial, step, layout, rng, vectors, perturb=perturb,
                           after_backward=None if perturb else after_backward, updates=updates and not perturb,
                           tape=tape, outputs=outputs, only=only)

    def fresh() -> nn.Module:
        with running():
            return mark_copy(copy_model(model))

    ref_model = fresh()
    path = reaching_path(model, ref_model)
    if path is not None:
        return LayoutCheck("not checked", reason=f"a copy of the model would run the real one ({path}): the "
                           "check does not run", seconds=time.perf_counter() - start)
    ref_model = to_contiguous(ref_model)
    # Every channels_last run computes each module from the reference's values (cltrain.check.isolation), recorded
    # here: rounding carried to a kink anywhere upstream is no difference, so a clean run needs no noise run.
    isolated = ReferenceOutputs() if _ISOLATE else None
    ref = run_on(ref_model, "contiguous", outputs=isolated)
    tape.recording = False
    if isolated is not None:
        isolated.replay()
    if ref.raised is not None:
        error = first_line(ref.raised.error)
        return LayoutCheck("not checked", reason=f"{STEP_RAISED} ({error})", seconds=time.perf_counter() - start,
                           step_raised=error)
    top_level = {key.module for key in ref.keys if key.kind == "forward-out"
                 and ref.contexts[key][0] is None}  # modules the step code calls directly
    noise: Run | None = None

    def measure_noise(run: Run, noise: Run | None) -> Run:
        # Only where a difference is over the bar: the run stops once it has measured them all.
        return run_on(to_contiguous(fresh()) if updates else ref_model, "contiguous", perturb=True,
                      only=_wanted(ref, run, floor, noise))

    def channels_last_run(fallbacks: list[Fallback]) -> Run:
        trial = fresh()
        apply_fallbacks(trial, fallbacks)
        return run_on(trial, "channels_last", outputs=isolated)

    search = FallbackSearch(model)
    for _ in range(_ATTEMPTS):
        run = channels_last_run(search.fallbacks)
        first = _compare(ref, noise, run, floor)
        if first is not None and math.isnan(first[3]):
            noise = measure_noise(run, noise)
            first = _compare(ref, noise, run, floor)
        fault = _fault(model, run, first, step_owner, update_owner, ref)
        if fault is not None:
            if not search.learn(*fault):
                break
            continue
        worst, fallbacks = _worst(ref, noise, run), tuple(search.fallbacks)
        if not fallbacks:
            return LayoutCheck("passed", seconds=time.perf_counter() - start, worst=worst)
        timings = None
        if time_fallbacks and any(f.module == "" or f.module in top_level or f.group for f in fallbacks):
            # Not isolated inside the model, or in every instance of a class: keep whichever costs less.
            trial = fresh()
            apply_fallbacks(trial, list(fallbacks))
            timings = {"channels_last": _time_step(trial, step, "channels_last", rng),
                       "contiguous": _time_step(ref_model, step, "contiguous", rng)}
            if timings["contiguous"] < timings["channels_last"]:
                return LayoutCheck("contiguous", tuple(search.findings), (Fallback("model", ""),),
                                   seconds=time.perf_counter() - start, worst=worst, timings=timings)
        return LayoutCheck("fallback", tuple(search.findings), fallbacks, seconds=time.perf_counter() - start,
                           worst=worst, timings=timings)
    return LayoutCheck("contiguous", tuple(search.findings), (Fallback("model", ""),),
                       seconds=time.perf_counter() - start)


def _fault(model: nn.Module, run: Run, first: tuple[int, Event, float, float] | None, step_owner: Any,
           update_owner: Any, ref: Run) -> tuple[Finding, int, tuple[str | None, str | None], str] | None:
    """The first fault of ``run`` (it raised, or its first event that differs: ``first``) as ``(finding, position,
    context, phase)``, or ``None`` where it agrees with the reference."""
    if run.raised is not None and (first is None or run.raised.position <= first[0]):
        context = run.raised.context
        phase = "step" if run.raised.phase == "forward" and context[0] is None else run.raised.phase
        where, package = user_frame(run.raised.error) or (None, None)
        return (Finding("raised", phase, context[0], where, first_line(run.raised.error),
                        guard=_guard_at(model, [context[0]]), package=package), run.raised.position, context, phase)
    if first is None:
        return None
    position, key, z, z_noise = first
    context, phase = _producer(run, key, ref), key.phase
    if phase == "update":
        context = (None, None)
        owner, method = update_owner if isinstance(update_owner, tuple) else (update_owner, "step")
        where, package = (method_source(owner, method) if owner is not None else None) or (None, None)
    else:
        phase = phase if context[0] is not None else "step"
        if context == (None, None) and key.kind == "grad-out" and key.module is not None:
            context = (None, key.module)  # the step's code after that module made it: its outputs handed on in NCHW
        where, package = source_of(model, context[0], step_owner) or (None, None)
    at = key.module if key.kind != "update" else None  # an update's guard is its step's, not a module's
    return (Finding("diverged", phase, context[0], where,
                    f"{z:.2g} relative difference at {key.describe()}, noise {z_noise:.2g}",
                    guard=_guard_at(model, [context[0], at]), package=package), position, context, phase)


def _producer(run: Run, key: Event, ref: Run) -> tuple[str | None, str | None]:
    """Where the value of ``key`` was made. The gradient arriving at a module's output was made by the backward of
    the code that took that output, open when the first hook on it fired: a module's own hook opens the module,
    so the hooks of its inner modules on the same gradient (its last child's output is its output) fire with the
    module itself open, which would name the module that received a user's bad backward, not the one that made it.
    Walked back over the hooks of that one gradient (the module's and its ancestors' outputs holding the same
    values, the consumers' inputs) to the first; and over a consumer that passed it on unchanged in both layouts'
    runs (an ``nn.Identity`` after the module: the same values at its output and its input), whose backward did not
    make it either (a ReLU passing all of it in one run only did)."""
    context = run.contexts[key]
    if key.kind != "grad-out":
        return context
    module, value = key.module or "", run.signatures.get(key)
    for earlier in reversed(run.keys[:run.keys.index(key)]):
        if earlier.kind == "grad-in":
            continue
        outer = earlier.module or ""
        inside = not outer or module == outer or module.startswith(outer + ".")  # the top module holds every one
        took = Event("grad-in", earlier.name, earlier.index)
        passed = run.signatures.get(took) == value and ref.signatures.get(took) == ref.signatures.get(earlier)
        if earlier.kind != "grad-out" or not (inside or passed) \
                or run.signatures.get(earlier) != value:  # the ancestor's own code after the child made it
            break
        context = run.contexts.get(earlier, context)
    return context


def _guard_at(model: nn.Module, names: list[str | None]) -> str | None:
    """The upstream issue of the guardrail on the first of the modules ``names``, or a module holding it, that has
    one (a guarded layer and what it holds are one unit)."""
    modules = dict(model.named_modules())
    for name in names:
        while name:
            fault = guard_of(modules[name]) if name in modules else None
            if fault is not None:
                return fault.upstream
            name = name.rpartition(".")[0]
    return None


def _time_step(model: nn.Module, step: Callable[[nn.Module, str], Any], layout: str, rng: dict[str, Any],
               repeats: int = 2) -> float:
    """The faster of ``repeats`` timed runs of the step and its backward (seconds)."""
    best = float("inf")
    for _ in range(repeats):
        set_rng_state(rng)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with same_randomness(), running():  # a copy's step, as the check's others: checking() says so
            loss = loss_of(step(model, layout))
            if loss is not None:
                loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
        for param in model.parameters():
            param.grad = None
    set_rng_state(rng)
    return best


def _worst(ref: Run, noise: Run | None, run: Run) -> tuple[float, float]:
    worst, at = 0.0, None
    for key in ref.keys:
        if key in run.signatures:
            z = distance(ref.signatures[key], run.signatures[key])
            if z > worst:
                worst, at = z, key
    z_noise = distance(ref.signatures[at], noise.signatures[at]) if noise is not None and at in noise.signatures \
        else float("nan")
    return worst, z_noise
