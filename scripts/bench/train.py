"""What train.py's Lightning path costs against a plain loop, and what channels_last + AMP buys end to end (the
method: docs/benchmarks.md#train). Prints markdown tables naming the machine; ``--out`` also writes them as JSON.

    python -m scripts.bench.train                      # ResNet-50, batch 32, 224 px
    python -m scripts.bench.train --device cuda --batch-size 256
    python -m scripts.bench.train --quick              # seconds: checks the script works
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import tempfile
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from cltrain import ChannelsLast, to_channels_last
from cltrain.app import ImageClassifier, build_classifier, compose_config, resolve_accelerator, resolve_precision
from cltrain.app.train import train
from cltrain.precision import autocast_dtype
from cltrain.timing.machine import machine, machine_line
from scripts.fits import StepClock, quiet_trainer
from scripts.harness import Stopwatch, interleaved, options, random_batches, table, timed, write_report


# --- part 1: plain loop vs the Lightning path ---------------------------------------------------
class PlainStep:
    """One training step as Lightning's automatic optimisation and precision plugin run it, without Lightning
    (docs/benchmarks.md#train): Lightning's own optimizer and scheduler, autocast, zero_grad, backward, a GradScaler."""

    def __init__(self, model: torch.nn.Module, precision: str, device: torch.device, batches: list,
                 num_classes: int = 1000) -> None:
        self.module = ImageClassifier(model, num_classes, lr=0.01, warmup_epochs=0, milestones=())
        trainer = quiet_trainer(accelerator=device.type, precision=precision, max_steps=0)
        trainer.fit(self.module, train_dataloaders=DataLoader(batches, batch_size=None))  # configures, steps nothing
        self.module.to(device).train()
        self.optimizer = trainer.optimizers[0]
        self.scheduler = next((c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"), None)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
        self.autocast_dtype = autocast_dtype(precision)
        self.device = device

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=False)
                    if self.autocast_dtype is not None else contextlib.nullcontext())
        with autocast:
            loss = self.module.criterion(self.module.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        return loss


def plain_loop(base: torch.nn.Module, batches: list, precision: str, device: torch.device, warmup: int,
               channels_last: bool = True) -> float:
    """Images/second of ``PlainStep`` on a copy of ``base`` (channels_last unless not) over ``batches``: the steps
    after ``warmup`` (at least one) in one window, the device synchronised at both ends (``timed``)."""
    model = copy.deepcopy(base).to(device)
    step = PlainStep(to_channels_last(model) if channels_last else model, precision, device, batches)
    first = max(warmup, 1)
    for x, y in batches[:first]:
        step(x, y)
    return sum(x.shape[0] for x, _ in batches[first:]) / timed(lambda: [step(x, y) for x, y in batches[first:]],
                                                               sync=device)


def lightning_path(model: torch.nn.Module, batches: list, precision: str, accelerator: str, warmup: int) -> float:
    """Images/second of ``ImageClassifier`` (1000 classes) under ``ChannelsLast`` in a ``Trainer`` over ``batches``:
    the same window as ``plain_loop``'s (``scripts.fits.StepClock``)."""
    first = max(warmup, 1)
    module = ImageClassifier(model, 1000, lr=0.01, warmup_epochs=0, milestones=())
    clock = StepClock(window=(first, len(batches) - 1))
    trainer = quiet_trainer(accelerator=accelerator, precision=precision, max_steps=len(batches),
                            callbacks=[clock, ChannelsLast(layout="channels_last")])
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    return sum(x.shape[0] for x, _ in batches[first:]) / clock.seconds


def overhead(args: argparse.Namespace, accelerator: str, precision: str) -> dict:
    """The plain loop and the Lightning path, channels_last, in ``--rounds`` interleaved rounds."""
    device = torch.device(accelerator)
    batches = random_batches(args.warmup + args.steps, (args.batch_size, 3, args.image_size, args.image_size),
                             device=device, memory_format=torch.channels_last)
    base = build_classifier(args.model, num_classes=1000)
    speeds = interleaved({
        "plain": lambda: plain_loop(base, batches, precision, device, args.warmup),
        "lightning": lambda: lightning_path(copy.deepcopy(base), batches, precision, accelerator, args.warmup)},
        args.rounds)
    plain, light = statistics.median(speeds["plain"]), statistics.median(speeds["lightning"])
    ratios = [lt / pl for lt, pl in zip(speeds["lightning"], speeds["plain"])]  # each round's pair ran back to back
    return {"model": args.model, "batch_size": args.batch_size, "image_size": args.image_size, "layout": "channels_last",
            "precision": precision, "plain_images_per_second": plain, "lightning_images_per_second": light,
            "ratio": statistics.median(ratios), "ratio_spread": (min(ratios), max(ratios)), "rounds": speeds}


# --- part 2: end to end on JPEGs -----------------------------------------------------------------
CONFIGS = {"contiguous fp32": (False, ["channels_last=false", "amp=false"]),
           "channels_last + AMP": (True, ["channels_last=true", "amp=true"])}


def end_to_end(args: argparse.Namespace, work: Path, accelerator: str, precision: str) -> tuple[list[dict], dict]:
    """``--e2e-rounds`` interleaved rounds of ``train(cfg)`` on JPEG files (contiguous fp32, channels_last + AMP) and
    of the plain loop's pair on synthetic tensors: the rows, and the share of the plain speed-up kept end to end."""
    common = [f"model={args.model}" if args.model in ("resnet18", "resnet50") else f"model.name={args.model}",
              f"device={args.device}", f"data.batch_size={args.batch_size}", f"data.image_size={args.image_size}",
              f"data.val_resize_size={int(args.image_size * 8 / 7)}", f"data.num_workers={args.num_workers}",
              f"trainer.max_steps={args.warmup + args.e2e_steps}", "trainer.max_epochs=-1",
              "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "print_freq=0",
              f"throughput_warmup={args.warmup}", *args.data]
    device, base = torch.device(accelerator), build_classifier(args.model, num_classes=1000)

    def e2e(r: int, name: str) -> dict:
        run_dir = work / f"e2e-{r}-{name.split()[0]}"
        return train(compose_config([*common, *CONFIGS[name][1], f"run_dir={run_dir}"]))

    def plain(name: str) -> float:
        cl = CONFIGS[name][0]
        batches = random_batches(args.warmup + args.e2e_steps, (args.batch_size, 3, args.image_size, args.image_size),
                                 device=device, memory_format=torch.channels_last if cl else torch.contiguous_format)
        return plain_loop(base, batches, precision if cl else "32-true", device, args.warmup, channels_last=cl)

    runs = interleaved({**{("e2e", n): (lambda r, n=n: e2e(r, n)) for n in CONFIGS},
                        **{("plain", n): (lambda r, n=n: plain(n)) for n in CONFIGS}}, args.e2e_rounds, with_round=True)
    c, cl = CONFIGS
    kept = [(runs[("e2e", cl)][r]["images_per_second"] / runs[("e2e", c)][r]["images_per_second"])
            / (runs[("plain", cl)][r] / runs[("plain", c)][r]) for r in range(args.e2e_rounds)]
    rows = [{"config": n, "precision": runs[("e2e", n)][0]["precision"],
             "images_per_second": statistics.median(m["images_per_second"] for m in runs[("e2e", n)]),
             "step_time_s": statistics.median(m["step_time_s"] for m in runs[("e2e", n)])} for n in CONFIGS]
    for row in rows:
        row["speedup"] = row["images_per_second"] / rows[0]["images_per_second"]
    med = {n: statistics.median(runs[("plain", n)]) for n in CONFIGS}
    reference = {**{f"{k} images_per_second": v for k, v in med.items()}, "speedup": med[cl] / med[c],
                 "kept": statistics.median(kept), "kept_spread": (min(kept), max(kept))}
    return rows, reference


def main(argv: list[str] | None = None) -> dict:
    parser = options(__doc__, model="resnet50", batch_size=32, image_size=224, device="auto", warmup=3,
                     steps=(10, "measured steps per round, part 1"), rounds=(5, "interleaved rounds, part 1"),
                     e2e_steps=(15, "measured steps per run, part 2 (0: skip part 2)"),
                     e2e_rounds=(3, "interleaved rounds, part 2"), num_workers=2,
                     quick=(dict(model="resnet18", batch_size=4, image_size=32, warmup=1, steps=2, rounds=1, e2e_steps=2,
                                 num_workers=0, e2e_rounds=1), "tiny sizes: check that the script works"),
                     data=([], "extra train.py overrides for part 2, e.g. data.root=..."),
                     out=(Path, "also write the results as JSON here"))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", module="lightning")
    accelerator, _ = resolve_accelerator(args.device)
    precision, _ = resolve_precision(True, accelerator)  # amp=auto
    desc = machine(accelerator)
    print(f"machine: {machine_line(desc)}")

    started = Stopwatch().start()
    part1 = overhead(args, accelerator, precision)
    print(f"\n## Lightning path vs plain PyTorch loop ({args.model}, batch {args.batch_size}, {args.image_size} px, "
          f"channels_last, {precision}; synthetic tensors; median of {args.rounds} interleaved rounds of {args.steps} steps)\n")
    print(table(["path", "images/s"], [["plain PyTorch loop", f"{part1['plain_images_per_second']:.2f}"],
                                       ["train.py (Lightning + ChannelsLast + ImageClassifier)",
                                        f"{part1['lightning_images_per_second']:.2f}"]], align="lr"))
    lo, hi = part1["ratio_spread"]
    print(f"\nratio Lightning / plain: **{part1['ratio']:.3f}** (median of the {args.rounds} rounds' ratios, each "
          f"pair run back to back; spread {lo:.3f}-{hi:.3f}) [goal >= 0.98]")

    part2: list[dict] = []
    reference: dict = {}
    if args.e2e_steps > 0:
        with tempfile.TemporaryDirectory(prefix="cltrain-bench-") as tmp:
            if args.quick and not args.data:
                # the demo set in a temporary folder (any_root), not data/demo
                args.data = [f"data.root={Path(tmp) / 'demo'}", "data.demo.num_classes=4", "data.demo.train_per_class=8",
                             "data.demo.val_per_class=2", "data.demo.image_size=[96,72]", "data.demo.any_root=true"]
            part2, reference = end_to_end(args, Path(tmp), accelerator, precision)
        print(f"\n## End to end on JPEG files ({args.model}, batch {args.batch_size}, {args.image_size} px, "
              f"{args.num_workers} loader workers, median step after {args.warmup} warm-up steps)\n")
        print(table(["config", "precision", "images/s", "step (s)", "speed-up"],
                    [[r["config"], r["precision"], f"{r['images_per_second']:.2f}", f"{r['step_time_s']:.3f}",
                      f"{r['speedup']:.2f}x"] for r in part2], align="llrrr"))
        e2e = part2[-1]["speedup"]
        print(f"\nplain loop on synthetic tensors, same model/batch/size: contiguous fp32 "
              f"{reference['contiguous fp32 images_per_second']:.2f} img/s, channels_last + AMP "
              f"{reference['channels_last + AMP images_per_second']:.2f} img/s: **{reference['speedup']:.2f}x**")
        lo, hi = reference["kept_spread"]
        print(f"end to end keeps {reference['kept']:.0%} of the plain step's speed-up (median of {args.e2e_rounds} "
              f"rounds, each pair against the plain pair run next to it; spread {lo:.0%}-{hi:.0%}; medians: "
              f"{e2e:.2f}x vs {reference['speedup']:.2f}x) [goal >= 98%]")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    result = {"machine": desc, "overhead": part1, "end_to_end": part2, "plain_step_reference": reference,
              "seconds": round(started.elapsed(), 1)}
    if args.out:
        write_report(args.out.with_suffix(""), data=result)
    return result


if __name__ == "__main__":
    main()
