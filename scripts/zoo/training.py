"""A zoo model trained by a real Lightning ``Trainer``: ``ZooModule`` (the model, its loss, the optimizer) and
``fit`` (a few steps on given batches, with or without a callback)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader

from scripts.fits import quiet_trainer
from scripts.zoo.models import Spec, clone_batch, logits_of, quiet_random_layers, training_loss

#: The optimizers the check is swept with, by name: SGD with momentum, Adam and AdamW.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}
OPTIMIZER_NAMES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
OPTIMIZER_SETTINGS = {"sgd": "momentum 0.9, lr 0.01", "adam": "lr 1e-3", "adamw": "lr 1e-3"}  #: as above, in words


def grads_of(net: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """A copy of each parameter's gradient by name (``None``: none), ``torch.compile``'s ``_orig_mod.`` left out."""
    return {n.removeprefix("_orig_mod."): None if p.grad is None else p.grad.detach().clone()
            for n, p in net.named_parameters()}


class ZooModule(LightningModule):
    """A zoo model with its spec's loss and an ``OPTIMIZERS`` optimizer; keeps the step-0 gradients and the losses."""

    def __init__(self, net: torch.nn.Module, spec: Spec, optimizer: str = "sgd"):
        super().__init__()
        self.net, self.spec, self.optimizer_name = net, spec, optimizer
        self.losses: list[torch.Tensor] = []
        self.step0_grads: dict[str, torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return logits_of(self.net, x, self.spec.dict_batch)

    def train(self, mode: bool = True):
        super().train(mode)
        quiet_random_layers(self)
        return self

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = training_loss(self.net, batch, self.spec)
        self.losses.append(loss.detach())
        return loss

    def on_after_backward(self) -> None:
        if self.step0_grads is None:
            self.step0_grads = grads_of(self.net)

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer_name](self.parameters())


def fit(net: torch.nn.Module, spec: Spec, batches: list[Any], callback: Any, max_steps: int,
        precision: str = "32-true", optimizer: str = "sgd", seed: int = 0) -> ZooModule:
    """``net`` trained for ``max_steps`` on ``batches`` (copies, in order) by a Trainer with ``callback``; the
    global RNG seeded with ``seed`` first (a detector's samplers draw from it)."""
    module = ZooModule(net, spec, optimizer).train()  # Lightning keeps each submodule's mode: quiet them here
    trainer = quiet_trainer(accelerator="cpu", max_steps=max_steps, precision=precision,
                            callbacks=[callback] if callback else [])
    torch.manual_seed(seed)
    trainer.fit(module, DataLoader([clone_batch(b) for b in batches], batch_size=None))
    return module
