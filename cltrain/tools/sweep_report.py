"""``cltrain-sweep-report``: a sweep's runs as a markdown table and a PNG chart.

    python train.py -m channels_last=true,false amp=auto,false     # -> multirun/<date>/<time>/{0,1,2,3}
    cltrain-sweep-report multirun/<date>/<time>                    # -> report.md, report.png there

Every run directory under the sweep directory holds a ``metrics.json`` (written by
``train(cfg)``); a run that stopped before it (a bad value, a crash) is listed as such, and an
interrupted or failed run is named so. The speed-up column compares each completed run with the
completed contiguous fp32 run of the same model, image size, global batch and device whose overrides
differ only in the layout and the precision (the same data, workers and steps). The chart needs
matplotlib (``pip install 'cltrain[report]'``).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cltrain.app.metrics_file import METRICS_FILE, read_metrics
from cltrain.atomic import atomic_open, atomic_write_text, remove_leftovers, removed_line

__all__ = ["collect", "label", "main", "markdown_table", "plot", "summary", "write_report"]


#: Overrides a sweep compares: a run's baseline may differ in these alone.
COMPARED = {"channels_last", "amp", "trainer.precision", "channels_last_layout"}
#: ``status`` of a run that left a job directory without ``metrics.json``.
NO_METRICS = "no metrics.json"


def collect(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Every ``metrics.json`` under ``sweep_dir`` (one per run) with the run's Hydra overrides, and each job
    directory of Hydra's without one (``status``: ``NO_METRICS``), ordered by run directory."""
    runs = []
    found = {p.parent for p in Path(sweep_dir).rglob(METRICS_FILE)} | {p.parent for p in Path(sweep_dir).rglob(".hydra")}
    for folder in sorted(found, key=lambda p: (len(p.parts), [int(t) if t.isdigit() else t  # job 2 before job 10
                                                              for t in re.split(r"(\d+)", str(p))])):
        path = folder / METRICS_FILE
        metrics = read_metrics(path) if path.is_file() else {"status": NO_METRICS, **_composed(folder)}
        metrics["run"] = str(folder.relative_to(sweep_dir)) or "."
        metrics["overrides"] = _overrides(folder)
        runs.append(metrics)
    return runs


def _composed(folder: Path) -> dict[str, Any]:
    """What the job's composed config (``.hydra/config.yaml``) says of its layout, for a job without metrics."""
    path = folder / ".hydra" / "config.yaml"
    if not path.is_file():
        return {}
    import yaml

    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return {}
    return {"channels_last": config["channels_last"]} if isinstance(config.get("channels_last"), bool) else {}


def _overrides(folder: Path) -> dict[str, str] | None:
    """``{key: value}`` of the job's ``.hydra/overrides.yaml`` (``None`` where there is none)."""
    path = folder / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    import yaml

    return dict(str(o).split("=", 1) if "=" in str(o) else (str(o), "") for o in yaml.safe_load(path.read_text()) or [])


def _completed(run: dict[str, Any]) -> bool:
    return run.get("status") in (None, "completed")


def label(run: dict[str, Any]) -> str:
    """A short name for a run's layout and precision, e.g. ``channels_last bf16-mixed``."""
    return f"{_layout(run)} {run.get('precision', '?')}"


