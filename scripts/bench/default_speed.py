"""The default's speed: ``ChannelsLast()`` against the same fit without cltrain (NCHW), model family by family.

For each model, one process (``scripts.harness.run_child``: a crash is a row, not the end of the run) builds it with
random weights and runs real ``lightning.Trainer`` fits on one fixed synthetic batch already on the device,
alternately without cltrain and with ``ChannelsLast()`` at its defaults (conversion, the first-batch check), for
``--rounds`` rounds that alternate which goes first (``cltrain.timing.rounds.interleaved``), in each precision asked: by default the one ``amp=auto`` picks on the device
(``cltrain.precision.auto_precision``) and ``32-true`` (TF32 on CUDA, as the app sets it: ``tf32=true``).

Per model and precision:

* **step**: the steady state, the mean step over ``--steps`` steps after ``--warmup`` (one device sync at each end of
  the window, none between), median over rounds; the ratio NCHW / ChannelsLast (above 1: the default is faster);
* **fit**: the wall time of the whole ``trainer.fit`` (conversion, the check, warm-up, cuDNN's autotuning under
  ``cudnn.benchmark``, the steps), median over rounds, and its ratio;
* the check's verdict and seconds, and the layout the model trained in.

The batch is made NCHW, as most users' loaders make it: the default's fit includes converting it each step.
The SGD optimizer with momentum is apex's recipe; ``--optimizer adamw`` for the other. The families::

    residual       resnet50, resnext50_32x4d        ConvNeXt   convnext_tiny
    depthwise      mobilenet_v3_large, efficientnet_b0, regnet_y_1_6gf
    ghost modules  ghostnet_100 (timm)              dense      densenet121
    shuffle        shufflenet_v2_x1_0               CSP        cspdarknet53 (timm)
    ViT            vit_b_16 (a 16x16 patch conv)    window attention  swin_t

Usage::

    python -m scripts.bench.default_speed --out bench_out/default_speed             # CUDA: batch 256 at 224 px
    python -m scripts.bench.default_speed --models resnet50,convnext_tiny --batch 32 --size 224   # a CPU
    python -m scripts.bench.default_speed --tiny --out /tmp/ds                      # any CPU, seconds: the script works

Writes ``default_speed.md`` (the table, the machine, the command) and ``default_speed.jsonl`` (one record per model
and precision, rewritten as each ends) to ``--out``; ``--budget`` seconds stops starting models past it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from cltrain.timing.clock import Stopwatch
from cltrain.timing.report import command_line, table
from cltrain.timing.rounds import interleaved
from scripts.harness import emit, python_module, run_child

#: One family after another first, so a run cut short by ``--budget`` still covers the most families.
MODELS = ("resnet50", "convnext_tiny", "mobilenet_v3_large", "ghostnet_100", "densenet121", "vit_b_16", "efficientnet_b0",
          "resnext50_32x4d", "regnet_y_1_6gf", "shufflenet_v2_x1_0", "cspdarknet53", "swin_t")
TINY_MODELS = ("resnet18", "mobilenet_v3_small")
VARIANTS = ("nchw", "channels_last")


def _build(name: str, size: int) -> torch.nn.Module:
    from cltrain.model_names import build_untrained_model

    kwargs = {"image_size": size} if name.startswith("vit_") else {}
    return build_untrained_model(name, num_classes=1000, **kwargs)


class _Repeat:
    """One batch, ``times`` times: a loader with nothing to load (a list would be a list of loaders to Lightning)."""

    def __init__(self, batch: tuple[torch.Tensor, torch.Tensor], times: int) -> None:
        self.batch, self.times = batch, times

    def __iter__(self) -> Any:
        return iter([self.batch] * self.times)

    def __len__(self) -> int:
        return self.times


def fit_once(name: str, variant: str, precision: str, batch: torch.Tensor, target: torch.Tensor, warmup: int,
             steps: int, optimizer: str) -> dict[str, Any]:
    """One fit of ``warmup + steps`` steps; its whole wall time and its steady-state step."""
    import torch.nn.functional as F

    from cltrain import ChannelsLast
    from scripts.fits import NetModule, StepClock, quiet_trainer

    def make_optimizer(params: Any) -> torch.optim.Optimizer:
        if optimizer == "adamw":
            return torch.optim.AdamW(params, lr=1e-4)
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4)

    torch.manual_seed(0)
    window = StepClock(window=(warmup, warmup + steps - 1))  # one device sync at each end, none between
    callbacks: list[Any] = [window] + ([ChannelsLast()] if variant == "channels_last" else [])
    trainer = quiet_trainer(accelerator=batch.device.type, precision=precision, max_steps=warmup + steps,
                            callbacks=callbacks)
    module = NetModule(_build(name, batch.shape[-1]), lambda out, b: F.cross_entropy(out, b[1]), make_optimizer)
    with Stopwatch(batch.device) as whole:
        trainer.fit(module, train_dataloaders=_Repeat((batch, target), warmup + steps))
    check = callbacks[-1].layout_checks.get("train") if variant == "channels_last" else None
    convs = [m.weight for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    nhwc = sum(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    layout = "channels_last" if nhwc == len(convs) else f"{nhwc}/{len(convs)} convs channels_last"
    return {"fit_s": whole.seconds, "step_s": window.seconds / steps, "verdict": check.verdict if check else None,
            "check_s": check.seconds if check else None, "layout": layout}


def child(args: argparse.Namespace) -> None:
    """Every precision and round of one model, in this process; one JSON line per fit, as it ends."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    g = torch.Generator().manual_seed(0)
    batch = torch.randn(args.batch, 3, args.size, args.size, generator=g).to(device)
    target = torch.randint(0, 1000, (args.batch,), generator=g).to(device)
    name = args.models[0]

    def fit(precision: str, variant: str, r: int) -> None:
        fit = fit_once(name, variant, precision, batch, target, args.warmup, args.steps, args.optimizer)
        if not batch.is_contiguous():  # the next fit would not be the one it says
            raise RuntimeError(f"the {variant} fit left the loader's batch in strides {batch.stride()}")
        emit({"model": name, "precision": precision, "variant": variant, "round": r, "device": str(device), **fit})

    for precision in args.precisions:
        try:
            interleaved({v: (lambda r, v=v: fit(precision, v, r)) for v in VARIANTS}, args.rounds, with_round=True)
        except Exception as error:  # a model that cannot train here is a row saying so
            emit({"model": name, "precision": precision,
                  "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"})


