"""LightningModules for tests/guard_cases.py, in their own module: the auto probe's child process imports
it by name to unpickle them, and guard_cases.py's other cases need not import Lightning."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import nn

from guard_cases import RepStem, UserConv2d


class Net(LightningModule):
    """A timm model built from config (or ``"repstem"``: :class:`RepStem`), recording its first gradients."""

    def __init__(self, name: str):
        super().__init__()
        if name == "repstem":
            self.net = RepStem()
        else:
            import timm

            self.net = timm.create_model(name, pretrained=False, num_classes=5, drop_rate=0.0)
        self.grads: dict[str, torch.Tensor] = {}
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        # BatchNorm on running statistics: with batch statistics over 4 images, the deep layers' gradients
        # are ill-conditioned (two correct fp32 kernels disagree by O(1) on mobileone_s0); the convolutions
        # run the same kernels either way.
        for m in self.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()

    def on_after_backward(self):
        if not self.grads:
            self.grads = {n: p.grad.detach().double().clone() for n, p in self.named_parameters() if p.grad is not None}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StemModule(LightningModule):
    """A bare ``Conv2d(3, 48, 1, stride=2)`` stem (the branch that crashes in repvgg_a0) and a head; at module
    level, so the auto probe's child process can unpickle it."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 48, 1, stride=2)
        self.head = nn.Linear(48, 5)

    def forward(self, x):
        return self.head(self.stem(x).mean((2, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class EightChannelStem(LightningModule):
    """An 8-channel input into a 1x1 stride-2 conv: below the AVX-512 block (16), not below AVX2's (8). A
    Conv2d subclass, whose guard (NCHW weight) changes parameter strides: ranks must agree on it."""

    def __init__(self):
        super().__init__()
        self.stem = UserConv2d(8, 16, 1, stride=2)
        self.body = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.body(self.stem(x)).mean((2, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
