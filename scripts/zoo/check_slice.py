"""Does the first-batch layout check on a slice of the batch find what it finds on the whole batch? Each zoo model in
its own process, a ``Trainer`` step with ``ChannelsLast(check_samples=K)`` and with ``check_samples=None``::

    python -m scripts.zoo.check_slice --models timm:repvgg_a0,timm:mobileone_s0,tv:resnet50 --batch 16 --samples 4
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from scripts.harness import CASE, emit, machine_line, options, run_case, table


def child(key: str, batch: int, samples: int) -> dict[str, Any]:
    """Both checks of one model in this process, each as the table's cells and what the two must share."""
    from cltrain import ChannelsLast
    from scripts.zoo.models import build, find, fit, make_batch

    spec = find([key])[0]
    row: dict[str, Any] = {"model": spec.key}
    for name, k in (("slice", samples), ("whole", None)):
        torch.manual_seed(0)
        callback = ChannelsLast(check_samples=k)
        fit(build(spec), spec, [make_batch(spec, batch, torch.Generator().manual_seed(0))], callback, max_steps=1)
        check = callback.layout_checks["train"]
        row[name] = {"verdict": check.verdict,
                     "findings": "; ".join(f"{f.kind} {f.phase} {f.module!r}" for f in check.findings) or "-",
                     "worst": f"{check.worst[0]:.2g} ({check.worst[1]:.2g})" if check.worst else "-",
                     "seconds": round(check.seconds, 2), "fallbacks": [f.describe() for f in check.fallbacks],
                     "layout": callback.layout}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = options(__doc__, models=("", "comma-separated zoo keys (timm:resnet50, tv:vit_b_16); required"),
                     batch=16, samples=(4, "check_samples of the sliced check"),
                     timeout=(1800, "seconds per model"), case=CASE)
    args = parser.parse_args(argv)
    if args.case:
        emit(child(**args.case))
        return 0
    if not args.models:
        parser.error("--models is required")
    print(f"batch {args.batch}, slice of {args.samples} samples\n")
    cells = []
    for key in args.models.split(","):
        run = run_case("scripts.zoo.check_slice", {"key": key, "batch": args.batch, "samples": args.samples},
                       timeout=args.timeout)
        found = run.results()
        if not found:
            cells.append([key, f"error: {run.failure() or run.last_error()}"[:127], *[""] * 8])
            continue
        row = found[-1]
        same = all(row["slice"][k] == row["whole"][k] for k in ("verdict", "findings", "fallbacks", "layout"))
        cells.append([row["model"], "yes" if same else "NO", *[row[name][k] for name in ("slice", "whole")
                                                               for k in ("verdict", "findings", "worst", "seconds")]])
        print(f"{key}: {cells[-1][1]}", flush=True)
    print(table(["model", "same", "slice: verdict", "findings", "largest agreeing difference (noise)", "s",
                 "whole batch: verdict", "findings", "largest agreeing difference (noise)", "s"], cells,
                align="lllllrlllr"))
    print("\n" + machine_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
