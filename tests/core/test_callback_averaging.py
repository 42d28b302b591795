"""ChannelsLast keeps Lightning's averaged copies (EMA, SWA) in the model's layout, whatever the callback order."""

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging
from torch import nn

from cltrain import ChannelsLast, is_channels_last
from cltrain.lightning_access import model_copies
from tests.helpers.plain_modules import Classifier, loader


def tiny_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )


class RecordsValidationWeights(Classifier):
    """Records the weights validation ran with (the averaged ones, swapped in by the callback)."""

    def __init__(self):
        super().__init__(net=tiny_net(), lr=0.5)
        self.val_weights: list[torch.Tensor] = []

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.val_weights.append(self.net[0].weight.detach().clone())


def fit(tmp_path, model, callbacks, **kw):
    kw = {"max_epochs": 1, **kw}
    trainer = Trainer(
        accelerator="cpu", limit_train_batches=3, limit_val_batches=1, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, callbacks=callbacks, **kw,
    )
    trainer.fit(model, loader(6, 2), loader(2, 2))
    return trainer


def conv_weights(module: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in module.modules() if isinstance(m, nn.Conv2d)]


@pytest.mark.parametrize("channels_last_first", [True, False])
def test_ema_copy_is_channels_last_in_either_order(tmp_path, channels_last_first):
    model, ema = RecordsValidationWeights(), EMAWeightAveraging(decay=0.5)
    callbacks = [ChannelsLast(), ema] if channels_last_first else [ema, ChannelsLast()]
    fit(tmp_path, model, callbacks)
    averaged = ema._average_model.module  # Lightning's AveragedModel wraps the copy
    assert all(is_channels_last(w) for w in conv_weights(averaged))
    assert all(is_channels_last(w) for w in conv_weights(model))
    # validation ran on the swapped-in averaged weights, in channels_last, and training ended on them
    assert len(model.val_weights) == 1 and is_channels_last(model.val_weights[0])
    assert torch.equal(model.val_weights[0], model.net[0].weight)
    assert torch.equal(averaged.net[0].weight, model.net[0].weight)
    assert "val" in model.seen and len(model.losses) == 3


def test_swa_copy_is_channels_last(tmp_path):
    model, swa = RecordsValidationWeights(), StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    fit(tmp_path, model, [swa, ChannelsLast()], max_epochs=2)
    assert all(is_channels_last(w) for w in conv_weights(swa._average_model))
    assert all(is_channels_last(w) for w in conv_weights(model))


def test_without_channels_last_the_copy_stays_nchw(tmp_path):
    # negative control: the averaged copy follows the model, whose weights are NCHW here
    model, averaging = RecordsValidationWeights(), WeightAveraging()
    fit(tmp_path, model, [averaging])
    assert all(w.is_contiguous() and not is_channels_last(w) for w in conv_weights(averaging._average_model.module))


def test_model_copies_finds_copies_not_the_model_or_strangers(tmp_path):
    model, ema = RecordsValidationWeights(), EMAWeightAveraging()
    trainer = fit(tmp_path, model, [ema])
    assert model_copies(trainer, model) == [ema._average_model]
    ema.other = model.net  # shares the model's parameters: not a copy
    ema.stranger = nn.Conv2d(3, 8, 3)  # other shapes: not a copy
    assert model_copies(trainer, model) == [ema._average_model]


class WithTemperature(RecordsValidationWeights):
    """A learnable temperature beside the network: the model's parameters are no copy's."""

    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.net(x) * self.temperature


class HeldEMA(Callback):
    """A user's EMA of the model's network, held in a dict (made in setup, as Lightning's WeightAveraging does)."""

    def setup(self, trainer, pl_module, stage):
        self.store = {"ema": torch.optim.swa_utils.AveragedModel(pl_module.net)}

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.store["ema"].update_parameters(pl_module.net)


def test_a_users_ema_of_the_network_held_in_a_dict_beside_a_temperature_is_channels_last(tmp_path):
    # only callback attributes shaped as the whole LightningModule counted: this EMA stayed NCHW, copied across layouts
    model, ema = WithTemperature(), HeldEMA()
    trainer = fit(tmp_path, model, [ema, ChannelsLast(layout="channels_last")])
    assert model_copies(trainer, model) == [ema.store["ema"]]
    assert all(is_channels_last(w) for w in conv_weights(ema.store["ema"])) and conv_weights(ema.store["ema"])
    assert all(is_channels_last(w) for w in conv_weights(model))
    ema.stranger = [nn.Conv2d(3, 8, 3)]  # shaped as one of the network's layers, not as the network: no copy
    assert model_copies(trainer, model) == [ema.store["ema"]]
