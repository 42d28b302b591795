"""Third-party Lightning libraries' own tasks under ``ChannelsLast``: anomalib, lightly, torchgeo (the cases:
``scripts/zoo/project_cases.py``; the method and the install: docs/benchmarks.md#projects).

    python -m scripts.zoo.projects                              # every case -> docs/projects.md, docs/projects.json
    python -m scripts.zoo.projects --only lightly:moco anomalib   # rerun some (keys or libraries); other rows kept
    python -m scripts.zoo.projects --fast --out /tmp/projects     # one case per library
    python -m scripts.zoo.projects --list
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, seed_everything

from cltrain.timing.clock import Stopwatch
from cltrain.timing.machine import machine, machine_line
from cltrain.timing.report import command_line
from scripts.fits import quiet_trainer
from scripts.harness import CASE, LAYOUTS, REPO, emit, options, python_module, run_child
from scripts.zoo.models import conv_weights_cl
from scripts.zoo.project_cases import CASES, Case
from scripts.zoo.pages import record, write_page

FAST = ["anomalib:reverse_distillation", "lightly:moco", "torchgeo:classification"]


# ---- one run, in the child process ----------------------------------------------------------------


class _ChannelsLastLines(logging.Handler):
    """Keeps, in order, every log record and warning whose message starts with "ChannelsLast" (the callback
    logs with ``rank_zero_info``, warns with ``rank_zero_warn``); a record once, whichever logger saw it."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self._last: logging.LogRecord | None = None  # a record propagates up the loggers, each handing it here

    def emit(self, record: logging.LogRecord) -> None:
        if record is not self._last and record.getMessage().startswith("ChannelsLast"):
            self.lines.append(record.getMessage())
        self._last = record

    def warning(self, message, category, filename, lineno, file=None, line=None) -> None:  # warnings.showwarning
        if str(message).startswith("ChannelsLast"):
            self.lines.append(str(message))
        print(f"{filename}:{lineno}: {category.__name__}: {message}", file=sys.stderr)


