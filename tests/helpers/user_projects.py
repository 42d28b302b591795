"""Small Lightning projects in the styles users write, correct in either layout, for either Lightning package.

Run one as ``python -m tests.helpers.user_projects PROJECT PACKAGE`` (PACKAGE: ``lightning`` or
``pytorch_lightning``): it trains three steps four times (without the callback, the same with the weights nudged by
1e-7 as the noise reference, with ``ChannelsLast()``, with ``ChannelsLast(verify=False)``) and prints one JSON line
each: the losses, the final weights' checksum, the check's lines, the error if one was raised.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tests.helpers import warm

pl = importlib.import_module("pytorch_lightning" if "pytorch_lightning" in sys.argv else "lightning.pytorch")


def _cnn(channels: int = 3, classes: int = 5) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, classes))


class Recorded(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def record(self, loss: torch.Tensor) -> torch.Tensor:
        self.losses.append(float(loss.detach()))
        return loss


class Notebook(Recorded):
    """Course-notebook style: metrics logged to the progress bar, a validation step, Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _cnn()

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.model(x)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)
        return self.record(loss)

    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]), prog_bar=True)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class EnergyModel(Recorded):
    """An energy-based model that samples with input gradients inside the step (Langevin), clipped by the Trainer."""

    def __init__(self) -> None:
        super().__init__()
        self.cnn = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 16, 3, stride=2, padding=1),
                                 nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 1))

    def forward(self, x):  # noqa: ANN001, ANN201
        return -self.cnn(x).squeeze(-1)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        real = batch[0]
        fake = torch.rand_like(real) * 2 - 1
        with torch.enable_grad():
            for _ in range(3):
                fake = fake.detach().requires_grad_(True)
                grad, = torch.autograd.grad(self(fake).sum(), fake)
                fake = (fake - 0.1 * grad + 0.005 * torch.randn_like(fake)).clamp(-1, 1)
        energy_real, energy_fake = self(real), self(fake.detach())
        loss = energy_real.mean() - energy_fake.mean() + 0.1 * (energy_real ** 2 + energy_fake ** 2).mean()
        self.log("epoch", float(self.current_epoch) + self.global_step)
        return self.record(loss)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.parameters(), lr=1e-3, betas=(0.0, 0.999))


def squeeze(x: torch.Tensor) -> torch.Tensor:
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, 4 * c, h // 2, w // 2)


