"""Small Lightning projects in common styles whose own code assumes NCHW strides, one pattern each.

Run one as ``python -m tests.helpers.user_code PATTERN VARIANT...`` (VARIANT: ``nchw`` without the
callback, ``checked`` with ``ChannelsLast()``, ``unchecked`` with ``ChannelsLast(verify=False)``); each
variant trains three steps and prints one JSON line: the losses, the error if it raised, the check's result,
the BatchNorm statistics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tests.helpers import warm


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


class ViewHeadFlat(ViewHead):
    """``ViewHead`` flattening with ``torch.flatten``: layout-agnostic."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(F.relu(self.conv2(F.relu(self.conv1(x))))), 1))


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


class BlockStemNet(nn.Module):
    """``Net`` whose stem is a block of its own (a Sequential): its last child's output is the block's output, so
    the gradient arriving there meets the hooks of both."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = block
        self.head = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.head(self.block(self.stem(x))))


class RawTail(nn.Module):
    """A block whose own forward, after its last child, applies an op with a backward that reads memory as NCHW."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RawGrad.apply(self.body(x))


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


class _PlainSGD(torch.optim.Optimizer):
    """SGD without momentum whose update is ``direction(p.grad)``: the user code the optimizer patterns vary."""

    def __init__(self, params, lr: float = 0.05) -> None:  # noqa: ANN001
        super().__init__(params, {"lr": lr})

    def direction(self, g: torch.Tensor) -> torch.Tensor:
        return g

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(self.direction(p.grad), alpha=-group["lr"])
        return loss


class FilterNormSGD(_PlainSGD):
    """MuSGD style: each conv filter's gradient flattened with ``view`` and normalised (ultralytics #26013)."""

    def direction(self, g: torch.Tensor) -> torch.Tensor:
        if g.dim() != 4:
            return g
        flat = g.view(len(g), -1)
        return (flat / (flat.norm(dim=1, keepdim=True) + 1e-8)).view_as(g)


class RawGradSGD(_PlainSGD):
    """An optimizer (a fused-kernel stand-in) that reads each gradient's memory as NCHW: silently wrong."""

    def direction(self, g: torch.Tensor) -> torch.Tensor:
        return torch.as_strided(g, g.shape, torch.empty(g.shape).stride())


class FilterClipping(pl.LightningModule):
    """Per-filter gradient clipping written with ``view`` in ``configure_gradient_clipping``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):  # noqa: ANN001
        for p in self.parameters():
            if p.grad is not None and p.dim() == 4:
                flat = p.grad.view(p.size(0), -1)
                flat.mul_((0.1 / (flat.norm(dim=1, keepdim=True) + 1e-6)).clamp(max=1.0))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class InputChannelScaling(FilterClipping):
    """A hook before torch's SGD that scales each input channel's gradient through its memory read as NCHW."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):  # noqa: ANN001
        pass

    def on_before_optimizer_step(self, optimizer) -> None:  # noqa: ANN001
        for p in self.parameters():
            if p.grad is not None and p.dim() == 4:
                o, i, kh, kw = p.grad.shape
                p.grad.as_strided((o, i, kh * kw), (i * kh * kw, kh * kw, 1)).mul_(torch.linspace(0.1, 1, i)[:, None])


class SplitNorm(nn.Module):
    """lightly's SplitBatchNorm: statistics per half batch through ``view(-1, C * 2, H, W)`` on the input."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(2 * channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        return self.bn(x.view(-1, c * 2, h, w)).view(n, c, h, w)


class SplitNormNet(nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), SplitNorm(8), nn.ReLU())
                                      for _ in range(blocks)))
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


class BNViewHead(ViewHead):
    """``ViewHead`` with BatchNorm, whose statistics show a step run on the real module."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn(self.conv2(F.relu(self.conv1(x))))))
        return self.fc(x.view(x.size(0), -1))


class Weights(pl.LightningDataModule):
    """A datamodule the step reads (torchgeo's tasks read ``self.trainer.datamodule``)."""

    def __init__(self, loader: DataLoader) -> None:
        super().__init__()
        self.loader = loader
        self.weight = 2.0

    def train_dataloader(self) -> DataLoader:
        return self.loader


