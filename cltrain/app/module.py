"""The LightningModule: image classification as apex ``main_amp.py`` trains it.

Cross-entropy (optional label smoothing); top-1 / top-5 accuracy micro-averaged
like main_amp's ``Prec@k``; SGD (or AdamW) with a per-iteration schedule
(``cltrain.app.schedule``: main_amp's warm-up + milestones, or cosine)
returned from ``configure_optimizers`` as a ``torch.optim.lr_scheduler`` that
Lightning steps after every optimizer step and saves in checkpoints. The model's
memory format is not this module's business: the
``cltrain.callback.ChannelsLast`` callback (or its absence) decides it.

A training step never waits for the host (``tests/app/test_sync.py`` counts): the loss goes to
the logger only, nothing is logged with ``prog_bar=True`` per step (Lightning#21232), train
accuracy accumulates on the device (``TopKAccuracy``) and reaches the host at print steps, and on
CUDA the optimizer is fused where ``cltrain.precision.loss_scaling_safe`` allows it.
Lightning's ``LearningRateFinder`` and ``BatchSizeFinder`` are refused with a ``ConfigError``
(docs/guides/app.md says why).

Example::

    >>> import torchvision
    >>> module = ImageClassifier(torchvision.models.resnet18(num_classes=10), num_classes=10, lr=0.05)
    >>> module.top_k
    5
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning.pytorch.utilities import rank_zero_info

from cltrain.app.config.errors import ConfigError

from cltrain.app.topk import TopKAccuracy
from cltrain.app.schedule import make_scheduler
from cltrain.precision import loss_scaling_safe, zero_momentum_buffers

#: Lightning's tuners, which ``ImageClassifier`` refuses, and why (the reason, the fix).
FINDERS = (LearningRateFinder, BatchSizeFinder)
FINDER_REFUSAL = ("not supported by ImageClassifier: the rate is optim.lr scaled for data.batch_size and then scheduled "
                  "per step by optim.schedule, so a found rate or batch would be overridden or mis-scaled",
                  "search them with a -m sweep over optim.lr / data.batch_size instead")

__all__ = ["ImageClassifier", "build_optimizer"]


class ImageClassifier(LightningModule):
    """Train and evaluate ``model`` on ``(images, targets)`` batches.

    Args:
        model: the network (``num_classes`` logits out).
        num_classes: number of classes.
        lr: the peak learning rate, already scaled for the global batch.
        optimizer: ``"sgd"`` or ``"adamw"``.
        momentum: SGD's momentum.
        weight_decay: weight decay of both optimizers.
        nesterov: SGD's Nesterov momentum.
        betas: AdamW's betas.
        schedule: ``"step"`` (``lr_at``) or ``"cosine"``
            (``cosine_lr_at``).
        warmup_epochs: the linear warm-up, in epochs (both schedules).
        milestones: the epochs at which the step schedule decays.
        gamma: the step schedule's decay factor.
        min_lr_ratio: the cosine schedule's final rate, as a fraction of ``lr``.
        label_smoothing: cross-entropy label smoothing.
        fused: a fused optimizer step; ``None``: on CUDA. Under loss scaling (fp16) SGD's
            momentum buffers start at zero (``cltrain.precision.zero_momentum_buffers``), and a
            fused optimizer that fails ``cltrain.precision.loss_scaling_safe`` is built unfused.

    The defaults are apex main_amp.py's 90-epoch recipe; ``train.py`` passes every value from its
    config (``cltrain.app.config.schema``, whose schedule fits the 8-epoch demo run).
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        lr: float,
        optimizer: str = "sgd",
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        nesterov: bool = False,
        betas: Sequence[float] = (0.9, 0.999),
        schedule: str = "step",
        warmup_epochs: float = 5,
        milestones: Sequence[int] = (30, 60, 80),
        gamma: float = 0.1,
        min_lr_ratio: float = 0.0,
        label_smoothing: float = 0.0,
        fused: bool | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        self.model = model
        self.optimizer_note = ""  # set by configure_optimizers when the fused optimizer was declined
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.top_k = min(5, num_classes)
        self.train_top1 = TopKAccuracy(top_k=1)
        self.train_top5 = TopKAccuracy(top_k=self.top_k)
        # validate_args=False: the default checks run torch.unique on the targets (a host sync) each update
        metric = dict(num_classes=num_classes, average="micro", validate_args=False)
        self.val_top1 = MulticlassAccuracy(top_k=1, **metric)
        self.val_top5 = MulticlassAccuracy(top_k=self.top_k, **metric)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    # --- training -------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        """Refuse Lightning's LR finder and BatchSizeFinder (see the module docstring)."""
        if stage != "fit":
            return
        for callback in self.trainer.callbacks:
            if isinstance(callback, FINDERS):
                raise ConfigError("callbacks", type(callback).__name__, *FINDER_REFUSAL)

    def steps_per_epoch(self) -> int:
        """Optimizer steps in one training epoch on this rank."""
        if self.trainer.train_dataloader is None:  # not loaded yet (max_epochs=-1 with max_steps)
            self.trainer.fit_loop.setup_data()
        trainer = self.trainer
        batches = stream_batches(trainer)
        if batches is None:
            if hasattr(trainer.datamodule, "samples_per_epoch"):
                raise ConfigError("data.samples_per_epoch", None, "a stream of WebDataset shards has no length, and "
                                  "the learning-rate schedule counts its epochs in steps: set it to the training "
                                  "samples of an epoch (1281167 for ImageNet)")
            raise ConfigError("trainer.limit_train_batches", trainer.limit_train_batches, "a streamed dataset has "
                              "no length, and the learning-rate schedule counts its epochs in steps: set it to the "
                              "batches of an epoch on each rank (a whole number)")
        return max(1, -(-int(batches) // trainer.accumulate_grad_batches))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        images, targets = batch
        logits = self.model(images)
        loss = self.criterion(logits, targets)  # takes mixup/cutmix's probability targets as they are
        labels = targets.argmax(1) if targets.ndim == 2 else targets  # accuracy against the dominant label
        top1 = self.train_top1(logits, labels)
        top5 = self.train_top5(logits, labels)
        self.log("train/loss", loss)  # logger only: made a number at log_every_n_steps, not every step
        self.log("train/top1", self.train_top1, on_step=False, on_epoch=True)
        self.log("train/top5", self.train_top5, on_step=False, on_epoch=True)  # top-min(5, classes)
        # Device tensors: MainAmpProgress reads them at print steps (main_amp's Loss/Prec@1/Prec@5).
        return {"loss": loss, "top1": top1.detach(), "top5": top5.detach()}

    # --- evaluation -----------------------------------------------------------------------------
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, targets = batch
        logits = self.model(images)
        self.val_top1.update(logits, targets)
        self.val_top5.update(logits, targets)
        self.log("val/loss", self.criterion(logits, targets), sync_dist=True)
        self.log("val/top1", self.val_top1, prog_bar=True)  # per epoch: made a number once, at its end
        self.log("val/top5", self.val_top5)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        # Fused on CUDA: GradScaler then hands the overflow check to the kernel (no .item() per step). Not with
        # gradient clipping: Lightning refuses to clip for an optimizer that unscales internally.
        fused = self.device.type == "cuda" and not self.trainer.gradient_clip_val if hp.fused is None else hp.fused
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        optimizer, self.optimizer_note = build_optimizer(
            self.model.parameters(), hp.optimizer, self.device, fused=bool(fused), loss_scaling=scaler is not None,
            lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay, nesterov=hp.nesterov, betas=tuple(hp.betas))
        if self.optimizer_note:
            rank_zero_info(f"cltrain: {self.optimizer_note}")
        total_steps = self.trainer.estimated_stepping_batches  # loads the training data (num_training_batches)
        steps_per_epoch = self.steps_per_epoch()
        if hp.schedule == "cosine" and total_steps == float("inf"):
            raise RuntimeError("optim.schedule=cosine needs a finite run: set trainer.max_epochs or trainer.max_steps")
        scheduler = make_scheduler(
            optimizer, hp.schedule, steps_per_epoch, max(1, int(min(total_steps, 2**62))),
            warmup_epochs=hp.warmup_epochs, milestones=tuple(hp.milestones), gamma=hp.gamma, min_lr_ratio=hp.min_lr_ratio,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


def build_optimizer(params: Any, name: str, device: torch.device, *, fused: bool, loss_scaling: bool, lr: float,
                    momentum: float = 0.9, weight_decay: float = 1e-4, nesterov: bool = False,
                    betas: Sequence[float] = (0.9, 0.999)) -> tuple[torch.optim.Optimizer, str]:
    """``name`` (``"sgd"`` or ``"adamw"``) over ``params``, and a note (empty when nothing to say).

    With ``fused`` and ``loss_scaling``, SGD's momentum buffers start at zero
    (``cltrain.precision.zero_momentum_buffers``), and the fused optimizer so built is used
    only if it passes ``cltrain.precision.loss_scaling_safe`` on ``device``; otherwise the
    unfused one, and the note says why.
    """
    if name == "adamw":
        cls, kwargs = torch.optim.AdamW, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    else:
        cls, kwargs = torch.optim.SGD, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    # Without loss scaling no step is skipped, so the fused SGD's first-step buffer is always written.
    prepare = zero_momentum_buffers if fused and loss_scaling and cls is torch.optim.SGD else None
    note = ""
    if fused and loss_scaling and not loss_scaling_safe(cls, device, prepare=prepare, **kwargs):
        fused, prepare = False, None
        note = (f"fused {cls.__name__} fails the loss-scaling check on {device.type} (an overflowed step changes its "
                f"state); using the unfused {cls.__name__}, whose overflow check costs one host sync per step")
    optimizer = cls(params, fused=True if fused else None, **kwargs)
    if prepare is not None:
        prepare(optimizer)
    return optimizer, note


def stream_batches(trainer: Any) -> int | float | None:
    """The training batches of an epoch on each rank: Lightning's count, or for a stream (no length) the whole batches
    of the samples its DataModule says an epoch holds (``samples_per_epoch``); ``None`` where nothing says."""
    batches = trainer.num_training_batches
    if batches != float("inf"):
        return batches
    samples = getattr(getattr(trainer, "datamodule", None), "samples_per_epoch", None)
    if samples is None:
        return None
    return max(1, samples // (trainer.world_size * trainer.datamodule.batch_size))
