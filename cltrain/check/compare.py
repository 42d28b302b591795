"""Check one real step in both layouts, find where the user's code assumes NCHW, and choose the fallback.

``check_layout(model, step)`` runs ``step`` (the forward, the step code that consumes the outputs, and
the backward) on an NCHW copy and a channels_last copy of ``model``, with the same RNG state and with
random ops (dropout) drawn in the same logical order in both. Every module's inputs, outputs and output
gradients, the loss and every parameter's gradient are compared as they happen; the first place that
raises only in channels_last, or differs beyond the layouts' own rounding noise, is the finding.
The noise is measured on the same batch: an NCHW run whose every module output, and the gradient
arriving at it, is perturbed by a few units in the last place of its dtype. A finding is then fixed by the smallest ``cltrain.check.fallback``
that makes the channels_last copy agree, tried in order (the outputs of the module just before the
faulty code, the module holding it, its parents, the whole model), each verified by running the step
again. The model itself, its gradients, BatchNorm statistics, optimizer and RNG state are not touched.

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
import inspect
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cltrain.layout import to_contiguous
from cltrain.check.fallback import Fallback, apply_fallbacks
from cltrain.check.record import (
    Run,
    SameRandomness,
    Vectors,
    distance,
    execute,
    loss_of,
    projection_loss,
    rng_state,
    set_rng_state,
)

__all__ = ["Finding", "LayoutCheck", "check_layout", "projection_loss"]

# A finding differs from the NCHW run by more than RATIO times the measured noise at the same place, by more
# than FLOOR (relative), and by more than JUMP times the difference already in its inputs: a layout fault
# moves values to other places, which is O(1) at once.
RATIO = 10.0
FLOOR = 0.02
JUMP = 3.0
_ATTEMPTS = 8  # fallbacks tried before the whole model stays contiguous
# Frames in these folders are not the user's code (the finding names the innermost frame outside them).
_LIBRARY_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}lightning{os.sep}", f"{os.sep}lightning_fabric{os.sep}",
                  f"{os.sep}pytorch_lightning{os.sep}", f"{os.sep}cltrain{os.sep}", os.path.dirname(contextlib.__file__) + os.sep)


# ---- findings and the result ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """The first place the channels_last run differs from the NCHW run.

    Attributes:
        kind: ``"raised"`` (only in channels_last) or ``"diverged"`` (beyond the layouts' rounding noise).
        phase: ``"forward"``, ``"backward"`` or ``"step"`` (the step code around the model).
        module: the qualified name of the module whose code it is in (``None``: the step code).
        where: ``file:line`` of the user's code, when it can be known.
        detail: the exception (type and first line), or the relative difference and the noise.
    """

    kind: str
    phase: str
    module: str | None
    where: str | None
    detail: str

    def fix(self) -> str:
        """What to change in the user's code, in a few words."""
        if "view size is not compatible" in self.detail or ".view(" in self.detail:
            return "use torch.flatten(x, 1) or .reshape(...) instead of .view(...) there"
        if self.kind == "raised" and "contiguous" in self.detail.lower():
            return "call .contiguous() on the tensor before that op"
        if self.kind == "diverged":
            return ("that code reads memory as if it were NCHW (as_strided, data_ptr, an extension op): call "
                    ".contiguous() on its input first")
        return "make that code layout-agnostic (.reshape instead of .view, .contiguous() before raw-memory ops)"

    def as_dict(self) -> dict[str, Any]:
        """Plain types, for ``metrics.json``."""
        return {"kind": self.kind, "phase": self.phase, "module": self.module, "where": self.where,
                "detail": self.detail, "fix": self.fix()}


@dataclass(frozen=True)
class LayoutCheck:
    """What ``check_layout`` found and chose.

    Attributes:
        verdict: ``"passed"`` (the same in both layouts), ``"fallback"`` (parts run in NCHW: ``fallbacks``),
            ``"contiguous"`` (the whole model should stay NCHW) or ``"not checked"`` (``reason`` says why).
        findings: each fault found, in the order found.
        fallbacks: the ``Fallback``s that make the channels_last step agree with NCHW.
        reason: for ``"not checked"``, why.
        seconds: the check's wall time.
        worst: the largest relative difference seen between the layouts where they agreed, and the noise there.
        timings: where the fault could not be isolated inside the model (the step code, the model's own
            forward), seconds per step of the channels_last model with its fallback and of the contiguous
            model, ``{"channels_last": s, "contiguous": s}``: the faster was kept.
    """

    verdict: str
    findings: tuple[Finding, ...] = ()
    fallbacks: tuple[Fallback, ...] = ()
    reason: str | None = None
    seconds: float = 0.0
    worst: tuple[float, float] | None = None
    timings: dict[str, float] | None = None

    def line(self) -> str:
        """One log line: what was found, where, what was done and how to fix it."""
        if self.verdict == "passed":
            return f"layout check passed: the first batch computes the same in channels_last as in NCHW ({self.seconds:.1f} s)"
        if self.verdict == "not checked":
            return f"layout check skipped: {self.reason}"
        parts = []
        for finding in self.findings:
            where = f" at {finding.where}" if finding.where else ""
            module = ("the step code" if finding.module is None else
                      f"`{finding.module}`" if finding.module else "the model's own forward")
            parts.append(f"{module} {finding.kind} in channels_last only ({finding.phase}{where}: {finding.detail}); "
                         f"fix: {finding.fix()}")
        done = "; ".join(f.describe() for f in self.fallbacks)
        if self.timings:
            done += (f" (measured {1e3 * self.timings['channels_last']:.0f} ms/step channels_last with the fallback, "
                     f"{1e3 * self.timings['contiguous']:.0f} ms/step contiguous)")
        return f"layout check: {' | '.join(parts)} -> {done} ({self.seconds:.1f} s)"

    def as_dict(self) -> dict[str, Any]:
        """Plain types, for ``metrics.json``."""
        return {"verdict": self.verdict, "findings": [f.as_dict() for f in self.findings],
                "fallbacks": [f.as_dict() for f in self.fallbacks], "reason": self.reason,
                "seconds": round(self.seconds, 3), "timings": self.timings}


def _user_frame(error: BaseException) -> str | None:
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        if not any(part in frame.filename for part in _LIBRARY_PARTS) and not frame.filename.startswith("<"):
            return f"{frame.filename}:{frame.lineno}"
    return None


def _source_of(model: nn.Module, name: str | None, step_owner: Any) -> str | None:
    target = dict(model.named_modules()).get(name) if name is not None else step_owner
    if target is None:
        return None
    try:
        method = getattr(type(target), "forward" if name is not None else "training_step", None) or type(target)
        return f"{inspect.getsourcefile(method)}:{inspect.getsourcelines(method)[1]}"
    except (TypeError, OSError):
        return None


def _first_line(error: BaseException) -> str:
    text = [line for line in str(error).strip().splitlines() if line.strip()]
    if text and text[0].startswith("The following operation failed in the TorchScript interpreter"):
        text = [text[-1].split(": ", 1)[-1]]  # TorchScript puts its own traceback first and the error last
    return f"{type(error).__name__}: {text[0].strip()[:160]}" if text else type(error).__name__


def _upstream(key: tuple, z: dict[tuple, float], previous: float, index: dict[str, Any]) -> float:
    """The largest difference already present in what ``key``'s value is computed from: a module's
    inputs for its outputs; the gradients arriving at its outputs (and its inputs) for its input and
    parameter gradients; otherwise the event just before."""
    kind = key[0]
    if kind == "forward-out":
        return z.get(("forward-in", key[1]), 0.0)
    if kind == "grad-in":
        calls = [key[1]]
    elif kind == "param":
        calls = index["calls"].get(key[1].rpartition(".")[0], [])
    else:
        return previous
    found = [z.get(("forward-in", c), 0.0) for c in calls]
    found += [z.get(k, 0.0) for c in calls for k in index["grad-out"].get(c, ())]
    return max(found, default=previous)


def _compare(ref: Run, noise: Run | None, run: Run, floor: float) -> tuple[int, tuple, float, float] | None:
    """The first event (position, key, difference, noise) where ``run`` differs from ``ref``, or ``None``.

    An event differs when its difference is above ``floor``, above ``RATIO`` times the noise there, and above
    ``JUMP`` times the difference already in what it is computed from (an ill-conditioned gradient grows
    step by step; a layout fault appears at once)."""
    z = {key: distance(ref.signatures[key], run.signatures[key]) for key in ref.keys if key in run.signatures}
    index: dict[str, Any] = {"calls": {}, "grad-out": {}}
    for key in ref.keys:
        if key[0] == "forward-in":
            index["calls"].setdefault(key[1].rpartition("#")[0], []).append(key[1])
        elif key[0] == "grad-out":
            index["grad-out"].setdefault(key[1], []).append(key)
    previous = 0.0
    for position, key in enumerate(ref.keys):
        if key not in z:
            continue
        here = z[key]
        bar = max(floor, JUMP * _upstream(key, z, previous, index))
        previous = here
        if here <= bar:
            continue
        if noise is None:
            return position, key, here, float("nan")  # the caller measures the noise and asks again
        z_noise = distance(ref.signatures[key], noise.signatures[key]) if key in noise.signatures else float("inf")
        if here > max(RATIO * z_noise, bar):
            return position, key, here, z_noise
    return None


def _candidates(context: tuple[str | None, str | None]) -> list[Fallback]:
    """The fallbacks to try for a fault in ``context``'s code, smallest first."""
    module, before = context
    found: list[Fallback] = []
    if before is not None:
        found.append(Fallback("outputs", before))
    name = module
    while name is not None and name != "":
        found.append(Fallback("module", name))
        name = name.rpartition(".")[0] if "." in name else None
    found.append(Fallback("model", ""))
    return found


def check_layout(
    model: nn.Module,
    step: Callable[[nn.Module, str], Any],
    *,
    step_owner: Any = None,
    copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy,
    floor: float = FLOOR,
    time_fallbacks: bool = True,
) -> LayoutCheck:
    """Run ``step`` in both layouts on copies of ``model`` and choose the NCHW fallbacks its code needs.

    Args:
        model: the model as it will train, already channels_last (not changed: the runs use copies).
        step: ``step(model_copy, layout) -> result`` runs one step's forward and step code on the copy and
            returns the loss (a scalar tensor, or a dict with ``"loss"``; its backward is run here) or, for a
            forward-only check, the outputs. ``layout`` is ``"contiguous"`` or ``"channels_last"``: the step
            puts the model's inputs in it.
        step_owner: the object whose method is the step code (a LightningModule), to name its file.
        copy_model: makes each copy (``cltrain.layout.lightning_access.detached_copy`` for a LightningModule).
        floor: the smallest relative difference that counts as a finding.
        time_fallbacks: where the fault is not isolated inside the model, time the fallback against the
            whole model contiguous and keep the faster; ``False`` keeps the fallback (a model already
            wrapped by DDP, whose gradient buckets keep the parameters' layout).

    Returns:
        A ``LayoutCheck``.
    """
    start = time.perf_counter()
    vectors = Vectors()
    rng = rng_state()
    ref_model = to_contiguous(copy_model(model))
    ref = execute(ref_model, step, "contiguous", rng, vectors)
    if ref.raised is not None:
        reason = f"the step raised without channels_last too ({_first_line(ref.raised.error)})"
        return LayoutCheck("not checked", reason=reason, seconds=time.perf_counter() - start)
    top_level = {key[1].rpartition("#")[0] for key in ref.keys if key[0] == "forward-out"
                 and ref.contexts[key][0] is None}  # modules the step code calls directly
    noise: Run | None = None
    fallbacks: list[Fallback] = []
    findings: list[Finding] = []
    pending: list[Fallback] = []
    last_position = -1
    worst: tuple[float, float] | None = None
    for _ in range(_ATTEMPTS):
        trial = copy_model(model)
        apply_fallbacks(trial, fallbacks)
        run = execute(trial, step, "channels_last", rng, vectors)
        del trial
        first = _compare(ref, noise, run, floor)
        if first is not None and noise is None:
            noise = execute(ref_model, step, "contiguous", rng, vectors, perturb=True)
            first = _compare(ref, noise, run, floor)
        if run.raised is not None and (first is None or run.raised.position <= first[0]):
            position, context = run.raised.position, run.raised.context
            where = _user_frame(run.raised.error)
            phase = "step" if run.raised.phase == "forward" and context[0] is None else run.raised.phase
            finding = Finding("raised", phase, context[0], where, _first_line(run.raised.error))
        elif first is not None:
            position, key, z, z_noise = first
            context = run.contexts[key]
            phase = {"forward-in": "forward", "forward-out": "forward", "grad-in": "backward",
                     "grad-out": "backward", "param": "backward"}.get(key[0], "step")
            finding = Finding("diverged", phase if context[0] is not None else "step", context[0],
                              _source_of(model, context[0], step_owner),
                              f"{z:.2g} relative difference at {key[0]} of {key[1] if len(key) > 1 else 'the result'}, "
                              f"noise {z_noise:.2g}")
        else:
            worst = _worst(ref, noise, run)
            if not fallbacks:
                return LayoutCheck("passed", seconds=time.perf_counter() - start, worst=worst)
            timings = None
            if time_fallbacks and any(f.module == "" or f.module in top_level for f in fallbacks):
                # Not isolated inside the model: keep whichever of the two costs less.
                trial = copy_model(model)
                apply_fallbacks(trial, fallbacks)
                timings = {"channels_last": _time_step(trial, step, "channels_last", rng),
                           "contiguous": _time_step(ref_model, step, "contiguous", rng)}
                if timings["contiguous"] < timings["channels_last"]:
                    return LayoutCheck("contiguous", tuple(findings), (Fallback("model", ""),),
                                       seconds=time.perf_counter() - start, worst=worst, timings=timings)
            return LayoutCheck("fallback", tuple(findings), tuple(fallbacks), seconds=time.perf_counter() - start,
                               worst=worst, timings=timings)
        if position > last_position:  # a new fault (or the first): its own candidates
            findings.append(finding)
            pending = [c for c in _candidates(context) if c not in fallbacks]
            last_position = position
        elif fallbacks:  # the last fallback did not move the fault: try the next candidate instead
            fallbacks.pop()
        if not pending:
            break
        choice = pending.pop(0)
        if choice.kind == "model":
            break
        fallbacks.append(choice)
    return LayoutCheck("contiguous", tuple(findings), (Fallback("model", ""),), seconds=time.perf_counter() - start)


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
        with SameRandomness():
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