class ReadsDatamodule(Classifier):
    """A heatmap step whose loss weight comes from ``self.trainer.datamodule`` and flattens with ``view``."""

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        out = self(batch[0])
        n = out.size(0)
        loss = self.trainer.datamodule.weight * F.mse_loss(out.view(n, -1), batch[1].reshape(n, -1))
        self.losses.append(loss.item())
        return loss


def _stem(net: nn.Module, stem: nn.Module) -> nn.Module:
    net.stem = stem
    return net


def _with_optimizer(module: pl.LightningModule, optimizer: type[torch.optim.Optimizer]) -> pl.LightningModule:
    module.configure_optimizers = lambda: optimizer(module.parameters(), lr=0.05)  # type: ignore[method-assign]
    return module


def _filter_clipping(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Per-filter clipping in a step pre-hook of torch's own AdamW, written with ``view``."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and p.dim() == 4:
                flat = p.grad.view(p.size(0), -1)
                flat.mul_((0.1 / (flat.norm(dim=1, keepdim=True) + 1e-6)).clamp(max=1.0))


def _adamw_with_hook(module: pl.LightningModule) -> pl.LightningModule:
    def configure() -> torch.optim.Optimizer:
        optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
        optimizer.register_step_pre_hook(_filter_clipping)
        return optimizer

    module.configure_optimizers = configure  # type: ignore[method-assign]
    return module


# Code around the step: after the backward, compiled modules, a class's every instance, the trainer.
STEP_PATTERNS = {
    "optimizer_view": lambda: _with_optimizer(Classifier(ViewHeadFlat()), FilterNormSGD),
    "optimizer_raw_memory": lambda: _with_optimizer(Classifier(ViewHeadFlat()), RawGradSGD),
    "clipping_view": lambda: FilterClipping(ViewHeadFlat()),
    "hook_raw_memory": lambda: InputChannelScaling(ViewHeadFlat()),
    "step_hook_view": lambda: _adamw_with_hook(Classifier(ViewHeadFlat())),
    "compiled_view_head": lambda: torch.compile(Classifier(BNViewHead()), backend="eager"),
    "compiled_submodule": lambda: Classifier(torch.compile(ViewHead(), backend="eager")),
    "class_wide": lambda: Classifier(SplitNormNet()),
    "reads_datamodule": lambda: ReadsDatamodule(Heatmaps()),
}

PATTERNS = {

    "view_head": lambda: Classifier(ViewHead()),
    "raw_memory": lambda: Classifier(RawMemory()),
    "backward_view": lambda: Classifier(Net(CustomOp(_ScaleFlat))),
    "backward_raw_memory": lambda: Classifier(Net(CustomOp(_RawGrad))),
    "backward_raw_memory_after_a_block": lambda: Classifier(BlockStemNet(CustomOp(_RawGrad))),
    "backward_raw_memory_in_a_blocks_own_code": lambda: Classifier(_stem(BlockStemNet(nn.Identity()), RawTail())),
    "contiguous_assert": lambda: Classifier(Net(ContiguousOnly())),
    "loss_view": lambda: Classifier(Heatmaps(), heatmap_loss=True),
}


def data(pattern: str) -> DataLoader | pl.LightningDataModule:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 3, 16, 16, generator=g)
    heatmaps = pattern in ("loss_view", "reads_datamodule")
    y = torch.randn(12, 4, 16, 16, generator=g) if heatmaps else torch.randint(0, 5, (12,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    return Weights(loader) if pattern == "reads_datamodule" else loader


def _statistics(module: nn.Module) -> dict[str, list[float]]:
    return {k: v.flatten().tolist() for k, v in module.state_dict().items()
            if k.endswith(("running_mean", "num_batches_tracked"))}


def main(pattern: str, variant: str) -> None:
    from cltrain import ChannelsLast

    torch.manual_seed(0)
    module = {**PATTERNS, **STEP_PATTERNS}[pattern]()
    callbacks = {"nchw": [], "checked": [ChannelsLast()], "unchecked": [ChannelsLast(verify=False)]}[variant]
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    report: dict = {"pattern": pattern, "variant": variant, "error": None}
    try:
        trainer.fit(module, data(pattern))
    except Exception as error:  # noqa: BLE001 - raising is the negative control's result
        report["error"] = f"{type(error).__name__}: {error}".splitlines()[0]
    module = getattr(module, "_orig_mod", module)  # torch.compile(module) handed to fit
    report["losses"] = module.losses
    report["statistics"] = _statistics(module)
    if callbacks:
        checks = callbacks[0].layout_checks
        report["check"] = {kind: check.as_dict() for kind, check in checks.items()}
        report["line"] = {kind: check.line() for kind, check in checks.items()}
        report["layout"] = callbacks[0].layout
    print(json.dumps(report))


def assert_trains_like_nchw(runs: dict[str, dict], subject: str, fix: str, failure: str,
                            statistics: bool = False) -> None:
    """``run_variants``' reports: the checked run trains on the numbers of the run without the callback and its
    line names ``subject`` and ``fix`` at the user's file; without the check the run ``failure``s ("raises" or
    "diverges"), the negative control. ``statistics``: the BatchNorm statistics match too (no step ran on the
    real module)."""
    from cltrain.check.result import MAX_LINE

    nchw, checked, unchecked = runs["nchw"], runs["checked"], runs["unchecked"]
    assert nchw["error"] is None and len(nchw["losses"]) == 3
    assert checked["error"] is None, checked["error"]
    torch.testing.assert_close(torch.tensor(checked["losses"]), torch.tensor(nchw["losses"]), rtol=1e-5, atol=1e-6)
    if statistics:
        assert checked["statistics"].keys() == nchw["statistics"].keys()
        for key, value in nchw["statistics"].items():
            torch.testing.assert_close(torch.tensor(checked["statistics"][key]), torch.tensor(value), rtol=1e-4,
                                       atol=1e-6, msg=key)
    line = checked["line"]["train"]
    assert subject in line and fix in line and "py:" in line, line  # "py:": the user's file and line
    assert len(line) <= MAX_LINE and line.count("view size is not compatible") <= 1, line
    assert checked["check"]["train"]["verdict"] in ("fallback", "contiguous")
    assert unchecked["check"] == {}
    if failure == "raises":
        assert unchecked["error"] is not None
    else:
        assert unchecked["error"] is None
        gap = max(abs(a - b) for a, b in zip(unchecked["losses"], nchw["losses"]))
        assert gap > 1e-5, (unchecked["losses"], nchw["losses"])


class FirstBatchSnapshot(pl.Callback):
    """The run's state at the first training batch (put one before and one after ``ChannelsLast`` to see what its
    hook changed): the RNG, the module's tensors and gradients, the optimizer's state, what was logged, the step,
    and the module's ``calls`` and ``losses`` where it counts them."""

    def __init__(self) -> None:
        self.state: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.state is None:
            import copy

            module = getattr(pl_module, "_orig_mod", pl_module)
            self.state = {
                "rng": torch.get_rng_state().clone(),
                "tensors": {k: v.clone() for k, v in module.state_dict().items()},
                "grads": [p.grad for p in module.parameters()],
                "optimizer": copy.deepcopy(trainer.optimizers[0].state_dict()),
                "logged": dict(trainer.callback_metrics),
                "step": trainer.global_step,
                "calls": dict(getattr(module, "calls", {})),
                "losses": list(getattr(module, "losses", [])),
            }


def run_variants(pattern: str) -> dict[str, dict]:
    """``pattern`` trained in a subprocess without the callback, with it, and with ``verify=False``: each
    variant's report by name (``"nchw"``, ``"checked"``, ``"unchecked"``)."""
    root = Path(__file__).resolve().parents[2]
    proc = warm.run([sys.executable, "-m", "tests.helpers.user_code", pattern, "nchw", "checked", "unchecked"],
                    cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["variant"]: r for r in reports}


if __name__ == "__main__":
    for variant in sys.argv[2:]:
        main(sys.argv[1], variant)
