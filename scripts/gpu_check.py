"""One command that proves and measures the GPU path, and writes the table for docs/performance.md (its parts and the
wheels it needs offline: docs/benchmarks.md#gpu-check).

    python -m scripts.gpu_check --out gpu-check              # a CUDA machine: about 8 minutes on one H100
    python -m scripts.gpu_check --wheels .whl --out $OUT     # the same, installing the app's wheels first
    python -m scripts.gpu_check --tiny --out /tmp/gpu-check  # any CPU, about a minute: checks the script works
    timeout 560 python -m scripts.gpu_check --mark --budget 520 --wheels .whl --out $OUT   # (device timeout_s 570)
    python -m scripts.gpu_check --tiny --mark --parts e2e --out /tmp/mark   # any CPU: every task at CI sizes
    python -m scripts.gpu_check --parts default --wheels .whl --out $OUT   # the default's race and check, 224 px
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from cltrain.data.demo import draw_demo_folder, write_once
from cltrain.timing.machine import machine, machine_line
from scripts.bench.default_speed import race_kept
from scripts.bench.mark import CONFIGS, MATRIX, SHORT, loader_splits, num, run_tasks, tasks
from scripts.harness import REPO, Stopwatch, command_line, options, run_child, table, write_report

COLUMNS = ("part", "configuration", "status", "precision", "img/s", "step (ms)", "finite losses", "host syncs/step",
           "notes")
CELLS = {"img_s": "img/s", "step_ms": "step (ms)", "finite": "finite losses", "syncs": "host syncs/step"}
E2E = "main_amp e2e"
FULL = {"classes": 10, "per_class": 512, "size": (500, 375), "warmup": 8, "steps": 60, "count": (3, 4),
        "overrides": [], "batch": 256,  # 20 batches of 256 an epoch
        "mark": {"synthetic": {"model": "resnet50", "batch": 256, "size": 224, "warmup": 3, "steps": 5, "rounds": 3},
                 "search": {"start": 256, "cap": 2048, "granularity": 256}, "loader": {"batches": 19, "rounds": 2}}}
TINY = {"classes": 2, "per_class": 6, "size": (64, 48), "warmup": 2, "steps": 1, "count": (1, 1),
        "overrides": ["model.name=resnet18", "data.batch_size=4", "data.image_size=32", "data.val_resize_size=36"],
        "batch": 4,
        "mark": {"synthetic": {"model": "resnet18", "batch": 4, "size": 32, "warmup": 1, "steps": 1, "rounds": 2},
                 "search": {"start": 4, "cap": 8, "granularity": 4}, "loader": {"batches": 2, "rounds": 2}}}
PARTS = ("tests", "newcomer", "e2e", "default")
#: Part (d): models whose layout the race decides at 224 px, the most contested first (docs/performance.md).
DEFAULT_MODELS = ("resnet50", "mobilenet_v3_large", "efficientnet_b0", "densenet121", "convnext_tiny", "ghostnet_100")
LAYOUT_DEFAULT = "layout default"
TINY_NEWCOMER = ["experiment=smoke", "data.demo.num_classes=2", "data.demo.train_per_class=8",
                 "data.demo.val_per_class=1", "data.demo.image_size=[64,48]"]


def row(part: str, configuration: str, status: str, **cells: Any) -> dict[str, str]:
    """A table row; ``cells`` by column, the numbers by the names in ``CELLS``."""
    return {**dict.fromkeys(COLUMNS, ""), "part": part, "configuration": configuration, "status": status,
            **{CELLS.get(k, k): "" if v is None else str(v) for k, v in cells.items()}}


def cuda_tests(limit: float, log: Path) -> dict[str, str]:
    shown = "`python -m pytest -m cuda tests/`"
    if not torch.cuda.is_available():
        return row("cuda tests", shown, "skipped: no CUDA")
    if importlib.util.find_spec("pytest") is None:
        return row("cuda tests", shown, "skipped: pytest is not installed")
    # -v: one line per test as it ends, so a run cut short by its limit still says which failed
    child = run_child([sys.executable, "-m", "pytest", "-m", "cuda", "tests/", "-v", "--tb=short", "-rfE", "-p",
                       "no:cacheprovider"], timeout=limit, log=log)
    text = child.output
    # one line per test: "path::name OUTCOME", or under pytest-xdist "[gw0] [ 1%] OUTCOME path::name"
    outcomes = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
    ended = re.findall(rf"^(\S+::\S+) ({outcomes})", text, re.MULTILINE) + [
        (name, outcome) for outcome, name in re.findall(rf"^\[gw\d+\] \[\s*\d+%\] ({outcomes}) (\S+::\S+)", text,
                                                          re.MULTILINE)]
    failed = [name.rpartition("::")[2] for name, outcome in ended if outcome in ("FAILED", "ERROR")]
    reasons = dict(re.findall(r"^(?:FAILED|ERROR) \S+::(\S+) - (.{0,160})", text, re.MULTILINE))
    notes = "; ".join([log.name] + [f"{n}: {reasons[n]}" if n in reasons else n for n in failed])
    if child.code is None:
        counts = Counter(outcome for _, outcome in ended)
        return row("cuda tests", shown, f"timed out after {limit:.0f} s with {counts['PASSED']} passed, "
                   f"{counts['FAILED']} failed, {counts['ERROR']} errors", notes=notes)
    summary = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", text.strip().splitlines()[-1])
    status = ("completed" if child.code == 0 else f"failed (exit {child.code})") + ": " + ", ".join(map(" ".join, summary))
    return row("cuda tests", shown, f"{status} in {child.seconds:.0f} s", notes=notes)


def newcomer(folder: Path, limit: float, log: Path, tiny: bool, out: Path) -> dict[str, str]:
    overrides = TINY_NEWCOMER if tiny else []
    shown = "`" + " ".join(["python train.py", *overrides]) + "`"
    folder.mkdir(parents=True)
    code = run_child([sys.executable, str(REPO / "train.py"), *overrides], timeout=limit, log=log, cwd=folder).code
    found = sorted(folder.glob("outputs/*/*/metrics.json"))
    if not found:
        return row("default train.py", shown, "timed out" if code is None else f"failed (exit {code})", notes=log.name)
    (out / "default_train.metrics.json").write_text(found[-1].read_text())
    m, losses = json.loads(found[-1].read_text()), []
    for path in found[-1].parent.glob("csv/**/metrics.csv"):
        with open(path) as f:
            losses += [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    return row("default train.py", shown, m["status"] if code == 0 else f"{m['status']} (exit {code})",
               precision=m["precision"], img_s=num(m.get("images_per_second")),
               step_ms=num(m.get("step_time_s"), 1000), finite=f"{sum(map(math.isfinite, losses))}/{len(losses)} logged",
               notes=f"{m['device']}, {m['layout']}, {m['global_step']} steps, val top-1 {m.get('val_top1')}%; "
                     f"{m['precision_reason']}")


def layout_default(limit: float, log: Path, out: Path, tiny: bool) -> list[dict[str, str]]:
    """Part (d): ``ChannelsLast()`` at its defaults against both layouts pinned, a model per process
    (``scripts.bench.default_speed``, batch 256 at 224 px in amp=auto's precision): a row per model."""
    timeout = 30 if tiny else 120  # one model's process; none starts where it could not end within ``limit``
    sizes = ["--tiny"] if tiny else ["--models", ",".join(DEFAULT_MODELS), "--sizes", "224", "--precisions", "auto",
                                     "--fit-steps", "60", "--steps", "20"]
    child = run_child([sys.executable, "-m", "scripts.bench.default_speed", *sizes, "--timeout", str(timeout),
                       "--budget", f"{max(limit - timeout - 10, 1):.0f}", "--out", str(out / "default_speed")],
                      timeout=limit, log=log)
    found = out / "default_speed" / "default_speed.json"
    records = json.loads(found.read_text()) if found.exists() else []
    if not records:
        return [row(LAYOUT_DEFAULT, "`scripts.bench.default_speed`",
                    "timed out" if child.code is None else f"failed (exit {child.code})", notes=log.name)]
    rows = []
    for r in records:
        shown = f"`{r['model']}` {r['size']} px"
        if "error" in r:
            rows.append(row(LAYOUT_DEFAULT, shown, r["error"][:160], precision=r["precision"], notes=log.name))
            continue
        step = r["default_step_s"]
        rows.append(row(LAYOUT_DEFAULT, shown, "completed", precision=r["precision"], step_ms=num(step, 1000), notes=(
                            f"race: {race_kept(r)}; NCHW {1000 * r['nchw_step_s']:.1f} ms, CL "
                            f"{1000 * r['channels_last_step_s']:.1f} ms; check {r['verdict']}, {r['check_s']:.2f} s "
                            f"({r['check_s'] / step:.1f} steps); default_speed/default_speed.md")))
    return rows


def e2e(work: Path, root: Path, limit: float, log: Path, size: dict, out: Path, tiny: bool,
        header: dict[str, str] | None, only: list[str] | None = None) -> list[dict[str, str]]:
    """Part (c) in one worker under ``limit``: the ``MATRIX`` configurations, or with ``header`` (``--mark``) the
    mark's tasks (``only``: by kind or name); a row per matrix configuration, and with ``--mark`` one for mark.md."""
    runs = work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    workers = 0 if tiny else max(1, min(16, (os.cpu_count() or 2) - 2))
    chosen = [t for t in tasks(tiny, matrix=header is None) if not only or t["kind"] in only or t.get("name") in only]
    spec = {**size["mark"], "runs": str(runs), "count": size["count"], "out": str(out),
            "tiny": tiny, "tasks": chosen, "deadline": time.time() + limit - 5, "needs_scale": 0 if tiny or not header else 1,
            "warmup": size["warmup"], "steps": size["steps"], "device": "cuda" if torch.cuda.is_available() else "cpu",
            "batch": size["batch"], "header": header, "common": [
                "experiment=main_amp", f"data.root={root}", f"data.num_workers={workers}", *size["overrides"],
                f"++trainer.max_steps={size['warmup'] + size['steps']}", "trainer.max_epochs=-1",
                "trainer.limit_val_batches=0", "print_freq=20", f"throughput_warmup={size['warmup']}"]}
    spec["loader"] = {**spec["loader"], "splits": loader_splits(workers, tiny)}
    (work / "e2e.json").write_text(json.dumps(spec, indent=1))
    worker = run_child([sys.executable, "-m", "scripts.gpu_check", "--worker", str(work / "e2e.json")], timeout=limit,
                       log=log)
    code, records = worker.code, worker.results()
    # every run's metrics.json beside the table, in one file: the device tool's eight returned files keep room
    lines = [json.dumps({"run": p.parent.name, **json.loads(p.read_text())}) for p in sorted(runs.glob("*/metrics.json"))]
    if lines:
        (out / "runs.metrics.jsonl").write_text("\n".join(lines) + "\n")
    ran = lambda r: r.get("status") in ("completed", "failed")  # noqa: E731
    first: dict[str, dict] = {}  # a configuration's first run that ran, else its first record (skipped, not run)
    for r in (r for r in records if r["kind"] == "e2e"):
        if r["name"] not in first or ran(r) and not ran(first[r["name"]]):
            first[r["name"]] = r
    names = {t.get("name") for t in chosen}
    why = f"time limit ({limit:.0f} s) reached" if code is None else f"the worker exited with {code}"
    rows = []
    for name in MATRIX:
        shown, r = "`" + " ".join(CONFIGS[name]) + "`", first.get(name)
        if r is None:
            rows.append(row(E2E, shown, f"not run: {why}" if name in names else "skipped: --mark-only",
                            notes=log.name if name in names else ""))
            continue
        # channels_last against contiguous, compile against eager
        short = SHORT.get(r.get("precision"))
        base, what = (f"channels_last {short}", "eager") if "compile" in name else (f"contiguous {short}", "contiguous")
        theirs = first.get(base, {}).get("images_per_second") if name.startswith("channels_last") else None
        notes = [f"{r['images_per_second'] / theirs:.2f}x {what}"] if theirs and r.get("images_per_second") else []
        notes += [f"{r['error']} ({log.name})"] if r.get("error") else []
        notes += ["TF32"] if r.get("precision") == "32-true" and r.get("tf32") and r.get("device") == "cuda" else []
        notes += [f"{op} x{n}" for op, n in r.get("sync_ops", {}).items()]
        rows.append(row(E2E, shown, r["status"], precision=r.get("precision"), img_s=num(r.get("images_per_second")),
                        step_ms=num(r.get("step_time_s"), 1000), finite=f"{r['finite']}/{r['steps']}" if "steps" in r
                        else None, syncs=f"{sum(r['sync_ops'].values()) / r['counted']:g}" if r.get("counted") else None,
                        notes="; ".join(notes)))
    if header is None:
        return rows
    done = sum(r.get("status") == "completed" for r in records)
    status = (f"timed out after {limit:.0f} s" if code is None else "completed" if code == 0
              else f"failed (exit {code})") + f": {done} of {len(chosen)} tasks completed"
    return [*rows, row("mark", "`--mark`", status, notes=f"mark.md; {log.name}")]


def install_wheels(folder: Path, target: Path) -> None:
    """``pip install --no-index --no-deps --target`` of every wheel in ``folder``; the target goes first on the paths."""
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"gpu_check: --wheels {folder}: no .whl files there")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade", "--target",
                    str(target), *wheels], check=True)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))


