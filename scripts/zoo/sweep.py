"""Which real models train correctly, and faster, under ``ChannelsLast``: timm, torchvision and Hugging Face models
(``scripts/zoo/models.py``), each in its own process. The method: docs/benchmarks.md#zoo-sweep.

    python -m scripts.zoo.sweep                            # the whole zoo -> docs/zoo.md, docs/zoo.json, docs/zoo.csv
    python -m scripts.zoo.sweep --resume                   # go on after an interruption (rows already in the JSON kept)
    python -m scripts.zoo.sweep --fast --out /tmp/zoo      # one model per special case, small and quick (the test suite's)
    python -m scripts.zoo.sweep --models resnet50,hf:swin --out /tmp/zoo
    python -m scripts.zoo.sweep --list
    python -m scripts.zoo.sweep --check-only --max-params 30 --out /tmp/zoo_check   # ChannelsLast()'s first-batch check
    python -m scripts.zoo.sweep --check-only --families --batch 4 --confirm-passes smp:,tv-video: --out /tmp/zoo_check
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import torch

from cltrain.platform import cpu_bf16_support
from cltrain.timing.clock import Stopwatch
from cltrain.timing.machine import machine, machine_line
from cltrain.timing.report import command_line
from cltrain.timing.rounds import time_steps
from cltrain.timing.steps import training_step
from scripts.harness import emit, options, python_module, run_child
from scripts.zoo.confirm import check_child, record_check, settle_confirmation
from scripts.zoo.models import (
    FAMILY_SUBSET, Spec, all_specs, batch_to, build, clone_batch, conv_weights_cl, find, image_of, make_batch,
    quiet_random_layers, training_loss,
)
from scripts.zoo.check_page import check_summary, write_check
from scripts.zoo.pages import load, now, record
from scripts.zoo.sweep_page import sweep_summary, write_sweep
from scripts.zoo.parity import parity
from scripts.zoo.tasks import SPECS as TASK_SPECS
from scripts.zoo.training import OPTIMIZER_NAMES, OPTIMIZERS, fit, grads_of

# One RepVGG-style stem stands for the three (tests/core/test_guardrails.py trains all three with parity).
FAST = ["timm:repvgg_a0", "timm:resnet26d", "timm:vit_tiny_patch16_224", "tv:googlenet", "hf:resnet_small"]


def _step_grads(net: torch.nn.Module, spec: Spec, batch: Any) -> tuple[dict[str, torch.Tensor | None], float]:
    torch.manual_seed(0)  # as ``fit`` does: a detector's samplers draw from the global RNG
    loss = training_loss(net, batch, spec)
    loss.backward()
    grads = grads_of(net)
    net.zero_grad(set_to_none=True)
    return grads, float(loss)


# ---- one model, in the child process ------------------------------------------------------------


def _time_training(runs: dict[str, tuple[torch.nn.Module, Any]], spec: Spec, dtype: torch.dtype | None,
                   rounds: int, min_window: float, warmup: int = 3) -> dict[str, float]:
    """Median training steps/s of each ``(net, batch)``, interleaved rounds filling ``min_window``; ``warmup``
    untimed steps first (oneDNN primitives, allocator pools)."""
    steps = {key: training_step(net, lambda net=net, batch=batch: training_loss(net, batch, spec),
                                optimizer=torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9), autocast_dtype=dtype)
             for key, (net, batch) in runs.items()}
    timing = time_steps(steps, rounds=rounds, warmup=warmup, min_window=min_window, max_steps=100_000)
    return {key: s.median for key, s in timing.rates().items()}


def _speed_runs(nets: dict[str, torch.nn.Module], batch: Any, dtype: torch.dtype | None):
    """Each layout's net with its own copy of ``batch`` (in ``dtype``), the channels_last one converted."""
    from cltrain.loops import convert_batch

    cast = batch_to(batch, dtype) if dtype is not None else batch
    return {"contiguous": (nets["contiguous"], clone_batch(cast)),
            "channels_last": (nets["channels_last"], convert_batch(clone_batch(cast)))}


