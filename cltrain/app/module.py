"""The LightningModule: image classification as apex ``main_amp.py`` trains it.

Cross-entropy (optional label smoothing); top-1 / top-5 accuracy (torchmetrics,
micro-averaged like main_amp's ``Prec@k``) on train and val; SGD (or AdamW)
whose rate :func:`cltrain.app.schedule.lr_at` sets before every batch from
``trainer.global_step``, so a resumed run continues the schedule where it
stopped. The model's memory format is not this module's business: the
:class:`cltrain.callback.ChannelsLast` callback (or its absence) decides it.

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
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from cltrain.app.schedule import lr_at

__all__ = ["ImageClassifier"]


class ImageClassifier(LightningModule):
    """Train and evaluate ``model`` on ``(images, targets)`` batches.

    Args:
        model: the network (``num_classes`` logits out).
        num_classes: number of classes.
        lr: the peak learning rate, already scaled for the global batch.
        optimizer: ``"sgd"`` or ``"adamw"``.
        momentum, weight_decay, nesterov, betas: optimizer settings.
        warmup_epochs, milestones, gamma: the schedule (see :func:`~cltrain.app.schedule.lr_at`).
        label_smoothing: cross-entropy label smoothing.
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
        warmup_epochs: float = 5,
        milestones: Sequence[int] = (30, 60, 80),
        gamma: float = 0.1,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        self.model = model
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.top_k = min(5, num_classes)
        metric = dict(num_classes=num_classes, average="micro")
        self.train_top1 = MulticlassAccuracy(top_k=1, **metric)
        self.train_top5 = MulticlassAccuracy(top_k=self.top_k, **metric)
        self.val_top1 = MulticlassAccuracy(top_k=1, **metric)
        self.val_top5 = MulticlassAccuracy(top_k=self.top_k, **metric)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    # --- training -------------------------------------------------------------------------------
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one training epoch on this rank."""
        batches = self.trainer.num_training_batches
        if batches == float("inf"):
            raise RuntimeError("the epoch-based schedule needs a training DataLoader with a length")
        return max(1, -(-int(batches) // self.trainer.accumulate_grad_batches))

    def current_lr(self) -> float:
        hp = self.hparams
        return lr_at(self.trainer.global_step, self.steps_per_epoch(), hp.lr, hp.warmup_epochs, hp.milestones, hp.gamma)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        lr = self.current_lr()
        for optimizer in self.trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        images, targets = batch
        logits = self.model(images)
        loss = self.criterion(logits, targets)  # takes mixup/cutmix's probability targets as they are
        labels = targets.argmax(1) if targets.ndim == 2 else targets  # accuracy against the dominant label
        top1 = self.train_top1(logits, labels)
        top5 = self.train_top5(logits, labels)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/top1", self.train_top1, prog_bar=True, on_epoch=True)
        self.log("train/top5", self.train_top5, on_epoch=True)  # top-min(5, classes)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], prog_bar=True)
        # The progress callback prints these every print_freq batches (main_amp's Loss/Prec@1/Prec@5).
        return {"loss": loss, "top1": top1.detach(), "top5": top5.detach()}

    # --- evaluation -----------------------------------------------------------------------------
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, targets = batch
        logits = self.model(images)
        self.val_top1.update(logits, targets)
        self.val_top5.update(logits, targets)
        self.log("val/loss", self.criterion(logits, targets), sync_dist=True)
        self.log("val/top1", self.val_top1, prog_bar=True)
        self.log("val/top5", self.val_top5)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        params = self.model.parameters()
        if hp.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=hp.lr, betas=tuple(hp.betas), weight_decay=hp.weight_decay)
        return torch.optim.SGD(params, lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay,
                               nesterov=hp.nesterov)