def _baseline(run: dict[str, Any], runs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The completed contiguous fp32 run with the same model, image size, batch and device as ``run`` and, where both
    have their overrides, the same ones but for ``COMPARED``."""
    def key(r: dict[str, Any]) -> tuple:
        return r.get("model"), r.get("image_size"), r.get("global_batch"), r.get("device")

    def others(r: dict[str, Any]) -> dict[str, str] | None:
        given = r.get("overrides")
        return None if given is None else {k: v for k, v in given.items() if k.lstrip("+~") not in COMPARED}

    mine = others(run)
    for other in runs:
        theirs = others(other)
        if other.get("channels_last") is False and other.get("precision") == "32-true" and key(other) == key(run) \
                and _completed(other) and (mine is None or theirs is None or mine == theirs):
            return other
    return None


def _speedup(run: dict[str, Any], runs: Sequence[dict[str, Any]]) -> float | None:
    base = _baseline(run, runs) if _completed(run) else None
    if base is None or not base.get("images_per_second") or not run.get("images_per_second"):
        return None
    return run["images_per_second"] / base["images_per_second"]


def summary(runs: Sequence[dict[str, Any]]) -> str:
    """One line: how many runs, and how many did not complete (failed, interrupted, or no ``metrics.json``)."""
    counts: dict[str, int] = {}
    for run in runs:
        status = "completed" if _completed(run) else str(run.get("status"))
        counts[status] = counts.get(status, 0) + 1
    done = counts.pop("completed", 0)
    rest = "".join(f", {n} {status}" for status, n in sorted(counts.items()))
    note = " (not in the speed-ups; a job Hydra never started, in a sweep a signal stopped, has no directory)" if rest \
        else ""
    return f"{len(runs)} runs: {done} completed{rest}{note}."


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def markdown_table(runs: Sequence[dict[str, Any]]) -> str:
    """One row per run: config, images/second, step time, top-1, top-5, speed-up vs contiguous fp32; where the runs'
    overrides differ in more than the layout and precision (an lr sweep, an Optuna search), those overrides too."""
    given = [run.get("overrides") or {} for run in runs]
    keys = sorted({k for o in given for k in o if k not in COMPARED and not k.lstrip("+~").startswith("hydra")
                   and len({o.get(k) for o in given}) > 1})
    lines = [
        "| run |" + (" overrides |" if keys else "") + " model | layout | precision | device | batch | img/s "
        "| step (ms) | top-1 (%) | top-5 (%) | speed-up vs contiguous fp32 |",
        "|---|" + ("---|" if keys else "") + "---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run, overrides in zip(runs, given):
        step = run.get("step_time_s")
        speedup = _speedup(run, runs)
        status = "" if _completed(run) else f" ({run.get('status')})"
        differ = (" " + (" ".join(f"{k}={overrides[k]}" for k in keys if k in overrides) or "-") + " |") if keys else ""
        lines.append(
            f"| {run['run']}{status} |{differ} {run.get('model', '?')} | {_layout(run)} "
            f"| {run.get('precision', '?')} | {run.get('device', '?')} | {run.get('global_batch', '-')} "
            f"| {_fmt(run.get('images_per_second'), '.1f')} | {_fmt(step * 1000 if step else None, '.0f')} "
            f"| {_fmt(run.get('val_top1'), '.2f')} | {_fmt(run.get('val_top5'), '.2f')} "
            f"| {_fmt(speedup, '.2f') + 'x' if speedup else '-'} |"
        )
    return "\n".join(lines) + "\n"


def _layout(run: dict[str, Any]) -> str:
    """The run's layout; ``?`` where its record does not say (a job that wrote no metrics.json, a run that failed
    before its layout was decided)."""
    if run.get("channels_last") is None:
        return "?"
    return "channels_last" if run["channels_last"] else "contiguous"


def plot(runs: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """A PNG with two bar charts per run: training images/second (with speed-up) and validation top-1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{r['run']}: {label(r)}" for r in runs]
    speed = [r.get("images_per_second") or 0.0 for r in runs]
    top1 = [r.get("val_top1") or 0.0 for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.6 * len(runs) + 2), sharey=True)
    bars = ax1.barh(names, speed, color="tab:blue")
    for bar, run in zip(bars, runs):
        s = _speedup(run, runs)
        if s:
            ax1.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {s:.2f}x", va="center")
    ax1.set_xlabel("training images / second")
    ax1.invert_yaxis()
    ax2.barh(names, top1, color="tab:green")
    ax2.set_xlabel("validation top-1 (%)")
    model = {r.get("model") for r in runs}
    fig.suptitle(f"{', '.join(map(str, model))}: speed and accuracy per config (speed-up vs contiguous fp32)")
    fig.tight_layout()
    with atomic_open(path) as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
    return Path(path)


def write_report(sweep_dir: str | Path, out_dir: str | Path | None = None) -> tuple[Path, Path | None]:
    """Write ``report.md`` and ``report.png`` for the runs under ``sweep_dir``; returns their paths (the chart's
    ``None`` where matplotlib, the ``report`` extra, is not installed: the table is written without it).

    Raises:
        FileNotFoundError: no ``metrics.json`` under ``sweep_dir``.
    """
    runs = collect(sweep_dir)
    if not runs:
        raise FileNotFoundError(f"no {METRICS_FILE} under {sweep_dir}: is it a multirun directory of finished runs?")
    out = Path(out_dir or sweep_dir)
    out.mkdir(parents=True, exist_ok=True)
    removed = remove_leftovers(out)
    if removed:
        print(f"cltrain-sweep-report: {removed_line(removed, 'a report stopped while writing')}", file=sys.stderr)
    md, png = out / "report.md", out / "report.png"
    try:
        plot(runs, png)
    except ModuleNotFoundError as err:
        if (err.name or "").partition(".")[0] != "matplotlib":
            raise
        png = None
    chart = f"\n![images/second and top-1]({png.name})\n" if png is not None else ""
    atomic_write_text(md, f"# Sweep report: {sweep_dir}\n\n{summary(runs)}\n\n{markdown_table(runs)}"
                          f"{_optuna_best(Path(sweep_dir))}{chart}")
    return md, png


def _optuna_best(sweep_dir: Path) -> str:
    """The line for the best trial of an Optuna search (hparams_search=optuna), if this sweep was one."""
    path = sweep_dir / "optimization_results.yaml"
    if not path.is_file():
        return ""
    import yaml

    results = yaml.safe_load(path.read_text()) or {}
    params = ", ".join(f"{k}={v}" for k, v in (results.get("best_params") or {}).items())
    return f"\nOptuna best: val top-1 {results.get('best_value')} with {params}\n"



def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 and one line on a mistake)."""
    parser = argparse.ArgumentParser(prog="cltrain-sweep-report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory (Hydra's hydra.sweep.dir)")
    parser.add_argument("--out", type=Path, default=None, help="where to write report.md/report.png (default: sweep_dir)")
    args = parser.parse_args(argv)
    try:
        if not args.sweep_dir.is_dir():
            raise FileNotFoundError(f"{args.sweep_dir}: no such directory")
        md, png = write_report(args.sweep_dir, args.out)
    except FileNotFoundError as err:
        print(f"cltrain-sweep-report: error: {err}", file=sys.stderr)
        return 2
    runs = collect(args.sweep_dir)
    print(summary(runs))
    print(markdown_table(runs))
    if png is None:
        print(f"wrote {md}; the chart needs matplotlib: pip install 'cltrain[report]'")
    else:
        print(f"wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