def _compile_phase(spec: Spec, net0: torch.nn.Module, batches: list[Any], speed_batch: Any,
                   exact: dict[str, tuple[dict, float]], dtypes: list[tuple[str, torch.dtype | None]],
                   args: argparse.Namespace, result: dict) -> None:
    """Parity and speed of ``torch.compile``-d copies, NCHW and converted by ``cltrain.loops.convert_model``."""
    from cltrain.loops import convert_batch, convert_model

    nets, grads, losses = {}, {}, {}
    for layout in ("contiguous", "channels_last"):
        net = quiet_random_layers(copy.deepcopy(net0).train())
        if layout == "channels_last":
            convert_model(net)
        nets[layout] = torch.compile(net)
        batch = clone_batch(batches[0])
        with Stopwatch() as watch:
            batch = convert_batch(batch) if layout == "channels_last" else batch
            grads[layout], losses[layout] = _step_grads(nets[layout], spec, batch)
        result[f"compile_seconds_{layout}"] = round(watch.seconds, 1)
    for key, value in (exact or {}).items():
        grads[key], losses[key] = value
    parity(result, grads, losses, prefix="compile_")
    for label, dtype in dtypes:
        result[f"compile_speed_{label}"] = _time_training(_speed_runs(nets, speed_batch, dtype), spec, dtype,
                                                          args.rounds, args.min_window, warmup=4)


def child(spec: Spec, args: argparse.Namespace) -> dict[str, Any]:
    """Measure one model; its row is emitted after every phase (``scripts.harness.emit``), so a crash leaves what
    was done and the phase it died in. Returns the row."""
    import warnings

    from cltrain import ChannelsLast

    warnings.filterwarnings("ignore")
    result: dict[str, Any] = {"key": spec.key, "family": spec.family, "size": spec.size, "note": spec.note}
    clock = Stopwatch().start()

    def phase(name: str) -> dict[str, Any]:
        if "phase" in result:  # seconds spent in the phase that ends here
            result.setdefault("phase_seconds", {})[result["phase"]] = round(clock.elapsed(), 1)
        clock.start()
        result["phase"] = name
        emit(result)
        return result

    phase("build")
    torch.manual_seed(0)
    net0 = build(spec)
    result["params_m"] = round(sum(p.numel() for p in net0.parameters()) / 1e6, 1)
    if result["params_m"] > args.max_params:
        result["skipped"] = f"{result['params_m']:.0f}M parameters: over --max-params {args.max_params:g}M"
        return phase("done")
    gen = torch.Generator().manual_seed(0)
    batches = [make_batch(spec, args.batch, gen) for _ in range(max(2, args.confirm_steps if args.check_only else 2))]

    if args.check_only:
        check_child(spec, net0, batches, args, result, phase)
        return phase("done")

    phase("references")
    exact = _references(spec, net0, batches[0], result)
    grads: dict[str, dict] = {k: g for k, (g, _) in exact.items()}
    losses: dict[str, float] = {k: loss for k, (_, loss) in exact.items()}

    nets = {}
    # The kernels and the guardrails, without the first-batch check's fallbacks (``--check-only`` measures those).
    for layout, callback in (("contiguous", None), ("channels_last", ChannelsLast(layout="channels_last", verify=False))):
        phase(layout)
        module = fit(copy.deepcopy(net0), spec, batches, callback, max_steps=2)
        nets[layout] = module.train().net
        losses[layout] = float(module.losses[0])
        grads[layout] = module.step0_grads
        result[f"losses_{layout}"] = [float(v) for v in module.losses]
        result[f"trains_{layout}"] = len(module.losses) == 2 and all(math.isfinite(v) for v in result[f"losses_{layout}"])
        if callback is not None:
            result["conv_weights_cl"] = conv_weights_cl(module.net)
            result["guardrails"] = "; ".join(  # the known-fault workarounds the callback applied, in a few words
                f"{getattr(r, 'fault', r)} ({len(getattr(r, 'modules', ()))} modules)"
                for r in getattr(callback, "guardrails", None) or [])
            record_check(result, callback)
    parity(result, grads, losses)
    del grads, losses

    dtypes: list[tuple[str, torch.dtype | None]] = [("fp32", None)] if "fp32" in args.dtypes else []
    if "bf16" in args.dtypes and cpu_bf16_support()[0]:
        dtypes.append(("bf16", torch.bfloat16))
    speed_batch = batches[0] if args.quick else make_batch(spec, args.speed_batch, torch.Generator().manual_seed(1))
    for label, dtype in dtypes if not args.no_speed else []:
        phase(f"speed {label}")
        result[f"speed_{label}"] = _time_training(_speed_runs(nets, speed_batch, dtype), spec, dtype,
                                                  args.rounds, args.min_window)
    del nets

    image = image_of(speed_batch, spec)
    # the race of the layouts keys on one image tensor: not a detector's list, not a (B, T, C, H, W) stack
    if not args.no_auto and isinstance(image, torch.Tensor) and image.dim() == 4:
        for label, dtype in dtypes:
            phase(f"auto {label}")
            callback = ChannelsLast()
            fit(copy.deepcopy(net0), spec, batches, callback, max_steps=11,
                precision="32-true" if dtype is None else "bf16-mixed")
            result[f"auto_{label}"] = callback.decision.layout if callback.decision else callback.layout
            result[f"auto_{label}_ms"] = {k: round(v * 1e3, 1) for k, v in (callback.timings or {}).items()}

    if spec.compile and not args.no_compile:
        phase("compile")
        _compile_phase(spec, net0, batches, speed_batch, exact, dtypes, args, result)
    return phase("done")


