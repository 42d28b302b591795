"""The zoo's pages, each rendered from its record (``<out>.json``) by :func:`write_page` and written atomically with it
(``cltrain.timing.report``): docs/zoo.md and docs/zoo.csv (``python -m scripts.zoo.sweep``), docs/zoo_check.md (its
``--check-only``: the first-batch check's false alarms, each model's verdicts, each confirmation) and docs/projects.md
(``python -m scripts.zoo.projects``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

from cltrain.timing.machine import machine_line
from cltrain.timing.report import page, table, write_report
from scripts.harness import REPO
from scripts.zoo.confirm import FACTOR, FALLBACK_VERDICTS, JUDGED, MIN_GAP, NUDGE, numerics
from scripts.zoo.models import OPTIMIZER_NAMES, OPTIMIZER_SETTINGS
from scripts.zoo.parity import OK_BELOW
from scripts.zoo.project_cases import NOTES


def load() -> str:
    """The load averages, as the pages give them."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def now() -> str:
    """The date and time, to the minute, as the pages give them."""
    return time.strftime("%Y-%m-%d %H:%M")


def record(out: Path, keep: bool = True) -> dict[str, Any]:
    """``<out>.json``, the record a rerun keeps rows from; ``{}`` where there is none or ``keep`` is off."""
    path = out.with_suffix(".json")
    return json.loads(path.read_text()) if keep and path.exists() else {}


def fmt_err(value: Any) -> str:
    """An error or a gap as the zoo's tables give it (``1.2e-03``, ``inf``); "" for none."""
    return "" if value is None else "inf" if value == math.inf else f"{value:.1e}"


def pair(a: Any, b: Any) -> str:
    """Two errors as one cell (``a / b``); "" where both are missing."""
    return "" if a is None and b is None else f"{fmt_err(a)} / {fmt_err(b)}"


def machine_lines(m: dict[str, Any], after: str = ".") -> str:
    """The machine's line and the load averages a sweep started and ended at."""
    return (f"Machine: {machine_line(m)}.\n"
            f"Load average at the start: {m.get('load_start', '?')}, at the end: {m.get('load_end', '?')}{after}")


def listed(items: list[str], sep: str = ", ") -> str:
    """How many, and which: ``2: a, b`` (``0`` alone)."""
    return f"{len(items)}" + (": " + sep.join(items) if items else "")


def write_page(out: Path, record: dict[str, Any], args: argparse.Namespace | None = None) -> None:
    """``<out>.json`` (``record``, as it is) and ``<out>.md`` rendered from it: docs/projects.md where the record has
    ``runs``, docs/zoo_check.md where it has ``optimizers``, else docs/zoo.md and ``<out>.csv``. ``args``: the sweep's
    (``scripts.zoo.sweep.recorded_args`` of the record's ``command``), which its pages quote."""
    rows, m = record["rows"], record["machine"]
    if "runs" in record:
        markdown, csv_rows = projects_page(rows, m, record["runs"]), None
    elif "optimizers" in record:
        markdown, csv_rows = check_page(rows, m, record["command"], args, record["optimizers"]), None
    else:
        markdown, csv_rows = sweep_page(rows, m, record["command"], args), [csv_row(r) for r in rows]
    write_report(out, markdown=markdown, data=record, csv_rows=csv_rows, csv_fields=CSV_FIELDS)


# ---- docs/zoo.md and docs/zoo.csv ----------------------------------------------------------------------------------


def _fmt_speed(speed: dict[str, float] | None) -> str:
    if not speed:
        return ""
    cl, nchw = speed["channels_last"], speed["contiguous"]
    return f"{cl:.2f} / {nchw:.2f} = **{cl / nchw:.2f}x**"


