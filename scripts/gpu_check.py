"""One command that proves and measures the GPU path, and writes the table for docs/performance.md.

    python -m scripts.gpu_check --out gpu-check              # a CUDA machine: about 8 minutes on one H100
    python -m scripts.gpu_check --wheels .whl --out $OUT     # the same, installing the app's wheels first
    python -m scripts.gpu_check --tiny --out /tmp/gpu-check  # any CPU, about a minute: checks the script works

With ``--mark``, part (c) runs apex's recipe toward the MLPerf per-GPU rate (``scripts/bench/mark.py``: amp by
measurement, compiled fp16 and bf16, the largest batch, CUDA graphs, the loader, the step by kind), the matrix
among its runs; ``OUT/mark.md`` holds its tables. A lent GPU with 15 minutes runs everything in one call that
stops itself within ``--budget`` seconds and leaves minutes to rerun a part::

    timeout 560 python -m scripts.gpu_check --mark --budget 520 --wheels .whl --out $OUT   # (device timeout_s 570)
    python -m scripts.gpu_check --mark --parts e2e --mark-only largest_batch loader --budget 150 --wheels .whl \
        --out $OUT/rerun                                                                # a part again, by name
    python -m scripts.gpu_check --tiny --mark --parts e2e --out /tmp/mark   # any CPU: every task at CI sizes

Each part runs in its own subprocess under its own time limit (``--limits``, seconds; ``--budget`` caps each at
what is left of the whole; ``--parts`` picks them); ``gpu_check.md`` is written again after each part:

(a) ``python -m pytest -m cuda tests/``: the tests marked ``cuda`` (conftest.py pins every other test to the CPU).
(b) ``python train.py`` as a newcomer types it, in an empty folder: its ``metrics.json`` (status, precision,
    images/s, step time) and how many of the training losses its CSV log holds are finite.
(c) apex's main_amp recipe (``experiment=main_amp``: ResNet-50, batch 256, 224 px) end to end on 5,120 + 10
    ImageNet-size JPEGs drawn by ``cltrain.data.demo`` (10,240 + 10 with ``--mark``); channels_last and
    contiguous in fp16, bf16 and fp32, then channels_last with ``compile.enabled=true``, in one process, in turn:
    images/s and step time over 60 steps after 8 warm-up steps (train.py's meter), the finite losses among all
    steps, and host syncs per step: ATen ops that read a device value on the host
    (``cltrain.timing.host_syncs.SyncOps``) in warm-up steps 3-6, which neither print nor log.
(d) one Markdown table (the machine, the command, every figure) in OUT/gpu_check.md, also printed, with the
    runs' ``metrics.json`` files (one line each in ``runs.metrics.jsonl``) and logs (the cuda tests' with short
    tracebacks); data, checkpoints and run folders stay in ``--work``.

``--tiny``: 12 JPEGs of 64x48, ResNet-18 at 32 px, 3 steps per configuration, the smoke experiment for (b); what
needs CUDA, bf16 where the CPU lacks it, and compile are rows saying "skipped" and why.

Where hydra-core, omegaconf, antlr4-python3-runtime, simplejpeg and turbojpeg are missing, fetch their wheels
(CPython 3.12, x86-64 Linux; antlr4-python3-runtime 4.9.3 is an sdist only: ``pip wheel`` builds it)::

    pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl hydra-core==1.3.8 omegaconf==2.3.1
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl simplejpeg==1.9.0 turbojpeg==0.0.2
    pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3

``--wheels .whl`` then runs ``python -m pip install -q --no-index --no-deps --target <work>/site .whl/*.whl``
first and puts that folder first on ``sys.path`` and the subprocesses' ``PYTHONPATH`` (by hand: ``python3 -m pip
install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site``). Run from the
repository root, which needs no install: ``-m`` puts it on ``sys.path``, the subprocesses get it on ``PYTHONPATH``,
and its ``conf/`` becomes ``$CLTRAIN_CONFIG_DIR``.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import multiprocessing
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

from cltrain.timing.clock import Stopwatch
from cltrain.timing.machine import machine
from cltrain.timing.report import command_line, table
from scripts.bench.config_run import run_config, skip_reason
from scripts.harness import REPO, run_child

COLUMNS = ("part", "configuration", "status", "precision", "img/s", "step (ms)", "finite losses", "host syncs/step",
           "notes")
CELLS = {"img_s": "img/s", "step_ms": "step (ms)", "finite": "finite losses", "syncs": "host syncs/step"}
E2E, SHORT = "main_amp e2e", {"16-mixed": "fp16", "bf16-mixed": "bf16", "32-true": "fp32"}
#: (configuration, train.py overrides); compile last: the slowest to start, the first a time limit drops.
MATRIX = [(f"{layout} {name}", [f"channels_last={str(layout == 'channels_last').lower()}", f"amp={amp}"])
          for name, amp in (("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "false"))
          for layout in ("channels_last", "contiguous")]
MATRIX.append(("channels_last compile", ["channels_last=true", "amp=auto", "compile.enabled=true"]))
FULL = {"classes": 10, "per_class": 512, "size": (500, 375), "warmup": 8, "steps": 60, "count": (3, 4),
        "overrides": [], "batch": 256,  # 20 batches of 256 an epoch
        "mark": {"synthetic": {"model": "resnet50", "batch": 256, "size": 224, "warmup": 3, "steps": 5, "rounds": 3},
                 "search": {"start": 256, "cap": 2048, "granularity": 256}, "loader": {"batches": 19, "rounds": 2}}}
TINY = {"classes": 2, "per_class": 6, "size": (64, 48), "warmup": 2, "steps": 1, "count": (1, 1),
        "overrides": ["model.name=resnet18", "data.batch_size=4", "data.image_size=32", "data.val_resize_size=36"],
        "batch": 4,
        "mark": {"synthetic": {"model": "resnet18", "batch": 4, "size": 32, "warmup": 1, "steps": 1, "rounds": 2},
                 "search": {"start": 4, "cap": 8, "granularity": 4}, "loader": {"batches": 2, "rounds": 2}}}
PARTS = ("tests", "newcomer", "e2e")
TINY_NEWCOMER = ["experiment=smoke", "data.demo.num_classes=2", "data.demo.train_per_class=8",
                 "data.demo.val_per_class=1", "data.demo.image_size=[64,48]"]


def run_matrix(spec_file: Path) -> int:
    """Part (c)'s worker: each configuration of the spec through ``run_config``, one JSON line each."""
    spec = json.loads(spec_file.read_text())
    for name, overrides in spec["configs"]:
        record = run_config(spec, name, overrides, re.sub(r"\W+", "-", name))
        with open(spec["results"], "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
    return 0


def _draw(job: tuple[str, int, list[int], tuple[int, int]]) -> None:
    import numpy as np

    from cltrain.data.demo import draw_demo_image

    path, k, seed, size = job
    rng = np.random.default_rng(seed)
    draw_demo_image(k, rng, size).save(path, quality=int(rng.integers(75, 96)))


def jpeg_folder(root: Path, classes: int, per_class: int, size: tuple[int, int]) -> Path:
    """An ImageNet-layout folder of ``cltrain.data.demo``'s images (``per_class`` train, 1 val), drawn on every core."""
    from cltrain.data.demo import class_names, write_once

    def fill(tmp: Path) -> None:
        jobs = []
        for s, (split, n) in enumerate((("train", per_class), ("val", 1))):
            for k, name in enumerate(class_names(classes)):
                (tmp / split / name).mkdir(parents=True)
                jobs += [(str(tmp / split / name / f"{i:05d}.jpg"), k, [0, s, k, i], size) for i in range(n)]
        with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:  # they draw, they never touch CUDA
            pool.map(_draw, jobs, chunksize=16)

    return write_once(root, {"classes": classes, "per_class": per_class, "size": list(size)}, fill, "gpu_check")


def run_part(cmd: list[str], cwd: Path, limit: float, log: Path) -> int | None:
    """``cmd``'s exit status, its output in ``log``; ``None`` when it ran past ``limit`` (its process group is killed)."""
    return run_child(cmd, timeout=limit, log=log, cwd=cwd).code


def row(part: str, configuration: str, status: str, **cells: Any) -> dict[str, str]:
    """A table row; ``cells`` by column, the numbers by the names in ``CELLS``."""
    return {**dict.fromkeys(COLUMNS, ""), "part": part, "configuration": configuration, "status": status,
            **{CELLS.get(k, k): "" if v is None else str(v) for k, v in cells.items()}}


def _num(v: float | None, scale: float = 1) -> str:
    return "" if v is None else f"{scale * v:,.1f}"


def cuda_tests(limit: float, log: Path) -> dict[str, str]:
    shown = "`python -m pytest -m cuda tests/`"
    if not torch.cuda.is_available():
        return row("cuda tests", shown, "skipped: no CUDA")
    if importlib.util.find_spec("pytest") is None:
        return row("cuda tests", shown, "skipped: pytest is not installed")
    watch = Stopwatch().start()
    # -v: one line per test as it ends, so a run cut short by its limit still says which failed
    code = run_part([sys.executable, "-m", "pytest", "-m", "cuda", "tests/", "-v", "--tb=short", "-rfE", "-p",
                     "no:cacheprovider"], REPO, limit, log)
    text = log.read_text(errors="replace")
    # one line per test: "path::name OUTCOME", or under pytest-xdist "[gw0] [ 1%] OUTCOME path::name"
    outcomes = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
    ended = re.findall(rf"^(\S+::\S+) ({outcomes})", text, re.MULTILINE) + [
        (name, outcome) for outcome, name in re.findall(rf"^\[gw\d+\] \[\s*\d+%\] ({outcomes}) (\S+::\S+)", text,
                                                          re.MULTILINE)]
    failed = [name.rpartition("::")[2] for name, outcome in ended if outcome in ("FAILED", "ERROR")]
    reasons = dict(re.findall(r"^(?:FAILED|ERROR) \S+::(\S+) - (.{0,160})", text, re.MULTILINE))
    notes = "; ".join([log.name] + [f"{n}: {reasons[n]}" if n in reasons else n for n in failed])
    if code is None:
        counts = Counter(outcome for _, outcome in ended)
        return row("cuda tests", shown, f"timed out after {limit:.0f} s with {counts['PASSED']} passed, "
                   f"{counts['FAILED']} failed, {counts['ERROR']} errors", notes=notes)
    summary = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)", text.strip().splitlines()[-1])
    status = ("completed" if code == 0 else f"failed (exit {code})") + ": " + ", ".join(map(" ".join, summary))
    return row("cuda tests", shown, f"{status} in {watch.elapsed():.0f} s", notes=notes)