def _references(spec: Spec, net0: torch.nn.Module, batch: Any, result: dict) -> dict[str, tuple[dict, float]]:
    """Step-0 gradients and loss of ``net0``: ``native``/``native_cl`` (fp32 without oneDNN) and ``float64``/
    ``float64_cl`` (none where float64 fails; why goes in ``result``)."""
    from cltrain.layout import to_channels_last
    from cltrain.loops import convert_batch

    cl = to_channels_last  # no guardrails: none of these runs reaches oneDNN
    refs = {}
    with torch.backends.mkldnn.flags(enabled=False):
        for key, layout in (("native", lambda n: n), ("native_cl", cl)):
            b = clone_batch(batch)
            refs[key] = _step_grads(layout(quiet_random_layers(copy.deepcopy(net0).train())), spec,
                                    convert_batch(b) if key.endswith("_cl") else b)
    try:
        for key, layout in (("float64", lambda n: n), ("float64_cl", cl)):
            b = batch_to(batch, torch.float64)
            refs[key] = _step_grads(layout(quiet_random_layers(copy.deepcopy(net0).double().train())), spec,
                                    convert_batch(b) if key.endswith("_cl") else b)
    except Exception as err:  # noqa: BLE001 - some models hard-code float32 somewhere: CL is compared with NCHW then
        result["float64_error"] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
        refs.pop("float64", None)
    return refs


# ---- the sweep, in the parent process -----------------------------------------------------------


def run_one(spec: Spec, args: argparse.Namespace, log_dir: Path, optimizer: str | None = None) -> dict[str, Any]:
    """One model in a subprocess (with ``optimizer``: its ``--check-only`` run with that optimizer), given this
    sweep's own arguments; a crash, a raise or a timeout comes back as the row's ``status``."""
    log = log_dir / f"{spec.key.replace(':', '_')}{'_' + optimizer if optimizer else ''}.log"
    timeout = args.timeout * (3 if spec.compile and not (args.no_compile or args.check_only) else 1)  # 4 compiles
    child_run = run_child(python_module("scripts.zoo.sweep", *args.argv, "--child", spec.key,
                                        *(["--optimizer", optimizer] if optimizer else [])), log=log, timeout=timeout)
    found = child_run.results()
    result = found[-1] if found else {"key": spec.key, "family": spec.family}
    result["seconds"] = round(child_run.seconds, 1)
    if optimizer:
        result["optimizer"] = optimizer
    phase, code = result.get("phase", "start"), child_run.code
    if code == 0 and phase == "done":
        result["status"] = "skipped" if "skipped" in result else "ok"
    elif code is None:
        result["status"] = f"timeout after {timeout}s in {phase}"
    elif code < 0:
        result["status"] = f"{child_run.status()} in {phase}"
    else:
        result["status"] = f"raised in {phase}: {child_run.last_error()}"
    settle_confirmation(result, phase, crashed=code is not None and code < 0)
    result["log"] = str(log)
    return result


