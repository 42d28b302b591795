"""LightningModules written with no knowledge of cltrain, as a user's project would have them.

They only record what reaches them (input strides, weight strides) so tests can check it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torchvision
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset


class RandomImages(Dataset):
    """``n`` random ``(C, H, W)`` float images (``(C, T, H, W)`` clips with ``frames``) with int
    labels; batches come out NCHW- (NCDHW-) contiguous."""

    def __init__(
        self, n: int = 6, channels: int = 3, size: int = 32, classes: int = 4, seed: int = 0, frames: int | None = None
    ):
        g = torch.Generator().manual_seed(seed)
        time = (frames,) if frames is not None else ()
        self.x = torch.randn(n, channels, *time, size, size, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def loader(n: int = 6, batch_size: int = 4, channels: int = 3, size: int = 32, **kw) -> DataLoader:
    return DataLoader(RandomImages(n, channels, size), batch_size=batch_size, **kw)


def clip_loader(n: int = 4, batch_size: int = 2, frames: int = 4, size: int = 16, **kw) -> DataLoader:
    """Random ``(3, frames, size, size)`` clips: batches come out NCDHW-contiguous."""
    return DataLoader(RandomImages(n, 3, size, frames=frames), batch_size=batch_size, **kw)


def tiny_video_net(classes: int = 4) -> nn.Module:
    """A small Conv3d classifier, as a user's own video model would be written."""
    return nn.Sequential(
        nn.Conv3d(3, 8, 3, padding=1), nn.BatchNorm3d(8), nn.ReLU(), nn.Conv3d(8, 8, (1, 3, 3), padding=(0, 1, 1)),
        nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(8, classes),
    )


class SteadyClock:
    """The clock of ``cltrain.timing.clock`` while :func:`steady_clock` holds: time passes in :func:`pause` and a
    millisecond at each reading, so the race of the layouts times the pauses of ``SlowIn`` and ``SlowStep`` and decides
    alike on a machine however busy (its compute takes no time on this clock). Everything but ``perf_counter`` is the
    ``time`` module's."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def perf_counter(self) -> float:
        self.seconds += 1e-3
        return self.seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


_steady: SteadyClock | None = None


def pause(seconds: float) -> None:
    """Waste ``seconds``: on the steady clock where one holds, else asleep."""
    if _steady is None:
        time.sleep(seconds)
    else:
        _steady.seconds += seconds


@contextmanager
def steady_clock() -> Iterator[SteadyClock]:
    """Time the race's steps on a :class:`SteadyClock` (this process, until the block ends)."""
    global _steady
    from cltrain.timing import clock

    saved, _steady = clock.time, SteadyClock()
    clock.time = _steady  # type: ignore[assignment]
    try:
        yield _steady
    finally:
        clock.time, _steady = saved, None


class SlowIn(nn.Module):
    """A small conv net (or ``net``) that wastes ``seconds`` per forward when its input is in ``slow_layout``
    (``"channels_last"``, ``"contiguous"``, or a callable giving it at the call): which layout trains faster is then
    beyond the noise of a busy machine. A real model's speed is a benchmark's business (scripts/bench)."""

    def __init__(self, slow_layout, net: nn.Module | None = None, seconds: float = 0.3):
        super().__init__()
        self.slow_layout, self.seconds = slow_layout, seconds
        self.body = net or nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def forward(self, x):
        from cltrain import is_channels_last

        slow = self.slow_layout() if callable(self.slow_layout) else self.slow_layout
        if ("channels_last" if is_channels_last(x) else "contiguous") == slow:
            pause(self.seconds)
        return self.body(x)


class ConvStack(nn.Module):
    """A stack of conv, normalisation, ReLU blocks (``kernel`` x ``kernel`` convs), as image-to-image generators
    (CycleGAN, pix2pix, style transfer) build them with ``norm="instance"``. CPU ``InstanceNorm2d`` normalises a
    ``(1, N*C, H, W)`` view of its input, which a channels_last tensor cannot give without a copy each way. With 1x1
    convs the norms are most of the step: one thread, fp32, batch 16 at 64 px, channels_last trains 1.43x slower on an
    AVX-512 EPYC and 1.70x with oneDNN and ATen held to AVX2 (3x3 convs: 1.2-1.55x). With BatchNorm and 3x3 convs,
    channels_last is 0.81-0.87x of NCHW's step on the EPYC."""

    def __init__(self, norm: str = "batch", width: int = 32, blocks: int = 6, classes: int = 4, kernel: int = 3):
        super().__init__()
        torch.manual_seed(0)
        layer = {"batch": nn.BatchNorm2d, "instance": lambda c: nn.InstanceNorm2d(c, affine=True)}[norm]
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Conv2d(width, width, kernel, padding=kernel // 2), layer(width),
                                                    nn.ReLU()) for _ in range(blocks)))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class NetCall(LightningModule):
    """A module whose training step is ``net(*batch)``, summed (a detector's ``model(images, targets)``), with AdamW."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        return self.net(*batch).sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Classifier(LightningModule):
    """A plain image classifier around any ``nn.Module``; records the layout of what it sees."""

    def __init__(self, net: nn.Module | None = None, lr: float = 0.05, momentum: float = 0.9):
        super().__init__()
        self.net = net if net is not None else torchvision.models.resnet18(num_classes=4)
        self.lr, self.momentum = lr, momentum
        self.seen: dict[str, list[tuple[int, ...]]] = {}
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def _record(self, stage: str, x: torch.Tensor) -> None:
        self.seen.setdefault(stage, []).append(tuple(x.stride()) + (tuple(x.shape),))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self._record("train", x)
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self._record("val", x)
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self._record("test", x)

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        self._record("predict", x)
        return self(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def channels_last_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The channels-last strides for a 4-D (``channels_last``) or 5-D (``channels_last_3d``) shape."""
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    return torch.empty(shape, memory_format=fmt).stride()


class _ReadsGradientAsNCHW(torch.autograd.Function):
    """Doubles its input; its backward reads the incoming gradient's memory as NCHW (wrong in channels_last)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        n, c, h, w = g.shape
        return torch.as_strided(g, g.shape, (c * h * w, h * w, w, 1)) * 2


class NCHWBackwardNet(nn.Module):
    """A stem whose custom backward assumes NCHW (``faulty``; else the same values computed plainly), then
    convolutions with BatchNorm, whose backward cancels the gradient's mean: in bfloat16 the stem's gradient is
    mostly rounding noise, which hides the fault unless the check computes in float32."""

    def __init__(self, faulty: bool = True) -> None:
        super().__init__()
        self.faulty = faulty
        self.conv, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.rest = nn.Sequential(
            nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2), nn.BatchNorm2d(16),
            nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.rest(self.conv2(_ReadsGradientAsNCHW.apply(y) if self.faulty else y * 2))
