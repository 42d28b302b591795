"""``train(cfg)``: the whole training run behind ``python train.py``, testable without a shell.

Steps: check the config (``validate``, before anything is
built), claim the run directory, seed, build the data (generating the demo set on
first use), the model (converted to channels_last first when it will be
compiled), the ``ImageClassifier`` and a Lightning
``Trainer`` whose accelerator and precision come from ``device`` / ``amp``; then
fit (or resume from ``ckpt_path``) or, with ``evaluate_only``, validate; finally
write ``metrics.json`` and print the result.

Example::

    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir="/path/to/conf", version_base="1.3"):
        cfg = compose("config", overrides=["experiment=smoke", "run_dir=/tmp/run1"])
    metrics = train(cfg)          # {"val_top1": ..., "images_per_second": ..., ...}
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf

from cltrain.app.components import build_callbacks, build_loggers
from cltrain.app.config import ConfigError, Resolved, validate
from cltrain.app.console import quiet_console
from cltrain.app.datasource import absolute
from cltrain.app.datasource import build_datamodule
from cltrain.app.ema import EMA, weights_in_checkpoint
from cltrain.app.finite import NonFiniteLossError, StopOnNonFinite
from cltrain.app.models import build_model
from cltrain.app.module import ImageClassifier
from cltrain.app.progress import MainAmpProgress, main_amp_progress_bar
from cltrain.app.report import write_metrics
from cltrain.app.rundir import claim_run_dir, is_slurm_requeue
from cltrain.app.schedule import scaled_lr
from cltrain.app.signals import RunInterrupted, SignalStop
from cltrain.atomic import DiskFullError
from cltrain.checkpoint_io import AtomicCheckpointIO

__all__ = ["build_datamodule", "resume_command", "train"]


def _run_dir(cfg: DictConfig) -> Path:
    if cfg.get("run_dir"):
        return claim_run_dir(cfg.run_dir, "run_dir")
    if HydraConfig.initialized():  # claimed by RunDirGuard before Hydra wrote into it; this finds our claim
        return claim_run_dir(HydraConfig.get().runtime.output_dir, "hydra.run.dir")
    raise ConfigError("run_dir", None, "not set and not running under Hydra", "a directory path")


def _refuse_ddp_in_a_sweep(cfg: DictConfig) -> None:
    # Lightning's DDP launcher starts the other processes by re-running this command line, which
    # in a -m sweep would start the whole sweep again. torchrun/SLURM start them themselves.
    devices = cfg.trainer.devices
    many = (len(devices) if isinstance(devices, (list, ListConfig)) else devices if isinstance(devices, int) else 1) > 1
    from lightning.fabric.plugins.environments import SLURMEnvironment

    started_by_scheduler = "WORLD_SIZE" in os.environ or SLURMEnvironment.detect()  # hydra/launcher=slurm
    if (many or cfg.trainer.num_nodes > 1) and not started_by_scheduler and HydraConfig.initialized() \
            and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise ConfigError("trainer.devices", devices, "more than one process cannot be launched inside a -m sweep",
                          "1 in a sweep; or run each DDP config on its own, or under torchrun/SLURM")


def _apply_cuda_math(cfg: DictConfig) -> None:
    """``tf32``: process-wide switches, set before the model is built (``trainer.benchmark``: Lightning's)."""
    torch.backends.cudnn.allow_tf32 = cfg.tf32
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32  # what set_float32_matmul_precision("high"/"highest") sets
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")


def _callbacks(cfg: DictConfig, resolved: Resolved, run_dir: Path, stop: SignalStop) -> tuple[list[Callback], MainAmpProgress, dict[str, Any]]:
    bar = cfg.trainer.get("enable_progress_bar", False)  # one progress display: the bar or main_amp's lines
    progress = MainAmpProgress(print_freq=cfg.print_freq, warmup=cfg.throughput_warmup, lines=not bar)
    callbacks: list[Callback] = [progress, stop]
    parts: dict[str, Any] = {}
    if cfg.channels_last:
        from cltrain.callback import ChannelsLast

        parts["channels_last"] = ChannelsLast(mode=cfg.channels_last_mode)
        callbacks.append(parts["channels_last"])
    # A progress bar fed from host values (nothing prog_bar=True per step: no per-step sync); EMA weights
    # when ema.enabled=true. The learning rate is logged by LearningRateMonitor (callbacks/lr_monitor.yaml, a default).
    if bar:
        callbacks.append(main_amp_progress_bar())
    if cfg.ema.enabled and not cfg.evaluate_only:
        callbacks.append(EMA(cfg.ema.decay, cfg.ema.warmup_steps, cfg.ema.every_n_steps))
    if cfg.data.get("bad_files") == "skip":  # counts what the DataModule's workers left out, per epoch
        from cltrain.data import SkippedFilesReport

        callbacks.append(SkippedFilesReport())
    if not cfg.evaluate_only:
        checkpoints = run_dir / "checkpoints"
        # The best k by val/top1, apart from last.ckpt: with a monitor, Lightning's save_last only
        # writes last.ckpt when the metric improves, so the latest state has its own checkpoint callback.
        parts["best"] = ModelCheckpoint(dirpath=checkpoints, filename="best-epoch{epoch:03d}", monitor="val/top1",
                                        mode="max", save_top_k=cfg.checkpoint.save_top_k, auto_insert_metric_name=False)
        parts["last"] = ModelCheckpoint(dirpath=checkpoints, filename="last", monitor=None, save_top_k=1,
                                        every_n_epochs=1, save_on_train_epoch_end=True, enable_version_counter=False)
        parts["on_exception"] = _KeepOnException(checkpoints, filename="last")  # signal or crash: the latest state
        callbacks += [parts["best"], parts["last"], parts["on_exception"]]
        # A NaN loss stops the run (checked where the progress line syncs anyway), before NaN weights are saved.
        try_amp = ", or amp=false" if resolved.precision != "32-true" else ""
        callbacks.append(StopOnNonFinite(every=cfg.print_freq, hint=f"; {checkpoints / 'last.ckpt'} (if written) keeps the "
                                                                     f"latest finite state. Try a lower optim.lr{try_amp}"))
    return callbacks, progress, parts


class _KeepOnException(Callback):
    """Writes ``last.ckpt`` when a run stops on an exception or signal, and keeps it.

    Not Lightning's ``OnExceptionCheckpoint``: that one deletes its file in ``teardown`` (after a
    normal run, the epoch-end ``last.ckpt``), and its presence makes ``fit(ckpt_path=None)`` look
    for a checkpoint to resume from. A run stopped for a non-finite loss is not saved: its weights
    are NaN, and the ``last.ckpt`` it has is the latest finite state; nor is a run stopped by a full
    disk: the save would fail again, and the ``last.ckpt`` it has is intact."""

    def __init__(self, dirpath: Path, filename: str = "last") -> None:
        self.ckpt_path = str(Path(dirpath) / f"{filename}.ckpt")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, (NonFiniteLossError, DiskFullError)):
            trainer.save_checkpoint(self.ckpt_path)


