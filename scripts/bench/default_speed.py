"""Never slower by default: ``ChannelsLast()``, which races the layouts on the run's first steps, against both layouts
pinned, model family by family (the method: docs/benchmarks.md#default-speed).

    python -m scripts.bench.default_speed --out bench_out/default_speed                       # the dozen, 64 and 128 px
    python -m scripts.bench.default_speed --models resnet50 --sizes 224 --batch 16 --fit-steps 40  # the race at 224 px
    python -m scripts.bench.default_speed --tiny --out /tmp/ds                                 # any CPU, seconds
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from cltrain import ChannelsLast, is_channels_last
from cltrain.layout.optimizer_state import restride_optimizer_state
from cltrain.precision import auto_precision, autocast_dtype
from scripts.bench.models import build_model, unknown_model
from scripts.fits import NetModule, StepClock, quiet_trainer
from scripts.harness import (CASE, Stopwatch, command_line, emit, interleaved, machine_line, options, random_batches,
                             run_case, table, timed, training_step, write_report)

#: One family after another first, so a run cut short by ``--budget`` still covers the most families.
MODELS = ("resnet50", "mobilenet_v3_large", "ghostnet_100", "efficientnet_b0", "convnext_tiny", "densenet121",
          "resnet18", "regnet_y_1_6gf", "shufflenet_v2_x1_0", "googlenet", "squeezenet1_1", "vit_b_16")
TINY_MODELS = ("resnet18", "mobilenet_v3_small")
#: What --precisions takes: Lightning's precision flags the fits run, and "auto" (amp=auto's pick here).
PRECISIONS = ("auto", "bf16-mixed", "16-mixed", "32-true", "bf16-true", "16-true")
VARIANTS = ("nchw", "channels_last", "default")
#: ``--optimizer``'s choices, the default first (SGD with momentum: apex's recipe).
OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4),
              "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4)}


def fit_once(name: str, variant: str, precision: str, batch: torch.Tensor, target: torch.Tensor, fit_steps: int,
             steps: int, optimizer: str) -> dict[str, Any]:
    """One fit of ``fit_steps`` steps; its whole wall time, its steady-state step (the last ``steps``), the race's
    decision."""
    torch.manual_seed(0)
    window = StepClock(window=(fit_steps - steps, fit_steps - 1))  # one device sync at each end, none between
    door = {"nchw": [], "channels_last": [ChannelsLast(layout="channels_last", verify=False)],
            "default": [ChannelsLast()]}[variant]
    trainer = quiet_trainer(accelerator=batch.device.type, precision=precision, max_steps=fit_steps,
                            callbacks=[window, *door])
    module = NetModule(build_model(name, batch.shape[-1]), lambda out, b: F.cross_entropy(out, b[1]),
                       OPTIMIZERS[optimizer])
    with Stopwatch(batch.device) as whole:
        trainer.fit(module, train_dataloaders=DataLoader([(batch, target)] * fit_steps, batch_size=None))
    check = door[0].layout_checks.get("train") if door else None
    decision = door[0].decision if door else None
    convs = [m.weight for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    nhwc = sum(is_channels_last(w) for w in convs)  # strictly: torch's own check calls a 1x1 kernel both
    layout = "channels_last" if nhwc == len(convs) else "contiguous" if nhwc == 0 else \
        f"{nhwc}/{len(convs)} convs channels_last"
    steady = interleaved_steps(module, trainer.optimizers[0], batch, target, precision) if variant == "default" else {}
    return {"fit_s": whole.seconds, "step_s": window.seconds / steps, "verdict": check.verdict if check else None,
            "check_s": check.seconds if check else None, "layout": layout,
            "decision": decision.as_dict() if decision else None, "interleaved_s": steady}


def interleaved_steps(module: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
                      target: torch.Tensor, precision: str, rounds: int = 8, steps: int = 4) -> dict[str, float]:
    """The trained model's steady step in each layout, timed in blocks that alternate within this process (the first
    step after each switch untimed): the reference the race is judged by, which the pinned fits, minutes apart on a
    machine that drifts, cannot give. Every module goes to the layout (a check's fallback is not kept): a case whose
    check fell back has that verdict in its record."""
    dtype = autocast_dtype(precision)
    module.to(batch.device)  # Lightning's teardown left the model and its optimizer's state on the CPU
    for state in optimizer.state.values():  # (a scalar "step" stays where the optimizer keeps it)
        state.update({k: v.to(batch.device) for k, v in state.items() if torch.is_tensor(v) and v.dim()})

    def block(fmt: torch.memory_format) -> float:
        module.to(memory_format=fmt)
        restride_optimizer_state([optimizer])
        step = training_step(module, lambda: F.cross_entropy(module(batch.contiguous(memory_format=fmt)), target),
                             optimizer=optimizer, autocast_dtype=dtype, device=batch.device)
        step()
        return timed(lambda: [step() for _ in range(steps)], batch.device) / steps

    got = interleaved({"channels_last": lambda: block(torch.channels_last),
                       "nchw": lambda: block(torch.contiguous_format)}, rounds)
    return {k: statistics.median(v) for k, v in got.items()}


def child(model: str, batch: int, sizes: list[int], precisions: list[str], fit_steps: int, steps: int, rounds: int,
          optimizer: str) -> None:
    """Every precision, size and round of one model, in this process; one JSON line per fit, as it ends."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    for size in sizes:
        ((images, target),) = random_batches(1, (batch, 3, size, size), device=device)

        def fit(precision: str, variant: str, r: int) -> None:
            fit = fit_once(model, variant, precision, images, target, fit_steps, steps, optimizer)
            if not images.is_contiguous():  # the next fit would not be the one it says
                raise RuntimeError(f"the {variant} fit left the loader's batch in strides {images.stride()}")
            emit({"model": model, "precision": precision, "size": size, "variant": variant, "round": r,
                  "device": str(device), **fit})

        for precision in precisions:
            try:
                interleaved({v: (lambda r, v=v: fit(precision, v, r)) for v in VARIANTS}, rounds, with_round=True)
            except Exception as error:  # a model that cannot train here is a row saying so
                emit({"model": model, "precision": precision, "size": size,
                      "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"})


def summarise(name: str, precision: str, size: int, fits: list[dict[str, Any]], why: str | None) -> dict[str, Any]:
    """One model, precision and size's row from its fits (medians by variant); ``why`` the run ended early."""
    runs = {v: [f for f in fits if f.get("variant") == v] for v in VARIANTS}
    error = next((f["error"] for f in fits if "error" in f), why)
    row = {"model": name, "precision": precision, "size": size}
    if not all(runs.values()):
        return {**row, "error": error or "no fit ended", "fits": fits}
    med = {v: {k: statistics.median(f[k] for f in runs[v]) for k in ("fit_s", "step_s")} for v in VARIANTS}
    faster = min(("nchw", "channels_last"), key=lambda v: med[v]["step_s"])
    default = runs["default"][-1]
    # The kept layout's pinned fits against the faster's: the race's choice, without the default fit's own drift.
    kept = {"channels_last": "channels_last", "contiguous": "nchw"}.get(default["layout"])
    steady = [f["interleaved_s"] for f in runs["default"] if f.get("interleaved_s")]
    inter = {k: statistics.median(d[k] for d in steady) for k in ("channels_last", "nchw")} if steady else None
    return {**row, "device": default["device"], "rounds": min(map(len, runs.values())),
            **{f"{v}_{k}": med[v][k] for v in VARIANTS for k in ("step_s", "fit_s")}, "faster": faster,
            "step_ratio": med["default"]["step_s"] / med[faster]["step_s"],
            "fit_ratio": med["default"]["fit_s"] / med[faster]["fit_s"],
            "kept_ratio": med[kept]["step_s"] / med[faster]["step_s"] if kept else None,
            "interleaved_s": inter,
            "kept_interleaved_ratio": inter[kept] / min(inter.values()) if inter and kept else None,
            "verdict": default["verdict"], "check_s": default["check_s"], "layout": default["layout"],
            "decisions": [f["decision"] for f in runs["default"]], "note": error or "", "fits": fits}


def race_kept(r: dict[str, Any]) -> str:
    """What the race kept, by how much, how it decided and what it cost (``*``: the fits did not all agree)."""
    picks = [d for d in r["decisions"] if d]
    if not picks:
        return "not decided"
    d = picks[-1]
    seconds = d["seconds"]
    ratio = max(seconds.values()) / min(seconds.values()) if len(seconds) == 2 else 1.0
    kept = "NCHW" if d["layout"] == "contiguous" else "CL"
    faster = "NCHW" if len(seconds) == 2 and seconds["contiguous"] < seconds["channels_last"] else "CL"
    # a noisy race keeps channels_last where NCHW's lead is not beyond doubt: then both are said
    said = f"{kept} {ratio:.2f}x" if faster == kept else f"{kept}, {faster} {ratio:.2f}x faster"
    return f"{said} ({d['how']}, {d['extra_seconds']:.2f} s)" + (" *" if len(picks) > 1 and any(
        p["layout"] != d["layout"] for p in picks) else "")


def records_table(records: list[dict[str, Any]], header: str) -> str:
    """``header``, then a row per record (a failed one: its error)."""
    cells = []
    for r in records:
        if "error" in r:
            cells.append([r["model"], r["precision"], str(r["size"]), r["error"], *[""] * 11])
            continue
        t = r.get("interleaved_s")
        kept = ["" if r.get(k) is None else f"{r[k]:.3f}" for k in ("kept_ratio", "kept_interleaved_ratio")]
        cells.append([r["model"], r["precision"], str(r["size"]), *(f"{1000 * r[f'{v}_step_s']:.1f}" for v in VARIANTS),
                      f"{r['step_ratio']:.3f}", kept[0], f"{t['channels_last'] / t['nchw']:.3f}" if t else "", kept[1],
                      *(f"{r[f'{v}_fit_s']:.1f}" for v in VARIANTS), f"{r['fit_ratio']:.3f}", race_kept(r)])
    columns = ["model", "precision", "px", "step NCHW (ms)", "step CL (ms)", "step default (ms)",
               "default / faster step", "kept / faster step", "interleaved CL / NCHW step",
               "kept / faster, interleaved", "fit NCHW (s)", "fit CL (s)", "fit default (s)", "default / faster fit",
               "the race kept"]
    return f"{header}\n\n{table(columns, cells, align='lllrrrrrrrrrrrl')}\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = options(__doc__, fit_steps=(200, "steps of each fit"), rounds=1,
                     steps=(50, "the last steps of a fit: its steady state"),
                     timeout=(3600.0, "seconds one model's process may take"),
                     tiny=(dict(batch=2, sizes=[32], precisions=["32-true"], fit_steps=14, steps=2, rounds=1),
                           "two small models, batch 2 at 32 px, fp32, 14-step fits"),
                     out=Path("bench_out/default_speed"), case=CASE, models=(lambda s: s.split(","), "comma-separated"),
                     precisions=([], "Lightning precision flags, space- or comma-separated; 'auto' is amp=auto's pick "
                                     "(default: auto 32-true)"),
                     batch=(int, "default: 256 on CUDA, 8 on a CPU"), optimizer=(tuple(OPTIMIZERS), None),
                     budget=(float, "seconds; no model starts past them"))
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[64, 128])
    args = parser.parse_args(argv)
    if args.case:
        child(**args.case)
        return []
    cuda = torch.cuda.is_available()
    args.models = args.models or list(TINY_MODELS if args.tiny else MODELS)
    args.batch = args.batch or (256 if cuda else 8)
    auto = auto_precision(torch.device("cuda" if cuda else "cpu"))
    given = [p for item in args.precisions or ["auto", "32-true"] for p in item.split(",") if p]
    if bad := [p for p in given if p not in PRECISIONS]:
        parser.error(f"--precisions {bad[0]!r}: not a precision; expected some of {', '.join(PRECISIONS)} "
                     "(space- or comma-separated)")
    args.precisions = [auto.flag if p == "auto" else p for p in given]
    if why := unknown_model(args.models):
        parser.error(why)
    command = command_line("scripts.bench.default_speed", argv)
    header = (f"`{command}`: batch {args.batch}, {args.optimizer}, fits of {args.fit_steps} steps timed whole and in "
              f"their last {args.steps} steps, {args.rounds} round(s) (medians); amp=auto: {auto.flag} ({auto.reason})."
              f"\n\n{machine_line()}")
    records: list[dict[str, Any]] = []
    started = Stopwatch().start()
    for name in args.models:
        if args.budget is not None and started.elapsed() > args.budget:
            records += [{"model": name, "precision": p, "size": size, "error": "not run: --budget spent"}
                        for size in args.sizes for p in args.precisions]
            continue
        run = run_case("scripts.bench.default_speed", {"model": name, **{k: vars(args)[k] for k in (
            "batch", "sizes", "precisions", "fit_steps", "steps", "rounds", "optimizer")}}, timeout=args.timeout)
        why = run.failure()
        lines = [summarise(name, p, size, [f for f in run.results() if f["precision"] == p and f["size"] == size], why)
                 for size in args.sizes for p in args.precisions]
        records += lines
        for r in lines:
            print(records_table([r], "").splitlines()[-1], flush=True)
        write_report(args.out / "default_speed", markdown=records_table(records, header), data=records)
    print(records_table(records, header))
    return records


if __name__ == "__main__":
    main()
