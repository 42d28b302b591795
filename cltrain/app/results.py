"""What a run reports: its final metrics (``metrics.json``) and its one-line summary.

``RunResults.finish(status)`` gathers the metrics from the Trainer and the run's callbacks (speed,
accuracy, checkpoints, the layout the model trained in, the guardrails and layout checks), writes
``metrics.json`` on rank zero and returns them; ``summary_line`` is the line printed at the end, and
``resume_command`` the command printed when a run is interrupted.
"""

from __future__ import annotations

import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from cltrain.app.config import Resolved
from cltrain.app.ema import weights_in_checkpoint
from cltrain.app.metrics_file import write_metrics
from cltrain.app.launch import launcher
from cltrain.app.rundir import is_slurm_requeue
from cltrain.app.callbacks import RunCallbacks
from cltrain.data.errors import error_line
from cltrain.data.remote import redact, redacted

__all__ = ["RunResults", "resume_command", "resume_line", "summary_line"]


@dataclass
class RunResults:
    """What a run's metrics are read from; ``finish`` reads them (at the end, or when the run stops)."""

    cfg: DictConfig
    resolved: Resolved
    trainer: pl.Trainer
    run: RunCallbacks
    run_dir: Path
    global_batch: int
    lr: float
    ckpt_path: str | None = None  # the checkpoint evaluated or resumed from
    guarded: list[Any] = field(default_factory=list)  # GuardRecords of workarounds applied outside the callback
    started: float = field(default_factory=time.perf_counter)

    def finish(self, status: str, error: BaseException | None = None) -> dict[str, Any]:
        """The final metrics with ``status`` (``"completed"``, ``"interrupted"``, ``"failed"``), written as
        ``metrics.json`` by rank zero (replacing the file only in a requeued SLURM job)."""
        cfg, parts = self.cfg, self.run.parts
        metrics = _final_metrics(cfg, self.resolved, self.trainer, self.run, self.run_dir,
                                self.global_batch, self.lr)
        callback_records = getattr(parts.get("channels_last"), "guardrails", None) or []
        metrics["guardrails"] = [r.as_dict() for r in (*self.guarded, *callback_records)]
        checks = getattr(parts.get("channels_last"), "layout_checks", None) or {}
        metrics["layout_check"] = {kind: check.as_dict() for kind, check in checks.items()}
        decisions = getattr(parts.get("channels_last"), "decisions", None) or {}
        metrics["layout_decisions"] = [decision.as_dict() for decision in decisions.values()]
        metrics["status"] = status
        # which weights val_* and the best checkpoint are of ("ema" | "live"; pretrained weights: "live")
        if cfg.evaluate_only:
            metrics["weights"] = weights_in_checkpoint(self.ckpt_path) or "live"
        else:
            metrics["weights"] = "ema" if cfg.ema.enabled else "live"
        if error is not None and status == "failed":
            metrics["error"] = redact(f"{type(error).__name__}: {error_line(error)}")  # a worker's: its own line
        metrics["wall_time_s"] = round(time.perf_counter() - self.started, 2)
        if self.trainer.is_global_zero:
            write_metrics(self.run_dir, metrics, replace=is_slurm_requeue())  # a requeued job ends its own run
        return metrics


def resume_command(run_dir: Path) -> str:
    """The command that resumes this run from its ``last.ckpt`` (the same overrides, in a new run directory), with
    every secret in it shown as ``***`` (``redact``)."""
    return _command(_resume_args(run_dir))


def resume_line(run_dir: Path, evaluate: bool = False) -> str:
    """``resume with: <command>`` (``evaluate``: ``validate it with:`` the command with ``evaluate_only=true``, for
    a run that has nothing left to train), after a word on the secrets left out of the command where there were any."""
    args = _resume_args(run_dir) + (["evaluate_only=true"] if evaluate else [])
    left_out = any(redact(a) != a for a in args)
    started_by = launcher()  # the command alone would start one rank, which waits for the others
    return ("the secrets shown as *** are left out of this command: put them back, then " if left_out else "") + \
        (f"start the ranks with {started_by} as before, on every node, each to " if started_by else "") + \
        f"{'validate it' if evaluate else 'resume'} with: {_command(args)}"


def _command(args: list[str]) -> str:
    return " ".join(shlex.quote(redact(a)) for a in args)


def _resume_args(run_dir: Path) -> list[str]:
    overrides: list[str] = []
    if HydraConfig.initialized():  # as typed: they parsed once, so they parse again
        overrides = [o for o in HydraConfig.get().overrides.task
                     if o.split("=", 1)[0].lstrip("+~") not in ("ckpt_path", "run_dir", "evaluate_only")]
    # the console script (cltrain-train) has no train.py of its own to run
    script = ["python", sys.argv[0]] if sys.argv and sys.argv[0].endswith(".py") else ["cltrain-train"]
    return [*script, *overrides, f"ckpt_path={_hydra_value(str(run_dir / 'checkpoints' / 'last.ckpt'))}"]


def _hydra_value(text: str) -> str:
    """``text`` as a Hydra override's value: a plain path as it is, else quoted (a space, a non-ASCII letter, a
    parenthesis or a comma is Hydra syntax or a lexer error unquoted; ``true``, ``1e5`` would not be text)."""
    if "/" in text and re.fullmatch(r"[A-Za-z0-9_/.+%@:-]+", text):
        return text
    # inside quotes Hydra 1.3 reads a backslash as an escape only before a quote or at the end
    return '"' + re.sub(r'(\\*)("|\Z)', lambda m: m.group(1) * 2 + ("\\" + m.group(2) if m.group(2) else ""),
                        text) + '"'


