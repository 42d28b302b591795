"""Hugging Face image models built from their configs (no download), tiny, and a generated dataset for them.

``build(name)`` gives a fresh model with random weights (``torch.manual_seed`` first for the same weights);
``dataset(name)`` a list of ``{"pixel_values", "labels"}`` dicts that ``default_data_collator`` stacks into an
NCHW batch, as an image processor's output would be.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

SIZE = 32  # pixels


def _convnext() -> nn.Module:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    return ConvNextForImageClassification(ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3))


def _resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="bottleneck", num_labels=3)
    return ResNetForImageClassification(config)


def _regnet() -> nn.Module:
    from transformers import RegNetConfig, RegNetForImageClassification

    config = RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8, num_labels=3)
    return RegNetForImageClassification(config)


def _segformer() -> nn.Module:
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    config = SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                             patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 1], mlp_ratios=[2, 2],
                             decoder_hidden_size=16, num_labels=3)
    return SegformerForSemanticSegmentation(config)


def _timm() -> nn.Module:
    from transformers import TimmWrapperConfig, TimmWrapperForImageClassification

    return TimmWrapperForImageClassification(TimmWrapperConfig(architecture="resnet10t", num_labels=3))


#: name -> builder. ``segformer`` is a segmentation model (its labels are (H, W) class maps).
MODELS: dict[str, Callable[[], nn.Module]] = {
    "convnext": _convnext, "resnet": _resnet, "regnet": _regnet,
    "segformer": _segformer, "timm": _timm,
}


def build(name: str, seed: int = 0) -> nn.Module:
    """The model ``name`` with the weights ``seed`` gives."""
    torch.manual_seed(seed)
    return MODELS[name]()


def dataset(name: str, n: int = 16, size: int = SIZE, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``n`` generated samples for ``name``: normalised images and class labels (class maps for segformer)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, size, size, generator=g)
    if name == "segformer":
        labels = torch.randint(0, 3, (n, size, size), generator=g)
    else:
        labels = torch.randint(0, 3, (n,), generator=g)
    return [{"pixel_values": images[i].clone(), "labels": labels[i].clone()} for i in range(n)]

