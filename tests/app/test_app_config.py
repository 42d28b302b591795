"""Config checks that need the machine or the filesystem (device, precision, paths, demo roots), and the
main_amp recipe; each bad value gets its one-line message. Every group option composing: test_schema.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cltrain.app.cli import compose_config
from cltrain.app.config import ConfigError, validate
from cltrain.app.config import resolve as app_config
from cltrain.app.schedule import lr_at, scaled_lr


def test_defaults_are_the_demo_main_job() -> None:
    cfg = compose_config()
    assert (cfg.model.name, cfg.data.root, cfg.channels_last, cfg.amp, cfg.device) == (
        "resnet50", "data/demo", True, "auto", "auto")
    assert cfg.data.demo.num_classes == 10


def test_main_amp_experiment_is_the_apex_recipe(tmp_path: Path) -> None:
    cfg = compose_config(["experiment=main_amp", f"data.root={tmp_path}"])
    assert cfg.model.name == "resnet50" and cfg.data.image_size == 224 and cfg.data.batch_size == 256
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.momentum, cfg.optim.weight_decay) == ("sgd", 0.1, 0.9, 1e-4)
    assert (cfg.optim.warmup_epochs, list(cfg.optim.milestones), cfg.trainer.max_epochs) == (5, [30, 60, 80], 90)


def test_main_amp_schedule_matches_adjust_learning_rate() -> None:
    def main_amp(epoch: int, step: int, len_epoch: int, base: float) -> float:  # apex main_amp.py, verbatim logic
        factor = epoch // 30
        if epoch >= 80:
            factor = factor + 1
        lr = base * (0.1 ** factor)
        if epoch < 5:
            lr = lr * float(1 + step + epoch * len_epoch) / (5.0 * len_epoch)
        return lr

    base, n = scaled_lr(0.1, 512), 7
    for epoch in (0, 1, 4, 5, 29, 30, 59, 60, 79, 80, 89):
        for step in (0, 3, 6):
            assert lr_at(epoch * n + step, n, base) == pytest.approx(main_amp(epoch, step, n, base))


def _error(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate(compose_config(overrides))
    return info.value


@pytest.mark.parametrize(
    "overrides,key,allowed",
    [
        (["model.name=resnet5"], "model.name", "resnet50"),
        (["model.source=onnx"], "model.source", "torchvision"),
        (["data=imagenet"], "data.root", "train/ and val/"),
        (["data=imagenet", "data.root=/no/such/dir"], "data.root", "train/ and val/"),
        (["data.batch_size=0"], "data.batch_size", None),
        (["data.batch_size=-4"], "data.batch_size", None),
        (["amp=fp16", "device=cpu"], "amp", "bf16"),
        (["amp=fp8"], "amp", "auto, true, false, bf16, fp16"),
        (["device=tpu"], "device", "auto, cpu, cuda"),
        (["channels_last=maybe"], "channels_last", "true, false"),
        (["optim.name=lbfgs"], "optim.name", "optim=sgd, optim=adamw"),
        (["evaluate_only=true"], "evaluate_only", "ckpt_path"),
        (["ckpt_path=/no/such.ckpt"], "ckpt_path", "local file"),
        (["model.pretrained=/no/such.pth"], "model.pretrained", "local file"),
        (["label_smoothing=1.5"], "label_smoothing", "0 <= value < 1"),
        (["trainer.sync_batchnorm=true", "device=cpu"], "trainer.sync_batchnorm", "device=cuda"),
        (["channels_last_mode=auto"], "channels_last_mode", "full, conv; the layout is channels_last_layout's: auto"),
        (["channels_last_layout=nhwc"], "channels_last_layout", "auto, channels_last, contiguous"),
        # a pin the run would not keep: channels_last=false trains without the callback (it was ignored in silence)
        (["channels_last=false", "channels_last_layout=channels_last"], "channels_last_layout",
         "channels_last=true channels_last_layout=channels_last"),
        (["channels_last=false", "channels_last_mode=conv"], "channels_last_mode", "channels_last=true"),
        (["compile.mode=fast"], "compile.mode", "reduce-overhead"),
        # an option of a list group not chosen: "+callbacks.early_stopping.patience=3" led to "needs a _target_"
        (["callbacks.early_stopping.patience=3"], "callbacks.early_stopping.patience",
         "callbacks=[default,early_stopping] callbacks.early_stopping.patience=3"),
        (["logger.tensorboard.name=x"], "logger.tensorboard.name", "logger=[csv,tensorboard]"),
        # a typo in a chosen entry: the argument meant, not "add it with +" (then the class's TypeError)
        (["callbacks=[default,early_stopping]", "callbacks.early_stopping.patiense=3"],
         "callbacks.early_stopping.patiense", "did you mean callbacks.early_stopping.patience?"),
        (["logger.csv.flush_every=5"], "logger.csv.flush_every", "flush_logs_every_n_steps"),
    ],
)
def test_bad_config_names_key_value_and_allowed(overrides: list[str], key: str, allowed: str | None) -> None:
    err = _error(overrides)
    message = str(err)
    assert err.key == key and message.startswith(f"{key}=")
    assert "\n" not in message and len(message) < 300
    value = overrides[-1].split("=", 1)[1] if overrides[-1].startswith(key) else None
    if value is not None:
        assert value in message
    if allowed is not None:
        assert allowed in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_asked_without_cuda() -> None:
    assert "no CUDA device" in str(_error(["device=cuda"]))


def test_amp_is_refused_on_a_device_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app_config, "resolve_accelerator", lambda device: ("mps", None))
    err = _error(["amp=true"])
    assert err.key == "amp" and "mps" in str(err) and "false" in str(err)
    assert validate(compose_config([])).precision == "32-true"  # amp=auto: fp32 there


def _native_bf16(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    import cltrain.precision

    support = (native, "natively (test)" if native else "no native bf16 (test)")
    monkeypatch.setattr(cltrain.precision, "cpu_bf16_support", lambda: support)


def test_cpu_amp_auto_is_bf16_only_where_bf16_is_native(monkeypatch: pytest.MonkeyPatch) -> None:
    assert validate(compose_config(["device=cpu", "amp=false"])).precision == "32-true"
    _native_bf16(monkeypatch, True)
    resolved = validate(compose_config(["device=cpu"]))
    assert resolved.precision == "bf16-mixed" and resolved.precision_reason == "amp=auto: natively (test)"
    _native_bf16(monkeypatch, False)
    assert validate(compose_config(["device=cpu"])).precision == "32-true"
    with pytest.warns(UserWarning, match="without native bf16.*14.5x slower"):  # asked for: runs, and says the cost
        assert validate(compose_config(["device=cpu", "amp=true"])).precision == "bf16-mixed"


def test_amp_takes_auto_or_a_boolean() -> None:
    err = _error(["amp=fast"])
    assert err.key == "amp" and "auto, true, false" in str(err)


@pytest.mark.parametrize("overrides", [["experiment=video"], ["data=video_demo"], []])
def test_each_demo_is_generated_at_its_own_default_root(overrides: list[str]) -> None:
    # data=video_demo's root is data/video_demo, not the image demo's data/demo: both are allowed to be made
    from cltrain.app.config import demo_home

    cfg = compose_config([*overrides, "device=cpu"])
    assert str(cfg.data.root) == demo_home(cfg.data) in ("data/demo", "data/video_demo")
    validate(cfg)  # raises ConfigError for a demo root that is not its config's own


@pytest.mark.parametrize("amp,bf16_ok,expected", [
    ("fp16", True, "16-mixed"), ("bf16", True, "bf16-mixed"), ("bf16", False, "amp='bf16': this GPU has no bf16 support"),
    (True, True, "bf16-mixed"), (True, False, "16-mixed"), ("auto", False, "16-mixed"), (False, True, "32-true"),
])
def test_amp_on_cuda_maps_to_lightning_precision(monkeypatch: pytest.MonkeyPatch, amp, bf16_ok: bool, expected: str) -> None:
    # amp=true and amp=auto pick the GPU's dtype (cltrain.precision.auto_precision); bf16 / fp16 ask for one
    from cltrain.precision import PrecisionChoice

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_ok)
    monkeypatch.setattr(app_config, "auto_precision",
                        lambda device: PrecisionChoice("bf16-mixed" if bf16_ok else "16-mixed", "test"))
    if expected.startswith("amp="):
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
            app_config.resolve_precision(amp, "cuda")
    else:
        assert app_config.resolve_precision(amp, "cuda")[0] == expected


def test_amp_fp16_is_refused_on_the_cpu_and_bf16_runs() -> None:
    with pytest.raises(ConfigError, match=r"amp='fp16': AMP on the CPU is bf16 autocast"):
        app_config.resolve_precision("fp16", "cpu")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert app_config.resolve_precision("bf16", "cpu")[0] == "bf16-mixed"
