"""What mode="auto"'s isolation costs: the timing in a child process against the same timing in this process.

For each model, rounds alternate (A B, B A, ...) between ``cltrain.timing.layouts.choose_layout`` (in this
process, as mode="auto" ran before) and ``cltrain.timing.probe.probe_layout`` (a spawned child: start
Python, import torch, unpickle the model, time, report), with the same steps; prints the median wall
seconds of each, their difference (the isolation's cost) and ratio, then the machine. "(cold)" is the
first in-process trial, which creates the kernels as a run's own trial would; every child starts cold.
The first row, one 3x3 conv, is the fixed cost of the child process alone::

    python -m scripts.bench.auto_probe                       # resnet18 and resnet50, (8, 3, 64, 64), 3 rounds
    python -m scripts.bench.auto_probe --models resnet50 --shape 16 3 112 112 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torchvision

from cltrain.timing import choose_layout, probe_layout
from scripts.machine import machine, machine_line
from scripts.timing import interleaved, timed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["resnet18", "resnet50"])
    parser.add_argument("--shape", type=int, nargs=4, default=[8, 3, 64, 64], metavar=("N", "C", "H", "W"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    shape = tuple(args.shape)
    print(f"shape {shape}, {args.steps} timed steps + 1 warm-up per layout, {args.rounds} rounds, median wall seconds")
    print(f"{'model':<12}{'in-process':>12}{'(cold)':>8}{'child':>10}{'cost':>9}{'ratio':>8}  auto's choice (child)")
    for name in ["tiny", *args.models]:  # tiny: one 3x3 conv, so its row is the isolation's fixed cost
        model = torch.nn.Conv2d(3, 8, 3) if name == "tiny" else getattr(torchvision.models, name)(num_classes=10)
        chosen: dict[str, str] = {}

        def probe() -> None:
            result = probe_layout(model, shape, steps=args.steps)
            if result.failure is not None:
                raise SystemExit(f"{name}: the probe failed: {result.failure}")
            chosen["layout"] = result.layout

        samples = interleaved(args.rounds, {
            "in-process": lambda: timed(lambda: choose_layout(model, shape, steps=args.steps)),
            "child": lambda: timed(probe)}, rotate=True)
        inproc, child = (statistics.median(samples[k]) for k in ("in-process", "child"))
        cold = samples["in-process"][0]  # this process's first trial of the model: kernels created, as in a run
        print(f"{name:<12}{inproc:>12.1f}{cold:>8.1f}{child:>10.1f}{child - inproc:>9.1f}{child / inproc:>8.2f}  "
              f"{chosen.get('layout')}", flush=True)
    print(f"Machine: {machine_line(machine())}")


if __name__ == "__main__":
    main()
