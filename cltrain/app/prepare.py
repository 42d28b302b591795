"""The model as a run trains it: its CUDA math set, guarded against known kernel faults, compiled, and
wrapped in the ``ImageClassifier`` with the configured optimizer and learning rate.

A channels_last model is converted (and guarded in that layout) by the ``ChannelsLast`` callback,
compiled or not: ``Module.compile`` compiles in place and on the first call, which comes after the
callback's conversion. A contiguous model training in bf16 on the CPU is guarded here: bf16 Conv3d
weight gradients are wrong on the CPU in either layout (``cltrain.guardrails``).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf

from cltrain.app.config import Resolved
from cltrain.app.module import ImageClassifier
from cltrain.app.schedule import scaled_lr
from cltrain.precision import autocast_dtype

__all__ = ["apply_cuda_math", "build_lightning_module", "prepare_model"]


def apply_cuda_math(cfg: DictConfig) -> None:
    """``tf32``: process-wide switches, set before the model is built (``trainer.benchmark``: Lightning's)."""
    torch.backends.cudnn.allow_tf32 = cfg.tf32
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32  # what set_float32_matmul_precision("high"/"highest") sets
    torch.set_float32_matmul_precision("high" if cfg.tf32 else "highest")


def prepare_model(cfg: DictConfig, resolved: Resolved, model: torch.nn.Module) -> list[Any]:
    """Guard ``model`` where the ``ChannelsLast`` callback does not, and compile it in place
    (``state_dict`` keys stay unprefixed) with ``compile.enabled=true``.

    Returns:
        The ``cltrain.guardrails.GuardRecord`` of each workaround applied here.
    """
    from cltrain.guardrails import apply_guardrails

    records: list[Any] = []
    dtype = autocast_dtype(resolved.precision)
    # A model compiled in channels_last is guarded by the callback alone, in the layout it is compiled in;
    # any other bf16 training run on the CPU is guarded here too, in the contiguous layout it is built in.
    compiled_channels_last = cfg.compile.enabled and cfg.channels_last
    if dtype is torch.bfloat16 and resolved.accelerator == "cpu" and not cfg.evaluate_only and not compiled_channels_last:
        records += apply_guardrails(model, device="cpu", dtype=dtype, layout="contiguous")
    for record in records if not cfg.channels_last else ():  # with the callback, its line says them (one line)
        rank_zero_info(f"cltrain: worked around a known kernel fault: {record.line()}")
    if cfg.compile.enabled:
        model.compile(backend=cfg.compile.backend, mode=cfg.compile.get("mode"))
    return records


def build_lightning_module(cfg: DictConfig, model: torch.nn.Module, num_classes: int,
                           global_batch: int) -> tuple[ImageClassifier, float]:
    """The ``ImageClassifier`` training ``model`` with the ``optim`` group's optimizer and schedule, and its
    learning rate: ``optim.lr``, times ``global_batch / 256`` with ``optim.scale_lr``."""
    optim = cfg.optim
    lr = scaled_lr(optim.lr, global_batch) if optim.scale_lr else optim.lr
    # every optimizer and schedule key of the optim option's schema (SGD: momentum, nesterov; AdamW: betas)
    hparams = {k: tuple(v) if isinstance(v, list) else v for k, v in OmegaConf.to_container(optim).items()
               if k not in ("name", "lr", "scale_lr")}
    module = ImageClassifier(model, num_classes, lr=lr, optimizer=optim.name, label_smoothing=cfg.label_smoothing,
                             **hparams)
    return module, lr
