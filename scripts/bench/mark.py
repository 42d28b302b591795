"""Toward the MLPerf per-GPU rate: the tasks of apex's recipe that ``python -m scripts.gpu_check --mark`` runs, in one
worker process, each within the budget (the tasks and their order: docs/benchmarks.md#mark), and ``mark.md``, their
records as the tables docs/performance.md takes (``mark_markdown``). An end-to-end task is a configuration of
train.py run in this process (``run_e2e``) with ``StepProbe``, which counts its finite losses and host syncs:
``scripts.gpu_check``'s matrix and its ``--mark``.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

from cltrain.check.budget import free_memory, is_out_of_memory
from cltrain.timing.host_syncs import SyncOps
from scripts.bench.step_profile import DATA_WAIT, breakdown_table
from scripts.harness import (Stopwatch, emit, interleaved, random_batches, rate_after_first, rotated, synchronize,
                             table, write_report)

#: The end-to-end configurations: name -> train.py overrides (the matrix's names and overrides where shared).
CONFIGS: dict[str, list[str]] = {
    "contiguous fp16": ["channels_last=false", "amp=fp16"],
    "channels_last fp16": ["channels_last=true", "amp=fp16"],
    "channels_last fp16 compile": ["channels_last=true", "amp=fp16", "compile.enabled=true"],
    "channels_last compile": ["channels_last=true", "amp=auto", "compile.enabled=true"],
    "contiguous bf16": ["channels_last=false", "amp=bf16"],
    "channels_last bf16": ["channels_last=true", "amp=bf16"],
    "contiguous fp32": ["channels_last=false", "amp=false"],
    "channels_last fp32": ["channels_last=true", "amp=false"],
    "channels_last fp16 compile, largest batch": ["channels_last=true", "amp=fp16", "compile.enabled=true"],
    "channels_last fp16 compile reduce-overhead": ["channels_last=true", "amp=fp16", "compile.enabled=true",
                                                   "compile.mode=reduce-overhead"],
    "channels_last fp16 compile max-autotune-no-cudagraphs": ["channels_last=true", "amp=fp16", "compile.enabled=true",
                                                              "compile.mode=max-autotune-no-cudagraphs"],
}
#: ``scripts.gpu_check``'s matrix (without ``--mark``): each layout in each precision, then channels_last compiled
#: (the slowest to start, the first a time limit drops).
MATRIX = [f"{layout} {p}" for p in ("fp16", "bf16", "fp32") for layout in ("channels_last", "contiguous")] + [
    "channels_last compile"]
#: Repeated in every round; on a CPU (``--tiny``) the fp32 pair instead.
KEY = ["contiguous fp16", "channels_last fp16", "channels_last fp16 compile", "channels_last compile"]
KEY_CPU = ["contiguous fp32", "channels_last fp32"]
#: Profiled over two warm-up steps (CUDA graphs hide their kernels from the profiler: not those).
PROFILED = {"channels_last fp16", "channels_last fp16 compile", "channels_last fp32"}
#: Seconds a task usually takes on one H100 (compiles included); a task starts only with this much budget left.
NEEDS = {"amp": 30, "e2e": 20, "compile": 90, "max-autotune": 300, "largest_batch": 60, "loader": 40}
SHORT = {"16-mixed": "fp16", "bf16-mixed": "bf16", "32-true": "fp32"}
#: MLPerf Training v4.0, ResNet-50, NVIDIA's 8-GPU entries (MXNet + DALI): images/s per GPU.
MLPERF = {"H200": 7950, "H100": 7150}
DATA_WAIT_LIMIT = 0.05  # above this share of the step, the loader holds the GPU back


def tasks(tiny: bool, matrix: bool = False) -> list[dict[str, Any]]:
    """The tasks in the order they run (docs/benchmarks.md#mark); ``matrix``: the ``MATRIX``'s, once each."""
    if matrix:
        return [dict(kind="e2e", name=name, round=0) for name in MATRIX]
    key = KEY_CPU if tiny else KEY
    e2e = [dict(kind="e2e", name=n, round=r) for r in range(3) for n in rotated(key, r)]
    first, second, third = e2e[:len(key)], e2e[len(key):2 * len(key)], e2e[2 * len(key):]
    rest = [dict(kind="e2e", name=n, round=0) for n in CONFIGS if n not in key and "largest" not in n
            and "reduce-overhead" not in n and "max-autotune" not in n]
    return [dict(kind="amp"), *first, *rest, dict(kind="loader"), dict(kind="largest_batch"),
            dict(kind="e2e", name="channels_last fp16 compile, largest batch", round=0), *second,
            dict(kind="e2e", name="channels_last fp16 compile reduce-overhead", round=0), *third,
            dict(kind="e2e", name="channels_last fp16 compile max-autotune-no-cudagraphs", round=0)]


def needs(task: dict[str, Any]) -> float:
    """What ``task`` usually takes, in seconds (``NEEDS``)."""
    if task["kind"] != "e2e":
        return NEEDS[task["kind"]]
    name = task["name"]
    return NEEDS["max-autotune" if "max-autotune" in name else "compile" if "compile" in name else "e2e"]


# --- the largest batch ---------------------------------------------------------------------------------------
def largest_batch(fits: Callable[[int], bool], start: int, cap: int, granularity: int) -> tuple[int | None, dict]:
    """The largest batch ``fits`` accepts (doubling from ``start`` up to ``cap``, then bisecting down to
    ``granularity``; ``None`` when none fits), and ``{size: fits}`` in the order tried."""
    tried: dict[int, bool] = {}

    def ok(n: int) -> bool:
        tried[n] = fits(n)
        return tried[n]

    low, high, n = 0, None, start
    while n <= cap:
        if not ok(n):
            high = n
            break
        low, n = n, 2 * n
    if high is None:
        return low, tried
    while high - low > granularity:
        mid = (low + high) // 2 // granularity * granularity
        if mid <= low:
            break
        if ok(mid):
            low = mid
        else:
            high = mid
    return low or None, tried


def _plain_step(model_name: str, flag: str, device: torch.device, batch: int, size: int) -> Callable[[], torch.Tensor]:
    """The recipe's step (``PlainStep``: the app's optimizer, autocast, loss scaling) on one synthetic batch."""
    from cltrain import to_channels_last
    from cltrain.app import build_classifier
    from scripts.bench.train import PlainStep

    batches = random_batches(1, (batch, 3, size, size), device=device, memory_format=torch.channels_last)
    step = PlainStep(to_channels_last(build_classifier(model_name, num_classes=1000).to(device)), flag, device, batches)
    x, y = batches[0]
    return lambda: step(x, y)


# --- the tasks -------------------------------------------------------------------------------------------------
def run_amp(spec: dict, records: list[dict]) -> dict:
    from cltrain.precision import auto_precision
    from cltrain.timing.precision import choose_precision, time_precisions

    s, device = spec["synthetic"], torch.device(spec["device"])
    flags = ["bf16-mixed", "16-mixed"] if device.type == "cuda" else ["bf16-mixed", "32-true"]
    trials = time_precisions(lambda flag: _plain_step(s["model"], flag, device, s["batch"], s["size"]), flags,
                             device=device, warmup=s["warmup"], steps=s["steps"], rounds=s["rounds"])
    free_memory()
    auto = auto_precision(device)
    choice = choose_precision(trials, fallback=auto)
    return {"status": "completed", "trials": [asdict(t) for t in trials], "batch": s["batch"], "rounds": s["rounds"],
            "choice": asdict(choice), "auto": asdict(auto)}


def run_largest_batch(spec: dict, records: list[dict]) -> dict:
    s, search, device = spec["synthetic"], spec["search"], torch.device(spec["device"])
    flag = "16-mixed" if device.type == "cuda" else "32-true"
    errors: dict[int, str] = {}

    def fits(n: int) -> bool:
        free_memory()  # the last try's model, optimizer and batch went with its frame
        try:
            step = _plain_step(s["model"], flag, device, n, s["size"])
            for _ in range(2):
                step()
            synchronize(device)  # an allocation that fails does so by now
            return True
        except RuntimeError as err:  # torch.OutOfMemoryError, or a kernel's plain RuntimeError saying so
            if not is_out_of_memory(err):
                raise
            if not isinstance(err, torch.OutOfMemoryError):
                errors[n] = str(err).splitlines()[0][:120]
            return False

    largest, tried = largest_batch(fits, search["start"], search["cap"], search["granularity"])
    free_memory()
    return {"status": "completed", "largest": largest, "precision": flag, "cap": search["cap"],
            "tried": [[n, ok] for n, ok in tried.items()], "errors": errors}


def _loader_rate(spec: dict, workers: Any, threads: Any, batches: int) -> dict:
    from cltrain.app import compose_config
    from cltrain.app.datasource import build_datamodule
    from scripts.fits import quiet_trainer

    cfg = compose_config([*spec["common"], f"data.num_workers={workers}", f"data.decode_threads={threads}"])
    dm = build_datamodule(cfg)
    dm.trainer = quiet_trainer(accelerator=spec["device"])  # the loader as a run on this device gets it (pinned, uint8)
    dm.setup("fit")
    loader = dm.train_dataloader()
    rate = rate_after_first(loader, lambda b: b[0].shape[0], limit=batches)  # worker start-up and the first batch untimed
    return {"workers": loader.num_workers, "threads": getattr(loader.dataset, "threads", 1), "images": rate.items,
            "img_s": rate.per_second}


def run_loader(spec: dict, records: list[dict]) -> dict:
    splits = spec["loader"]["splits"]
    rates = interleaved({i: (lambda w=w, t=t: {**_loader_rate(spec, w, t, spec["loader"]["batches"]), "asked": [w, t]})
                         for i, (w, t) in enumerate(splits)}, spec["loader"]["rounds"])
    return {"status": "completed", "rates": [r for values in zip(*rates.values()) for r in values], "batch": spec["batch"]}


# --- one configuration of train.py ---------------------------------------------------------------------------
class StepProbe(Callback):
    """Keeps every training step's loss on the device and counts host-sync ops over ``count_steps`` steps; writes
    ``{"finite", "steps", "counted", "sync_ops"}`` to ``path`` as JSON when training ends or fails."""

    def __init__(self, path: str, count_from: int, count_steps: int) -> None:
        self.path, self.first, self.stop = Path(path), count_from, count_from + count_steps
        self.losses: list[torch.Tensor] = []
        self.mode: SyncOps | None = None
        self.ops: Counter = Counter()

    def _close(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.ops, self.mode = sum(self.mode.counts.values(), Counter()), None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if len(self.losses) == self.stop:
            self._close()
        if len(self.losses) == self.first:
            self.mode = SyncOps().__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append((outputs["loss"] if isinstance(outputs, dict) else outputs).detach())  # no sync

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()
        finite = int(torch.stack(self.losses).float().isfinite().sum()) if self.losses else 0
        counted = max(0, min(self.stop, len(self.losses)) - self.first)
        self.path.write_text(json.dumps({"finite": finite, "steps": len(self.losses), "counted": counted,
                                         "sync_ops": self.ops}))

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)


def skip_reason(overrides: list[str], tiny: bool) -> str | None:
    """Why the configuration ``overrides`` cannot run on this machine ("skipped: ..."), or ``None``: fp16 needs
    CUDA, bf16 a device that has it, and ``--tiny`` (``tiny``) leaves out compiling."""
    from cltrain.platform import cpu_bf16_support

    cuda = torch.cuda.is_available()
    if "amp=fp16" in overrides and not cuda:
        return "skipped: no CUDA"
    if "amp=bf16" in overrides and not (torch.cuda.is_bf16_supported() if cuda else cpu_bf16_support()[0]):
        return f"skipped: no bf16 on this {'GPU' if cuda else 'CPU'}"
    if tiny and "compile.enabled=true" in overrides:
        return "skipped: --tiny (compiling takes minutes on a CPU)"
    return None


def run_e2e(spec: dict, task: dict, records: list[dict], tiny: bool) -> dict:
    """One configuration through ``train(cfg)`` in this process: ``train``'s metrics with the ``StepProbe``'s counts
    (``status`` "failed" and the error's first line when it raised), the run in ``spec["runs"]/slug``."""
    from cltrain.app import compose_config
    from cltrain.app.train import train

    name, overrides = task["name"], list(CONFIGS[task["name"]])
    skipped = skip_reason(overrides, tiny)
    if skipped:
        return {"status": skipped}
    batch = spec["batch"]
    if "largest" in name:
        found = next((r for r in reversed(records) if r["kind"] == "largest_batch" and r.get("largest")), None)
        if found is None:
            return {"status": "not run: no largest batch was found"}
        batch = found["largest"]
        steps = max(10, spec["steps"] * spec["batch"] // batch)  # about as many images as a run at the recipe's batch
        overrides += [f"data.batch_size={batch}", f"++trainer.max_steps={spec['warmup'] + steps}"]
    runs, (first, count) = Path(spec["runs"]), spec["count"]
    slug = f"{re.sub(r'[^A-Za-z0-9]+', '-', name).strip('-')}-r{task['round']}"
    profile, probe = runs / f"{slug}.profile.json", runs / f"{slug}.probe.json"
    extra = []
    if name in PROFILED and task["round"] == 0 and spec["header"]:  # the mark's, not the plain matrix's runs
        # two steps ending before the last warm-up step: the timed window is clean
        extra = ["+callbacks.profile._target_=scripts.bench.step_profile.StepProfile",
                 f"+callbacks.profile.path={profile}", f"+callbacks.profile.first={max(1, spec['warmup'] - 3)}",
                 "+callbacks.profile.steps=2"]
    graphs = "compile.mode=reduce-overhead" in overrides
    if graphs:
        from torch._dynamo.utils import counters

        skips_before = counters["inductor"].get("cudagraph_skips", 0)
    if "compile.enabled=true" in overrides:
        torch._dynamo.reset()  # a fresh compile (docs/benchmarks.md#mark says why); inductor's caches on disk stay
    record: dict[str, Any] = {"name": name}
    print(f"gpu_check: {name}: {' '.join([*overrides, *extra])}", flush=True)
    try:
        record.update(train(compose_config([
            *spec["common"], *overrides, f"run_dir={runs / slug}",
            "+callbacks.probe._target_=scripts.bench.mark.StepProbe", f"+callbacks.probe.path={probe}",
            f"+callbacks.probe.count_from={first}", f"+callbacks.probe.count_steps={count}", *extra])))
    except Exception as err:  # noqa: BLE001 - one configuration failing must not stop the others
        record.update(status="failed", error=f"{type(err).__name__}: {err}".splitlines()[0])
    record.update(json.loads(probe.read_text()) if probe.is_file() else {})
    record.pop("config", None)
    free_memory()  # the finished run's loader workers and tensors, before the next run starts
    record["batch"] = batch
    if profile.is_file():
        record["profile"] = json.loads(profile.read_text())
    if graphs:
        record["cudagraph_skips"] = counters["inductor"].get("cudagraph_skips", 0) - skips_before
    return record


def run_tasks(spec_file: Path) -> int:
    """The worker (``python -m scripts.gpu_check --worker SPEC``): every task of the spec in order, each record
    emitted (``scripts.harness.emit``) as it ends and, for ``--mark`` (``spec["header"]``), ``mark.md`` written again."""

    spec = json.loads(spec_file.read_text())
    tiny, records = spec["tiny"], []
    torch.backends.cudnn.benchmark = True  # as the app, apex and timm run: the synthetic steps too
    runners = {"amp": run_amp, "largest_batch": run_largest_batch, "loader": run_loader}
    for task in spec["tasks"]:
        left = spec["deadline"] - time.time()
        record = {"kind": task["kind"], "name": task.get("name", task["kind"]), "round": task.get("round", 0)}
        watch = Stopwatch().start()
        if left < needs(task) * spec["needs_scale"]:
            record["status"] = f"not run: {left:.0f} s of the budget left, it needs about {needs(task):.0f} s"
        else:
            print(f"mark: {record['name']} (round {record['round'] + 1})", flush=True)
            try:
                record.update(run_e2e(spec, task, records, tiny) if task["kind"] == "e2e"
                              else runners[task["kind"]](spec, records))
            except Exception as err:  # noqa: BLE001 - one task failing must not stop the others
                record.update(status="failed", error=f"{type(err).__name__}: {err}".splitlines()[0][:300])
        record["seconds"] = round(watch.elapsed(), 1)
        records.append(record)
        emit(record)
        if spec["header"]:
            write_report(Path(spec["out"], "mark"), markdown=mark_markdown(records, spec["header"]))
        print(f"mark: {record['name']}: {record.get('status')} in {record['seconds']} s", flush=True)
    return 0


def loader_splits(run_workers: int, tiny: bool) -> list[list[Any]]:
    """(workers, decode threads) to time the loader at: the runs' own split, the app's ``auto``, and 2 threads in
    half as many workers (``--tiny``: in this process, and one worker)."""
    from cltrain.data.loader_threads import usable_cores

    if tiny:
        return [[0, 1], [1, 1]]
    splits = [[run_workers, "auto"], ["auto", "auto"], [max(1, usable_cores() // 2), 2]]
    return [s for i, s in enumerate(splits) if s not in splits[:i]]


# --- mark.md ---------------------------------------------------------------------------------------------------
def num(v: float | None, scale: float = 1) -> str:
    """A figure as the tables give it (``1,234.5``); "" for none."""
    return "" if v is None else f"{scale * v:,.1f}"


def _completed(records: list[dict], name: str | None = None) -> list[dict]:
    return [r for r in records if r["kind"] == "e2e" and name in (None, r["name"]) and r.get("status") == "completed"
            and r.get("images_per_second")]


def _ratios(records: list[dict], runs: list[dict]) -> list[float]:
    """Each run's images/s over the contiguous run of its precision in the same round (none for itself)."""
    out = []
    for run in runs:
        base = f"contiguous {SHORT.get(run.get('precision'), '?')}"
        if run["name"] == base:
            continue
        same = [b for b in _completed(records, base) if b["round"] == run["round"]]
        if same:
            out.append(run["images_per_second"] / same[0]["images_per_second"])
    return out


def _e2e_rows(records: list[dict]) -> list[list[Any]]:
    e2e = [r for r in records if r["kind"] == "e2e"]
    baseline = next((r.get("batch") for r in e2e if r["name"].startswith("contiguous") and r.get("batch")), None)
    rows = []
    for name in dict.fromkeys(r["name"] for r in e2e):
        runs = _completed(records, name)
        notes = [f"{r['status']}{': ' + r['error'] if r.get('error') else ''}" for r in e2e
                 if r["name"] == name and r.get("status") != "completed"]
        if not runs:
            rows.append([name, "", "", "", "", 0, "", "", "", "; ".join(dict.fromkeys(notes))])
            continue
        speeds = [r["images_per_second"] for r in runs]
        ratios = _ratios(records, runs)
        if name.startswith("contiguous"):
            ratio = "1.00x"
        else:
            ratio = f"{statistics.median(ratios):.2f}x" if ratios else ""
            ratio += f" ({len(ratios)} rounds)" if len(ratios) > 1 else ""
        finite = f"{sum(r.get('finite', 0) for r in runs)}/{sum(r.get('steps', 0) for r in runs)}"
        if runs[0].get("batch") != baseline:
            notes.append(f"against the baseline at batch {baseline}")
        notes += [f"CUDA graphs skipped {r['cudagraph_skips']} times" for r in runs[:1] if r.get("cudagraph_skips")]
        notes += [f"{op} x{n} host syncs" for op, n in runs[0].get("sync_ops", {}).items()]
        spread = f"{min(speeds):,.0f}-{max(speeds):,.0f}" if len(speeds) > 1 else ""
        rows.append([name, runs[0].get("precision", ""), runs[0].get("batch", ""), num(statistics.median(speeds)),
                     spread, len(runs), ratio, num(1e3 * statistics.median(r["step_time_s"] for r in runs)), finite,
                     "; ".join(notes)])
    return rows


def _step_rows(amp: dict | None) -> list[list[Any]]:
    if not amp or amp.get("status") != "completed":
        return []
    rows = []
    for t in amp["trials"]:
        rate = amp["batch"] / t["seconds_per_step"] if t["seconds_per_step"] else None
        note = t["error"] or ("" if t["finite"] else "a loss was not finite")
        rows.append([f"recipe step only, channels_last {SHORT.get(t['flag'], t['flag'])} (synthetic batch)", t["flag"],
                     amp["batch"], num(rate), "", amp["rounds"], "",
                     num(1e3 * t["seconds_per_step"]) if t["seconds_per_step"] else "", "", note])
    return rows


def _lines(records: list[dict], device: str) -> list[str]:
    out = []
    amp = next((r for r in records if r["kind"] == "amp"), None)
    if amp and amp.get("status") == "completed":
        out.append(f"- **amp by measurement** (the recipe's step, batch {amp['batch']}): would pick "
                   f"`{amp['choice']['flag']}`: {amp['choice']['reason']}. `amp=auto` picks `{amp['auto']['flag']}` "
                   f"({amp['auto']['reason']}).")
    search = next((r for r in records if r["kind"] == "largest_batch"), None)
    if search and search.get("status") == "completed":
        tried = ", ".join(f"{n} {'fits' if ok else 'out of memory'}" for n, ok in search["tried"])
        capped = f" (the search stops at {search['cap']})" if search["largest"] == search["cap"] else ""
        out.append(f"- **Largest batch** (eager {search['precision']} step, synthetic): {search['largest']}{capped}; "
                   f"tried {tried}.")
    best = max(_completed(records), key=lambda r: r["images_per_second"], default=None)
    mark = next((rate for gpu, rate in MLPERF.items() if gpu in device), None)
    if best and mark:
        out.append(f"- **Against the mark**: the best run, {best['name']} at {num(best['images_per_second'])} img/s, "
                   f"is {best['images_per_second'] / mark:.0%} of MLPerf Training v4.0's ~{mark:,} img/s per GPU.")
    for r in records:
        wait = r.get("profile", {}).get("kinds", {}).get(DATA_WAIT)
        if wait is not None and r["profile"]["wall_ms"] > 0:
            share = wait / r["profile"]["wall_ms"]
            verdict = ("above 5%: decoding on the GPU is the next step" if share > DATA_WAIT_LIMIT
                       else "the loader keeps up")
            out.append(f"- **Data wait** in {r['name']}: {share:.1%} of the step ({verdict}).")
    return out


def _loader_table(records: list[dict]) -> list[str]:
    found = next((r for r in records if r["kind"] == "loader" and r.get("status") == "completed"), None)
    if not found:
        return []
    by_split: dict[str, list[float]] = {}
    for rate in found["rates"]:
        asked = f"{rate['workers']} x {rate['threads']} ({rate['asked'][0]}, {rate['asked'][1]})"
        by_split.setdefault(asked, []).append(rate["img_s"] or 0.0)
    return ["", f"The loader alone (the batches of {found['batch']} a run on this device gets; no training):", "",
            table(["workers x decode threads (asked)", "img/s (median)", "min-max", "runs"],
                  [[split, num(statistics.median(v)), f"{min(v):,.0f}-{max(v):,.0f}", len(v)]
                   for split, v in by_split.items()], align="lrlr")]


def mark_markdown(records: list[dict], header: dict[str, str]) -> str:
    """``mark.md`` from the records so far; ``header``: ``gpu`` (its name), ``machine`` (its line), ``command``."""
    lines = [f"Machine: {header['machine']}", "", f"`{header['command']}`", "",
             table(["configuration", "precision", "batch", "img/s (median)", "min-max", "runs", "vs contiguous",
                    "step (ms)", "finite losses", "notes"],
                   [*_e2e_rows(records), *_step_rows(next((r for r in records if r["kind"] == "amp"), None))],
                   align="llrrlrrrrl")]
    notes = _lines(records, header["gpu"])
    lines += ["", *notes] if notes else []
    lines += _loader_table(records)
    profiles = {r["name"]: r["profile"] for r in records if r.get("profile")}
    if profiles:
        lines += ["", "One step by kind (ms per step, share of the step; two warm-up steps profiled, run by run):", "",
                  breakdown_table(profiles).rstrip("\n")]
    left = [f"{r['name']} ({r['status']})" for r in records if r["kind"] != "e2e" and r.get("status") != "completed"]
    lines += ["", "Not completed: " + "; ".join(left)] if left else []
    return "\n".join(lines) + "\n"
