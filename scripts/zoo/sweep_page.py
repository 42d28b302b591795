"""docs/zoo.md, ``<out>.json`` and ``<out>.csv`` of ``python -m scripts.zoo.sweep``: how it was made, a summary and a
row per model, written atomically (``cltrain.timing.report``)."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from cltrain.timing.report import page, table, write_report
from scripts.zoo.pages import fmt_err, machine_lines, now
from scripts.zoo.parity import OK_BELOW


def _fmt_speed(speed: dict[str, float] | None) -> str:
    if not speed:
        return ""
    return f"{speed['channels_last']:.2f} / {speed['contiguous']:.2f} = **{speed['channels_last'] / speed['contiguous']:.2f}x**"


def _fmt_grad(grad: dict[str, Any]) -> str:
    if not grad:
        return ""
    cell = f"{fmt_err(grad.get('err_cl'))} / {fmt_err(grad.get('err_nc'))}"
    if grad.get("verdict") != "ok" and grad.get("grad_scale") is not None:
        cell += f" (its gradient {grad['grad_scale']:.0e} of the largest)"
    return cell + (f": {grad['why']}" if grad.get("why") else "")


def _row_cells(r: dict[str, Any]) -> list[str]:
    grad = r.get("grad") or {}
    status = r.get("status", "")
    trains = "" if "trains_contiguous" not in r else (
        f"{'yes' if r['trains_contiguous'] else 'NO'} / {'yes' if r.get('trains_channels_last') else 'NO'}")
    verdict = grad.get("verdict", "")
    if grad and "float64_error" in r:
        verdict += " (vs NCHW fp32)"
    if r.get("examined"):  # scripts/zoo/miss_check.py: the worst parameter's layer run alone
        verdict += f", examined: {r['examined']['verdict']}"
    if "compile_grad" in r:
        verdict += f"; compiled: {r['compile_grad']['verdict']}"
    note = "; ".join(filter(None, [r.get("note", ""), r.get("skipped", ""),
                                   f"no float64: {r['float64_error']}" if "float64_error" in r else ""]))
    speed = _fmt_speed(r.get("speed_fp32"))
    bf16 = _fmt_speed(r.get("speed_bf16"))
    if "compile_speed_fp32" in r:
        speed += f"<br>compiled {_fmt_speed(r['compile_speed_fp32'])}"
        bf16 += f"<br>compiled {_fmt_speed(r.get('compile_speed_bf16'))}" if r.get("compile_speed_bf16") else ""
    return [
        f"`{r['key']}`", r.get("family", ""), str(r.get("params_m", "")), status if status != "ok" else "ok", trains,
        f"{fmt_err(r['loss_err_cl'])} / {fmt_err(r.get('loss_noise'))}" if "loss_err_cl" in r else "", _fmt_grad(grad),
        f"`{grad.get('worst_param', '')}`" if grad.get("worst_param") else "", verdict, r.get("conv_weights_cl", ""),
        r.get("guardrails", ""), speed, bf16, "; ".join(filter(None, [note, (r.get("examined") or {}).get("why", "")])),
    ]


SWEEP_HEADER = ["model", "family", "params (M)", "run", "trains NCHW / CL", "step-0 loss err CL / fp32 noise",
          "worst grad err CL / fp32 noise (vs float64)", "worst parameter", "gradients", "conv weights CL", "guardrail",
          "fp32 steps/s CL / NCHW", "bf16 steps/s CL / NCHW", "note"]


def sweep_summary(rows: list[dict[str, Any]]) -> list[str]:
    """A few lines: how many ran, crashed, raised, missed; the speed ratios."""
    ran = [r for r in rows if r.get("status") != "skipped"]
    crashed = [r["key"] for r in ran if r.get("status", "").startswith(("crashed", "timeout"))]
    raised = [r["key"] for r in ran if r.get("status", "").startswith("raised")]
    cl_fail = [r["key"] for r in ran if r.get("trains_contiguous") and not r.get("trains_channels_last")]
    verdicts = [(r.get("grad") or {}).get("verdict") for r in ran]
    lines = [
        f"- {len(rows)} models: {len(ran)} ran, {len(rows) - len(ran)} skipped (over --max-params).",
        f"- Crashed or timed out: {len(crashed)}{': ' + ', '.join(crashed) if crashed else ''}. "
        f"Raised: {len(raised)}{': ' + ', '.join(raised) if raised else ''}. "
        f"Trained without ChannelsLast but not with it: {len(cl_fail)}{': ' + ', '.join(cl_fail) if cl_fail else ''}.",
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


# auto_fp32 and auto_bf16: the layout the default kept, in the records of sweeps that ran it (docs/zoo.json)
CSV_FIELDS = ["key", "family", "params_m", "status", "trains_contiguous", "trains_channels_last", "loss_err_cl",
              "loss_noise", "grad_verdict", "grad_why", "grad_err_cl", "grad_noise", "grad_scale", "layout_err_f64",
              "worst_param", "conv_weights_cl", "guardrails", "fp32_cl", "fp32_nchw", "bf16_cl", "bf16_nchw", "auto_fp32",
              "auto_bf16", "compile_grad_verdict", "compile_fp32_cl", "compile_fp32_nchw", "seconds", "note"]
_GRAD = {"grad_verdict": "verdict", "grad_why": "why", "grad_err_cl": "err_cl", "grad_noise": "err_nc",
         "grad_scale": "grad_scale", "layout_err_f64": "layout_err_f64", "worst_param": "worst_param"}
_SPEED = {"fp32_cl": ("speed_fp32", "channels_last"), "fp32_nchw": ("speed_fp32", "contiguous"),
          "bf16_cl": ("speed_bf16", "channels_last"), "bf16_nchw": ("speed_bf16", "contiguous"),
          "compile_fp32_cl": ("compile_speed_fp32", "channels_last"),
          "compile_fp32_nchw": ("compile_speed_fp32", "contiguous")}


def csv_row(r: dict[str, Any]) -> dict[str, Any]:
    """One row of ``<out>.csv``."""
    grad = r.get("grad") or {}
    return {**{k: r.get(k, "") for k in CSV_FIELDS}, **{k: grad.get(v, "") for k, v in _GRAD.items()},
            **{k: (r.get(key) or {}).get(layout, "") for k, (key, layout) in _SPEED.items()},
            "compile_grad_verdict": (r.get("compile_grad") or {}).get("verdict", "")}


def write_sweep(out: Path, rows: list[dict[str, Any]], m: dict[str, Any], command: str,
                args: argparse.Namespace) -> None:
    """``<out>.md`` (:func:`sweep_page`), ``<out>.json`` (every row) and ``<out>.csv``."""
    write_report(out, markdown=sweep_page(rows, m, command, args), data={"machine": m, "command": command, "rows": rows},
                 csv_rows=[csv_row(r) for r in rows], csv_fields=CSV_FIELDS)

