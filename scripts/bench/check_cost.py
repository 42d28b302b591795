"""What ChannelsLast's first-batch layout check costs: peak memory and wall time against a run without it (the
method: docs/benchmarks.md#check-cost).

    python -m scripts.bench.check_cost                          # resnet50, convnext_tiny, vit_s_16; batch 32, 224 px
    python -m scripts.bench.check_cost --models resnet50 --batch 32 --size 224 --precision bf16-mixed
    python -m scripts.bench.check_cost --grid --batch 32 --optimizer adamw
    python -m scripts.bench.check_cost --tiny                   # seconds: resnet18, batch 4 at 32 px (the test)
    python -m scripts.bench.check_cost --models resnet50 --batch 256 --warm   # + the check of a 2nd fit in the process
"""

from __future__ import annotations

import resource
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from cltrain import ChannelsLast
from scripts.bench.models import build_model
from scripts.fits import NetModule, StepClock, quiet_trainer
from scripts.harness import CASE, emit, interleaved, machine_line, options, run_case, table, table_row, write_report

#: ``--models`` names (``scripts.bench.models.build_model``; ``unet_resnet18`` is trained with Dice + BCE).
MODELS = ("resnet18", "resnet50", "efficientnet_b0", "mobilenet_v3_large", "convnext_tiny", "vit_s_16", "unet_resnet18")
GRID = (("resnet50", "efficientnet_b0", "unet_resnet18"), (64, 128, 224))
#: ``--optimizer``'s choices, the default first.
OPTIMIZERS = {"adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
              "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)}


def child(model: str, batch: int, size: int, precision: str, steps: int, optimizer: str,
          verify: bool, warm: bool = False) -> dict[str, Any]:
    """One training run in this process; returns its figures (``peak_rss_mb``: Linux's ``VmHWM``). ``warm``: then
    a second run with the check in the same process, whose check's seconds are ``warm_check_s`` (its kernels'
    first use already paid)."""
    segmentation = model.startswith("unet")

    class Images(Dataset):
        def __len__(self) -> int:
            return batch * steps

        def __getitem__(self, i: int) -> tuple[torch.Tensor, Any]:
            g = torch.Generator().manual_seed(i)
            image = torch.randn(3, size, size, generator=g)
            return (image, (image[:1] > 0).float()) if segmentation else (image, i % 10)

    def loss(out: torch.Tensor, b: Any) -> torch.Tensor:
        if not segmentation:
            return F.cross_entropy(out, b[1])
        probs = out.sigmoid()
        dice = 1 - (2 * (probs * b[1]).sum() + 1) / (probs.sum() + b[1].sum() + 1)
        return dice + F.binary_cross_entropy_with_logits(out, b[1])

    def fit(verify: bool) -> tuple[Any, StepClock, ChannelsLast]:
        torch.manual_seed(0)
        timer, callback = StepClock(), ChannelsLast(verify=verify)
        trainer = quiet_trainer(max_steps=steps, precision=precision, callbacks=[timer, callback])
        trainer.fit(NetModule(build_model(model, size, classes=10), loss, OPTIMIZERS[optimizer]),
                    DataLoader(Images(), batch_size=batch))
        return trainer, timer, callback

    trainer, timer, callback = fit(verify)
    check = callback.layout_checks.get("train")
    cuda = torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda"
    warm_check = fit(True)[2].layout_checks["train"].seconds if warm and verify else None
    return {"warm_check_s": warm_check, "steps": timer.steps,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "cuda_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            "check_s": check.seconds if check else None, "verdict": check.verdict if check else None,
            "device": str(trainer.strategy.root_device)}


def measure(case: dict[str, Any], repeats: int, warm: bool = False) -> dict[str, Any]:
    """``repeats`` alternating rounds of a run of ``case`` without and with the check, each in a fresh process."""
    def run(verify: bool) -> dict[str, Any]:
        child = run_case("scripts.bench.check_cost", {**case, "verify": verify, "warm": warm})
        if child.code != 0 or not child.results():
            raise RuntimeError(f"check_cost child failed ({case}, verify={verify}): {child.status()}\n"
                               f"{child.output[-3000:]}")
        return child.results()[-1]

    runs = interleaved({False: lambda: run(False), True: lambda: run(True)}, repeats)
    med = statistics.median
    plain_step = med(t for run in runs[False] for t in run["steps"][1:])
    step_with_check = med(t for run in runs[True] for t in run["steps"][1:])
    first_plain, first_check = (med(run["steps"][0] for run in runs[v]) for v in (False, True))
    rss_plain, rss_check = (med(run["peak_rss_mb"] for run in runs[v]) for v in (False, True))
    check_s = med(run["check_s"] for run in runs[True])
    warm_s = med(run["warm_check_s"] for run in runs[True]) if warm else None
    row = {**case, "device": runs[True][0]["device"], "rss_plain_mb": rss_plain, "rss_check_mb": rss_check,
           "memory_ratio": rss_check / rss_plain, "plain_step_s": plain_step, "step_with_check_s": step_with_check,
           "check_s": check_s, "warm_check_s": warm_s, "check_in_steps": check_s / step_with_check,
           "first_step_extra_in_steps": (first_check - first_plain) / plain_step, "verdict": runs[True][0]["verdict"],
           "runs": {"plain": runs[False], "check": runs[True]}}
    if runs[True][0]["cuda_peak_mb"] is not None:
        cuda_plain, cuda_check = (med(run["cuda_peak_mb"] for run in runs[v]) for v in (False, True))
        row.update(cuda_plain_mb=cuda_plain, cuda_check_mb=cuda_check, cuda_memory_ratio=cuda_check / cuda_plain)
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = options(__doc__, batch=32, size=224, precision="bf16-mixed", steps=(3, "training steps per run (>= 2)"),
                     repeats=(2, "rounds of (without, with) the check"),
                     grid=(False, "resnet50, efficientnet_b0, unet_resnet18 at 64, 128, 224 px"),
                     tiny=(dict(models=["resnet18"], batch=4, size=32, precision="32-true", steps=2, repeats=1),
                           "resnet18, batch 4 at 32 px, fp32, one round"), case=CASE,
                     optimizer=(tuple(OPTIMIZERS), None), json=(Path, "also write the rows here"),
                     warm=(False, "also the check of a second fit in each process, with its kernels' first use paid"))
    parser.add_argument("--models", nargs="*", default=["resnet50", "convnext_tiny", "vit_s_16"], choices=MODELS)
    args = parser.parse_args(argv)
    if args.case:
        emit(child(**args.case))
        return []
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the plain step time is read from steps 2..)")
    points = [(m, z) for m in GRID[0] for z in GRID[1]] if args.grid else [(m, args.size) for m in args.models]
    print(f"batch {args.batch}, {args.precision}, {args.optimizer}, {args.steps} steps per run, {args.repeats} "
          "rounds, each run in its own process; medians")
    print(table([f"model, batch {args.batch}", "px", "peak RSS without / with the check", "memory ratio", "step",
                 "check", "check in steps", "first step +", "verdict"], [], align="lrrrrrrrl"))
    rows = []
    for name, size in points:
        row = measure(dict(model=name, batch=args.batch, size=size, precision=args.precision, steps=args.steps,
                           optimizer=args.optimizer), args.repeats, args.warm)
        rows.append(row)
        cuda = (f" (CUDA max_memory_allocated {row['cuda_plain_mb']:.0f} -> {row['cuda_check_mb']:.0f} MiB, "
                f"{row['cuda_memory_ratio']:.2f}x)" if "cuda_memory_ratio" in row else "")
        print(table_row([name, size, f"{row['rss_plain_mb']:.0f} / {row['rss_check_mb']:.0f} MB",
                         f"{row['memory_ratio']:.2f}x{cuda}", f"{row['step_with_check_s']:.2f} s",
                         f"{row['check_s']:.2f} s" + (f" (2nd fit {row['warm_check_s']:.2f} s)" if args.warm else ""),
                         f"{row['check_in_steps']:.1f}",
                         f"{row['first_step_extra_in_steps']:.1f}", row["verdict"]]), flush=True)
    print(f"device {rows[0]['device'] if rows else '?'}; " + machine_line())
    if args.json:
        write_report(args.json.with_suffix(""), data=rows)
    return rows


if __name__ == "__main__":
    main()
