"""A LightningCLI application that knows nothing of cltrain (run by tests/test_lightning_cli.py); on the standalone
``pytorch_lightning`` package where ``CLI_PACKAGE=pytorch_lightning``.

    python -m tests.helpers.lightning_cli_app fit --trainer.callbacks+=cltrain.ChannelsLast --trainer.max_steps=2

Each training step prints whether the first convolution's weight and the batch reached the step in
channels_last, so the test can read what the callback did from outside the process.
"""

import os

import torch
if os.environ.get("CLI_PACKAGE") == "pytorch_lightning":  # a project on the standalone package
    from pytorch_lightning import LightningModule
    from pytorch_lightning.cli import LightningCLI
else:
    from lightning.pytorch import LightningModule
    from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyClassifier(LightningModule):
    def __init__(self, channels: int = 8, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 4))

    def training_step(self, batch, batch_idx):
        images, targets = batch
        weight = self.net[0].weight
        print(f"step {batch_idx}: weight_cl={weight.is_contiguous(memory_format=torch.channels_last)} "
              f"batch_cl={images.is_contiguous(memory_format=torch.channels_last)}", flush=True)
        return nn.functional.cross_entropy(self.net(images), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 4, (16,), generator=g))
        return DataLoader(data, batch_size=self.batch_size)


if __name__ == "__main__":
    LightningCLI(TinyClassifier, trainer_defaults={"logger": False, "enable_checkpointing": False,
                                                    "enable_progress_bar": False, "accelerator": "cpu"},
                 save_config_callback=None)
