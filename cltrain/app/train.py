"""``train(cfg)``: the whole training run behind ``python train.py``, testable without a shell.

Steps: check the config (:func:`~cltrain.app.config.validate`, before anything is
built), claim the run directory, seed, build the data (generating the demo set on
first use), the model (converted to channels_last first when it will be
compiled), the :class:`~cltrain.app.module.ImageClassifier` and a Lightning
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
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_info
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf

from cltrain.app.config import ConfigError, Resolved, validate
from cltrain.app.models import build_model
from cltrain.app.module import ImageClassifier
from cltrain.app.progress import MainAmpProgress
from cltrain.app.report import write_metrics
from cltrain.app.rundir import check_run_dir
from cltrain.app.schedule import scaled_lr

__all__ = ["train"]


def _run_dir(cfg: DictConfig) -> Path:
    if cfg.get("run_dir"):
        return check_run_dir(cfg.run_dir, "run_dir")
    if HydraConfig.initialized():
        return check_run_dir(HydraConfig.get().runtime.output_dir, "hydra.run.dir")
    raise ConfigError("run_dir", None, "not set and not running under Hydra", "a directory path")


def _refuse_ddp_in_a_sweep(cfg: DictConfig) -> None:
    # Lightning's DDP launcher starts the other processes by re-running this command line, which
    # in a -m sweep would start the whole sweep again. torchrun/SLURM start them themselves.
    devices = cfg.trainer.devices
    many = (len(devices) if isinstance(devices, (list, ListConfig)) else devices if isinstance(devices, int) else 1) > 1
    if (many or cfg.trainer.num_nodes > 1) and "WORLD_SIZE" not in os.environ and HydraConfig.initialized() \
            and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise ConfigError("trainer.devices", devices, "more than one process cannot be launched inside a -m sweep",
                          "1 in a sweep; or run each DDP config on its own, or under torchrun/SLURM")


def _absolute(path: Any) -> str | None:
    return None if path is None else str(Path(str(path)).expanduser().resolve())


def build_datamodule(cfg: DictConfig) -> pl.LightningDataModule:
    """The configured DataModule (``data._target_``), with the demo set generated first when configured."""
    data = OmegaConf.to_container(cfg.data, resolve=True)
    demo = data.pop("demo", None)
    data["root"] = _absolute(data["root"])
    if demo is not None:
        from hydra.utils import get_method

        # data.demo._target_ picks the generator (the video demo names its own); default: the image demo.
        make_demo = get_method(demo.pop("_target_", "cltrain.data.make_demo_dataset"))
        try:
            make_demo(data["root"], **demo)
        except FileExistsError as err:  # a different folder already sits at root
            raise ConfigError("data.root", data["root"], str(err).split(": ", 1)[-1],
                              "a new path, or the demo folder made with the same data.demo settings") from None
    try:
        datamodule = instantiate(data, channels_last=cfg.channels_last)
    except InstantiationException as err:  # a bad data.* argument: the DataModule's ValueError names it
        raise ConfigError("data", data.get("_target_"), str(err.__cause__ or err).splitlines()[0]) from None
    try:
        datamodule.num_classes  # reads the class folders: a missing split or class fails here, not in a worker
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError("data.root", data["root"], str(err), "an ImageNet-layout folder: train/<class>/, val/<class>/") from None
    return datamodule


def _callbacks(cfg: DictConfig, run_dir: Path) -> tuple[list[Callback], MainAmpProgress, ModelCheckpoint | None]:
    progress = MainAmpProgress(print_freq=cfg.print_freq, warmup=cfg.throughput_warmup)
    callbacks: list[Callback] = [progress]
    if cfg.channels_last:
        from cltrain.callback import ChannelsLast

        callbacks.append(ChannelsLast(mode=cfg.channels_last_mode))
    checkpoint = None
    if not cfg.evaluate_only:
        checkpoint = ModelCheckpoint(dirpath=run_dir / "checkpoints", filename="best-epoch{epoch:03d}",
                                     monitor="val/top1", mode="max", save_last=True, auto_insert_metric_name=False)
        callbacks.append(checkpoint)
    return callbacks, progress, checkpoint


def _percent(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return None if value is None else round(100.0 * float(value), 3)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured training (or evaluation); returns the final metrics (also in ``metrics.json``).

    Raises:
        ConfigError: a bad config value (raised before anything is built), or a run
            directory that already holds a run.
    """
    resolved: Resolved = validate(cfg)
    _refuse_ddp_in_a_sweep(cfg)
    run_dir = _run_dir(cfg)
    started = time.perf_counter()
    pl.seed_everything(cfg.seed, workers=True, verbose=False)

    datamodule = build_datamodule(cfg)
    kwargs = cfg.model.get("kwargs")
    model = build_model(cfg.model.name, datamodule.num_classes, cfg.model.get("source", "auto"),
                        _absolute(cfg.model.get("pretrained")), {} if kwargs is None else OmegaConf.to_container(kwargs))
    if cfg.compile:
        if cfg.channels_last:  # compile sees the final layout; the callback then finds nothing to convert
            from cltrain import to_channels_last

            to_channels_last(model, mode=cfg.channels_last_mode)
        model.compile(backend=cfg.compile_backend)  # in place: state_dict keys stay unprefixed

    callbacks, progress, checkpoint = _callbacks(cfg, run_dir)
    trainer: pl.Trainer = instantiate(
        cfg.trainer, accelerator=resolved.accelerator, devices=resolved.devices, precision=resolved.precision,
        callbacks=callbacks, logger=CSVLogger(save_dir=run_dir, name="csv", version=""),
        sync_batchnorm=cfg.sync_bn, deterministic=cfg.deterministic, default_root_dir=str(run_dir),
    )
    global_batch = cfg.data.batch_size * trainer.world_size * trainer.accumulate_grad_batches
    optim = cfg.optim
    lr = scaled_lr(optim.lr, global_batch) if optim.get("scale_lr", True) else optim.lr
    module = ImageClassifier(
        model, datamodule.num_classes, lr=lr, optimizer=optim.name, momentum=optim.get("momentum", 0.9),
        weight_decay=optim.weight_decay, nesterov=optim.get("nesterov", False),
        betas=tuple(optim.get("betas", (0.9, 0.999))), warmup_epochs=optim.warmup_epochs,
        milestones=tuple(optim.milestones), gamma=optim.gamma, label_smoothing=cfg.label_smoothing,
    )

    ckpt_path = _absolute(cfg.get("ckpt_path"))
    if cfg.evaluate_only:
        with warnings.catch_warnings():  # "callbacks used to create the checkpoint": not needed to validate
            warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`")
            trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False)
    else:
        rank_zero_info(f"cltrain: lr {lr:.4g} (optim.lr {optim.lr} x global batch {global_batch} / 256)"
                       if optim.get("scale_lr", True) else f"cltrain: lr {lr:.4g}")
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        if progress.last_val_step != trainer.global_step:  # the final model has not been validated yet
            trainer.validate(module, datamodule=datamodule, verbose=False)

    metrics = _final_metrics(cfg, resolved, trainer, progress, checkpoint, run_dir, global_batch, lr)
    metrics["wall_time_s"] = round(time.perf_counter() - started, 2)
    if trainer.is_global_zero:
        write_metrics(run_dir, metrics)
        print(_summary_line(metrics, datamodule.num_classes), flush=True)
    return metrics


def _final_metrics(cfg: DictConfig, resolved: Resolved, trainer: pl.Trainer, progress: MainAmpProgress,
                   checkpoint: ModelCheckpoint | None, run_dir: Path, global_batch: int, lr: float) -> dict[str, Any]:
    logged = trainer.callback_metrics
    speed = progress.summary()
    best = checkpoint.best_model_score if checkpoint is not None else None
    return {
        "model": cfg.model.name,
        "channels_last": cfg.channels_last,
        "amp": cfg.amp,
        "precision": resolved.precision,
        "device": resolved.accelerator,
        "world_size": trainer.world_size,
        "image_size": cfg.data.image_size,
        "batch_size": cfg.data.batch_size,
        "global_batch": global_batch,
        "lr": lr,
        "compile": cfg.compile,
        "evaluate_only": cfg.evaluate_only,
        **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in speed.items()},
        "val_top1": _percent(logged, "val/top1"),
        "val_top5": _percent(logged, "val/top5"),
        "val_loss": None if logged.get("val/loss") is None else round(float(logged["val/loss"]), 4),
        "best_val_top1": None if best is None else round(100.0 * float(best), 3),
        "train_top1": _percent(logged, "train/top1_epoch"),
        "epochs": trainer.current_epoch,
        "global_step": trainer.global_step,
        "best_checkpoint": checkpoint.best_model_path if checkpoint is not None else None,
        "last_checkpoint": checkpoint.last_model_path if checkpoint is not None else None,
        "run_dir": str(run_dir),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def _summary_line(m: dict[str, Any], num_classes: int) -> str:
    speed = (f"{m['images_per_second']:.1f} images/s, {m['step_time_s']:.3f} s/step"
             if m.get("images_per_second") else "images/s: too few steps to measure")
    if m["evaluate_only"]:
        speed = f"{m['val_images_per_second']:.1f} images/s (validation)" if m.get("val_images_per_second") else "-"
    layout = "channels_last" if m["channels_last"] else "contiguous"
    top1 = "-" if m["val_top1"] is None else f"{m['val_top1']:.2f}%"
    top5 = "-" if m["val_top5"] is None else f"{m['val_top5']:.2f}%"
    return (f"\ncltrain: val top-1 {top1} (chance {100 / num_classes:.1f}%), top-5 {top5} | {speed} "
            f"| {m['model']}, global batch {m['global_batch']}, {layout}, {m['precision']}, {m['device']} "
            f"| {Path(m['run_dir']) / 'metrics.json'}")