def _percent(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return None if value is None else round(100.0 * float(value), 3)


def resume_command(run_dir: Path) -> str:
    """The command that resumes this run from its ``last.ckpt`` (the same overrides, in a new run directory)."""
    overrides: list[str] = []
    if HydraConfig.initialized():
        overrides = [o for o in HydraConfig.get().overrides.task
                     if o.split("=", 1)[0].lstrip("+~") not in ("ckpt_path", "run_dir")]
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else "train.py"
    args = [*overrides, f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"]
    return " ".join(["python", shlex.quote(script), *(shlex.quote(a) for a in args)])


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured training (or evaluation); returns the final metrics (also in ``metrics.json``).

    A run stopped by SIGTERM / SIGINT saves ``checkpoints/last.ckpt``, writes ``metrics.json``
    with ``"status": "interrupted"``, prints the resume command and raises ``SystemExit(143 / 130)``.
    A run that fails with an exception saves ``last.ckpt`` too, and writes ``"status": "failed"``.
    Checkpoints are saved atomically (``AtomicCheckpointIO``): a save that
    fails for lack of space raises ``DiskFullError`` and leaves the previous
    ``last.ckpt`` as it was.

    Raises:
        ConfigError: a bad config value (raised before anything is built), or a run
            directory that cannot be this run's.
    """
    resolved: Resolved = validate(cfg)
    _refuse_ddp_in_a_sweep(cfg)
    run_dir = _run_dir(cfg)
    started = time.perf_counter()
    with SignalStop() as stop:
        try:
            with quiet_console():
                return _train(cfg, resolved, run_dir, stop, started)
        except RunInterrupted as interrupt:
            code = 128 + interrupt.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
            if not getattr(interrupt, "reported", False):
                print(f"cltrain: interrupted by {signal.Signals(interrupt.signum).name} before training started; "
                      "nothing to resume", file=sys.stderr, flush=True)
    raise SystemExit(code)


_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def _guard(cfg: DictConfig, resolved: Resolved, model: torch.nn.Module) -> list[Any]:
    """Work around known kernel faults the callback does not see (cltrain.guardrails); returns the records.

    bf16 Conv3d weight gradients are wrong on the CPU in either layout, with or without the ChannelsLast
    callback. A model to compile is converted here, before compiling, so its layout's faults are guarded
    here too (the callback then finds nothing to convert)."""
    from cltrain.guardrails import apply_guardrails

    records: list[Any] = []
    dtype = _AUTOCAST.get(resolved.precision)
    if cfg.compile.enabled and cfg.channels_last:
        from cltrain import to_channels_last

        to_channels_last(model, mode=cfg.channels_last_mode)
        records += apply_guardrails(model, device=resolved.accelerator, dtype=dtype, layout="channels_last")
    elif dtype is torch.bfloat16 and resolved.accelerator == "cpu" and not cfg.evaluate_only:
        records += apply_guardrails(model, device="cpu", dtype=dtype, layout="contiguous")
    for record in records:
        rank_zero_info(f"cltrain: worked around a known kernel fault: {record.line()}")
    return records


def _train(cfg: DictConfig, resolved: Resolved, run_dir: Path, stop: SignalStop, started: float) -> dict[str, Any]:
    _apply_cuda_math(cfg)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = build_datamodule(cfg)
    kwargs = cfg.model.get("kwargs")
    model = build_model(cfg.model.name, datamodule.num_classes, cfg.model.source,
                        absolute(cfg.model.pretrained), {} if kwargs is None else OmegaConf.to_container(kwargs))
    guarded = _guard(cfg, resolved, model)
    if cfg.compile.enabled:
        model.compile(backend=cfg.compile.backend)  # in place: state_dict keys stay unprefixed

    callbacks, progress, parts = _callbacks(cfg, resolved, run_dir, stop)
    loggers = build_loggers(cfg.get("logger"), run_dir)
    callbacks += build_callbacks(cfg.get("callbacks"), run_dir, has_logger=bool(loggers)).values()
    trainer: pl.Trainer = instantiate(
        cfg.trainer, accelerator=resolved.accelerator, devices=resolved.devices, precision=resolved.precision,
        callbacks=callbacks, logger=loggers or False, plugins=[AtomicCheckpointIO()],  # atomic saves, weights_only loads
        benchmark=resolved.benchmark, default_root_dir=str(run_dir),
    )
    global_batch = cfg.data.batch_size * trainer.world_size * trainer.accumulate_grad_batches
    optim = cfg.optim
    lr = scaled_lr(optim.lr, global_batch) if optim.scale_lr else optim.lr
    # every optimizer and schedule key of the optim option's schema (SGD: momentum, nesterov; AdamW: betas)
    hparams = {k: tuple(v) if isinstance(v, list) else v for k, v in OmegaConf.to_container(optim).items()
               if k not in ("name", "lr", "scale_lr")}
    module = ImageClassifier(model, datamodule.num_classes, lr=lr, optimizer=optim.name,
                             label_smoothing=cfg.label_smoothing, **hparams)

    def finish(status: str, error: BaseException | None = None) -> dict[str, Any]:
        metrics = _final_metrics(cfg, resolved, trainer, progress, parts, model, run_dir, global_batch, lr)
        callback_records = getattr(parts.get("channels_last"), "guardrails", None) or []
        metrics["guardrails"] = [r.as_dict() for r in (*guarded, *callback_records)]
        checks = getattr(parts.get("channels_last"), "layout_checks", None) or {}
        metrics["layout_check"] = {kind: check.as_dict() for kind, check in checks.items()}
        metrics["status"] = status
        # which weights val_* and the best checkpoint are of ("ema" | "live"; pretrained weights: "live")
        if cfg.evaluate_only:
            metrics["weights"] = weights_in_checkpoint(ckpt_path) or "live"
        else:
            metrics["weights"] = "ema" if cfg.ema.enabled else "live"
        if error is not None and status == "failed":
            metrics["error"] = f"{type(error).__name__}: {error}".splitlines()[0]
        metrics["wall_time_s"] = round(time.perf_counter() - started, 2)
        if trainer.is_global_zero:
            write_metrics(run_dir, metrics, replace=is_slurm_requeue())  # a requeued job ends its own run
        return metrics

    ckpt_path = absolute(cfg.get("ckpt_path"))
    rank_zero_info(f"cltrain: precision {resolved.precision} ({resolved.precision_reason})")
    try:
        if cfg.evaluate_only:
            with warnings.catch_warnings():  # "callbacks used to create the checkpoint": not needed to validate
                warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`")
                trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False)
        else:
            rank_zero_info(f"cltrain: lr {lr:.4g} (optim.lr {optim.lr} x global batch {global_batch} / 256)"
                           if optim.scale_lr else f"cltrain: lr {lr:.4g}")
            with stop.deferred():
                trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
            if stop.signum is not None or trainer.received_sigterm:
                raise RunInterrupted(stop.signum or signal.SIGTERM)
            if progress.last_val_step != trainer.global_step:  # the final model has not been validated yet
                trainer.validate(module, datamodule=datamodule, verbose=False)
    except (RunInterrupted, SIGTERMException, KeyboardInterrupt) as err:
        signum = getattr(err, "signum", None) or stop.signum or (signal.SIGTERM if trainer.received_sigterm else signal.SIGINT)
        metrics = finish("interrupted")
        if trainer.is_global_zero:
            last = metrics.get("last_checkpoint")
            how = f"resume with: {resume_command(run_dir)}" if last else "no checkpoint was written (stopped before training)"
            print(f"\ncltrain: interrupted by {signal.Signals(signum).name} at step {trainer.global_step}; {how}",
                  file=sys.stderr, flush=True)
        interrupt = RunInterrupted(signum)
        interrupt.reported = True
        raise interrupt from None
    except Exception as err:
        if not cfg.evaluate_only:
            try:  # last.ckpt was written by the on-exception checkpoint; say so in metrics.json
                finish("failed", err)
            except Exception:  # noqa: BLE001 - the original error is the one to show
                pass
        raise

    metrics = finish("completed")
    if trainer.is_global_zero:
        unit = "clips" if len(getattr(datamodule, "input_shape", ())) == 5 else "images"  # what a sample is
        print(_summary_line(metrics, datamodule.num_classes, unit), flush=True)
    return metrics


def _kept_layout(cfg: DictConfig, parts: dict[str, Any], model: torch.nn.Module) -> str:
    """The layout the model trained in: ``mode="auto"`` may have kept contiguous."""
    if not cfg.channels_last:
        return "contiguous"
    layout = getattr(parts.get("channels_last"), "layout", None)
    if layout in ("channels_last", "contiguous"):
        return layout
    from cltrain.layout import is_channels_last

    conv = next((m.weight for m in model.modules() if isinstance(m, torch.nn.Conv2d)), None)
    return "channels_last" if conv is None or is_channels_last(conv) else "contiguous"


def _checkpoint_path(path: str | None, run_dir: Path) -> str | None:
    """``path`` if it is a file of this run (a resumed run's callback state can name the previous run's)."""
    return path if path and Path(path).is_file() and Path(path).is_relative_to(run_dir) else None


def _final_metrics(cfg: DictConfig, resolved: Resolved, trainer: pl.Trainer, progress: MainAmpProgress,
                   parts: dict[str, Any], model: torch.nn.Module, run_dir: Path, global_batch: int,
                   lr: float) -> dict[str, Any]:
    logged = trainer.callback_metrics
    speed = progress.summary()
    best_cb: ModelCheckpoint | None = parts.get("best")
    best = best_cb.best_model_score if best_cb is not None else None
    last = run_dir / "checkpoints" / "last.ckpt"
    layout = _kept_layout(cfg, parts, model)
    return {
        "status": None,
        "model": cfg.model.name,
        "channels_last": layout == "channels_last",
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
        "train_top1": _percent(logged, "train/top1_epoch"),
        "epochs": trainer.current_epoch,
        "global_step": trainer.global_step,
        "best_checkpoint": _checkpoint_path(best_cb.best_model_path, run_dir) if best_cb is not None else None,
        "best_checkpoints": {} if best_cb is None else {
            p: round(100.0 * float(v), 3) for p, v in sorted(best_cb.best_k_models.items()) if _checkpoint_path(p, run_dir)},
        "last_checkpoint": str(last) if last.is_file() and not cfg.evaluate_only else None,
        "run_dir": str(run_dir),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def _optimizer_report(trainer: pl.Trainer) -> dict[str, Any] | None:
    """The optimizer that trained: its class, whether its step was fused, and why a fused one was declined."""
    if not trainer.optimizers:
        return None
    optimizer = trainer.optimizers[0]
    note = getattr(trainer.lightning_module, "optimizer_note", "")
    return {"name": type(optimizer).__name__, "fused": bool(optimizer.defaults.get("fused")), "note": note or None}


def _summary_line(m: dict[str, Any], num_classes: int, unit: str = "images") -> str:
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