def _row_cells(r: dict[str, Any]) -> list[str]:
    grad = r.get("grad") or {}
    trains = "" if "trains_contiguous" not in r else (
        f"{'yes' if r['trains_contiguous'] else 'NO'} / {'yes' if r.get('trains_channels_last') else 'NO'}")
    errors = pair(grad.get("err_cl"), grad.get("err_nc"))
    if grad.get("verdict") != "ok" and grad.get("grad_scale") is not None:
        errors += f" (its gradient {grad['grad_scale']:.0e} of the largest)"
    errors += f": {grad['why']}" if grad.get("why") else ""
    verdict = grad.get("verdict", "")
    if grad and "float64_error" in r:
        verdict += " (vs NCHW fp32)"
    if r.get("examined"):  # scripts/zoo/miss_check.py: the worst parameter's layer run alone
        verdict += f", examined: {r['examined']['verdict']}"
    if "compile_grad" in r:
        verdict += f"; compiled: {r['compile_grad']['verdict']}"
    note = "; ".join(filter(None, [r.get("note", ""), r.get("skipped", ""),
                                   f"no float64: {r['float64_error']}" if "float64_error" in r else "",
                                   (r.get("examined") or {}).get("why", "")]))
    speed, bf16 = _fmt_speed(r.get("speed_fp32")), _fmt_speed(r.get("speed_bf16"))
    if "compile_speed_fp32" in r:
        speed += f"<br>compiled {_fmt_speed(r['compile_speed_fp32'])}"
        bf16 += f"<br>compiled {_fmt_speed(r.get('compile_speed_bf16'))}" if r.get("compile_speed_bf16") else ""
    return [
        f"`{r['key']}`", r.get("family", ""), str(r.get("params_m", "")), r.get("status", ""), trains,
        pair(r.get("loss_err_cl"), r.get("loss_noise")), errors,
        f"`{grad.get('worst_param', '')}`" if grad.get("worst_param") else "", verdict, r.get("conv_weights_cl", ""),
        r.get("guardrails", ""), speed, bf16, note,
    ]


SWEEP_HEADER = ["model", "family", "params (M)", "run", "trains NCHW / CL", "step-0 loss err CL / fp32 noise",
                "worst grad err CL / fp32 noise (vs float64)", "worst parameter", "gradients", "conv weights CL",
                "guardrail", "fp32 steps/s CL / NCHW", "bf16 steps/s CL / NCHW", "note"]


def sweep_summary(rows: list[dict[str, Any]]) -> list[str]:
    """A few lines: how many ran, crashed, raised, missed; the speed ratios."""
    ran = [r for r in rows if r.get("status") != "skipped"]
    crashed = [r["key"] for r in ran if r.get("status", "").startswith(("crashed", "timeout"))]
    raised = [r["key"] for r in ran if r.get("status", "").startswith("raised")]
    cl_fail = [r["key"] for r in ran if r.get("trains_contiguous") and not r.get("trains_channels_last")]
    verdicts = [(r.get("grad") or {}).get("verdict") for r in ran]
    lines = [
        f"- {len(rows)} models: {len(ran)} ran, {len(rows) - len(ran)} skipped (over --max-params).",
        f"- Crashed or timed out: {listed(crashed)}. Raised: {listed(raised)}. "
        f"Trained without ChannelsLast but not with it: {listed(cl_fail)}.",
        f"- Gradients under ChannelsLast: {verdicts.count('ok')} ok (<= {OK_BELOW:g}), {verdicts.count('numerics')} "
        f"numerics, {verdicts.count('MISS')} MISS{_examined(ran)}.",
    ]
    for label in ("fp32", "bf16"):
        ratios = [r[f"speed_{label}"]["channels_last"] / r[f"speed_{label}"]["contiguous"] for r in ran
                  if r.get(f"speed_{label}")]
        if ratios:
            faster = sum(x > 1.0 for x in ratios)
            lines.append(f"- {label} CL / NCHW training steps/s: median {statistics.median(ratios):.2f}x "
                         f"(range {min(ratios):.2f}-{max(ratios):.2f}); CL faster for {faster} of {len(ratios)}.")
    return lines


def _examined(ran: list[dict[str, Any]]) -> str:
    misses = [r for r in ran if (r.get("grad") or {}).get("verdict") == "MISS"]
    if not misses:
        return ""
    found = [(r.get("examined") or {}).get("verdict") for r in misses]
    return (f" ({len(misses) - found.count(None)} examined by scripts/zoo/miss_check.py: {found.count('numerics')} "
            f"numerics (the layer alone is exact in both layouts; the gradient is ill-conditioned at batch 2), "
            f"{found.count('kernel')} kernel faults)")