def newcomer(folder: Path, limit: float, log: Path, tiny: bool, out: Path) -> dict[str, str]:
    overrides = TINY_NEWCOMER if tiny else []
    shown = "`" + " ".join(["python train.py", *overrides]) + "`"
    folder.mkdir(parents=True)
    code = run_part([sys.executable, str(REPO / "train.py"), *overrides], folder, limit, log)
    found = sorted(folder.glob("outputs/*/*/metrics.json"))
    if not found:
        return row("default train.py", shown, "timed out" if code is None else f"failed (exit {code})", notes=log.name)
    (out / "default_train.metrics.json").write_text(found[-1].read_text())
    m, losses = json.loads(found[-1].read_text()), []
    for path in found[-1].parent.glob("csv/**/metrics.csv"):
        with open(path) as f:
            losses += [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    return row("default train.py", shown, m["status"] if code == 0 else f"{m['status']} (exit {code})",
               precision=m["precision"], img_s=_num(m.get("images_per_second")),
               step_ms=_num(m.get("step_time_s"), 1000), finite=f"{sum(map(math.isfinite, losses))}/{len(losses)} logged",
               notes=f"{m['device']}, {m['layout']}, {m['global_step']} steps, val top-1 {m.get('val_top1')}%; "
                     f"{m['precision_reason']}")


def e2e_spec(work: Path, root: Path, size: dict, tiny: bool) -> dict:
    """What every end-to-end run shares: the recipe on ``root``, its sizes, where runs and results go."""
    runs = work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    workers = 0 if tiny else max(1, min(16, (os.cpu_count() or 2) - 2))
    return {"runs": str(runs), "count": size["count"], "common": [
        "experiment=main_amp", f"data.root={root}", f"data.num_workers={workers}", *size["overrides"],
        f"++trainer.max_steps={size['warmup'] + size['steps']}", "trainer.max_epochs=-1",
        "trainer.limit_val_batches=0", "print_freq=20", f"throughput_warmup={size['warmup']}"]}


def matrix(work: Path, root: Path, limit: float, log: Path, size: dict, out: Path, tiny: bool) -> list[dict[str, str]]:
    results = work / "matrix.jsonl"
    skips = {name: skip_reason(o, tiny) for name, o in MATRIX}
    spec = {**e2e_spec(work, root, size, tiny), "configs": [(n, o) for n, o in MATRIX if not skips[n]],
            "results": str(results)}
    (work / "matrix.json").write_text(json.dumps(spec, indent=1))
    code = run_part([sys.executable, "-m", "scripts.gpu_check", "--worker", str(work / "matrix.json")], REPO, limit,
                    log) if spec["configs"] else 0
    done = {r["name"]: r for r in map(json.loads, results.read_text().splitlines())} if results.is_file() else {}
    copy_metrics(Path(spec["runs"]), out)
    return matrix_rows(done, skips, code, limit, log)


def mark_part(work: Path, root: Path, limit: float, log: Path, size: dict, out: Path, tiny: bool,
              header: dict[str, str], only: list[str] | None = None) -> list[dict[str, str]]:
    """Part (c) with ``--mark``: ``scripts.bench.mark``'s tasks (those whose kind or configuration ``only`` names,
    when given) in one worker under ``limit``, the matrix's configurations among them; the matrix's rows from
    their first runs, and a row for ``OUT/mark.md``."""
    from scripts.bench.mark import loader_splits, tasks

    results, base = work / "mark.jsonl", e2e_spec(work, root, size, tiny)
    chosen = [t for t in tasks(tiny) if not only or t["kind"] in only or t.get("name") in only]
    run_workers = int(next(o for o in base["common"] if o.startswith("data.num_workers=")).split("=")[1])
    spec = {**base, **size["mark"], "results": str(results), "out": str(out), "tiny": tiny, "tasks": chosen,
            "deadline": time.time() + limit - 5, "needs_scale": 0 if tiny else 1, "warmup": size["warmup"],
            "steps": size["steps"],
            "device": "cuda" if torch.cuda.is_available() else "cpu", "batch": size["batch"], "header": header}
    spec["loader"] = {**spec["loader"], "splits": loader_splits(run_workers, tiny)}
    (work / "mark.json").write_text(json.dumps(spec, indent=1))
    code = run_part([sys.executable, "-m", "scripts.gpu_check", "--mark-worker", str(work / "mark.json")], REPO, limit,
                    log)
    records = list(map(json.loads, results.read_text().splitlines())) if results.is_file() else []
    copy_metrics(Path(spec["runs"]), out)
    first: dict[str, dict] = {}
    for r in records:
        if r["kind"] == "e2e" and r.get("status") in ("completed", "failed"):
            first.setdefault(r["name"], r)
    done = sum(r.get("status") == "completed" for r in records)
    status = (f"timed out after {limit:.0f} s" if code is None else "completed" if code == 0
              else f"failed (exit {code})") + f": {done} of {len(spec['tasks'])} tasks completed"
    names = {t.get("name") for t in chosen}
    skips = {name: skip_reason(o, tiny) or (None if name in names else "skipped: --mark-only") for name, o in MATRIX}
    return [*matrix_rows(first, skips, code, limit, log), row("mark", "`--mark`", status, notes=f"mark.md; {log.name}")]


def copy_metrics(runs: Path, out: Path) -> None:
    """Every run's ``metrics.json`` beside the table, one line each in ``runs.metrics.jsonl`` (``"run"``: its
    folder): one file, so the device tool's eight returned files keep room for the tables and logs."""
    lines = [json.dumps({"run": p.parent.name, **json.loads(p.read_text())}) for p in sorted(runs.glob("*/metrics.json"))]
    if lines:
        (out / "runs.metrics.jsonl").write_text("\n".join(lines) + "\n")


def matrix_rows(done: dict[str, dict], skips: dict[str, str | None], code: int | None, limit: float,
                log: Path) -> list[dict[str, str]]:
    """Part (c)'s rows, one per ``MATRIX`` configuration, from its run's record (``done``, by name)."""
    rows = []
    for name, overrides in MATRIX:
        shown, r = "`" + " ".join(overrides) + "`", done.get(name)
        if r is None:
            why = f"time limit ({limit:.0f} s) reached" if code is None else f"the worker exited with {code}"
            rows.append(row(E2E, shown, skips[name] or f"not run: {why}", notes="" if skips[name] else log.name))
            continue
        notes = [f"{r['error']} ({log.name})"] if r.get("error") else []
        notes += ["TF32"] if r.get("precision") == "32-true" and r.get("tf32") and r.get("device") == "cuda" else []
        notes += [f"{op} x{n}" for op, n in r.get("sync_ops", {}).items()]
        rows.append(row(E2E, shown, r["status"], precision=r.get("precision"), img_s=_num(r.get("images_per_second")),
                        step_ms=_num(r.get("step_time_s"), 1000), finite=f"{r['finite']}/{r['steps']}" if "steps" in r
                        else None, syncs=f"{sum(r['sync_ops'].values()) / r['counted']:g}" if r.get("counted") else None,
                        notes="; ".join(notes)))
    speed = {name: (r.get("precision"), r.get("images_per_second")) for name, r in done.items()}
    for (name, _), r in zip(MATRIX, rows):  # channels_last against contiguous, compile against eager
        precision, mine = speed.get(name, (None, None))
        if mine and name.startswith("channels_last") and precision in SHORT:
            base, what = ((f"channels_last {SHORT[precision]}", "eager") if "compile" in name
                          else (f"contiguous {SHORT[precision]}", "contiguous"))
            if speed.get(base, (None, None))[1]:
                r["notes"] = "; ".join(filter(None, [f"{mine / speed[base][1]:.2f}x {what}", r["notes"]]))
    return rows


def describe_machine() -> tuple[str, str]:
    """The GPU (name, driver, CUDA, cuDNN) or "no CUDA device", and the host (CPU, cores, Python, versions)."""
    m = machine()
    gpu = m.get("gpu")
    device = (f"{gpu['name']}, driver {gpu['driver']}, CUDA {gpu['cuda']}, cuDNN {gpu['cudnn']}" if gpu
              else "no CUDA device")
    host = (f"{m['cpu']}, {m['logical_cpus']} logical cores; Python {m['python']}; "
            + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    return device, host


def machine_rows(command: str, seconds: float, data: str, machine_: tuple[str, str]) -> list[dict[str, str]]:
    device, host = machine_
    return [row("machine", device, "", notes=host), row("command", f"`{command}`", f"finished in {seconds:.0f} s",
                                                        notes=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
            row("data", data, "")]


def gpu_results_table(rows: list[dict[str, str]]) -> str:
    """The rows as one Markdown table, numbers right-aligned."""
    return table(COLUMNS, [[r[c] for c in COLUMNS] for r in rows],
                 align="".join("r" if c in CELLS.values() else "l" for c in COLUMNS)) + "\n"


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="gpu_check.md, metrics.json files, logs")
    parser.add_argument("--work", type=Path, default=None, help="data and runs (default: a temporary folder)")
    parser.add_argument("--wheels", type=Path, default=None, help="install these wheels first (see the docstring)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: checks the script on any CPU")
    parser.add_argument("--mark", action="store_true", help="(c) runs scripts/bench/mark.py's tasks: OUT/mark.md")
    parser.add_argument("--mark-only", nargs="+", default=None, metavar="TASK",
                        help="with --mark: only these tasks, by kind (amp, loader, largest_batch, e2e) or by "
                             "configuration")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="which parts run: (a) tests, (b) newcomer, (c) e2e (the matrix, or --mark)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole command; each part gets "
                        "at most what is left, less 15 s to write the tables")
    parser.add_argument("--limits", type=float, nargs=3, default=None, metavar=("A", "B", "C"),
                        help="seconds for (a) the cuda tests, (b) the default train.py, (c) the matrix or the mark "
                             "(default 180 100 220; with --mark 150 90 and (c) what the budget leaves)")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mark-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return run_matrix(args.worker)
    if args.mark_worker:
        from scripts.bench.mark import run_tasks

        return run_tasks(args.mark_worker)
    started, command = Stopwatch().start(), command_line("scripts.gpu_check", argv)
    budget = args.budget if args.budget is not None else math.inf
    args.out.mkdir(parents=True, exist_ok=True)
    size = TINY if args.tiny else FULL
    if args.mark and not args.tiny:
        size = {**size, "per_class": 1024}  # 40 batches of 256 an epoch, 5 of 2,048 at the largest batches tried
    limits = args.limits or ([150, 90, math.inf] if args.mark else [180, 100, 220])
    with tempfile.TemporaryDirectory(prefix="cltrain-gpu-check-") as tmp:
        work = args.work or Path(tmp)
        if args.wheels:
            install_wheels(args.wheels, work / "site")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))
        if importlib.util.find_spec("cltrain.conf") is None:  # a source tree, not installed
            os.environ.setdefault("CLTRAIN_CONFIG_DIR", str(REPO / "conf"))
        with Stopwatch() as drawing:
            root = jpeg_folder(work / f"jpegs-{size['classes']}x{size['per_class']}", size["classes"],
                               size["per_class"], size["size"])
        data = (f"{size['classes'] * size['per_class']:,} + {size['classes']} JPEGs of {size['size'][0]}x"
                f"{size['size'][1]} drawn by cltrain.data.demo in {drawing.seconds:.0f} s")
        stamp = work / time.strftime("%Y%m%d-%H%M%S")
        device, host = describe_machine()
        parts = {
            "tests": ("cuda tests", lambda limit: [cuda_tests(limit, args.out / "cuda_tests.log")]),
            "newcomer": ("default train.py", lambda limit: [
                newcomer(stamp / "newcomer", limit, args.out / "default_train.log", args.tiny, args.out)]),
            "e2e": (E2E, lambda limit: mark_part(
                stamp, root, limit, args.out / "mark.log", size, args.out, args.tiny,
                {"device": device, "host": host, "command": command}, args.mark_only) if args.mark
                else matrix(stamp, root, limit, args.out / "matrix.log", size, args.out, args.tiny)),
        }
        rows: list[dict[str, str]] = []
        for (name, (label, run)), wanted in zip(parts.items(), limits):
            limit = min(wanted, budget - started.elapsed() - 15)
            if name not in args.parts:
                rows.append(row(label, "", "skipped: --parts"))
            elif limit < 10:
                rows.append(row(label, "", "not run: less than 10 s of --budget left"))
            else:
                rows += run(limit)
                print(f"gpu_check: {label}: {rows[-1]['status']} ({started.elapsed():.0f} s)", flush=True)
            text = gpu_results_table(machine_rows(command, started.elapsed(), data, (device, host)) + rows)
            (args.out / "gpu_check.md").write_text(text)  # after every part: a run cut short keeps what it has
    print(text, end="")
    return 1 if any(r["status"].startswith(("failed", "timed out", "not run")) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
