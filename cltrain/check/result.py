"""What the layout check found and chose: ``Finding``, ``LayoutCheck`` and its one log line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cltrain.check.fallback import Fallback

__all__ = ["COPY_LIMIT", "MAX_LINE", "MODEL_ALONE", "REACHED_REAL", "STEP_RAISED", "Finding", "LayoutCheck"]

MAX_LINE = 287  # characters of the line (300 with the "ChannelsLast " before it); the rest is in ``as_dict()``
#: Named in every error a check copy's stand-ins raise: a limit of the copy, not of the user's code.
COPY_LIMIT = "the layout check's copy"
#: How a "not checked" reason starts where the step raised on the NCHW copy: the real step may still run.
STEP_RAISED = "the step raised on the check's NCHW copy"
#: How a "not checked" reason starts where the user's code reached the real model from the copies: what that code does
#: in channels_last is unknown (said as a warning).
REACHED_REAL = "the step changed the real model through code the check's copy shares with it"
#: How a note starts where the model was checked alone because the step could not run on the copies.
MODEL_ALONE = "the model alone"


@dataclass(frozen=True)
class Finding:
    """The first place the channels_last run differs from the NCHW run.

    Attributes:
        kind: ``"raised"`` (only in channels_last) or ``"diverged"`` (beyond the layouts' rounding noise).
        phase: ``"forward"``, ``"backward"``, ``"step"`` (the step code around the model) or ``"update"``
            (after the backward: gradient hooks, clipping, the optimizer step).
        module: the qualified name of the module whose code it is in (``None``: the step code).
        where: ``file:line`` of the user's code, when it can be known.
        detail: the exception (type and first line), or the relative difference and the noise.
        others: how many more instances of the same class hold the same fault (handled at once).
        module_type: the class of ``module`` when ``others`` > 0.
        guard: the cltrain guardrail on the layer where it shows (``"oneDNN #6035"``), when there is one: the
            guard and its layer are the cause, not the user's code.
        package: the installed package ``where`` is in (``cltrain.check.localise.place``), or ``None``: the user's
            own code.
    """

    kind: str
    phase: str
    module: str | None
    where: str | None
    detail: str
    others: int = 0
    module_type: str | None = None
    guard: str | None = None
    package: str | None = None

    def fix(self) -> str:
        """What to change in the user's code, in a few words; nothing where the code is not the user's."""
        if self.guard:
            return f"nothing to edit: it shows at cltrain's guardrail for {self.guard}; the fallback stands"
        if self.package:
            return f"nothing to edit: that code is in the installed package `{self.package}`; the fallback stands"
        if "view size is not compatible" in self.detail or ".view(" in self.detail:
            mine = "; where the tensor viewed is not the model's input (a target under an image key), name the " \
                "input instead: inputs=<key or index>" if self.module is None and self.phase == "step" else ""
            return f"use .reshape(...) or torch.flatten(x, 1) instead of .view(...) there{mine}"
        if self.kind == "raised" and "contiguous" in self.detail.lower():
            return "call .contiguous() on the tensor before that op"
        if self.kind == "diverged" and self.phase == "update":
            return "call .contiguous() on p.grad there: it reads a gradient's memory as NCHW"
        if self.kind == "diverged" and self.phase == "backward":
            return "call .contiguous() on the incoming gradient in its backward: it reads a gradient's memory as NCHW"
        if self.kind == "diverged":
            return "call .contiguous() on its input there: it reads memory as NCHW (as_strided, data_ptr, ...)"
        return "make that code layout-agnostic (.reshape instead of .view, .contiguous() before raw-memory ops)"

    def subject(self) -> str:
        """Whose code it is: a module (and its siblings of the same class), the step code, the update."""
        if self.module is None:
            return "the code after the backward" if self.phase == "update" else "the step code"
        if not self.module:
            return "the model's own forward"
        more = f" and {self.others} more `{self.module_type}`" if self.others else ""
        return f"`{self.module}`{more}"

    def as_dict(self) -> dict[str, Any]:
        """Plain types, for ``metrics.json``."""
        return {"kind": self.kind, "phase": self.phase, "module": self.module, "where": self.where,
                "detail": self.detail, "fix": self.fix(), "others": self.others, "module_type": self.module_type,
                "guard": self.guard, "package": self.package}


def describe_fallbacks(fallbacks: tuple[Fallback, ...]) -> str:
    """The fallbacks in a few words, those applied to every instance of a class named once."""
    parts: list[str] = []
    seen: set[tuple[str, str]] = set()
    for fallback in fallbacks:
        if fallback.group:
            key = (fallback.kind, fallback.group)
            if key in seen:
                continue
            seen.add(key)
            count = sum(1 for f in fallbacks if (f.kind, f.group) == key)
            text = fallback.describe()
            parts.append(text.replace(f"`{fallback.module}`", f"`{fallback.module}` and {count - 1} more "
                                                               f"`{fallback.group}`", 1))
        else:
            parts.append(fallback.describe())
    return "; ".join(parts)


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
            forward, every instance of a class), seconds per step of the channels_last model with its
            fallback and of the contiguous model, ``{"channels_last": s, "contiguous": s}``: the faster
            was kept.
        notes: what the check could not run on its copies (an optimizer it could not copy, LR schedulers).
        step_raised: the first line of the error the step raised on the check's NCHW copy (``None``: it ran); the
            verdict is then ``"not checked"``, or the model's checked alone (``notes`` says on what).
    """

    verdict: str
    findings: tuple[Finding, ...] = ()
    fallbacks: tuple[Fallback, ...] = ()
    reason: str | None = None
    seconds: float = 0.0
    worst: tuple[float, float] | None = None
    timings: dict[str, float] | None = None
    notes: tuple[str, ...] = ()
    step_raised: str | None = None

    def line(self, kind: str = "train") -> str:
        """One log line (at most ``MAX_LINE`` characters): what was found, where, the fix, what was done; the
        error or the difference last, where there is room. ``kind`` (``"train"``, ``"eval"``) names the step
        checked, so the two checks of a run never print the same line."""
        notes = "".join(f"; {note}" for note in self.notes)
        check = "layout check" if kind == "train" else f"layout check of the {kind} step"
        if self.verdict == "passed":
            batch = "the first batch" if kind == "train" else f"the first {kind} batch"
            text = (f"{check} passed: {batch} computes the same in channels_last as in NCHW"
                    f"{notes} ({self.seconds:.1f} s)")
        elif self.verdict == "not checked":
            text = f"{check} skipped: {self.reason}{notes}"
        else:
            parts: list[str] = []
            details: list[str] = []
            for finding in self.findings:
                where = f" at {finding.where}" if finding.where else ""
                part = (f"{finding.subject()} {finding.kind} in channels_last only ({finding.phase}{where}); "
                        f"fix: {finding.fix()}")
                if part not in parts:  # the same error in several places is named once
                    parts.append(part)
                    details.append(finding.detail)
            done = describe_fallbacks(self.fallbacks)
            if self.timings:
                done += (f" ({1e3 * self.timings['channels_last']:.0f} ms/step, "
                         f"{1e3 * self.timings['contiguous']:.0f} contiguous)")
            found, tail, end = " | ".join(parts), f" -> {done}", f" ({self.seconds:.1f} s)"
            room = MAX_LINE - len(f"{check}: ") - len(tail) - len(end)
            # what was done whole; the notes (a step checked only in part says so there) in the room the finding
            # leaves, at least their start; then the finding, shortened last; the difference where room is left
            space = max(room - len(found), min(len(notes), 64))
            notes = _shorten(notes, space) if len(notes) > space else notes
            if len(found) > room - len(notes):
                found = _shorten(found, max(room - len(notes), 40))
            elif room - len(found) - len(notes) > 30 and details:
                found += f" [{_shorten(' | '.join(details), room - len(found) - len(notes) - 3)}]"
            text = f"{check}: {found}{tail}{notes}{end}" if found else f"{check}: {done}{notes}{end}"
        return _shorten(text, MAX_LINE)

    def as_dict(self) -> dict[str, Any]:
        """Plain types, for ``metrics.json``."""
        return {"verdict": self.verdict, "findings": [f.as_dict() for f in self.findings],
                "fallbacks": [f.as_dict() for f in self.fallbacks], "reason": self.reason,
                "seconds": round(self.seconds, 3), "timings": self.timings, "notes": list(self.notes)}


def _shorten(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, with an ellipsis where cut."""
    if len(text) <= limit:
        return text
    cut = text[:limit - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip(" ;,(") + "…"
