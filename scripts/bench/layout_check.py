"""What the first-batch layout check costs: its seconds against one training step and one demo epoch.

For each model, rounds alternate (check, step; step, check; ...) between ``cltrain.check.compare.check_layout``
on one batch as ``ChannelsLast`` runs it (in float32 also when training in bf16: the forward, the
cross-entropy and the backward on an NCHW copy, a channels_last copy and, when they differ by more than
the floor, a perturbed NCHW copy) and one plain channels_last training step in the training precision
(forward, loss, backward, SGD) on the same batch; prints the median of each, the check's cost in steps and
as a fraction of one epoch of the demo set (1,000 images at this batch size), then the machine::

    python -m scripts.bench.layout_check                        # resnet18, resnet50; batch 32 at 112 px (the demo's)
    python -m scripts.bench.layout_check --models resnet50 --batch 64 --size 224 --amp fp32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
import torchvision

from cltrain.check import check_layout
from cltrain.loops import convert_model
from cltrain.precision import auto_precision
from scripts.machine import machine, machine_line

DEMO_TRAIN_IMAGES = 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["resnet18", "resnet50"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--amp", choices=["auto", "bf16", "fp32"], default="auto",
                        help="autocast dtype; auto: bf16 where this CPU computes it natively (the app's amp=auto)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    amp = args.amp
    if amp == "auto":
        amp = "bf16" if auto_precision(torch.device("cpu")).flag == "bf16-mixed" else "fp32"
    dtype = torch.bfloat16 if amp == "bf16" else None
    steps_per_epoch = DEMO_TRAIN_IMAGES / args.batch
    print(f"batch {args.batch} at {args.size} px, {amp}, {args.rounds} rounds, median seconds; "
          f"a demo epoch is {steps_per_epoch:.1f} steps")
    print(f"{'model':<12}{'check s':>9}{'step s':>8}{'in steps':>10}{'of an epoch':>13}  verdict")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    for name in args.models:
        torch.manual_seed(0)
        model = convert_model(getattr(torchvision.models, name)(num_classes=10), dtype=dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def loss_of(m: torch.nn.Module, layout: str, amp: bool = False) -> torch.Tensor:
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=amp and dtype is not None):
                return F.cross_entropy(m(x if layout == "channels_last" else x.contiguous()), y)

        def train_step() -> None:
            loss_of(model, "channels_last", amp=True).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        train_step()  # kernels made once, as a run's first steps make them
        samples: dict[str, list[float]] = {"check": [], "step": []}
        verdict = ""
        for i in range(args.rounds):
            for what in ("check", "step") if i % 2 == 0 else ("step", "check"):
                start = time.perf_counter()
                if what == "check":
                    verdict = check_layout(model, loss_of).verdict
                else:
                    train_step()
                samples[what].append(time.perf_counter() - start)
        check, step = (statistics.median(samples[k]) for k in ("check", "step"))
        print(f"{name:<12}{check:>9.2f}{step:>8.3f}{check / step:>10.1f}{check / (step * steps_per_epoch):>12.1%}  "
              f"{verdict}", flush=True)
    print(machine_line(machine()))


if __name__ == "__main__":
    main()
