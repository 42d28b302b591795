"""Model factory: torchvision and timm by name, weights only from a local file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision

from cltrain import is_channels_last, to_channels_last
from cltrain.app.config import ConfigError
from cltrain.app.models import build_model, check_model_name, load_pretrained


def test_torchvision_model_by_name() -> None:
    model = build_model("mobilenet_v3_small", num_classes=7)
    assert isinstance(model, torchvision.models.MobileNetV3)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_timm_model_by_name() -> None:
    pytest.importorskip("timm")
    assert check_model_name("resnet50") == "torchvision"  # auto: torchvision first
    assert check_model_name("resnet50", "timm") == "timm"
    model = build_model("convnext_atto", num_classes=3)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)


def test_unknown_model_suggests_close_names() -> None:
    with pytest.raises(ConfigError, match=r"model.name='resnet5': unknown model .*closest: resnet50"):
        check_model_name("resnet5")


def test_pretrained_from_a_local_state_dict_skips_a_mismatched_head(tmp_path: Path) -> None:
    source = torchvision.models.resnet18(num_classes=1000)
    path = tmp_path / "resnet18.pth"
    torch.save(source.state_dict(), path)
    with pytest.warns(UserWarning, match="skipped 2 unmatched"):
        model = build_model("resnet18", num_classes=10, pretrained=path)
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
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match="model.pretrained"):
        build_model("resnet18", num_classes=10, pretrained=path)