def sweep_page(rows: list[dict[str, Any]], m: dict[str, Any], command: str, args: argparse.Namespace) -> str:
    """docs/zoo.md: how it was made (the day from ``m["ended"]``), the summary and a row per model."""
    return page("Model zoo under ChannelsLast", [
        f"Made by `{command}` ({m.get('ended', now())[:10]}).",
        machine_lines(m),
        f"Parity: batch {args.batch} at each model's size (128 px unless noted), one initialisation, the same two "
        "batches, a real Lightning Trainer with and without `ChannelsLast()`; step-0 gradients of every parameter "
        "against float64 ([how](benchmarks.md#zoo-sweep); MISS = O(1) off where NCHW fp32 is not). Speed: "
        f"training steps/s (forward, cross-entropy, backward, SGD) at batch "
        f"{args.batch if args.quick else args.speed_batch}, median of {args.rounds} interleaved rounds in one "
        "process; ratio = CL / NCHW. The layout the default keeps on each model is not on this page: its race of the "
        "layouts is measured on a dozen models by `python -m scripts.bench.default_speed` "
        "([performance](performance.md)).",
    ], {"Summary": sweep_summary(rows), "Every model": [table(SWEEP_HEADER, [_row_cells(r) for r in rows])]})


#: ``<out>.csv``'s columns: a row's own field, or (field, key) inside it (auto_fp32 and auto_bf16: the layout the
#: default kept, in the records of sweeps that ran it, docs/zoo.json)
CSV_FIELDS = ["key", "family", "params_m", "status", "trains_contiguous", "trains_channels_last", "loss_err_cl",
              "loss_noise", "grad_verdict", "grad_why", "grad_err_cl", "grad_noise", "grad_scale", "layout_err_f64",
              "worst_param", "conv_weights_cl", "guardrails", "fp32_cl", "fp32_nchw", "bf16_cl", "bf16_nchw",
              "auto_fp32", "auto_bf16", "compile_grad_verdict", "compile_fp32_cl", "compile_fp32_nchw", "seconds",
              "note"]
_NESTED = {"grad_verdict": ("grad", "verdict"), "grad_why": ("grad", "why"), "grad_err_cl": ("grad", "err_cl"),
           "grad_noise": ("grad", "err_nc"), "grad_scale": ("grad", "grad_scale"),
           "layout_err_f64": ("grad", "layout_err_f64"), "worst_param": ("grad", "worst_param"),
           "fp32_cl": ("speed_fp32", "channels_last"), "fp32_nchw": ("speed_fp32", "contiguous"),
           "bf16_cl": ("speed_bf16", "channels_last"), "bf16_nchw": ("speed_bf16", "contiguous"),
           "compile_grad_verdict": ("compile_grad", "verdict"),
           "compile_fp32_cl": ("compile_speed_fp32", "channels_last"),
           "compile_fp32_nchw": ("compile_speed_fp32", "contiguous")}


def csv_row(r: dict[str, Any]) -> dict[str, Any]:
    """One row of ``<out>.csv``."""
    return {k: (r.get(_NESTED[k][0]) or {}).get(_NESTED[k][1], "") if k in _NESTED else r.get(k, "")
            for k in CSV_FIELDS}


# ---- docs/zoo_check.md ---------------------------------------------------------------------------------------------

VERDICTS = ("passed", "fallback", "contiguous", "not checked")


