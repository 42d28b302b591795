"""``mark.md``: the records of ``scripts.bench.mark``'s tasks as the tables docs/performance.md takes."""

from __future__ import annotations

import statistics
from typing import Any

from scripts.bench.step_profile import DATA_WAIT, breakdown_table
from scripts.harness import table

SHORT = {"16-mixed": "fp16", "bf16-mixed": "bf16", "32-true": "fp32"}


def num(v: float | None, scale: float = 1) -> str:
    """A figure as the tables give it (``1,234.5``); "" for none."""
    return "" if v is None else f"{scale * v:,.1f}"

__all__ = ["MLPERF", "mark_markdown"]

#: MLPerf Training v4.0, ResNet-50, NVIDIA's 8-GPU entries (MXNet + DALI): images/s per GPU.
MLPERF = {"H200": 7950, "H100": 7150}
DATA_WAIT_LIMIT = 0.05  # above this share of the step, the loader holds the GPU back


def _completed(records: list[dict], name: str) -> list[dict]:
    return [r for r in records if r["kind"] == "e2e" and r["name"] == name and r.get("status") == "completed"
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
    rows, names = [], list(dict.fromkeys(r["name"] for r in records if r["kind"] == "e2e"))
    for name in names:
        mine = [r for r in records if r["kind"] == "e2e" and r["name"] == name]
        runs = _completed(records, name)
        notes = [f"{r['status']}{': ' + r['error'] if r.get('error') else ''}" for r in mine
                 if r.get("status") != "completed"]
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
        if runs[0].get("batch") != _baseline_batch(records):
            notes.append(f"against the baseline at batch {_baseline_batch(records)}")
        notes += [f"CUDA graphs skipped {r['cudagraph_skips']} times" for r in runs[:1] if r.get("cudagraph_skips")]
        notes += [f"{op} x{n} host syncs" for op, n in runs[0].get("sync_ops", {}).items()]
        spread = f"{min(speeds):,.0f}-{max(speeds):,.0f}" if len(speeds) > 1 else ""
        rows.append([name, runs[0].get("precision", ""), runs[0].get("batch", ""), num(statistics.median(speeds)),
                     spread, len(runs), ratio, num(1e3 * statistics.median(r["step_time_s"] for r in runs)), finite,
                     "; ".join(notes)])
    return rows


def _baseline_batch(records: list[dict]) -> Any:
    return next((r.get("batch") for r in records if r["kind"] == "e2e" and r["name"].startswith("contiguous")
                 and r.get("batch")), None)


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
    best = max((r for r in records if r["kind"] == "e2e" and r.get("status") == "completed"
                and r.get("images_per_second")), key=lambda r: r["images_per_second"], default=None)
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
