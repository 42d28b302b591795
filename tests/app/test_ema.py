"""ema.enabled=true (issue 10.4, the app side): the sync-free EMA update, and what validation,
checkpoints and metrics.json say about the weights they used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import timm
from torch import nn

from cltrain import is_channels_last
from cltrain.app.cli import compose_config
from cltrain.app.config import ConfigError
from cltrain.app.ema import EMA, EMAModel
from cltrain.app.train import train
from cltrain.data import make_demo_dataset
from tests.helpers import SMOKE

DEMO = {"num_classes": 4, "train_per_class": 8, "val_per_class": 4, "image_size": [48, 40]}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def test_the_update_follows_during_warm_up_then_averages() -> None:
    model = _net()
    ema = EMAModel(model, decay=0.75, warmup_steps=2)
    for _ in range(2):  # warm-up: the copy is the model
        with torch.no_grad():
            model[0].weight.add_(1.0)
        model(torch.randn(5, 3))  # moves BatchNorm's running statistics and num_batches_tracked
        ema.update_parameters(model)
        assert torch.equal(ema.module[0].weight, model[0].weight)
    before, mean_before = ema.module[0].weight.clone(), ema.module[1].running_mean.clone()
    with torch.no_grad():
        model[0].weight.add_(4.0)
    model(torch.randn(5, 3))
    ema.update_parameters(model)
    assert torch.allclose(ema.module[0].weight, 0.75 * before + 0.25 * model[0].weight)
    assert torch.allclose(ema.module[1].running_mean, 0.75 * mean_before + 0.25 * model[1].running_mean)  # buffers too
    assert ema.module[1].num_batches_tracked == model[1].num_batches_tracked == 3  # integers are copied
    assert int(ema.n_averaged) == 3

    resumed = EMAModel(_net(), decay=0.75)
    resumed.load_state_dict(ema.state_dict())  # n_averaged 3: the next update averages, no warm-up again
    previous = resumed.module[0].weight.clone()
    resumed.update_parameters(model)
    assert torch.allclose(resumed.module[0].weight, 0.75 * previous + 0.25 * model[0].weight)


def test_the_update_reads_nothing_back_to_the_host() -> None:
    """Lightning's EMAWeightAveraging model (AveragedModel + an EMA avg_fn) tests n_averaged twice per update."""
    from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

    from cltrain.timing.host_syncs import SyncOps

    model = _net()
    ours, lightnings = EMAModel(model, decay=0.9), AveragedModel(model, avg_fn=get_ema_avg_fn(0.9), use_buffers=True)
    for averaged in (ours, lightnings):
        averaged.update_parameters(model)  # the first update copies
    counts = []
    for averaged in (ours, lightnings):
        with SyncOps() as mode:
            averaged.update_parameters(model)
        counts.append(sum(mode.counts["setup"].values()))
    assert counts == [0, 2]


def test_the_average_follows_the_module_to_its_device_at_fit_start() -> None:
    """Made in setup, before the strategy moves the module: left behind, every update would copy to the host."""
    from tests.helpers.plain_modules import Classifier

    module = Classifier()
    callback = EMA(decay=0.9)
    callback.setup(None, module, "fit")
    module.to("meta")  # stands for the GPU the strategy moves the module to
    callback.on_fit_start(None, module)
    assert {p.device.type for p in callback._average_model.parameters()} == {"meta"}


def test_a_checkpoint_saved_inside_a_validation_holds_the_average_and_the_training_weights_in_place(tmp_path) -> None:
    """A signal's stop saves inside the validation, where WeightAveraging has swapped the average into the module:
    the resumed run trained on from the average, and the checkpoint's averaged weights were the training ones."""
    import lightning.pytorch as pl

    from tests.helpers.plain_modules import Classifier, loader

    seen: dict[str, dict[str, torch.Tensor]] = {}

    class SaveInside(pl.Callback):  # before the EMA in the callbacks: it sees the validation before the swap
        def on_validation_epoch_start(self, trainer, pl_module):
            seen["live"] = {k: v.clone() for k, v in pl_module.state_dict().items()}
            seen["average"] = {k: v.clone() for k, v in ema._average_model.module.state_dict().items()}

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            if batch_idx == 0:
                trainer.save_checkpoint(tmp_path / "inside.ckpt")

    torch.manual_seed(0)
    module, ema = Classifier(), EMA(decay=0.5)
    pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, num_sanity_val_steps=0, callbacks=[SaveInside(), ema]).fit(
        module, loader(8, 4), loader(4, 4))
    saved = torch.load(tmp_path / "inside.ckpt", weights_only=False)
    live, average = seen["live"], seen["average"]
    assert not all(torch.equal(live[k], average[k]) for k in live)  # the two differ, so the test can tell them apart
    assert all(torch.equal(saved["current_model_state"][k], live[k]) for k in live)
    assert all(torch.equal(saved["state_dict"][k], average[k]) for k in live)


