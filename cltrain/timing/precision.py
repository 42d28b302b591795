"""Pick the mixed precision a device trains fastest in, by running the recipe's own step in each.

bf16 needs no loss scaling, which is why ``cltrain.precision.auto_precision`` picks it on every GPU
that has it; but the faster one depends on the GPU and the model (on an H100, ResNet-50 channels_last
computed 1.24x faster in fp16 than in bf16: docs/performance.md). ``time_precisions`` runs a training
step in each candidate precision (warm-up steps, then interleaved rounds of timed steps), keeping every
loss on the device until the end; ``choose_precision`` keeps the candidates that trained (no error, every
loss finite) and picks the fastest, unless the preferred one (bf16) is within ``margin`` of it.

Prepared, not the default: ``amp=auto`` picks by ``auto_precision``; ``python -m scripts.gpu_check --mark``
reports what this would pick on the GPU it runs on, and why.

Example::

    >>> import torch
    >>> from cltrain.timing.precision import PrecisionTrial, choose_precision
    >>> choice = choose_precision([PrecisionTrial("bf16-mixed", 0.056, True, 15),
    ...                            PrecisionTrial("16-mixed", 0.045, True, 15)])
    >>> choice.flag
    '16-mixed'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cltrain.precision import PrecisionChoice
from cltrain.timing.rounds import time_steps

__all__ = ["PrecisionTrial", "choose_precision", "describe_precision", "time_precisions"]

#: How a reason names each Lightning precision flag.
_NAMES = {"bf16-mixed": "bf16", "16-mixed": "fp16 + loss scaling", "32-true": "fp32"}


def describe_precision(flag: str) -> str:
    """A precision flag in words: ``"16-mixed"`` -> ``"fp16 + loss scaling"``."""
    return _NAMES.get(flag, flag)


@dataclass(frozen=True)
class PrecisionTrial:
    """One candidate's result: median seconds per step (``None`` when it could not run), whether every
    loss was finite, how many steps ran, and the error that stopped it (empty when none)."""

    flag: str
    seconds_per_step: float | None
    finite: bool
    steps: int
    error: str = ""

    @property
    def trained(self) -> bool:
        """Ran every step without an error and with every loss finite."""
        return not self.error and self.finite and self.seconds_per_step is not None


def time_precisions(step_for: Callable[[str], Callable[[], torch.Tensor]], flags: Sequence[str], *,
                    device: torch.device | str, warmup: int = 2, steps: int = 5,
                    rounds: int = 3) -> list[PrecisionTrial]:
    """Each of ``flags`` trained by its own step: ``warmup`` untimed steps, then ``rounds`` rounds of
    ``steps`` timed steps each, the order of the candidates alternating from round to round
    (``cltrain.timing.rounds.time_steps``).

    Args:
        step_for: builds the step for a precision flag (its own model copy, optimizer and, for
            ``16-mixed``, loss scaler); the step trains once and returns the loss, left on the device.
        flags: the candidates, e.g. ``("bf16-mixed", "16-mixed")``.
        device: where the steps run (synchronised around each timed round).
        warmup: untimed steps per candidate first (kernel selection, the loss scale backing off).
        steps: steps per timed round.
        rounds: timed rounds; the median round gives the seconds per step.

    Returns:
        One ``PrecisionTrial`` per flag, in the order given. A candidate whose build or step raises
        (no kernel, out of memory) gets the error and is not timed further.

    Raises:
        ValueError: ``steps`` or ``rounds`` < 1, or ``warmup`` < 0.
    """
    if steps < 1 or rounds < 1 or warmup < 0:
        raise ValueError(f"time_precisions: need steps >= 1, rounds >= 1, warmup >= 0; "
                         f"got {steps}, {rounds}, {warmup}.")
    # torch.OutOfMemoryError is a RuntimeError
    failures = (RuntimeError, ValueError, TypeError)
    errors: dict[str, str] = {}
    losses: dict[str, list[torch.Tensor]] = {flag: [] for flag in flags}
    runners: dict[str, Callable[[], None]] = {}
    for flag in flags:
        try:
            step = step_for(flag)
        except failures as err:
            errors[flag] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
            continue
        runners[flag] = lambda step=step, kept=losses[flag]: kept.append(step().detach())
    timing = time_steps(runners, rounds=rounds, warmup=warmup, min_steps=steps, max_steps=steps, sync=device,
                        catch=failures)
    errors.update(timing.errors)
    trials = []
    for flag in flags:
        kept = losses[flag]
        # one read of all the losses on the host, after every step
        finite = bool(torch.stack([t.float().reshape(()) for t in kept]).isfinite().all()) if kept else False
        median = timing.per_step()[flag].median if timing.seconds.get(flag) and flag not in errors else None
        trials.append(PrecisionTrial(flag, median, finite, len(kept), errors.get(flag, "")))
    return trials


def _why_not(trial: PrecisionTrial) -> str:
    if trial.error:
        return f"{describe_precision(trial.flag)} failed ({trial.error})"
    return f"{describe_precision(trial.flag)} gave a non-finite loss within {trial.steps} steps"


def choose_precision(trials: Sequence[PrecisionTrial], *, prefer: str = "bf16-mixed", margin: float = 0.03,
                     fallback: PrecisionChoice | None = None) -> PrecisionChoice:
    """The precision to train in, by ``trials`` (``time_precisions``), with the reason in one line.

    Among the candidates that trained, the fastest; ``prefer`` (bf16: no loss scaling to go wrong)
    when it is within ``margin`` of the fastest (0.03: 3% slower at most). When none trained,
    ``fallback`` (default ``32-true``) with what went wrong.

    Raises:
        ValueError: no trials, or ``margin`` < 0.
    """
    if not trials or margin < 0:
        raise ValueError(f"choose_precision: need trials and margin >= 0; got {len(trials)} trials, margin {margin}.")
    trained = [t for t in trials if t.trained]
    failed = "; ".join(_why_not(t) for t in trials if not t.trained)
    if not trained:
        base = fallback or PrecisionChoice("32-true", "")
        return PrecisionChoice(base.flag, "; ".join(filter(None, [f"measured: {failed}", base.reason])))
    fastest = min(trained, key=lambda t: t.seconds_per_step)
    close = [t for t in trained if t.flag == prefer and t.seconds_per_step <= fastest.seconds_per_step * (1 + margin)]
    chosen = close[0] if close else fastest
    timings = ", ".join(f"{describe_precision(t.flag)} {1e3 * t.seconds_per_step:.1f} ms/step" for t in trained)
    others = [t for t in trained if t is not chosen]
    if not others:
        why = f"the only one that trained ({timings})"
    elif chosen is fastest:
        runner_up = min(others, key=lambda t: t.seconds_per_step)
        why = f"{runner_up.seconds_per_step / chosen.seconds_per_step:.2f}x faster ({timings})"
    else:
        why = f"within {margin:.0%} of the fastest and needs no loss scaling ({timings})"
    steps = min(t.steps for t in trained)
    line = f"measured: {describe_precision(chosen.flag)}, {why}; finite losses over {steps} steps"
    return PrecisionChoice(chosen.flag, "; ".join(filter(None, [line, failed])))
