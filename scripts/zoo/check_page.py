"""docs/zoo_check.md and ``<out>.json`` of ``python -m scripts.zoo.sweep --check-only``: the first-batch check's false
alarms, each model's verdicts and each confirmation, written atomically (``cltrain.timing.report``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cltrain.timing.report import page, table, write_report
from scripts.zoo.confirm import FACTOR, FALLBACK_VERDICTS, JUDGED, MIN_GAP, NUDGE, numerics
from scripts.zoo.pages import machine_lines, pair
from scripts.zoo.training import OPTIMIZER_NAMES, OPTIMIZER_SETTINGS


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
                     + (f"; no verdict (the run died first): {len(died)}: {', '.join(died)}" if died else "") + ".")
    fallbacks = [r for r in _checked(rows) if r["layout_check"] in FALLBACK_VERDICTS]
    false = _judged(rows, "FALSE")
    lines.append(f"- **False fallbacks: {len(false)}** of {len(fallbacks)} fallback or contiguous verdicts"
                 + ("." if not false else ": " + "; ".join(f"{_name(r)}: {r.get('layout_check_line', '')}"
                                                          for r in false)))
    confirmed = _judged(rows, "confirmed")
    lines.append(f"- Confirmed fallbacks: {len(confirmed)}"
                 + (": " + ", ".join(_name(r) for r in confirmed) if confirmed else "") + ".")
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
        if all(r.get("status") == "skipped" for r in runs.values()):
            cells.append([key, first.get("family", ""), first.get("size", ""), str(first.get("params_m", "")),
                          "skipped", *[""] * (len(optimizers) + 2)])
            continue
        per = [runs.get(o) for o in optimizers]
        kept = {r.get("layout_kept", "") for r in per if r}
        cells.append([key, first.get("family", ""), first.get("size", ""), str(first.get("params_m", "")),
                      *[_cell(r) for r in per],
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
        f"{f'{args.size} px' if args.size else 'its size (px in the table)'}, {args.check_precision}, and the "
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


def write_check(out: Path, rows: list[dict[str, Any]], m: dict[str, Any], command: str,
                args: argparse.Namespace, optimizers: list[str]) -> None:
    """``<out>.md`` (:func:`check_page`) and ``<out>.json`` (every row)."""
    write_report(out, markdown=check_page(rows, m, command, args, optimizers),
                 data={"command": command, "machine": m, "optimizers": optimizers, "rows": rows})