# ---- command line -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = options(
        __doc__, models=("", "comma-separated keys (timm:resnet50) or names (resnet50); default all"),
        families=(False, "one classifier per family (scripts/zoo/models.py FAMILY_SUBSET) and every segmentation, "
                         "detection and video model, beside the models of --models"),
        fast=(False, f"the quick subset: {', '.join(FAST)} (--quick, --no-speed, fp32 only)"),
        quick=(False, "speed timed on the parity batch, 1 round, no compile"), list=(False, "print the zoo and exit"),
        out=(Path("docs/zoo"), "output stem: <out>.md, .json, .csv"),
        log_dir=(Path("bench_out/zoo/logs"), "one log per model"),
        resume=(False, "keep the rows already in <out>.json and run the others"),
        timeout=(1200, "seconds per model, 3x with torch.compile (default 1200)"),
        batch=(2, "parity (and --check-only) batch size (default 2)"),
        speed_batch=(8, "speed batch size (default 8)"), rounds=(5, "interleaved timing rounds per layout (default 5)"),
        min_window=(0.5, "seconds per timed round, at least (default 0.5)"),
        max_params=(150.0, "skip models larger than this, millions (150)"),
        dtypes=("fp32,bf16", "speed and auto in these (bf16 only where native; default fp32,bf16)"),
        no_speed=(False, "do not time training steps"), no_auto=(False, "do not run mode='auto'"),
        no_compile=(False, "do not run the torch.compile rows"),
        check_only=(False, "only the ChannelsLast run and its first-batch layout check: <out>.json and a verdict "
                           "count"),
        check_precision=("32-true", "the Trainer's precision for --check-only (bf16-mixed, ...)"),
        optimizers=(",".join(OPTIMIZERS), f"--check-only: each model checked once per optimizer, each in its own "
                                          f"process (default {','.join(OPTIMIZERS)})"),
        confirm_passes=("", "--check-only: also confirm the passes of models whose key starts with one of these "
                            "comma-separated prefixes (smp:,tv-video:), or 'all' (fallbacks are always confirmed)"),
        confirm_steps=(4, "--check-only: steps of each confirmation run (4)"),
        optimizer=("sgd", "(a model's process: its optimizer)"), child=("", "(a model's process: its key)"))
    p.add_argument("--size", type=int, default=None,
                   help="every model's input size, pixels (tiny runs for the tests); default each model's own")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what each model's process is given, its key added
    unknown = [o for o in args.optimizers.split(",") if o not in OPTIMIZERS]
    if unknown or not args.optimizers:
        p.error(f"--optimizers {args.optimizers!r}: each of {', '.join(OPTIMIZERS)}, comma-separated")
    if args.confirm_steps < 1:
        p.error(f"--confirm-steps {args.confirm_steps}: at least 1")
    if args.fast:
        args.quick, args.dtypes, args.no_speed = True, "fp32", True
        args.models = args.models or ",".join(FAST)
    if args.quick:
        args.rounds, args.min_window, args.no_compile = 1, 0.0, True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        spec = find([args.child])[0]
        child(dataclasses.replace(spec, size=args.size) if args.size else spec, args)
        return 0
    try:
        keys = (args.models.split(",") if args.models else []) + (FAMILY_SUBSET + [s.key for s in TASK_SPECS]
                                                                 if args.families else [])
        specs = find(keys) if keys else all_specs()
    except ValueError as err:
        print(f"zoo_sweep: error: {err}", file=sys.stderr)
        return 2
    if args.list:
        for s in specs:
            print(f"{s.key:40s} {s.family:26s} {s.size:4d}px {s.note}")
        return 0
    command = command_line("scripts.zoo.sweep", argv)
    m = machine()
    m["load_start"], m["started"] = load(), now()
    print(machine_line(m), flush=True)
    previous = record(args.out, args.resume)
    if previous:
        m["started"] = previous.get("machine", {}).get("started", m["started"])
        m["earlier_commands"] = previous.get("machine", {}).get("earlier_commands", []) + [previous["command"]]
        m["resumed"] = now()
    rows = [r for r in previous.get("rows", []) if r["key"] in {s.key for s in specs}]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    optimizers = args.optimizers.split(",") if args.check_only else [None]
    done = {(r["key"], r.get("optimizer", optimizers[0])) for r in rows}
    order = {s.key: i for i, s in enumerate(specs)}
    for spec, optimizer in ((s, o) for s in specs for o in optimizers if (s.key, o) not in done):
        result = run_one(spec, args, args.log_dir, optimizer)
        rows.append(result)
        done.add((spec.key, optimizer))
        if optimizer and result["status"] == "skipped":  # built once: its row stands for every optimizer
            for other in (o for o in optimizers if (spec.key, o) not in done):
                rows.append(dict(result, optimizer=other))
                done.add((spec.key, other))
        confirmed = (result.get("confirm") or {}).get("verdict")
        said = (f" {OPTIMIZER_NAMES[optimizer]}: {result['status']} {result.get('layout_check', '')}"
                f"{f' ({confirmed})' if confirmed else ''}" if optimizer
                else f": {result['status']} {(result.get('grad') or {}).get('verdict', '')}")
        print(f"[{len(done)}/{len(specs) * len(optimizers)}] {spec.key}{said} {result['seconds']}s", flush=True)
        m["load_end"], m["ended"] = load(), now()
        rows.sort(key=lambda r: (order.get(r["key"], len(order)), optimizers.index(r.get("optimizer", optimizers[0]))
                                 if r.get("optimizer", optimizers[0]) in optimizers else len(optimizers)))
        if args.check_only:
            write_check(args.out, rows, m, command, args, optimizers)
        else:
            write_sweep(args.out, rows, m, command, args)
    print("\n".join(check_summary(rows, optimizers) if args.check_only else sweep_summary(rows)))
    print(f"wrote {args.out.with_suffix('.md')}, .json" + ("" if args.check_only else ", .csv"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