def _percent(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return None if value is None else round(100.0 * float(value), 3)


def _kept_layout(cfg: DictConfig, parts: dict[str, Any]) -> str | None:
    """The layout the model trained in (the race of the layouts may have kept contiguous); before the callback's
    setup (a run that failed first) its pinned layout, or ``None``: not decided."""
    if not cfg.channels_last:
        return "contiguous"
    callback = parts["channels_last"]
    return callback.layout or callback.session.pinned


def _checkpoint_path(path: str | None, run_dir: Path) -> str | None:
    """``path`` if it is a file of this run (a resumed run's callback state can name the previous run's)."""
    return path if path and Path(path).is_file() and Path(path).is_relative_to(run_dir) else None


def _optimizer_report(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The optimizer that trained: its class, whether its step was fused, and why a fused one was declined."""
    if not trainer.optimizers:
        return None
    optimizer = trainer.optimizers[0]
    note = getattr(trainer.lightning_module, "optimizer_note", "")
    return {"name": type(optimizer).__name__, "fused": bool(optimizer.defaults.get("fused")), "note": note or None}


def _final_metrics(cfg: DictConfig, resolved: Resolved, trainer: pl.Trainer, run: RunCallbacks,
                  run_dir: Path, global_batch: int, lr: float) -> dict[str, Any]:
    """The run's metrics as ``metrics.json`` holds them, ``status`` still None."""
    logged = trainer.callback_metrics
    speed = run.progress.summary()
    best_cb: ModelCheckpoint | None = run.parts.get("best")
    best = best_cb.best_model_score if best_cb is not None else None
    last = run_dir / "checkpoints" / "last.ckpt"
    layout = _kept_layout(cfg, run.parts)
    return {
        "status": None,
        "model": cfg.model.name,
        "channels_last": None if layout is None else layout == "channels_last",  # None: failed before it was decided
        "layout": layout,
        "amp": cfg.amp,
        "precision": resolved.precision,
        "precision_reason": resolved.precision_reason,
        "optimizer": _optimizer_report(trainer),
        "device": resolved.accelerator,
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "world_size": trainer.world_size,
        "image_size": cfg.data.image_size,
        "batch_size": cfg.data.batch_size,
        "global_batch": global_batch,
        "lr": lr,
        "compile": cfg.compile.enabled,
        "evaluate_only": cfg.evaluate_only,
        **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in speed.items()},
        "val_top1": _percent(logged, "val/top1"),
        "val_top5": _percent(logged, "val/top5"),
        "val_loss": None if logged.get("val/loss") is None else round(float(logged["val/loss"]), 4),
        "best_val_top1": None if best is None else round(100.0 * float(best), 3),
        "train_top1": _percent(logged, "train/top1"),  # logged per epoch only: no _epoch suffix
        "epochs": _epochs_completed(trainer),
        "global_step": trainer.global_step,
        "best_checkpoint": _checkpoint_path(best_cb.best_model_path, run_dir) if best_cb is not None else None,
        "best_checkpoints": {} if best_cb is None else {
            p: round(100.0 * float(v), 3) for p, v in sorted(best_cb.best_k_models.items()) if _checkpoint_path(p, run_dir)},
        "last_checkpoint": str(last) if last.is_file() and not cfg.evaluate_only else None,
        "run_dir": str(run_dir),
        "config": redacted(OmegaConf.to_container(cfg, resolve=True)),  # a URL's password, a token: never on disk
    }


def _epochs_completed(trainer: pl.Trainer) -> int:
    """The epochs trained to their end: Lightning's ``current_epoch`` counts the one a ``max_steps`` stop ended in
    the middle as done (a signal's stop there it does not)."""
    loop = trainer.fit_loop
    if loop.epoch_loop.batch_progress.is_last_batch or loop.epoch_loop.batch_progress.current.completed == 0:
        return trainer.current_epoch
    return min(trainer.current_epoch, loop.epoch_progress.current.started - 1)


def summary_line(m: dict[str, Any], num_classes: int, unit: str = "images") -> str:
    """The run's one-line summary; ``unit``: what one sample is (``images_per_second`` counts clips for video)."""
    speed = (f"{m['images_per_second']:.1f} {unit}/s, {m['step_time_s']:.3f} s/step"
             if m.get("images_per_second") else f"{unit}/s: too few steps to measure")
    if m["evaluate_only"]:
        speed = f"{m['val_images_per_second']:.1f} {unit}/s (validation)" if m.get("val_images_per_second") else "-"
    top1 = "-" if m["val_top1"] is None else f"{m['val_top1']:.2f}%"
    top5 = "-" if m["val_top5"] is None else f"{m['val_top5']:.2f}%"
    math = ", tf32" if m["tf32"] and m["precision"] == "32-true" and m["device"] == "cuda" else ""
    return (f"\ncltrain: val top-1 {top1} (chance {100 / num_classes:.1f}%), top-5 {top5} | {speed} "
            f"| {m['model']}, global batch {m['global_batch']}, {m['layout']}, {m['precision']}{math}, {m['device']} "
            f"| {Path(m['run_dir']) / 'metrics.json'}")