class Coupling(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(channels // 2, 16, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(16, channels, 3, padding=1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = x.chunk(2, dim=1)
        scale, shift = self.net(a).chunk(2, dim=1)
        scale = torch.tanh(scale)
        return torch.cat([a, b * scale.exp() + shift], dim=1), scale.flatten(1).sum(1)


class Flow(Recorded):
    """A multiscale normalizing flow: squeeze with reshape and permute, affine couplings, half the channels out."""

    def __init__(self) -> None:
        super().__init__()
        self.scales = nn.ModuleList([nn.ModuleList([Coupling(12), Coupling(12)]), nn.ModuleList([Coupling(24)])])

    def forward(self, x):  # noqa: ANN001, ANN201
        logdet, out = torch.zeros(x.size(0), device=x.device), []
        for couplings in self.scales:
            x = squeeze(x)
            for coupling in couplings:
                x, ld = coupling(x)
                logdet = logdet + ld
                x = x.flip(1)
            z, x = x.chunk(2, dim=1)
            out.append(z.flatten(1))
        out.append(x.flatten(1))
        z = torch.cat(out, 1)
        return -0.5 * (z ** 2).sum(1) + logdet

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        return self.record(-self(batch[0]).mean() / batch[0][0].numel())

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Uint8Images(Recorded):
    """Integer images in the batch, made float inside the step; one argument fewer: ``training_step(self, batch)``;
    two validation loaders (``dataloader_idx``) and a ``predict_step(self, batch)``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _cnn()

    def training_step(self, batch):  # noqa: ANN001, ANN201
        x, y = batch
        return self.record(F.cross_entropy(self.net(x.float() / 255 - 0.5), y))

    def validation_step(self, batch, batch_idx, dataloader_idx=0):  # noqa: ANN001, ANN201
        self.log(f"val_loss_{dataloader_idx}", F.cross_entropy(self.net(batch[0].float() / 255), batch[1]))

    def predict_step(self, batch):  # noqa: ANN001, ANN201
        return self.net(batch[0].float() / 255).argmax(1)

    def val_dataloader(self):  # noqa: ANN201
        return [DataLoader(_images(torch.uint8), batch_size=4), DataLoader(_images(torch.uint8), batch_size=4)]

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Probe(pl.Callback):
    """A self-supervised library's online probe: the callback adds a linear head to the module in ``setup`` and
    trains it from a forward hook of its own, on the detached features, inside the module's step."""

    def setup(self, trainer, pl_module, stage):  # noqa: ANN001, ANN201
        if "probe" not in pl_module.probes:
            pl_module.probes["probe"] = nn.Linear(16, 5)
            self.module = pl_module
            pl_module.register_forward_hook(lambda module, args, outputs: self.train_probe(module, args, outputs))

    def train_probe(self, pl_module, args, outputs):  # noqa: ANN001, ANN201
        head = self.module.probes["probe"]
        outputs["loss"] = outputs["loss"] + F.cross_entropy(head(outputs["features"].detach()), args[1])
        return outputs


class WithProbe(Recorded):
    """A backbone whose forward returns a dict (SSL style), with a probe added by ``Probe`` and AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = _cnn()[:-1]
        self.head = nn.Linear(16, 5)
        self.probes = nn.ModuleDict()

    def forward(self, x, y):  # noqa: ANN001, ANN201
        features = self.backbone(x)
        return {"features": features, "loss": F.cross_entropy(self.head(features), y)}

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        return self.record(self(*batch)["loss"])

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class ReadsTrainer(Notebook):
    """A step that reads the Trainer: accumulation, the schedule's length, the device, the datamodule-free loader,
    and steps its scheduler by hand (``self.lr_schedulers()``)."""

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        warm = min(1.0, (self.global_step + 1) / max(1, self.trainer.estimated_stepping_batches))
        loss = F.cross_entropy(self(x.to(self.trainer.strategy.root_device)), y) * warm
        self.lr_schedulers().step()
        return self.record(loss / self.trainer.accumulate_grad_batches)

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}


PROJECTS = {"notebook": Notebook, "energy": EnergyModel, "flow": Flow, "uint8": Uint8Images, "probe": WithProbe,
            "reads_trainer": ReadsTrainer}


def _images(dtype: torch.dtype, channels: int = 3, size: int = 16, n: int = 12, noise: bool = True) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, channels, size, size, generator=g)
    if not noise:  # smooth, photo-like: a blurred field
        x = F.avg_pool2d(F.pad(x, (2, 2, 2, 2), mode="reflect"), 5, stride=1)
    x = (x * 255).to(torch.uint8) if dtype == torch.uint8 else x * 2 - 1
    return TensorDataset(x, torch.randint(0, 5, (n,), generator=g))


def _data(project: str) -> tuple[DataLoader, DataLoader | None]:
    if project == "uint8":
        return DataLoader(_images(torch.uint8), batch_size=4), None
    if project == "energy":
        return DataLoader(_images(torch.float32, channels=1), batch_size=4), None
    return DataLoader(_images(torch.float32, noise=project != "flow"), batch_size=4), \
        DataLoader(_images(torch.float32), batch_size=4) if project == "notebook" else None


def main(project: str, variant: str) -> dict:
    from cltrain import ChannelsLast

    torch.manual_seed(0)
    module = PROJECTS[project]()
    if variant == "nudged":  # the noise reference: NCHW with every weight moved by a relative 1e-7
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(1 + 1e-7)
    callbacks = [Probe()] if project == "probe" else []
    layout = {"checked": ChannelsLast(), "unchecked": ChannelsLast(verify=False)}.get(variant)
    callbacks += [layout] if layout is not None else []
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         num_sanity_val_steps=0, gradient_clip_val=0.5 if project == "energy" else None)
    report: dict = {"project": project, "variant": variant, "error": None}
    train, val = _data(project)
    try:
        trainer.fit(module, train, val)
        if project == "uint8":
            trainer.predict(module, DataLoader(_images(torch.uint8), batch_size=4))
    except Exception as error:  # noqa: BLE001 - a raise is a result
        report["error"] = f"{type(error).__name__}: {error}".splitlines()[0]
    report["losses"] = module.losses
    report["weights"] = float(sum(p.detach().double().abs().sum() for p in module.parameters()))
    if layout is not None:
        report["lines"] = {kind: check.line() for kind, check in layout.layout_checks.items()}
        report["verdicts"] = {kind: check.verdict for kind, check in layout.layout_checks.items()}
    return report


def run_project(project: str, package: str) -> dict[str, dict]:
    """``project`` trained in a subprocess in every variant: each variant's report by name."""
    root = Path(__file__).resolve().parents[2]
    proc = warm.run([sys.executable, "-m", "tests.helpers.user_projects", project, package], cwd=root,
                    capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["variant"]: r for r in reports}


if __name__ == "__main__":
    for name in ("nchw", "nudged", "checked", "unchecked"):
        print(json.dumps(main(sys.argv[1], name)))
