"""Model factory: torchvision and timm by name, weights only from a local file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision

from cltrain import is_channels_last, to_channels_last
from cltrain.app.config import ConfigError
from cltrain.app.config.resolve import check_model_name
from cltrain.app.models import build_classifier, load_pretrained, read_checkpoint


def test_torchvision_model_by_name() -> None:
    model = build_classifier("mobilenet_v3_small", num_classes=7)
    assert isinstance(model, torchvision.models.MobileNetV3)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_timm_model_by_name() -> None:
    pytest.importorskip("timm")
    assert check_model_name("resnet50") == "torchvision"  # auto: torchvision first
    assert check_model_name("resnet50", "timm") == "timm"
    model = build_classifier("convnext_atto", num_classes=3)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)


def test_unknown_model_suggests_close_names() -> None:
    with pytest.raises(ConfigError, match=r"model.name='resnet5': unknown model .*closest: resnet50"):
        check_model_name("resnet5")


def test_pretrained_from_a_local_state_dict_skips_a_mismatched_head(tmp_path: Path) -> None:
    source = torchvision.models.resnet18(num_classes=1000)
    path = tmp_path / "resnet18.pth"
    torch.save(source.state_dict(), path)
    with pytest.warns(UserWarning, match=r"skipped 2 unmatched .*2 model key\(s\) left at their initial values "
                                         r"\['fc.weight', 'fc.bias'\]"):
        model = build_classifier("resnet18", num_classes=10, pretrained=path)
    assert torch.equal(model.conv1.weight, source.conv1.weight)
    assert model.fc.out_features == 10


def test_pretrained_from_a_lightning_checkpoint_keeps_the_layout(tmp_path: Path) -> None:
    source = torchvision.models.resnet18(num_classes=10)
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in source.state_dict().items()}, "epoch": 3}, path)
    model = to_channels_last(torchvision.models.resnet18(num_classes=10))
    assert load_pretrained(model, path) == []
    assert torch.equal(model.layer1[0].conv1.weight, source.layer1[0].conv1.weight)
    assert is_channels_last(model.layer1[0].conv1.weight)


def test_pretrained_with_nothing_matching_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.pth"
    torch.save({"foo.weight": torch.zeros(3)}, path)
    with pytest.raises(ConfigError, match="model.pretrained=.*other.pth.*no weight in the file matches"):
        build_classifier("resnet18", num_classes=10, pretrained=path)


# --- video models ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["r3d_18", "mc3_18", "r2plus1d_18"])
def test_torchvision_video_model_by_name(name: str) -> None:
    assert check_model_name(name) == "torchvision"
    model = build_classifier(name, num_classes=6)
    assert model.fc.out_features == 6
    assert model(torch.randn(1, 3, 4, 32, 32)).shape == (1, 6)


def test_an_input_smaller_than_a_torchvision_model_takes_is_one_line_naming_the_key() -> None:
    from cltrain.app.models import check_input_size

    for name, size, frames, said in [("s3d", 32, 8, "data.image_size=32: model.name='s3d' (torchvision) takes images of "
                                      "at least 224 px (allowed: data.image_size=224 or more, or another model)"),
                                     ("s3d", 224, 8, "data.num_frames=8: model.name='s3d' (torchvision) takes clips of "
                                      "at least 14 frames"),
                                     ("inception_v3", 64, None, "data.image_size=64: model.name='inception_v3'")]:
        with pytest.raises(ConfigError) as raised:  # each failed inside the first step, with a traceback
            check_input_size(name, "auto", size, frames)
        assert str(raised.value).startswith(said), str(raised.value)
    for name, size, frames in [("s3d", 224, 16), ("r3d_18", 32, 8), ("resnet18", 8, None), ("resnet18", 8, 4)]:
        check_input_size(name, "auto", size, frames)


def test_unknown_video_model_suggests_the_video_names() -> None:
    with pytest.raises(ConfigError, match=r"model.name='r3d_19': unknown model .*closest: .*r3d_18"):
        check_model_name("r3d_19", "torchvision")


# --- the checkpoint reader ------------------------------------------------------------------------
def _small() -> torch.nn.Module:
    return torchvision.models.resnet18(num_classes=4)


@pytest.mark.parametrize("kind", ["text", "truncated", "empty", "truncated_safetensors", "list"])
def test_a_file_that_is_not_a_checkpoint_is_a_one_line_error_naming_it(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"weights-{kind}.pth"
    if kind == "text":
        path.write_text("these are not weights\n")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "list":
        torch.save([1, 2, 3], path)
    else:
        full = tmp_path / "full"
        if kind == "truncated":
            torch.save(_small().state_dict(), full)
        else:
            from safetensors.torch import save_file

            save_file(_small().state_dict(), full)
            path = path.with_suffix(".safetensors")
        path.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    with pytest.raises(ConfigError) as info:
        build_classifier("resnet18", num_classes=4, pretrained=path)
    message = str(info.value)
    assert message.startswith(f"model.pretrained='{path}': ") and "\n" not in message
    assert ("holds no weights" if kind == "list" else "not a") in message


@pytest.mark.parametrize("suffix", [".safetensors", ".bin"])
def test_safetensors_files_by_suffix_or_by_content(tmp_path: Path, suffix: str) -> None:
    from safetensors.torch import save_file

    source = _small()
    path = tmp_path / f"model{suffix}"
    save_file({f"module.{k}": v.contiguous() for k, v in source.state_dict().items()}, path)  # a DDP-wrapped save
    model = _small()
    assert load_pretrained(model, path) == []
    assert torch.equal(model.conv1.weight, source.conv1.weight)


def test_ema_weights_are_preferred_as_timm_does(tmp_path: Path) -> None:
    live, ema = _small(), torch.optim.swa_utils.AveragedModel(_small(), multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    ema.update_parameters(_small())
    path = tmp_path / "checkpoint.pth"  # torchvision's references save {"model": ..., "model_ema": AveragedModel.state_dict()}
    torch.save({"model": live.state_dict(), "model_ema": ema.state_dict(), "epoch": 3}, path)
    state, where = read_checkpoint(path)
    assert where == "model_ema" and "n_averaged" not in state and not any(k.startswith("module.") for k in state)
    model = _small()
    assert load_pretrained(model, path) == []
    assert torch.equal(model.conv1.weight, ema.module.conv1.weight)
    assert load_pretrained(model, path, use_ema=False) == []
    assert torch.equal(model.conv1.weight, live.conv1.weight)

    timm_style = tmp_path / "timm.pth.tar"  # timm's train.py: state_dict + state_dict_ema
    torch.save({"state_dict": live.state_dict(), "state_dict_ema": ema.module.state_dict()}, timm_style)
    assert read_checkpoint(timm_style)[1] == "state_dict_ema"


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "_orig_mod.module.", "module._orig_mod."])
def test_wrapper_prefixes_are_stripped(tmp_path: Path, prefix: str) -> None:
    source = _small()
    path = tmp_path / "wrapped.pth"
    torch.save({f"{prefix}{k}": v for k, v in source.state_dict().items()}, path)
    model = _small()
    assert load_pretrained(model, path) == []
    assert torch.equal(model.fc.weight, source.fc.weight)


def test_a_real_lightning_checkpoint_of_the_app(tmp_path: Path) -> None:
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from cltrain.app.module import ImageClassifier

    module = ImageClassifier(_small(), num_classes=4, lr=0.01)
    data = DataLoader(TensorDataset(torch.randn(4, 3, 32, 32), torch.arange(4)), batch_size=2)
    trainer = Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path)
    trainer.fit(module, data)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    assert read_checkpoint(path)[1] == "state_dict"
    model = _small()
    assert load_pretrained(model, path) == []
    assert torch.equal(model.layer1[0].conv1.weight, module.model.layer1[0].conv1.weight)