def test_bad_ema_values_are_refused() -> None:
    with pytest.raises(ValueError, match="decay must be in"):
        EMA(decay=1.0)
    with pytest.raises(ConfigError, match=r"ema.decay=1.5: must be a number in \[0, 1\)"):
        train(compose_config([*SMOKE, "ema.enabled=true", "ema.decay=1.5", "run_dir=/nonexistent"]))


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ema")
    make_demo_dataset(root / "demo", **DEMO)
    demo = [f"data.demo.{k}={v}".replace(" ", "") for k, v in DEMO.items()]
    common = [*SMOKE, f"data.root={root / 'demo'}", *demo, "device=cpu", "amp=false",
              "trainer.enable_progress_bar=false", "print_freq=0"]
    fit = train(compose_config([*common, f"run_dir={root / 'fit'}", "ema.enabled=true", "ema.decay=0.5",
                                "trainer.max_epochs=2", "channels_last=true"]))
    evaluated = train(compose_config([*common, f"run_dir={root / 'eval'}", "evaluate_only=true",
                                      f"ckpt_path={fit['best_checkpoint']}"]))
    return {"fit": fit, "eval": evaluated}


@pytest.mark.slow
def test_validation_checkpoint_and_metrics_use_the_ema_weights(ema_run: dict) -> None:
    fit = ema_run["fit"]
    assert fit["weights"] == "ema" and json.loads((Path(fit["run_dir"]) / "metrics.json").read_text())["weights"] == "ema"
    checkpoint = torch.load(fit["best_checkpoint"], map_location="cpu", weights_only=True)
    averaged, live = checkpoint["state_dict"], checkpoint["current_model_state"]
    assert not torch.equal(averaged["model.conv1.0.weight"], live["model.conv1.0.weight"])
    # portable: the averaged weights load into a plain timm model, no EMA code needed
    plain = timm.create_model("test_resnet", num_classes=4)
    plain.load_state_dict({k.removeprefix("model."): v for k, v in averaged.items() if k.startswith("model.")})
    # the best score was measured on the averaged weights: evaluating them alone gives the same figure
    evaluated = ema_run["eval"]
    assert evaluated["weights"] == "ema" and evaluated["val_top1"] == fit["best_val_top1"]


@pytest.mark.slow
def test_the_averaged_copy_is_channels_last_with_channels_last(ema_run: dict) -> None:
    averaged = torch.load(ema_run["fit"]["best_checkpoint"], map_location="cpu", weights_only=True)["state_dict"]
    assert is_channels_last(averaged["model.conv1.0.weight"]) and is_channels_last(averaged["model.layer1.0.conv1.weight"])


@pytest.mark.slow
def test_an_ema_checkpoint_resumes_only_with_ema(ema_run: dict, tmp_path: Path) -> None:
    # Its state_dict is the average; without ema=true nothing restores the training weights (current_model_state)
    # and the run would go on from the average without a word. Refused before anything is built.
    fit = ema_run["fit"]
    cfg = fit["config"]
    common = [*SMOKE, f"data.root={cfg['data']['root']}", "data.demo=null", "device=cpu", "amp=false", "trainer.enable_progress_bar=false",
              "print_freq=0", f"ckpt_path={fit['last_checkpoint']}", "trainer.max_epochs=3"]
    with pytest.raises(ConfigError, match=r"ema.enabled=false: the checkpoint .*last.ckpt was trained with ema.enabled=true"
                                          r".*resuming needs ema.enabled=true"):
        train(compose_config([*common, f"run_dir={tmp_path / 'no'}", "ema.enabled=false"]))
    assert not (tmp_path / "no").exists()
    resumed = train(compose_config([*common, f"run_dir={tmp_path / 'yes'}", "ema.enabled=true", "ema.decay=0.5"]))
    assert resumed["status"] == "completed" and resumed["epochs"] == 3 and resumed["weights"] == "ema"