def summarise(name: str, precision: str, fits: list[dict[str, Any]], why: str | None) -> dict[str, Any]:
    """One model and precision's row from its fits (medians by variant); ``why`` the run ended early."""
    runs = {v: [f for f in fits if f.get("variant") == v] for v in VARIANTS}
    error = next((f["error"] for f in fits if "error" in f), why)
    if not all(runs.values()):
        return {"model": name, "precision": precision, "error": error or "no fit ended", "fits": fits}
    med = {v: {k: statistics.median(f[k] for f in runs[v]) for k in ("fit_s", "step_s")} for v in VARIANTS}
    cl = runs["channels_last"][0]
    return {"model": name, "precision": precision, "device": cl["device"], "rounds": min(map(len, runs.values())),
            "nchw_step_s": med["nchw"]["step_s"], "cl_step_s": med["channels_last"]["step_s"],
            "step_ratio": med["nchw"]["step_s"] / med["channels_last"]["step_s"],
            "nchw_fit_s": med["nchw"]["fit_s"], "cl_fit_s": med["channels_last"]["fit_s"],
            "fit_ratio": med["nchw"]["fit_s"] / med["channels_last"]["fit_s"], "verdict": cl["verdict"],
            "check_s": cl["check_s"], "layout": cl["layout"], "note": error or "", "fits": fits}


