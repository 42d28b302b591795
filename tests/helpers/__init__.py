"""What the tests share: the repository root, the tiny demo set's sizes, and its Hydra overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The checkout's root (``train.py``, ``scripts/``).
REPO = Path(__file__).resolve().parents[2]

#: The tiny demo set most tests train on: 4 classes, 8 training and 4 validation JPEGs each, 64x48.
TINY_DEMO: dict[str, Any] = {"num_classes": 4, "train_per_class": 8, "val_per_class": 4, "image_size": [64, 48]}


#: The smoke experiment on timm's ``test_resnet`` (a ResNet with BatchNorm, 0.47 M parameters against ResNet-18's 11.7 M,
#: a 5 MB checkpoint against 89 MB): the app's tests exercise the app, and its runs take half the time.
SMOKE: list[str] = ["experiment=smoke", "model=timm", "model.name=test_resnet"]


def demo_overrides(root: Path, demo: dict[str, Any] = TINY_DEMO) -> list[str]:
    """The ``data.root`` / ``data.demo.*`` overrides that point ``train.py`` at a demo set made with ``demo``."""
    return [f"data.root={root}", *(f"data.demo.{k}={v}".replace(" ", "") for k, v in demo.items())]
