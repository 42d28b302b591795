"""Which real models train correctly, and faster, under ``ChannelsLast``: timm, torchvision and Hugging Face models
(``scripts/zoo/models.py``), each in its own process (what that process measures: ``scripts/zoo/sweep_child.py``);
here the sweep around them: which models, resuming, the pages. The method: docs/benchmarks.md#zoo-sweep.

    python -m scripts.zoo.sweep                            # the whole zoo -> docs/zoo.md, docs/zoo.json, docs/zoo.csv
    python -m scripts.zoo.sweep --resume                   # go on after an interruption (rows already in the JSON kept)
    python -m scripts.zoo.sweep --fast --out /tmp/zoo      # one model per special case, small and quick
    python -m scripts.zoo.sweep --models resnet50,hf:swin --out /tmp/zoo
    python -m scripts.zoo.sweep --list
    python -m scripts.zoo.sweep --check-only --max-params 30 --out /tmp/zoo_check   # ChannelsLast()'s first-batch check
    python -m scripts.zoo.sweep --check-only --families --batch 4 --confirm-passes smp:,tv-video: --out /tmp/zoo_check
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any

from cltrain.timing.machine import machine, machine_line
from cltrain.timing.report import command_line
from scripts.harness import options, python_module, run_child
from scripts.zoo.confirm import settle_confirmation
from scripts.zoo.models import FAMILY_SUBSET, OPTIMIZER_NAMES, OPTIMIZERS, TASK_SPECS, Spec, all_specs, find
from scripts.zoo.pages import check_summary, load, now, record, sweep_summary, write_page
from scripts.zoo.sweep_child import child

# One RepVGG-style stem stands for the three (tests/core/test_guardrails.py trains all three with parity).
FAST = ["timm:repvgg_a0", "timm:resnet26d", "timm:vit_tiny_patch16_224", "tv:googlenet", "hf:resnet_small"]


def run_one(spec: Spec, args: argparse.Namespace, optimizer: str | None = None) -> dict[str, Any]:
    """One model in a subprocess (with ``optimizer``: its ``--check-only`` run with that optimizer), given this
    sweep's own arguments; a crash, a raise or a timeout comes back as the row's ``status``."""
    log = args.log_dir / f"{spec.key.replace(':', '_')}{'_' + optimizer if optimizer else ''}.log"
    timeout = args.timeout * (3 if spec.compile and not (args.no_compile or args.check_only) else 1)  # 4 compiles
    child_run = run_child(python_module("scripts.zoo.sweep", *args.argv, "--child", spec.key,
                                        *(["--optimizer", optimizer] if optimizer else [])), log=log, timeout=timeout)
    result = (child_run.results() or [{"key": spec.key, "family": spec.family}])[-1]
    result["seconds"] = round(child_run.seconds, 1)
    if optimizer:
        result["optimizer"] = optimizer
    phase, code = result.get("phase", "start"), child_run.code
    if code == 0 and phase == "done":
        result["status"] = "skipped" if "skipped" in result else "ok"
    elif code is None or code < 0:  # the time limit or a native crash
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
        fast=({"quick": True, "no_speed": True}, f"the quick subset: {', '.join(FAST)} (--quick, --no-speed)"),
        quick=({"rounds": 1, "min_window": 0.0, "no_compile": True},
               "speed timed on the parity batch, 1 round, no compile"),
        list=(False, "print the zoo and exit"),
        out=(Path("docs/zoo"), "output stem: <out>.md, .json, .csv"),
        log_dir=(Path("bench_out/zoo/logs"), "one log per model"),
        resume=(False, "keep the rows already in <out>.json and run the others"),
        timeout=(1200, "seconds per model, 3x with torch.compile (default 1200)"),
        batch=(2, "parity (and --check-only) batch size (default 2)"),
        speed_batch=(8, "speed batch size (default 8)"), rounds=(5, "interleaved timing rounds per layout (default 5)"),
        min_window=(0.5, "seconds per timed round, at least (default 0.5)"),
        max_params=(150.0, "skip models larger than this, millions (150)"),
        no_speed=(False, "do not time training steps (else fp32, and bf16 where the CPU has it natively)"),
        no_compile=(False, "do not run the torch.compile rows"),
        check_only=(False, "only the ChannelsLast run and its first-batch layout check: <out>.json and a verdict "
                           "count"),
        optimizers=(",".join(OPTIMIZERS), f"--check-only: each model checked once per optimizer, each in its own "
                                          f"process (default {','.join(OPTIMIZERS)})"),
        confirm_passes=("", "--check-only: also confirm the passes of models whose key starts with one of these "
                            "comma-separated prefixes (smp:,tv-video:), or 'all' (fallbacks are always confirmed)"),
        confirm_steps=(4, "--check-only: steps of each confirmation run (4)"),
        optimizer=("sgd", "(a model's process: its optimizer)"), child=("", "(a model's process: its key)"),
        size=(int, "every model's input size, pixels (tiny runs for the tests); default each model's own"))
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what each model's process is given, its key added
    unknown = [o for o in args.optimizers.split(",") if o not in OPTIMIZERS]
    if unknown or not args.optimizers:
        p.error(f"--optimizers {args.optimizers!r}: each of {', '.join(OPTIMIZERS)}, comma-separated")
    if args.confirm_steps < 1:
        p.error(f"--confirm-steps {args.confirm_steps}: at least 1")
    if args.fast:
        args.models = args.models or ",".join(FAST)
    return args


def recorded_args(command: str) -> argparse.Namespace:
    """The arguments of a recorded sweep, ``<out>.json``'s ``command`` (``python -m scripts.zoo.sweep ...``): what
    its page is rendered with again."""
    return parse_args(shlex.split(command)[3:])


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
    args.log_dir.mkdir(parents=True, exist_ok=True)
    optimizers = args.optimizers.split(",") if args.check_only else [None]
    order = {s.key: i for i, s in enumerate(specs)}
    rank = {o: i for i, o in enumerate(optimizers)}  # rows of an optimizer not swept this time (--resume) last
    rows = {(r["key"], r.get("optimizer", optimizers[0])): r for r in previous.get("rows", []) if r["key"] in order}

    def ordered() -> list[dict[str, Any]]:
        return [rows[k] for k in sorted(rows, key=lambda k: (order[k[0]], rank.get(k[1], len(rank))))]

    for spec, optimizer in ((s, o) for s in specs for o in optimizers if (s.key, o) not in rows):
        result = rows[spec.key, optimizer] = run_one(spec, args, optimizer)
        if optimizer and result["status"] == "skipped":  # built once: its row stands for every optimizer
            rows.update({(spec.key, o): dict(result, optimizer=o) for o in optimizers if (spec.key, o) not in rows})
        confirmed = (result.get("confirm") or {}).get("verdict")
        said = (f" {OPTIMIZER_NAMES[optimizer]}: {result['status']} {result.get('layout_check', '')}"
                f"{f' ({confirmed})' if confirmed else ''}" if optimizer
                else f": {result['status']} {(result.get('grad') or {}).get('verdict', '')}")
        print(f"[{len(rows)}/{len(specs) * len(optimizers)}] {spec.key}{said} {result['seconds']}s", flush=True)
        m["load_end"], m["ended"] = load(), now()
        write_page(args.out, {"command": command, "machine": m, "optimizers": optimizers, "rows": ordered()}
                   if args.check_only else {"machine": m, "command": command, "rows": ordered()}, args)
    print("\n".join(check_summary(ordered(), optimizers) if args.check_only else sweep_summary(ordered())))
    print(f"wrote {args.out.with_suffix('.md')}, .json" + ("" if args.check_only else ", .csv"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
