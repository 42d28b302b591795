"""Which layout trains faster here, decided from the run's own training steps: what the default layout runs.

Kernels change with the torch version, the machine, the precision and the model (pytorch#183815: bf16 convolutions
on the CPU 4-16x slower in 2.13 nightlies; Ultralytics #26105: a 3.24x slowdown on one OS). Only the user's run knows
which layout is faster there, so ``LayoutRace`` times it: the real training steps, on the real batches, in both
layouts, and keeps the faster. The first-batch check has shown the two layouts compute the same, so a step in the
slower layout is still a real step: the decision costs only that step's extra time.

The schedule, for one kind of batch (``key``: the input's shape without the batch size, or ``("images",)`` for a
detector's lists of 3-D images, the precision and the device; a new key, as progressive resizing makes, is decided
again):

* ``warmup`` steps in channels_last, not timed (the first-batch check, lazy initialisation, autotuning);
* then rounds of ``[channels_last, channels_last, NCHW, NCHW]``; the very first NCHW step is a warm-up of its own
  (cuDNN autotunes, oneDNN makes its primitives), not timed. The layouts alternate, so a machine getting busier or
  quieter drifts both alike;
* after each round, ``judge`` decides or asks for another round. After the first round only a clear channels_last
  win ends the race (a ``z``-sigma bound from the steps' pooled spread, where no NCHW step is slower than NCHW's
  warm-up step), or NCHW's steps having cost ``budget`` steps already. From the second round on, ``r`` is the NCHW
  step over the channels_last step, each round's NCHW steps against the channels_last steps on both sides of them,
  a step or two apart (``cltrain.timing.stats.paired_log_ratio``): a machine that drifts over the race (another
  process, the clock; seen here as +-10% swings lasting 20 steps, and early steps getting faster) moves both sides
  alike, where pooling the steps would blur the layouts' difference into the spread. With ``h(p)`` Student's ``p``
  bound on ``log r`` from the rounds' spread:

  - NCHW slower (``log r - h(0.975) > 0``): channels_last, kept;
  - NCHW faster by more than ``margin`` (``log r + h(0.99) < -margin``): NCHW;
  - in the second and third rounds, the steps pooled as well (more degrees of freedom, the drift in their spread):
    a 99.9% bound beyond the margin switches, a ``z``-sigma one keeps, where the paired ratio agrees;
  - both within ``margin`` (``|log r| + h(0.975) < margin``): a tie, channels_last;
  - else another round: where NCHW looks slower, until its steps have cost ``budget`` steps of channels_last; where
    it looks faster (more rounds then cost the default's own, slower, steps: a few percent of a step each), up to
    ``max_rounds`` rounds; then NCHW only where it is faster by more than ``margin`` beyond a 99.9% bound, so noise on
    a shared machine ends in the default.

  ``scripts/bench/race_rule.py`` plays the rule against a model of this machine's noise: with steps 12% apart at
  random and drifting, the default's steady step is within 3% of the faster layout's on average, whatever the
  layouts' true difference, and equal layouts switch in about 3 races in 100 (where switching costs nothing).

A key is decided once and never flips back. Only samples with the race's batch size count (a last, smaller batch is
not a sample). ``judge`` runs on the deciding rank and ``settle`` on every rank, at the same step: the schedule is a
function of the step count alone. A race restored from a checkpoint goes on at its place in the schedule and compares
only the steps timed since (each layout's first step there warms up, untimed): a resumed process's cold steps against
the stopped one's warm steps made ratios of 8-109x.

Example::

    >>> race = LayoutRace(warmup=1)
    >>> key = ((3, 224, 224), "bf16", "cpu")
    >>> for step, seconds in enumerate([9.0, 1.0, 1.0, 9.0, 1.5]):  # a warm-up, 2 channels_last, 2 NCHW steps
    ...     layout = race.next_layout(key)
    ...     race.record(key, 32, layout, seconds)
    >>> decision = race.judge()
    >>> race.settle(decision).layout, round(decision.ratio, 2)
    ('channels_last', 1.5)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Any

from cltrain.timing.stats import log_ratio, paired_log_ratio

__all__ = ["LAYOUTS", "LayoutDecision", "LayoutRace"]


#: The two layouts raced: the default, and NCHW.
LAYOUTS: tuple[str, str] = ("channels_last", "contiguous")

_ROUND = ("channels_last", "channels_last", "contiguous", "contiguous")


@dataclass(frozen=True)
class LayoutDecision:
    """What a race decided for one key.

    Attributes:
        key: the kind of batch: ``(shape without the batch size, precision, device)``.
        layout: ``"channels_last"`` or ``"contiguous"``, the layout kept.
        how: ``"timed"``, ``"tie"`` (within the margin), ``"noisy"`` (the budget ran out: the default kept unless
            NCHW was faster beyond doubt), ``"untimed"`` (the rounds ran out before both layouts had a step to
            compare: the default kept), or ``"restored"`` (from a checkpoint).
        seconds: the median seconds per step of each layout.
        samples: the steps timed in each layout.
        extra_seconds: what the steps in the slower layout cost over the faster one's time.
        judged: the faster layout's lead as the rule judged it (the slower step over the faster, paired steps from
            the second round on, pooled in the first; its medians may differ), ``None`` where not timed.
        timed_how: a restored decision's ``how`` when it was timed (``""``: not restored, or not kept).
    """

    key: tuple[Any, ...]
    layout: str
    how: str
    seconds: dict[str, float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)
    extra_seconds: float = 0.0
    judged: float | None = None
    timed_how: str = ""

    @property
    def ratio(self) -> float:
        """The slower layout's step over the faster's (1.0 where not timed)."""
        if len(self.seconds) < 2 or min(self.seconds.values()) <= 0:
            return 1.0
        return max(self.seconds.values()) / min(self.seconds.values())

    def as_dict(self) -> dict[str, Any]:
        """Plain types, for a checkpoint and ``metrics.json``."""
        how = self.timed_how or self.how if self.how == "restored" else self.how  # saved again: as it was timed
        return {"key": _plain(self.key), "layout": self.layout, "how": how, "seconds": dict(self.seconds),
                "samples": dict(self.samples), "extra_seconds": self.extra_seconds, "judged": self.judged,
                "restored": self.how == "restored"}  # metrics.json: a resumed run's decision came from its checkpoint

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> LayoutDecision:
        """The decision ``as_dict`` wrote, as restored from a checkpoint."""
        return cls(_key(saved["key"]), saved["layout"], "restored", dict(saved.get("seconds", {})),
                   dict(saved.get("samples", {})), float(saved.get("extra_seconds", 0.0)), _float(saved.get("judged")),
                   str(saved.get("how", "")).replace("restored", ""))


def _plain(obj: Any) -> Any:
    return [_plain(o) for o in obj] if isinstance(obj, (tuple, list)) else obj


def _float(t: Any) -> float | None:
    return None if t is None else float(t)


def _key(obj: Any) -> Any:
    return tuple(_key(o) for o in obj) if isinstance(obj, list) else obj


@dataclass
class _Heat:
    """One key's race in progress."""

    key: Hashable
    batch: int | None = None
    position: int = 0
    # each layout's timed steps: (round, seconds)
    times: dict[str, list[tuple[int, Any]]] = field(default_factory=lambda: {layout: [] for layout in LAYOUTS})
    warm: list[Any] = field(default_factory=list)  # the warm-up's later channels_last steps: for the spread only
    first_nchw: Any = None  # the NCHW warm-up step: no steady NCHW step should be slower
    untimed: dict[str, int] = field(default_factory=lambda: {layout: 0 for layout in LAYOUTS})
    cold: set[str] = field(default_factory=set)  # a resumed race's layouts not yet run in this process


