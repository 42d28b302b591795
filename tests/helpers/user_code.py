"""Small Lightning projects in common styles whose own code assumes NCHW strides, one pattern each.

Run one as ``python -m tests.helpers.user_code PATTERN VARIANT...`` (VARIANT: ``nchw`` without the
callback, ``checked`` with ``ChannelsLast()``, ``unchecked`` with ``ChannelsLast(verify=False)``); each
variant trains three steps and prints one JSON line: the losses, the error if it raised, the check's result.
"""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ViewHead(nn.Module):
    """LeNet style: ``x.view(x.size(0), -1)`` between the convolutions and the classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv2(F.relu(self.conv1(x)))))
        return self.fc(x.view(x.size(0), -1))


class SpaceToDepth(nn.Module):
    """A hand-written space-to-depth reading memory as NCHW with ``as_strided`` (as extension ops do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        blocks = torch.as_strided(x, (n, c, h // 2, w // 2, 2, 2), (c * h * w, h * w, 2 * w, 2, w, 1))
        return blocks.permute(0, 1, 4, 5, 2, 3).reshape(n, c * 4, h // 2, w // 2)


class RawMemory(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.s2d = SpaceToDepth()
        self.body = nn.Conv2d(32, 16, 3, padding=1)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.body(self.s2d(self.stem(x)))), 1), 1))


class _ScaleFlat(torch.autograd.Function):
    """A custom op whose backward flattens the gradient with ``view`` (legal on NCHW gradients only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        flat = grad.view(grad.size(0), -1)
        return (flat * 2).view_as(grad)


class _RawGrad(torch.autograd.Function):
    """A custom op whose backward reads the gradient's memory as NCHW (silently wrong otherwise)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        n, c, h, w = grad.shape
        raw = torch.as_strided(grad, (n, c, h, w), (c * h * w, h * w, w, 1))
        return raw * torch.linspace(0.5, 1.5, w, device=grad.device)


class CustomOp(nn.Module):
    def __init__(self, fn: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn.apply(x)


class ContiguousOnly(nn.Module):
    """The Python wrapper of an extension op that refuses non-contiguous input (``TORCH_CHECK`` style)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.is_contiguous(), "input must be contiguous"
        return x * torch.sigmoid(x)


class Net(nn.Module):
    """Two convolutions around one block of the user's own."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = block
        self.head = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.block(F.relu(self.stem(x))))
        return self.fc(x.mean((2, 3)))


class Heatmaps(nn.Module):
    """A keypoint-heatmap network: 4-D outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Classifier(pl.LightningModule):
    def __init__(self, net: nn.Module, heatmap_loss: bool = False) -> None:
        super().__init__()
        self.net = net
        self.heatmap_loss = heatmap_loss
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        if self.heatmap_loss:  # the step code flattens the model's 4-D output with view
            n = out.size(0)
            loss = F.mse_loss(out.view(n, -1), y.reshape(n, -1))
        else:
            loss = F.cross_entropy(out, y)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


PATTERNS = {
    "view_head": lambda: Classifier(ViewHead()),
    "raw_memory": lambda: Classifier(RawMemory()),
    "backward_view": lambda: Classifier(Net(CustomOp(_ScaleFlat))),
    "backward_raw_memory": lambda: Classifier(Net(CustomOp(_RawGrad))),
    "contiguous_assert": lambda: Classifier(Net(ContiguousOnly())),
    "loss_view": lambda: Classifier(Heatmaps(), heatmap_loss=True),
}


def data(pattern: str) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 3, 16, 16, generator=g)
    y = torch.randn(12, 4, 16, 16, generator=g) if pattern == "loss_view" else torch.randint(0, 5, (12,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def main(pattern: str, variant: str) -> None:
    from cltrain import ChannelsLast

    torch.manual_seed(0)
    module = PATTERNS[pattern]()
    callbacks = {"nchw": [], "checked": [ChannelsLast()], "unchecked": [ChannelsLast(verify=False)]}[variant]
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    report: dict = {"pattern": pattern, "variant": variant, "error": None}
    try:
        trainer.fit(module, data(pattern))
    except Exception as error:  # noqa: BLE001 - raising is the negative control's result
        report["error"] = f"{type(error).__name__}: {error}".splitlines()[0]
    report["losses"] = module.losses
    if callbacks:
        checks = callbacks[0].layout_checks
        report["check"] = {kind: check.as_dict() for kind, check in checks.items()}
        report["line"] = {kind: check.line() for kind, check in checks.items()}
        report["layout"] = callbacks[0].layout
    print(json.dumps(report))


if __name__ == "__main__":
    for variant in sys.argv[2:]:
        main(sys.argv[1], variant)
