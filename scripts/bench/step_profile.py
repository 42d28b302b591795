"""Where a training step's time goes, by kind: ``StepProfile``, a Lightning callback that writes a ``torch.profiler``
window over a few steps of a real run as JSON (the kinds: docs/benchmarks.md#step-profile).

    python train.py experiment=smoke +callbacks.profile._target_=scripts.bench.step_profile.StepProfile \\
        +callbacks.profile.path=/tmp/profile.json
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.profiler import ProfilerActivity, profile, record_function

from scripts.harness import Stopwatch, synchronize, table

__all__ = ["DATA_WAIT", "KINDS", "StepProfile", "breakdown", "breakdown_table", "kind_of"]

#: The kinds, in the order a table lists them.
KINDS = ("convolution forward", "convolution backward", "BatchNorm", "elementwise and other", "optimizer",
         "between steps", "idle and launch gaps")
#: The host's wall time between steps, apart from ``KINDS`` (on a GPU it overlaps them).
DATA_WAIT = "data wait"
BETWEEN_STEPS = "cltrain: between steps"
#: (a pattern a name holds, the kind), the first that matches wins; names are compared in lower case. Compiled
#: kernels are named after the ops they fuse ("triton_red_fused__native_batch_norm_legit_functional_relu_3"),
#: "convert_element_type" among them.
_RULES = tuple((re.compile(pattern), kind) for pattern, kind in (
    (r"optimizer\.zero_grad", "optimizer"), (r"convolution_?backward", "convolution backward"),
    (r"batch_?norm", "BatchNorm"), (r"conv(?!ert)", "convolution forward"),
    (re.escape(BETWEEN_STEPS), "between steps")))


def kind_of(event: Any) -> str:
    """The kind of a profiler event: the first rule matched by its name or, going outwards, a range around it."""
    while event is not None:
        name = event.name.lower()
        for pattern, kind in _RULES:
            if pattern.search(name):
                return kind
        event = event.cpu_parent
    return "elementwise and other"


def _update_starts(events: list[Any]) -> dict[int, float]:
    """For each ``Optimizer.step`` range, when the last backward inside its time span ended (its start if none):
    what the step runs after that is the update. Backward may run on another thread (CUDA), so by time."""
    backward = [e.time_range.end for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    return {id(e): max((end for end in backward if e.time_range.start <= end <= e.time_range.end),
                       default=e.time_range.start) for e in events if e.name.startswith("Optimizer.step")}


def _in_update(event: Any, starts: dict[int, float]) -> bool:
    parent = event.cpu_parent
    while parent is not None and id(parent) not in starts:
        parent = parent.cpu_parent
    return parent is not None and event.time_range.start >= starts[id(parent)]


def breakdown(events: Any, wall_s: float, steps: int, device_type: str) -> dict[str, float]:
    """Milliseconds per step of each kind in ``KINDS`` and of ``DATA_WAIT`` from a profiler's ``events()`` over
    ``steps`` steps of ``wall_s`` seconds (device time on ``"cuda"``, else CPU time; the rest is idle)."""
    ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]  # kernels count through their op
    starts = _update_starts(ops)
    ms = dict.fromkeys(KINDS, 0.0)
    wait = 0.0
    for event in ops:
        if event.name == BETWEEN_STEPS:
            wait += event.cpu_time_total / 1e3
        # a range's own CPU time (Optimizer.step's, Lightning's closure in it, the wait between steps) is host time
        own = event.self_device_time_total if device_type == "cuda" else (
            0 if event.is_user_annotation else event.self_cpu_time_total)
        if own > 0:
            ms["optimizer" if _in_update(event, starts) else kind_of(event)] += own / 1e3
    ms["idle and launch gaps"] = max(0.0, 1e3 * wall_s - sum(ms.values()))
    return {**{kind: value / steps for kind, value in ms.items()}, DATA_WAIT: wait / steps}


class StepProfile(Callback):
    """Profile training steps ``first`` (>= 1: the window opens at the end of the step before) .. ``first + steps -
    1`` and write ``{"device", "steps", "wall_ms", "kinds": {kind: ms per step}}`` to ``path`` as JSON; a ``first`` or
    ``steps`` below 1 raises ``ValueError``."""

    def __init__(self, path: str, first: int = 1, steps: int = 2) -> None:
        if first < 1 or steps < 1:
            raise ValueError(f"StepProfile: first must be >= 1 and steps >= 1, got first={first}, steps={steps}")
        self.path, self.first, self.last = Path(path), first, first + steps - 1
        self.prof: profile | None = None
        self.between: record_function | None = None
        self.watch = Stopwatch()

    def _close_between(self) -> None:
        if self.between is not None:
            self.between.__exit__(None, None, None)
            self.between = None

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self._close_between()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        step, device = trainer.global_step - 1, trainer.strategy.root_device  # global_step counts the steps taken
        if step == self.first - 1 and self.prof is None:
            synchronize(device)  # the window opens on an idle device
            self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                                                      else []))
            self.prof.__enter__()
            self.watch.start()
        elif step == self.last and self.prof is not None:
            synchronize(device)
            wall, steps = self.watch.elapsed(), self.last - self.first + 1
            self.prof.__exit__(None, None, None)
            self.path.write_text(json.dumps({"device": device.type, "steps": steps, "wall_ms": 1e3 * wall / steps,
                                             "kinds": breakdown(self.prof.events(), wall, steps, device.type)}))
            self.prof = None
        if self.prof is not None:
            self.between = record_function(BETWEEN_STEPS)
            self.between.__enter__()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close_between()
        if self.prof is not None:  # the run ended inside the window: nothing to report
            self.prof.__exit__(None, None, None)
            self.prof = None


def breakdown_table(profiles: dict[str, dict[str, Any]]) -> str:
    """One Markdown table: a row per kind, then the data wait and the step's wall time; a column per profiled
    configuration (ms per step, share of the step)."""
    names = list(profiles)

    def cell(name: str, kind: str) -> str:
        ms, wall = profiles[name]["kinds"].get(kind, 0.0), profiles[name]["wall_ms"]
        return f"{ms:.1f} ms ({100 * ms / wall:.0f}%)" if wall > 0 else f"{ms:.1f} ms"

    rows = [[f"{kind} (host, apart)" if kind == DATA_WAIT else kind, *(cell(n, kind) for n in names)]
            for kind in (*KINDS, DATA_WAIT)]
    rows.append(["step (wall)", *(f"{profiles[n]['wall_ms']:.1f} ms" for n in names)])
    return table(["kind", *names], rows, align="l" + "r" * len(names)) + "\n"
