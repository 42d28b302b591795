"""ChannelsLast under the standalone ``pytorch_lightning`` package (its Trainer, its LightningModule, its SWA
callback): fit a ``view`` head with and without the callback, and without the check; print one JSON line.

Run as ``python -m tests.helpers.pl_standalone_run``. Its own process: importing ``pytorch_lightning`` points
the logger that ``lightning_utilities`` shares with ``lightning.pytorch`` at ``pytorch_lightning``'s name.
"""

from __future__ import annotations

import json

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cltrain import ChannelsLast, is_channels_last


class ViewHead(nn.Module):
    """A LeNet-style head: ``view`` flattens the feature map, which raises on channels_last memory."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8 * 16 * 16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.conv(x)))
        return self.fc(y.view(y.size(0), -1))


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = ViewHead()
        self.losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def fit(callbacks: list, epochs: int = 2) -> Module:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 5, (16,), generator=g)),
                      batch_size=8)
    module = Module()
    pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks).fit(module, data)
    return module


def main() -> None:
    callback, swa = ChannelsLast(), pl.callbacks.StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    checked, reference = fit([callback, swa]), fit([pl.callbacks.StochasticWeightAveraging(0.05, swa_epoch_start=1)])
    check = callback.layout_checks["train"]
    try:  # the negative control: channels_last without the check
        fit([ChannelsLast(verify=False)], epochs=1)
        control = None
    except RuntimeError as error:
        control = str(error)
    print(json.dumps({
        "verdict": check.verdict, "line": check.line(), "control": control,
        "losses": [float(v) for v in checked.losses], "reference": [float(v) for v in reference.losses],
        "conv_cl": is_channels_last(checked.net.conv.weight),
        "swa_conv_cl": is_channels_last(swa._average_model.net.conv.weight),
    }))


if __name__ == "__main__":
    main()
