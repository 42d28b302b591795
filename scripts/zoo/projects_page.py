"""docs/projects.md and its ``.json`` (``python -m scripts.zoo.projects``): the commands, the machine, a summary, a
row per case and the notes on the cases, written atomically (``cltrain.timing.report``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from cltrain.timing.machine import machine_line
from cltrain.timing.report import page, table, write_report
from scripts.harness import REPO
from scripts.zoo.project_cases import NOTES


def rel_diff(a: float | None, b: float | None) -> float | None:
    """``|a - b| / max(|a|, |b|)``, 0 where both are 0, ``None`` where either is missing."""
    if a is None or b is None:
        return None
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0


def _shorten(line: str, limit: int = 700) -> str:
    line = re.sub(r"\S*/(site-packages|dist-packages)/", "", line.replace(str(REPO) + "/", ""))
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _trains(run: dict[str, Any]) -> str:
    if run.get("trained"):
        return "yes"
    return "NO (" + (run.get("error") or run.get("status", "?"))[:120] + ")"


# log lines every run writes (the layout kept, the batch conversion) and "passed", which the verdicts column says
_ROUTINE = ("layout check passed", "parameters and buffers:", "batches arrive in another layout")


def project_cells(row: dict[str, Any]) -> list[str]:
    """The table's cells of one case."""
    name = [row["library"] or "", f"`{row['key'].split(':', 1)[1]}` {row['task']}"]
    if "contiguous" not in row:
        return name + [row["status"]] + [""] * 5
    nc, cl = row["contiguous"], row["channels_last"]
    loss = rel_diff(nc.get("first_loss"), cl.get("first_loss"))
    loss_cell = "" if loss is None else f"{nc['first_loss']:.5g} / {cl['first_loss']:.5g}: {loss:.1e}"
    metrics_nc = {**(nc.get("metrics") or {}), **(nc.get("val_outputs") or {})}
    metrics_cl = {**(cl.get("metrics") or {}), **(cl.get("val_outputs") or {})}
    diffs = {k: rel_diff(metrics_nc[k], metrics_cl[k]) for k in metrics_nc.keys() & metrics_cl.keys()}
    worst = max(diffs, key=lambda k: (diffs[k], k)) if diffs else None
    metric_cell = f"{diffs[worst]:.1e} (`{worst}`, {len(diffs)} compared)" if worst else ""
    if worst and worst != "val_loss" and "val_loss" in diffs:  # a count-based metric flips in steps; the loss not
        metric_cell += f"; `val_loss` {diffs['val_loss']:.1e}"
    kept = cl.get("layout_kept") or ""
    if cl.get("fallbacks") and kept != "contiguous":  # a contiguous model's one fallback is the whole model
        kept += f" + {cl['fallbacks']} NCHW fallback(s)"
    checks = "; ".join(f"{k}: {v['verdict']}" for k, v in (cl.get("layout_checks") or {}).items())
    lines = "<br>".join(_shorten(line) for line in cl.get("lines", []) if not any(s in line for s in _ROUTINE))
    if cl.get("at"):
        lines += ("<br>" if lines else "") + f"raised at {_shorten(cl['at'])}"
    return name + [f"{_trains(nc)} / {_trains(cl)}", loss_cell, metric_cell,
                   f"{kept}; conv weights CL {cl.get('conv_weights_cl', '')} "
                   f"(NCHW run {nc.get('conv_weights_cl', '')})",
                   checks, lines]


PROJECTS_HEADER = ["library", "task", "trains NCHW / CL", "first loss NCHW / CL: rel. diff",
          "metrics after fit: worst rel. diff", "layout kept (CL run)", "layout checks", "the check's lines"]


def projects_page(rows: list[dict[str, Any]], m: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """The page: the commands that made it (``runs``: ``{"command", "seconds"}``), the machine and versions, a
    summary, the table and the notes on the cases."""
    ran = [r for r in rows if "contiguous" in r]
    both = [r["key"] for r in ran if r["contiguous"].get("trained") and r["channels_last"].get("trained")]
    broken = [r["key"] for r in ran if r["status"] != "ok"]
    found = [r["key"] for r in ran if any(c["verdict"] in ("fallback", "contiguous")
                                           for c in (r["channels_last"].get("layout_checks") or {}).values())]
    libraries = {r["library"]: r["version"] for r in ran if r["library"]}
    versions = ", ".join(f"{name} {version}" for name, version in libraries.items())
    return page("Lightning libraries' own tasks under ChannelsLast", [
        "Made by " + ", then ".join(f"`{r['command']}` ({r['seconds'] / 60:.1f} min)" for r in runs) + ".",
        f"Machine: {machine_line(m)}; {versions or 'no library installed'}.",
        "Each case: the library's own LightningModule at 64 px, resnet18-sized, random weights, generated images, "
        "batch 4-8, 2 training steps (anomalib: its one epoch, then validation), a real Lightning Trainer on the "
        "CPU in fp32, seeded, in its own process, without and with `ChannelsLast()` ([how](benchmarks.md#projects); "
        "the cases: `scripts/zoo/project_cases.py`). Metrics: `trainer.callback_metrics` after `fit` and "
        "the sums of the first validation outputs' float tensors. The libraries are installed by "
        "`pip install -c constraints.txt -e \".[projects]\"` in a virtual environment of their own (the steps: "
        "[how](benchmarks.md#projects)).",
        f"- {len(rows)} cases: {len(ran)} ran, {len(rows) - len(ran)} skipped; trained both ways: {len(both)}"
        + (f"; a run that crashed, raised or timed out: {', '.join(broken)}" if broken else "") + ".\n"
        f"- The layout check worked around the user code in: {', '.join(found) or 'none'}.",
        table(PROJECTS_HEADER, [project_cells(r) for r in rows]),
    ], {"Notes on the cases": [f"- {note}" for note in NOTES]})


def write_projects(out: Path, rows: list[dict[str, Any]], m: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """``<out>.md`` (:func:`projects_page`) and ``<out>.json`` (every run's record, for ``--only`` reruns)."""
    write_report(out, markdown=projects_page(rows, m, runs), data={"runs": runs, "machine": m, "rows": rows})
