"""A gradient difference at a kink (a ReLU input that rounding puts on the other side of zero) is not a finding, at
any distance and in any number of modules: the check runs every module on the reference's values again, and a
module whose code is right then agrees. A layout fault in the same module's backward is still caught."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import cltrain.check.compare as compare
from cltrain import ChannelsLast
from cltrain.check import check_layout
from cltrain.layout import to_channels_last


class Nudge(nn.Module):
    """A forward difference far under the floor, in channels_last only, as a kernel's rounding makes one: the
    exact zeros a ReLU gave become 1e-6."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1e-6 if x.dim() == 4 and not x.is_contiguous() else x.clone()


class _RawMemoryRelu(torch.autograd.Function):
    """ReLU whose backward reads the gradient's memory as NCHW (a layout fault)."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x)
        return x.clamp_min(0)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (x,) = ctx.saved_tensors
        raw = torch.as_strided(grad, grad.shape, torch.empty(grad.shape).stride())
        return raw * (x > 0)


class RawMemoryRelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RawMemoryRelu.apply(x)


def _kinked(act: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), Nudge(), act, nn.Conv2d(8, 8, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def _step(batch: tuple[torch.Tensor, torch.Tensor]):  # noqa: ANN202
    def step(model: nn.Module, layout: str) -> torch.Tensor:
        x = batch[0].contiguous(memory_format=torch.channels_last if layout == "channels_last" else
                                torch.contiguous_format)
        return F.cross_entropy(model(x), batch[1])

    return step


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 5, (4,), generator=g)


def test_a_difference_at_a_kink_passes_and_needs_the_reference_values(monkeypatch: pytest.MonkeyPatch) -> None:
    model = to_channels_last(_kinked(nn.ReLU()))
    result = check_layout(model, _step(_batch()))
    assert result.verdict == "passed", result.line()
    # The control: without the run on the reference's values, the same kink is a finding at the ReLU.
    monkeypatch.setattr(compare, "_ISOLATE", False)
    control = check_layout(model, _step(_batch()))
    assert control.verdict in ("fallback", "contiguous"), control.line()
    assert control.findings[0].module == "3" and control.findings[0].phase == "backward", control.line()


def test_a_layout_fault_in_the_kinked_module_is_still_caught() -> None:
    model = to_channels_last(_kinked(RawMemoryRelu()))
    result = check_layout(model, _step(_batch()))
    assert result.verdict in ("fallback", "contiguous"), result.line()
    assert result.findings[0].module == "3" and result.findings[0].phase == "backward", result.line()
    # The fix names the backward's gradient, not the forward's input.
    assert "incoming gradient in its backward" in result.findings[0].fix(), result.findings[0].fix()


class Distant(nn.Module):
    """A ReLU's exact zeros, nudged in channels_last only (``Nudge``), carried exactly through two identity 1x1
    convolutions to a second ReLU: a kink two modules away from the difference that moves it."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.first, self.nudge, self.second = nn.ReLU(), Nudge(), nn.ReLU()
        self.carry = nn.Sequential(*(nn.Conv2d(channels, channels, 1, bias=False) for _ in range(2)))
        for conv in self.carry:
            nn.init.dirac_(conv.weight)
        self.mix = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(self.second(self.carry(self.nudge(self.first(x)))))


def _distant(blocks: int = 5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *[Distant(8) for _ in range(blocks)], nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 5))


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW])
def test_kinks_in_every_block_pass_and_fail_without_the_reference_values(
        optimizer: type[torch.optim.Optimizer], monkeypatch: pytest.MonkeyPatch) -> None:
    model = to_channels_last(_distant())
    data = _batch()
    result = check_layout(model, _step(data), after_backward=lambda m: optimizer(m.parameters(), 1e-3).step(),
                          updates=True)
    assert result.verdict == "passed", result.line()
    monkeypatch.setattr(compare, "_ISOLATE", False)
    control = check_layout(model, _step(data), after_backward=lambda m: optimizer(m.parameters(), 1e-3).step(),
                           updates=True)
    assert control.verdict in ("fallback", "contiguous"), control.line()
    assert control.findings[0].phase == "backward", control.line()


class _Classifier(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _repghostnet_check() -> str:
    # timm's RepGhostNet: its head is a 1x1 conv on pooled features, then a ReLU and dropout; at batch 4 and
    # 128 px an input of that ReLU lies within rounding of zero on some CPUs
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    net = timm.create_model("repghostnet_050", num_classes=10)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 3, 128, 128, generator=g), torch.randint(0, 10, (4,), generator=g))]
    callback = ChannelsLast()
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(_Classifier(net), DataLoader(data, batch_size=None))
    return callback.layout_checks["train"].line()


def test_a_real_model_with_a_relu_at_rounding_passes() -> None:
    line = _repghostnet_check()
    assert line.startswith("layout check passed"), line


@pytest.mark.parametrize("tail", [[], [nn.Identity()]], ids=["plain", "identity-tail"])
def test_a_loss_reading_raw_memory_is_the_step_code_s_behind_a_pass_through_tail(tail: list) -> None:
    # SMP's segmentation head ends in nn.Identity: the gradient it passes on unchanged was blamed on it ("`4` ...
    # installed package `torch`; nothing to edit"), and on the model's own forward without it
    torch.manual_seed(0)
    model = to_channels_last(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                           nn.Conv2d(8, 3, 1), *tail))
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4, 8, 8))

    def step(m: nn.Module, layout: str) -> torch.Tensor:
        out = m(x.contiguous(memory_format=torch.channels_last if layout == "channels_last" else
                             torch.contiguous_format))
        flat = torch.as_strided(out, (4, 3, 64), (192, 64, 1))  # reads the logits' memory as NCHW
        return F.cross_entropy(flat, y.view(4, -1))

    result = check_layout(model, step)
    assert result.verdict in ("fallback", "contiguous"), result.line()
    finding = result.findings[0]
    assert (finding.module, finding.phase, finding.package) == (None, "step", None), result.line()