def _checked(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows whose check gave a verdict (a run that died later, in a confirmation, still has one)."""
    return [r for r in rows if r.get("layout_check")]


def _name(r: dict[str, Any]) -> str:
    """The model and optimizer, and what the float64 run says of a diverging channels_last run."""
    exact = numerics(r.get("confirm") or {})
    said = "" if exact is None else " [float64: rounding]" if exact else " [float64: channels_last off]"
    return f"{r['key']} ({OPTIMIZER_NAMES.get(r.get('optimizer', ''), r.get('optimizer', ''))}){said}"


def _judged(rows: list[dict[str, Any]], verdict: str) -> list[dict[str, Any]]:
    return [r for r in _checked(rows) if (r.get("confirm") or {}).get("verdict") == verdict]


def check_summary(rows: list[dict[str, Any]], optimizers: list[str]) -> list[str]:
    """The false-alarm figures, one bullet each: runs, verdicts per optimizer, false fallbacks (each with the
    check's line), confirmed fallbacks, passes confirmed and misses."""
    models = sorted({r["key"] for r in rows})
    skipped = sorted({r["key"] for r in rows if r.get("status") == "skipped"})
    lines = [f"- {len(models)} models x {len(optimizers)} optimizers "
             f"({', '.join(OPTIMIZER_NAMES[o] for o in optimizers)}): {len(models) - len(skipped)} models checked "
             f"with each optimizer, {len(skipped)} skipped (over --max-params)."]
    for opt in optimizers:
        ran = [r for r in rows if r.get("optimizer") == opt and r.get("status") != "skipped"]
        checked = _checked(ran)
        counts = ", ".join(f"{v} {sum(r['layout_check'] == v for r in checked)}" for v in VERDICTS)
        died = [r["key"] for r in ran if not r.get("layout_check")]
        lines.append(f"- {OPTIMIZER_NAMES[opt]}: {len(ran)} models; {counts}"
                     + (f"; no verdict (the run died first): {listed(died)}" if died else "") + ".")
    fallbacks = [r for r in _checked(rows) if r["layout_check"] in FALLBACK_VERDICTS]
    false = _judged(rows, "FALSE")
    lines.append(f"- **False fallbacks: {len(false)}** of {len(fallbacks)} fallback or contiguous verdicts"
                 + ("." if not false else ": " + "; ".join(f"{_name(r)}: {r.get('layout_check_line', '')}"
                                                          for r in false)))
    confirmed = _judged(rows, "confirmed")
    lines.append(f"- Confirmed fallbacks: {listed([_name(r) for r in confirmed])}.")
    passes = [r for r in _checked(rows) if r["layout_check"] == "passed" and r.get("confirm")]
    missed = _judged(rows, "MISSED")
    lines.append(f"- Passes confirmed by the same three runs: {len(passes)}; right {len(_judged(rows, 'right'))}, "
                 f"**missed {len(missed)}**" + (": " + ", ".join(_name(r) for r in missed) if missed else "") + ".")
    open_ = [r for r in _checked(rows) if r.get("confirm") and r["confirm"].get("verdict") not in JUDGED]
    if open_:
        lines.append("- Not judged: " + "; ".join(f"{_name(r)}: {r['confirm'].get('verdict')}" for r in open_) + ".")
    return lines


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return ""
    if not r.get("layout_check"):
        return r.get("status", "")
    verdict = (r.get("confirm") or {}).get("verdict")
    shown = {"FALSE": "**FALSE**", "MISSED": "**MISSED**"}.get(verdict, verdict)
    exact = numerics(r.get("confirm") or {})
    shown = f"{shown}, float64: {'rounding' if exact else 'channels_last off'}" if exact is not None else shown
    return r["layout_check"] + (f" ({shown})" if verdict else "")


def _worst(r: dict[str, Any] | None) -> str:
    worst = (r or {}).get("layout_check_worst")
    return f"{worst[0]:.2g} ({worst[1]:.2g})" if worst else ""


def _model_rows(rows: list[dict[str, Any]], optimizers: list[str]) -> list[list[str]]:
    by_key: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_key.setdefault(r["key"], {})[r.get("optimizer", "")] = r
    cells = []
    for key, runs in by_key.items():
        first = next(iter(runs.values()))
        model = [key, first.get("family", ""), first.get("size", ""), str(first.get("params_m", ""))]
        if all(r.get("status") == "skipped" for r in runs.values()):
            cells.append([*model, "skipped", *[""] * (len(optimizers) + 2)])
            continue
        per = [runs.get(o) for o in optimizers]
        kept = {r.get("layout_kept", "") for r in per if r}
        cells.append([*model, *[_cell(r) for r in per],
                      " / ".join(_worst(r) for r in per),
                      " / ".join(str((r or {}).get("layout_check_seconds", "")) for r in per),
                      kept.pop() if len(kept) == 1 else " / ".join(str((r or {}).get("layout_kept", "")) for r in per)])
    return cells


def _confirm_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    cells = []
    for r in _checked(rows):
        c = r.get("confirm")
        if not c:
            continue
        gap, noise = c.get("gap") or {}, c.get("noise") or {}
        run = c.get("error_channels_last") or "trained"
        for other in ("nchw", "nudged"):
            if c.get(f"error_{other}"):
                run = f"{other} raised: {c[f'error_{other}']}"
        exact = c.get("float64") or {}
        cells.append([r["key"], OPTIMIZER_NAMES.get(r.get("optimizer", ""), ""), r["layout_check"],
                      c.get("verdict", ""), pair(gap.get("loss"), noise.get("loss")),
                      pair(gap.get("update"), noise.get("update"))
                      + (f" (`{gap['update_param']}`)" if gap.get("update_param") else ""),
                      " ; ".join(f"{k} {pair(exact[n]['loss'], exact[n]['update'])}"
                                 for k, n in (("CL", "channels_last"), ("NCHW", "nchw"),
                                              ("NCHW without oneDNN", "nchw_native")) if n in exact),
                      run, r.get("layout_check_line", "") if r["layout_check"] != "passed" else ""])
    return cells


def check_page(rows: list[dict[str, Any]], m: dict[str, Any], command: str, args: argparse.Namespace,
               optimizers: list[str]) -> str:
    """docs/zoo_check.md: how it was made, the false-alarm summary, each model's verdicts, each confirmation."""
    names = [OPTIMIZER_NAMES[o] for o in optimizers]
    scope = "every model" if args.confirm_passes == "all" else ", ".join(
        f"`{p}`" for p in args.confirm_passes.split(",") if p) or "no model"
    return page("The first-batch layout check over the zoo", [
        "Made by " + ", then ".join(f"`{c}`" for c in [*m.get("earlier_commands", []), command])
        + f" (resumed: the rows already made kept), {m.get('started', '?')} to {m.get('ended', '?')}."
        if m.get("earlier_commands") else f"Made by `{command}`, {m.get('started', '?')} to {m.get('ended', '?')}.",
        machine_lines(m, ": the machine is shared, so the check's seconds are upper bounds, not speed measurements."),
        "Each model (built from config, random weights, nothing downloaded) with each optimizer ("
        + ", ".join(f"{OPTIMIZER_NAMES[o]} {OPTIMIZER_SETTINGS[o]}" for o in optimizers) + ") in its own process: a "
        f"real `Trainer` with `ChannelsLast()` for 2 steps, batch {args.batch} at "
        f"{f'{args.size} px' if args.size else 'its size (px in the table)'}, 32-true, and the "
        "first-batch layout check's verdict. Where "
        "the verdict is fallback or contiguous (and for the passes of "
        f"{scope}), the same process trains {args.confirm_steps} steps three more times from the same "
        "initialisation, seed, batches and optimizer: NCHW without the callback; NCHW with every parameter nudged by "
        f"a relative {NUDGE:g} (the noise reference); channels_last with `ChannelsLast(verify=False)`. Gaps are the "
        "largest relative difference from the NCHW run of the losses (per step), and the relative difference of the "
        "parameter updates over the whole model (the parameter farthest off on its own named). The channels_last run "
        "diverges where it raised or crashed, or a gap is above "
        f"{FACTOR:g}x the nudged run's and above {MIN_GAP:g}: a fallback is then **confirmed**, else **FALSE** (a "
        "false fallback); a pass is **right**, or **MISSED** where it diverges (`scripts/zoo/confirm.py`). A "
        "channels_last run that diverged without raising is run twice more, NCHW in float64 and NCHW fp32 without "
        f"oneDNN: *rounding* where channels_last fp32 is within {FACTOR:g}x as close to float64 as the farther NCHW "
        "fp32 run (fp32 kernels round differently), *channels_last off* where it is farther.",
    ], {
        "Summary": check_summary(rows, optimizers),
        "Every model": [
            "Each optimizer's verdict (its confirmation); the largest relative difference between the layouts where "
            "they agreed and the noise measured there (`nan`: no noise run was needed); the check's seconds.", "",
            table(["model", "family", "px", "params (M)", *names, "largest agreeing difference (noise)", "check s",
                    "layout kept"], _model_rows(rows, optimizers))],
        "Confirmations": [
            "Gaps from the NCHW run, of the channels_last run and of the nudged run (the noise); where the "
            "channels_last run diverged, how far each fp32 run is from the float64 run (loss / update).", "",
            table(["model", "optimizer", "verdict", "confirmation", "loss gap / noise", "update gap / noise",
                    "off float64 (loss / update)", "channels_last run", "the check's line"], _confirm_rows(rows))],
    })


# ---- docs/projects.md ----------------------------------------------------------------------------------------------


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
    metrics_nc, metrics_cl = ({**(run.get("metrics") or {}), **(run.get("val_outputs") or {})} for run in (nc, cl))
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
    found = [r["key"] for r in ran if any(c["verdict"] in FALLBACK_VERDICTS
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