def main(argv: list[str] | None = None) -> int:
    parser = options(__doc__, out=(Path("gpu-check"), "gpu_check.md, metrics.json files, logs"),
                     tiny=(False, "tiny sizes: checks the script on any CPU"),
                     mark=(False, "(c) runs scripts/bench/mark.py's tasks: OUT/mark.md"),
                     work=(Path, "data and runs (default: a temporary folder)"),
                     wheels=(Path, "install these wheels first (docs/benchmarks.md#gpu-check)"),
                     budget=(float, "seconds for the whole command; each part gets at most what is left, less 15 s "
                                    "to write the tables"), worker=(Path, argparse.SUPPRESS))
    parser.add_argument("--mark-only", nargs="+", default=None, metavar="TASK",
                        help="with --mark: only these tasks, by kind (amp, loader, largest_batch, e2e) or by "
                             "configuration")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS[:3]),
                        help="which parts run: (a) tests, (b) newcomer, (c) e2e (the matrix, or --mark), (d) "
                             "default (the layout race and check at 224 px; not run unless named)")
    parser.add_argument("--limits", type=float, nargs=3, default=None, metavar=("A", "B", "C"),
                        help="seconds for (a) the cuda tests, (b) the default train.py, (c) the matrix or the mark "
                             "(default 180 100 220; with --mark 150 90 and (c) what the budget leaves)")
    args = parser.parse_args(argv)
    if args.worker:
        return run_tasks(args.worker)
    started, command = Stopwatch().start(), command_line("scripts.gpu_check", argv)
    budget = args.budget if args.budget is not None else math.inf
    args.out.mkdir(parents=True, exist_ok=True)
    size = TINY if args.tiny else FULL
    if args.mark and not args.tiny:
        size = {**size, "per_class": 1024}  # 40 batches of 256 an epoch, 5 of 2,048 at the largest batches tried
    limits = [*(args.limits or ([150, 90, math.inf] if args.mark else [180, 100, 220])), 300]
    with tempfile.TemporaryDirectory(prefix="cltrain-gpu-check-") as tmp:
        work = args.work or Path(tmp)
        if args.wheels:
            install_wheels(args.wheels, work / "site")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))
        if importlib.util.find_spec("cltrain.conf") is None:  # a source tree, not installed
            os.environ.setdefault("CLTRAIN_CONFIG_DIR", str(REPO / "conf"))
        with Stopwatch() as drawing:
            c, n, wh = size["classes"], size["per_class"], size["size"]  # n train images a class, 1 val
            root = write_once(work / f"jpegs-{c}x{n}", {"classes": c, "per_class": n, "size": list(wh)}, lambda tmp:
                              draw_demo_folder(tmp, c, n, 1, wh, workers=os.cpu_count() or 1), "gpu_check")  # no CUDA
        data = f"{c * n:,} + {c} JPEGs of {wh[0]}x{wh[1]} drawn by cltrain.data.demo in {drawing.seconds:.0f} s"
        stamp = work / time.strftime("%Y%m%d-%H%M%S")
        m = machine()
        gpu = (m.get("gpu") or {}).get("name", "no CUDA device")
        header = {"gpu": gpu, "machine": machine_line(m), "command": command} if args.mark else None
        parts = {
            "tests": ("cuda tests", lambda limit: [cuda_tests(limit, args.out / "cuda_tests.log")]),
            "newcomer": ("default train.py", lambda limit: [
                newcomer(stamp / "newcomer", limit, args.out / "default_train.log", args.tiny, args.out)]),
            "e2e": (E2E, lambda limit: e2e(stamp, root, limit, args.out / ("mark.log" if args.mark else "matrix.log"),
                                           size, args.out, args.tiny, header, args.mark_only)),
            "default": (LAYOUT_DEFAULT, lambda limit: layout_default(limit, args.out / "default_speed.log", args.out,
                                                                     args.tiny)),
        }
        rows: list[dict[str, str]] = []
        for (name, (label, run)), wanted in zip(parts.items(), limits):
            limit = min(wanted, budget - started.elapsed() - 15)
            if name not in args.parts:
                if name != "default":  # (d) runs only where named
                    rows.append(row(label, "", "skipped: --parts"))
            elif limit < 10:
                rows.append(row(label, "", "not run: less than 10 s of --budget left"))
            else:
                rows += run(limit)
                print(f"gpu_check: {label}: {rows[-1]['status']} ({started.elapsed():.0f} s)", flush=True)
            text = table(COLUMNS, [[r[c] for c in COLUMNS] for r in [
                row("machine", gpu, "", notes=machine_line(m)),
                row("command", f"`{command}`", f"finished in {started.elapsed():.0f} s",
                    notes=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
                row("data", data, ""), *rows]], align="".join("r" if c in CELLS.values() else "l" for c in COLUMNS))
            write_report(args.out / "gpu_check", markdown=text + "\n")  # after every part: a run cut short keeps it
    print(text)
    return 1 if any(r["status"].startswith(("failed", "timed out", "not run")) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
