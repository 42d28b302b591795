"""How well the race of the layouts (``cltrain.timing.layout_race``) decides on a noisy machine: its rule played
against step times drawn from a model of that noise (the model: docs/benchmarks.md#race-rule).

    python -m scripts.bench.race_rule                 # 400 races per ratio, this machine's noise
    python -m scripts.bench.race_rule --noise 0.5     # a quieter machine
    python -m scripts.bench.race_rule --quick         # 40 races per ratio
"""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path
from typing import Any

from cltrain.timing.layout_race import LayoutRace
from scripts.harness import command_line, options, table, write_report

RATIOS = (0.78, 0.86, 0.90, 0.93, 0.95, 0.97, 1.0, 1.03, 1.05, 1.10, 1.22)


def noise(rng: random.Random, steps: int, scale: float) -> list[float]:
    """Log-time offsets of ``steps`` steps: a drift, a jitter and rare slow steps."""
    phi, drift_sd, jitter, slow, slow_by = 0.92, 0.097 * scale, 0.07 * scale, 0.03, 0.3 * scale
    x, out = rng.gauss(0, drift_sd), []
    for _ in range(steps):
        x = phi * x + rng.gauss(0, drift_sd * math.sqrt(1 - phi * phi))
        out.append(x + rng.gauss(0, jitter) + (slow_by if rng.random() < slow else 0.0))
    return out


def play(ratio: float, seed: int, scale: float, fit: int = 200) -> dict[str, Any]:
    """One race, with NCHW's steps ``ratio`` times channels_last's, to its decision or the end of a fit."""
    rng, race, key = random.Random(seed), LayoutRace(), ("race",)
    offsets, slow_steps, step = noise(rng, fit, scale), 0, 0
    for step in range(fit):
        layout = race.next_layout(key)
        if key in race.decisions:
            break
        slow_steps += layout == ("contiguous" if ratio > 1 else "channels_last")
        race.record(key, 8, layout, (ratio if layout == "contiguous" else 1.0) * math.exp(offsets[step]))
        if race.due() and (decision := race.judge()) is not None:
            race.settle(decision)
    kept = race.decisions[key].layout if key in race.decisions else "channels_last"
    loss = (ratio if kept == "contiguous" else 1.0) / min(1.0, ratio) - 1
    cost = slow_steps * (max(ratio, 1 / ratio) - 1)
    return {"nchw": kept == "contiguous", "loss": loss, "steps": step, "cost": cost,
            "fit": (cost + (fit - step) * loss) / fit}


def main(argv: list[str] | None = None) -> str:
    args = options(__doc__, races=(400, "races per ratio"), quick=(dict(races=40), "40 races per ratio"),
                   noise=(1.0, "scales the drift, the jitter and the slow steps"),
                   out=Path("bench_out/race_rule")).parse_args(argv)
    rows = []
    for ratio in RATIOS:
        played = [play(ratio, seed, args.noise) for seed in range(args.races)]
        mean = {k: statistics.fmean(p[k] for p in played) for k in played[0]}
        p90 = sorted(p["loss"] for p in played)[int(0.9 * (args.races - 1))]
        rows.append([f"{ratio:.2f}", f"{mean['nchw']:.2f}", f"{1 + mean['loss']:.3f}", f"{1 + p90:.3f}",
                     f"{mean['steps']:.0f}", f"{mean['cost']:.2f}", f"{1 + mean['fit']:.3f}"])
    markdown = "\n".join([
        f"`{command_line('scripts.bench.race_rule', argv)}`: {args.races} races per ratio, noise x{args.noise}.", "",
        table(["NCHW / CL step", "races keeping NCHW", "default / faster step", "p90", "race steps",
               "race cost (steps)", "200-step fit / faster"], rows, align="rrrrrrr")]) + "\n"
    write_report(args.out / "race_rule", markdown=markdown)
    print(markdown)
    return markdown


if __name__ == "__main__":
    main()