def records_table(records: list[dict[str, Any]], header: str) -> str:
    cells = []
    for r in records:
        if "error" in r:
            done = ", ".join(f"{f['variant']} {f['step_s'] * 1000:.1f} ms/step, fit {f['fit_s']:.1f} s"
                             for f in r.get("fits", []) if "variant" in f)
            cells.append([r["model"], r["precision"], f"{r['error']}{'; ended: ' + done if done else ''}", *[""] * 7])
            continue
        check = f"{r['verdict']} ({r['check_s']:.1f} s)" if r["check_s"] is not None else str(r["verdict"])
        cells.append([r["model"], r["precision"], f"{1000 * r['nchw_step_s']:.1f}", f"{1000 * r['cl_step_s']:.1f}",
                      f"{r['step_ratio']:.2f}x", f"{r['nchw_fit_s']:.1f}", f"{r['cl_fit_s']:.1f}", f"{r['fit_ratio']:.2f}x",
                      check, f"{r['layout']}{'; ' + r['note'] if r['note'] else ''}"])
    return "\n".join([header, "", table(["model", "precision", "step NCHW (ms)", "step default (ms)", "step ratio",
                                          "fit NCHW (s)", "fit default (s)", "fit ratio", "check", "trained in"],
                                         cells, align="llrrrrrr")]) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=None, help="comma-separated")
    parser.add_argument("--precisions", nargs="*", default=None,
                        help="Lightning precision flags; 'auto' is amp=auto's pick (default: auto 32-true)")
    parser.add_argument("--batch", type=int, default=None, help="default: 256 on CUDA, 16 on a CPU")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--budget", type=float, default=None, help="seconds; no model starts past them")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one model's process may take")
    parser.add_argument("--tiny", action="store_true", help="two small models, batch 2 at 32 px, fp32, 1 step")
    parser.add_argument("--cpu", action="store_true", help="the CPU even where CUDA is")
    parser.add_argument("--out", type=Path, default=Path("bench_out/default_speed"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    if args.tiny:
        args.models, args.batch, args.size, args.precisions = args.models or list(TINY_MODELS), 2, 32, ["32-true"]
        args.warmup, args.steps, args.rounds = 1, 1, 2
    args.models = args.models or list(MODELS)
    args.batch = args.batch or (256 if cuda else 16)
    if args.child:
        child(args)
        return []
    from cltrain.precision import auto_precision
    from cltrain.timing.machine import machine, machine_line
    from cltrain.timing.report import write_report

    auto = auto_precision(torch.device("cuda" if cuda else "cpu"))
    args.precisions = [auto.flag if p == "auto" else p for p in (args.precisions or ["auto", "32-true"])]
    args.out.mkdir(parents=True, exist_ok=True)
    command = command_line("scripts.bench.default_speed", argv)
    header = (f"`{command}`: batch {args.batch} at {args.size} px, {args.optimizer}, {args.warmup} warm-up + "
              f"{args.steps} timed steps a fit, {args.rounds} rounds (medians); amp=auto: {auto.flag} ({auto.reason})."
              f"\n\n{machine_line(machine())}")
    records: list[dict[str, Any]] = []
    started = Stopwatch().start()
    for name in args.models:
        if args.budget is not None and started.elapsed() > args.budget:
            records += [{"model": name, "precision": p, "error": "not run: --budget spent"} for p in args.precisions]
            continue
        run = run_child(python_module(
            "scripts.bench.default_speed", "--child", "--models", name, "--batch", args.batch, "--size", args.size,
            "--warmup", args.warmup, "--steps", args.steps, "--rounds", args.rounds, "--optimizer", args.optimizer,
            "--precisions", *args.precisions, *(["--cpu"] if args.cpu else [])), timeout=args.timeout)
        why = None if run.code == 0 else (f"timed out after {args.timeout:.0f} s" if run.code is None
                                           else f"exit {run.code}: {run.last_error()}")
        lines = [summarise(name, p, [f for f in run.results() if f["precision"] == p], why) for p in args.precisions]
        records += lines
        for r in lines:
            print(records_table([r], "").splitlines()[-1], flush=True)
        write_report(args.out / "default_speed", markdown=records_table(records, header))
        (args.out / "default_speed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print(records_table(records, header))
    return records


if __name__ == "__main__":
    main()