class _FirstOutputs(Callback):
    """The first training loss and a fingerprint of the first validation outputs (their float tensors' sums)."""

    def __init__(self) -> None:
        self.first_loss: float | None = None
        self.val_outputs: dict[str, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if self.first_loss is None and loss is not None:
            self.first_loss = float(loss)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if not self.val_outputs and outputs is not None:
            fields = outputs if isinstance(outputs, dict) else (
                {f.name: getattr(outputs, f.name) for f in dataclasses.fields(outputs)}
                if dataclasses.is_dataclass(outputs) else {"output": outputs})
            self.val_outputs = {f"val output {k}": float(v.detach().double().abs().sum())
                                for k, v in fields.items() if k != "image" and hasattr(v, "is_floating_point")
                                and v.is_floating_point()}


def child(case: Case, layout: str) -> dict[str, Any]:
    """Build the case, fit it with or without ``ChannelsLast()``, and say what happened."""
    from cltrain import ChannelsLast

    seed_everything(0, workers=True)
    handler = _ChannelsLastLines()
    for name in ("", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "cltrain"):
        logging.getLogger(name).addHandler(handler)
    logging.getLogger("cltrain").setLevel(logging.INFO)
    result: dict[str, Any] = {"key": case.key, "layout": layout, "trained": False}
    callback = ChannelsLast() if layout == "channels_last" else None
    recorder = _FirstOutputs()
    module = None
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = handler.warning
        try:
            module_name, function = case.build.split(":")
            built = getattr(importlib.import_module(module_name), function)(Path(tmp))
            module = built.module
            trainer = quiet_trainer(importlib.import_module(built.package).Trainer, **{
                **dict(accelerator="cpu", precision="32-true", max_steps=2, limit_val_batches=1, default_root_dir=tmp),
                **built.trainer}, callbacks=[recorder] + ([callback] if callback else []))
            trainer.fit(module, datamodule=built.datamodule, train_dataloaders=built.train_dataloaders,
                        val_dataloaders=built.val_dataloaders)
            result.update(trained=trainer.global_step > 0, steps=trainer.global_step,
                          metrics={k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1})
        except Exception as error:  # noqa: BLE001 - a raise is this run's result
            frame = traceback.extract_tb(error.__traceback__)[-1]
            result.update(error=f"{type(error).__name__}: {error}"[:400], at=f"{frame.filename}:{frame.lineno}")
            traceback.print_exc()
    result.update(first_loss=recorder.first_loss, val_outputs=recorder.val_outputs, lines=handler.lines,
                  conv_weights_cl=conv_weights_cl(module) if isinstance(module, torch.nn.Module) else "")
    if callback is not None:
        result.update(layout_kept=callback.layout, fallbacks=len(callback.fallbacks),
                      layout_checks={kind: check.as_dict() for kind, check in callback.layout_checks.items()})
    return result


# ---- the sweep, in the parent process ------------------------------------------------------------------


def run_case(case: Case, log_dir: Path, timeout: float) -> dict[str, Any]:
    """Both layouts of one case, each in its own subprocess; a crash or a timeout is that run's ``status``."""
    row: dict[str, Any] = {"key": case.key, "library": case.library, "task": case.task}
    if case.library and importlib.util.find_spec(case.library) is None:
        return {**row, "status": f"skipped: {case.library} is not installed"}
    row["version"] = importlib.metadata.version(case.library) if case.library else ""
    watch = Stopwatch().start()
    for layout in LAYOUTS:
        log = log_dir / f"{case.key.replace(':', '_')}.{layout}.log"
        child = run_child(python_module("scripts.zoo.projects", "--case", json.dumps(
            {"case": dataclasses.asdict(case), "layout": layout})), log=log, timeout=timeout)
        found = child.results()
        run = found[-1] if found else {"trained": False}
        run["status"] = child.failure() or (f"exited 0: {child.last_error()}" if not found
                                            else "raised" if "error" in run else "ok")
        row[layout] = {**run, "log": str(log)}
    row["status"] = "ok" if all(row[k]["status"] == "ok" for k in LAYOUTS) else "see runs"
    row["seconds"] = round(watch.elapsed(), 1)
    return row


def main(argv: list[str] | None = None) -> int:
    p = options(__doc__, only=([], "case keys (lightly:moco) or libraries (anomalib)"),
                fast=(False, f"one case per library: {', '.join(FAST)}"),
                out=(REPO / "docs" / "projects.md", "the page; its .json beside it"),
                log_dir=Path(tempfile.gettempdir()) / "projects_logs",
                timeout=(600.0, "seconds per run (one case, one layout)"), list=(False, "print the cases and exit"),
                case=CASE)
    args = p.parse_args(argv)
    if args.case:
        emit(child(Case(**args.case["case"]), args.case["layout"]))
        return 0
    if args.list:
        for case in CASES:
            print(f"{case.key:32} {case.task}")
        return 0
    wanted = set(args.only or (FAST if args.fast else [c.key for c in CASES]))
    cases = [c for c in CASES if c.key in wanted or c.library in wanted]
    if unknown := wanted - {c.key for c in cases} - {c.library for c in cases}:
        p.error(f"unknown case(s) {sorted(unknown)}; --list shows them")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    old = record(args.out, keep=bool(args.only))  # a rerun of some cases keeps the other rows and the commands
    rows = {r["key"]: r for r in old.get("rows", [])}
    runs = old.get("runs", []) + [{"command": command_line("scripts.zoo.projects", argv), "seconds": 0.0}]
    m = machine()
    print(machine_line(m), flush=True)
    order = [c.key for c in CASES]  # the others (a test's own cases) stay in the order they first ran
    watch = Stopwatch().start()
    for case in cases:
        row = rows[case.key] = run_case(case, args.log_dir, args.timeout)
        print(f"{case.key}: {row['status']} ({row.get('seconds', 0)} s)", flush=True)
        runs[-1]["seconds"] = round(watch.elapsed(), 1)
        write_page(args.out, {"runs": runs, "machine": m, "rows": sorted(
            rows.values(), key=lambda r: order.index(r["key"]) if r["key"] in order else len(order))})
    print(f"wrote {args.out} ({watch.elapsed():.0f} s); each run's log in {args.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