class LayoutRace:
    """Times the run's training steps in both layouts and keeps the faster, per kind of batch (the module docstring).

    Args:
        warmup: the first steps of a key, in channels_last, not timed.
        margin: how much faster NCHW must be to be kept (a relative difference; a tie goes to channels_last).
        budget: the most the steps in the slower layout may cost, in steps of the faster one, before the race ends.
        max_rounds: the most rounds of four steps.
        z: the confidence bound, in sigmas, for a clear decision.
        max_keys: the most kinds of batch raced; beyond, new kinds keep channels_last (inputs whose shape changes
            from step to step: multi-scale training).

    Raises:
        ValueError: a negative ``warmup`` or ``margin``, a ``budget`` or ``max_rounds`` below 1.
    """

    def __init__(self, *, warmup: int = 3, margin: float = 0.02, budget: float = 1.0, max_rounds: int = 24,
                 z: float = 3.0, max_keys: int = 4) -> None:
        if warmup < 0 or margin < 0 or budget <= 0 or max_rounds < 1:
            raise ValueError(f"LayoutRace(warmup={warmup}, margin={margin}, budget={budget}, max_rounds={max_rounds}):"
                             " expected warmup >= 0, margin >= 0, budget > 0 and max_rounds >= 1.")
        self.warmup, self.margin, self.budget, self.max_rounds, self.z = warmup, margin, budget, max_rounds, z
        self.max_keys = max_keys
        self.decisions: dict[Hashable, LayoutDecision] = {}
        self._heats: dict[Hashable, _Heat] = {}  # each kind of batch's race under way: sizes that alternate keep theirs
        self._last: Hashable | None = None  # the kind of the step recorded last
        self._raced = 0

    # ---- the schedule ----------------------------------------------------------------------------------------------

    def next_layout(self, key: Hashable) -> str:
        """The layout the coming training step of ``key`` runs in."""
        if key in self.decisions:
            return self.decisions[key].layout
        heat = self._heats.get(key)
        if heat is None:
            if self._raced >= self.max_keys:
                return "channels_last"
            heat = self._heats[key] = _Heat(key)
            self._raced += 1
        if heat.position < self.warmup:
            return "channels_last"
        return _ROUND[(heat.position - self.warmup) % len(_ROUND)]

    def record(self, key: Hashable, batch: int, layout: str, seconds: float | Any, timed: bool = True) -> None:
        """The training step of ``key`` that just ran, with ``batch`` samples, in ``layout``, took ``seconds``
        (``timed=False``: a step whose time is not its own, such as one an evaluation ran inside)."""
        heat = self._heats.get(key)
        if key in self.decisions or heat is None:
            return
        self._last = key
        position = heat.position - self.warmup
        heat.position += 1
        cold = layout in heat.cold
        heat.cold.discard(layout)
        if position < 0:
            if heat.position > 1 and layout == "channels_last" and not cold:  # the first step is the check's
                heat.warm.append(seconds)
            return
        if heat.batch is None or batch > heat.batch:  # the full batch: a smaller one before was a last, partial one
            for name, times in heat.times.items():
                heat.untimed[name] += len(times)
                times.clear()
            heat.batch = batch
        # the very first NCHW step warms its kernels up, and so does each layout's first step in a resumed process
        first_nchw = position == _ROUND.index("contiguous") or cold and layout == "contiguous"
        if first_nchw:
            heat.first_nchw = seconds
        if first_nchw or cold or not timed or batch != heat.batch or layout != _ROUND[position % len(_ROUND)]:
            heat.untimed[layout] += 1
            return
        heat.times[layout].append((position // len(_ROUND), seconds))

    def due(self) -> bool:
        """Whether the step just recorded ended a round: ``judge`` on the deciding rank, then ``settle`` everywhere."""
        heat = self._heats.get(self._last)
        if heat is None or heat.key in self.decisions:
            return False
        position = heat.position - self.warmup
        return position > 0 and position % len(_ROUND) == 0

    # ---- the decision ----------------------------------------------------------------------------------------------

    def judge(self) -> LayoutDecision | None:
        """The decision at the end of a round (``None``: another round), from the times recorded on this rank."""
        heat = self._heats.get(self._last)
        if heat is None:
            return None
        if not all(len(heat.times[layout]) for layout in LAYOUTS):  # steps of other sizes, or evaluations, in between
            if (heat.position - self.warmup) // len(_ROUND) < self.max_rounds:
                return None
            return LayoutDecision(heat.key, "channels_last", "untimed", {}, self._samples(heat))
        heat.times = {k: [(r, float(t)) for r, t in v] for k, v in heat.times.items()}  # a device's lazy times, read
        heat.warm, heat.first_nchw = [float(t) for t in heat.warm], _float(heat.first_nchw)
        cl, nchw = [t for _, t in heat.times["channels_last"]], [t for _, t in heat.times["contiguous"]]
        med = {"channels_last": statistics.median(cl), "contiguous": statistics.median(nchw)}
        slower, faster = ("contiguous", "channels_last") if med["contiguous"] > med["channels_last"] else \
            ("channels_last", "contiguous")
        extra = (len(heat.times[slower]) + heat.untimed[slower]) * (med[slower] - med[faster])
        spent = slower == "contiguous" and extra >= self.budget * med[faster]  # NCHW's trials' cost (none if faster)
        rounds = (heat.position - self.warmup) // len(_ROUND)
        if rounds < 2:
            # one round: a clear channels_last win ends it (the pooled spread of the steps, the warm-up's later
            # steps included), trusted only where no NCHW step is slower than NCHW's warm-up step (which a
            # disturbance, not the layout, would explain)
            ratio = log_ratio(cl, nchw, spread_only=heat.warm)
            steady = heat.first_nchw is not None and max(nchw) <= 1.05 * heat.first_nchw
            if not steady or ratio.log < 0 or ratio.log - self.z * ratio.width <= 0 and not spent:
                return None
            how = "timed" if ratio.log - self.z * ratio.width > 0 else "noisy"  # else NCHW's trials spent the budget
            return LayoutDecision(heat.key, "channels_last", how, med, self._samples(heat), extra, math.exp(ratio.log))
        # two rounds on: each round's NCHW steps against the channels_last steps around them, a step or two apart,
        # so a machine getting busier or quieter over the race cancels out (paired_log_ratio); the steps pooled
        # (more degrees of freedom, the drift in their spread) end a race that is clear in its first rounds (only
        # then: looked at every round, their medians would meet a 99.9% bound by chance in a long race)
        if not {r for r, _ in heat.times["channels_last"]} & {r for r, _ in heat.times["contiguous"]}:
            return None  # no round holds both layouts' samples yet (other batch sizes in between): another round
        ratio = paired_log_ratio(heat.times["channels_last"], heat.times["contiguous"], around=True)
        pooled = log_ratio(cl, nchw, spread_only=heat.warm)
        log_r, t975, t999 = ratio.log, ratio.bound(0.975), ratio.bound(0.999)
        early, lead = rounds <= 3, log_r  # the estimate the rule judged
        if log_r - t975 > 0 or early and pooled.log - self.z * pooled.width > 0 and log_r > 0:  # the default, faster
            layout, how = "channels_last", "timed"
            lead = log_r if log_r - t975 > 0 else pooled.log
        elif log_r + ratio.bound(0.99) < -self.margin or \
                early and pooled.log + pooled.bound(0.999) < -self.margin and log_r < -self.margin:
            layout, how = "contiguous", "timed"
        elif abs(log_r) + t975 < self.margin:
            layout, how = "channels_last", "tie"
        elif rounds >= self.max_rounds or spent and log_r >= 0:
            # NCHW's trials have cost the budget, or the rounds are out (where NCHW looks faster, more rounds cost
            # only the default's own steps): NCHW only where its whole lead is beyond the margin and beyond the
            # noise (a 99% bound), so noise on a shared machine ends in the default, never in a flip
            layout = "contiguous" if log_r < -self.margin and log_r + t999 < 0 else "channels_last"
            how = "noisy"
        else:
            return None
        return LayoutDecision(heat.key, layout, how, med, self._samples(heat), extra, math.exp(abs(lead)))

    @staticmethod
    def _samples(heat: _Heat) -> dict[str, int]:
        return {layout: len(times) for layout, times in heat.times.items()}

    def settle(self, decision: LayoutDecision) -> LayoutDecision:
        """Keep ``decision`` for its key (the deciding rank's, on every rank) and end that key's race."""
        self.decisions[decision.key] = decision
        self._heats.pop(decision.key, None)
        return decision

    def carry(self, key: Hashable, like: Callable[[Hashable], bool]) -> None:
        """Let an undecided, unraced ``key`` take the decision (the last made) or else the race under way of the keys
        ``like`` accepts: a checkpoint's, keyed otherwise (a run resumed on another number of ranks). The races of
        those keys end: their kind of batch is not seen again."""
        if key in self.decisions or key in self._heats:
            return
        decided = [k for k in self.decisions if like(k)]
        racing = [k for k in self._heats if like(k)]
        if decided:
            self.decisions[key] = replace(self.decisions[decided[-1]], key=key)
        elif racing:
            last = self._last if self._last in racing else racing[-1]
            self._heats[key] = replace(self._heats[last], key=key, batch=None)  # each rank's batch differs now
            if self._last in racing:
                self._last = key
        for old in racing:
            self._heats.pop(old, None)

    def stop(self) -> None:
        """Give up the races under way (their keys stay undecided)."""
        self._heats.clear()

    def steps_run(self) -> int:
        """The training steps the races under way have run (their warm-ups included)."""
        return sum(heat.position for heat in self._heats.values())

    def racing(self) -> bool:
        """Whether a race is under way (a key seen and not yet decided)."""
        return bool(self._heats)

    # ---- a checkpoint ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The decisions made so far, and the races under way (their places in the schedule and their times), so a
        run resumed from a checkpoint goes on where it stopped."""
        racing = [{"key": _plain(heat.key), "batch": heat.batch, "position": heat.position,
                   "times": {k: [[r, float(t)] for r, t in v] for k, v in heat.times.items()},
                   "untimed": dict(heat.untimed), "warm": [float(t) for t in heat.warm],
                   "first_nchw": None if heat.first_nchw is None else float(heat.first_nchw)}
                  for heat in self._heats.values()]
        return {"decisions": [d.as_dict() for d in self.decisions.values()], "racing": racing,
                "last": _plain(self._last), "raced": self._raced}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """A checkpoint's decisions (their keys are not timed again) and its races under way: each goes on at its
        place in the schedule, timed afresh (another process, maybe another machine, warming up: its steps are
        compared with each other, never with the checkpoint's; those count only in what the slower layout cost)."""
        for entry in saved.get("decisions", ()):
            decision = LayoutDecision.from_dict(entry)
            self.decisions[decision.key] = decision
        racing = saved.get("racing") or []
        for entry in [racing] if isinstance(racing, dict) else racing:  # a dict: one race, as older checkpoints hold
            untimed = {k: n + len(entry["times"].get(k, ())) for k, n in entry["untimed"].items()}
            heat = _Heat(key=_key(entry["key"]), batch=entry["batch"], position=entry["position"], untimed=untimed,
                         cold=set(LAYOUTS))
            if heat.key in self.decisions:  # decided since that checkpoint (a validate/test from an earlier one)
                continue
            self._heats[heat.key] = heat
            self._last = heat.key
        if saved.get("last") is not None:
            self._last = _key(saved["last"])
        self._raced = max(self._raced, saved.get("raced", 0))
