"""Segmentation (``smp:``), detection (``tv-det:``) and video (``tv-video:``, ``hf:``) models of the zoo: how each is
built, its batch and its loss (docs/benchmarks.md#zoo-tasks).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from scripts.zoo.spec import NUM_CLASSES, Spec

_SMP = ("Unet", "UnetPlusPlus", "DeepLabV3Plus", "FPN", "Linknet", "PSPNet", "PAN", "MAnet")
SEGMENTATION = [Spec(f"smp:{a.lower()}_resnet18", f"SMP {a}", loss="dice_bce", note="Dice + BCE, binary masks")
                for a in _SMP]

def _detector_spec(name: str, family: str, note: str) -> Spec:
    return Spec(f"tv-det:{name}", family, loss="detection", note=note)


DETECTION = [
    _detector_spec("fasterrcnn_mobilenet_v3_large_320_fpn", "Faster R-CNN", "RPN and RoI samplers draw at random"),
    _detector_spec("ssdlite320_mobilenet_v3_large", "SSD", "images resized to 320 px by the model"),
    _detector_spec("retinanet_resnet18_fpn", "RetinaNet", "torchvision's RetinaNet on a resnet18 FPN"),
    _detector_spec("fcos_resnet18_fpn", "FCOS", "torchvision's FCOS on a resnet18 FPN"),
]

_CLIP = {"size": 64, "frames": 8}
_TINY_VIT = {"patch_size": 16, "num_frames": 4, "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "intermediate_size": 128}
#: Hugging Face video classifiers: (config class, model class, config kwargs).
HF_VIDEO: dict[str, tuple[str, str, dict[str, Any]]] = {
    "videomae": ("VideoMAEConfig", "VideoMAEForVideoClassification", {**_TINY_VIT, "tubelet_size": 2}),
    "timesformer": ("TimesformerConfig", "TimesformerForVideoClassification", _TINY_VIT),
}
VIDEO = [Spec(f"tv-video:{n}", "Video ResNet", **_CLIP, note="(N, 3, T, H, W) clips")
         for n in ("r3d_18", "mc3_18", "r2plus1d_18")]
VIDEO += [Spec(f"hf:{n}", f"HF {n}", size=64, frames=4, note="dict batch {pixel_values (B, T, C, H, W), labels}")
          for n in HF_VIDEO]

SPECS = SEGMENTATION + DETECTION + VIDEO


def is_task_model(spec: Spec) -> bool:
    """Whether ``spec`` is one of these (at any ``size``: the tests shrink them)."""
    return spec.source in ("smp", "tv-det", "tv-video") or spec.source == "hf" and spec.name in HF_VIDEO


def build_task_model(spec: Spec) -> nn.Module:
    """``spec``'s segmentation, detection or video model with random weights."""
    if spec.source == "smp":
        import segmentation_models_pytorch as smp

        arch = next(a for a in _SMP if spec.name == f"{a.lower()}_resnet18")
        return getattr(smp, arch)(encoder_name="resnet18", encoder_weights=None, classes=1)
    if spec.source == "tv-det":
        return _detector(spec)
    if spec.source == "tv-video":
        from torchvision.models import video

        return getattr(video, spec.name)(weights=None, num_classes=NUM_CLASSES)
    if spec.source == "hf" and spec.name in HF_VIDEO:
        import transformers

        config_cls, model_cls, kwargs = HF_VIDEO[spec.name]
        config = getattr(transformers, config_cls)(num_labels=NUM_CLASSES, **{**kwargs, "image_size": spec.size})
        return getattr(transformers, model_cls)(config)
    raise ValueError(f"no task model {spec.key!r}")


def _detector(spec: Spec) -> nn.Module:
    from torchvision.models import detection
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    same_size = {"min_size": spec.size, "max_size": spec.size}
    if spec.name == "ssdlite320_mobilenet_v3_large":
        return detection.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=NUM_CLASSES)
    if spec.name == "fasterrcnn_mobilenet_v3_large_320_fpn":
        return detection.fasterrcnn_mobilenet_v3_large_320_fpn(weights=None, weights_backbone=None,
                                                               num_classes=NUM_CLASSES, **same_size)
    arch = {"retinanet_resnet18_fpn": detection.RetinaNet, "fcos_resnet18_fpn": detection.FCOS}[spec.name]
    backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5,
                                   returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256))
    return arch(backbone, num_classes=NUM_CLASSES, **same_size)


def task_batch(spec: Spec, n: int, generator: torch.Generator, dtype: torch.dtype) -> Any:
    """A batch of ``n`` for a segmentation (images, masks) or detection (images, targets) spec."""
    if spec.loss == "dice_bce":
        x = torch.randn(n, 3, spec.size, spec.size, generator=generator).to(dtype)
        mask = (torch.rand(n, 1, spec.size, spec.size, generator=generator) > 0.5).to(dtype)
        return x, mask
    images = [torch.rand(3, spec.size, spec.size, generator=generator).to(dtype) for _ in range(n)]
    targets = []
    for _ in range(n):  # two boxes an image, 8 px to a third of the image wide, class 1 .. NUM_CLASSES - 1
        corner = torch.rand(2, 2, generator=generator) * spec.size * 0.6
        extent = 8 + torch.rand(2, 2, generator=generator) * spec.size / 3
        targets.append({"boxes": torch.cat([corner, corner + extent], 1).to(dtype),
                        "labels": torch.randint(1, NUM_CLASSES, (2,), generator=generator)})
    return images, targets


def dice_bce(net: nn.Module, batch: Any) -> torch.Tensor:
    """Dice + binary cross-entropy of ``net``'s one-channel logits against ``batch``'s masks, as
    segmentation_models_pytorch's examples train."""
    from segmentation_models_pytorch.losses import DiceLoss

    x, mask = batch
    logits = net(x)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return DiceLoss("binary", from_logits=True)(logits, mask) + F.binary_cross_entropy_with_logits(logits, mask)


def detection_loss(net: nn.Module, batch: Any) -> torch.Tensor:
    """The sum of the loss dict a torchvision detector returns in training mode."""
    images, targets = batch
    return sum(net(list(images), list(targets)).values())
