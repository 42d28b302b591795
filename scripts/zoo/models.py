"""The models of ``python -m scripts.zoo.sweep``: timm, torchvision and Hugging Face classifiers, segmentation
(``smp:``), detection (``tv-det:``) and video (``tv-video:``, ``hf:``) models (docs/benchmarks.md#zoo-tasks), and
planted ones only the tests name; how each is built (random weights, nothing downloaded), its batch and its loss;
``fit``: a few steps of it under a real Lightning ``Trainer`` (``ZooModule``), with or without a callback.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from scripts.fits import quiet_trainer

NUM_CLASSES = 5
SIZE = 128


@dataclass(frozen=True)
class Spec:
    """One row of the sweep."""

    key: str                      #: ``source:name``, unique
    family: str
    size: int = SIZE              #: square input size, pixels
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    note: str = ""
    compile: bool = False         #: also measured under torch.compile
    #: ``"cross_entropy"`` on class labels, ``"dice_bce"`` (Dice + BCE) on binary masks, ``"detection"``: the sum
    #: of the loss dict a torchvision detector returns in training mode for its list of images and of targets
    loss: str = "cross_entropy"
    frames: int = 0               #: frames of a video clip; 0: images

    @property
    def source(self) -> str:
        return self.key.split(":", 1)[0]

    @property
    def name(self) -> str:
        return self.key.split(":", 1)[1]

    @property
    def dict_batch(self) -> bool:
        return self.source == "hf"


#: timm classifiers by family, in the sweep's order (those built otherwise than at 128 px, or also compiled: ``_TIMM``).
_TIMM_FAMILIES = {
    "ResNet": "resnet18 resnet26d resnet50 resnet10t",
    "ResNeXt/SE": "seresnext26d_32x4d resnext26ts ecaresnet26t skresnet18",
    "RegNet": "regnetx_002 regnety_002 regnetz_b16",
    "EfficientNet": "efficientnet_b0 efficientnet_lite0 tf_efficientnetv2_b0 tinynet_a mixnet_s",
    "MobileNet": "mobilenetv2_050 mobilenetv3_small_050 mobilenetv3_large_100 mobilenetv4_conv_small "
                 "mobilenetv4_hybrid_medium lcnet_050 fbnetc_100 mnasnet_small rexnet_100",
    "ConvNeXt": "convnext_atto convnextv2_atto",
    "RepVGG/MobileOne/FastViT": "repvgg_a0 mobileone_s0 fastvit_t8 repghostnet_050 repvit_m0_9",
    "DenseNet": "densenet121", "HRNet": "hrnet_w18_small", "Res2Net/ResNeSt": "res2net50_14w_8s resnest14d",
    "DLA": "dla34", "VoVNet": "ese_vovnet19b_dw", "GhostNet": "ghostnet_050 ghostnetv2_100",
    "CSP/Darknet": "cspresnet50 cs3darknet_s darknet17",
    "Inception": "inception_v3 inception_next_tiny legacy_xception",
    "NF-ResNet": "nf_resnet26", "ConvMixer": "convmixer_768_32", "PoolFormer": "poolformer_s12 poolformerv2_s12",
    "EfficientFormer": "efficientformer_l1 efficientformerv2_s0", "MobileViT": "mobilevit_xxs mobilevitv2_050",
    "ViT/DeiT": "vit_tiny_patch16_224 deit_tiny_patch16_224", "Swin": "swin_tiny_patch4_window7_224",
    "MaxViT/CoAtNet": "maxvit_nano_rw_256 coatnet_nano_rw_224", "LeViT": "levit_128s",
    "EfficientViT": "efficientvit_b0 efficientvit_m0", "EdgeNeXt": "edgenext_xx_small", "HGNet": "hgnetv2_b0",
    "StarNet": "starnet_s1", "TinyViT": "tiny_vit_5m_224", "PVT": "pvt_v2_b0", "MambaOut": "mambaout_femto",
    "XCiT": "xcit_nano_12_p16_224", "SelecSLS": "selecsls42b", "DPN": "dpn48b", "GENet": "gernet_s",
    "RDNet": "rdnet_tiny", "MLP": "mixer_s32_224 resmlp_12_224",
}
_STEM = {"note": "1x1 stride-2 conv on the 3-channel stem"}
_VIT_SIZE = {"kwargs": {"img_size": SIZE}}  # fixed-size position embeddings / attention: built for 128 px
_TIMM: dict[str, dict[str, Any]] = {
    "resnet26d": {"note": "ill-conditioned gradients at batch 2"}, "efficientnet_b0": {"compile": True},
    "convnext_atto": {"compile": True}, "repvgg_a0": _STEM, "mobileone_s0": _STEM, "fastvit_t8": _STEM,
    "efficientformer_l1": {"size": 224, "note": "fixed 224 px attention bias"},
    **dict.fromkeys(["efficientformerv2_s0", "vit_tiny_patch16_224", "deit_tiny_patch16_224",
                     "swin_tiny_patch4_window7_224", "maxvit_nano_rw_256", "coatnet_nano_rw_224", "levit_128s",
                     "mixer_s32_224", "resmlp_12_224"], _VIT_SIZE),
}
TIMM = [Spec(f"timm:{n}", family, **_TIMM.get(n, {}))
        for family, names in _TIMM_FAMILIES.items() for n in names.split()]

_NO_AUX = {"kwargs": {"aux_logits": False, "init_weights": True}, "note": "no aux heads"}
#: The torchvision models built otherwise than at 128 px with ``num_classes`` alone, or also compiled.
_TV: dict[str, dict[str, Any]] = {
    "googlenet": _NO_AUX, "inception_v3": _NO_AUX,
    **{f"vit_{v}": {"kwargs": {"image_size": SIZE}} for v in ("b_16", "b_32", "l_16", "l_32")},
    "vit_h_14": {"size": 112, "kwargs": {"image_size": 112}, "note": "112 px: patch 14"},  # 14 does not divide 128
    "maxvit_t": {"size": 224, "note": "224 px: its partition size 7 does not divide 128 px maps"},
    "resnet50": {"compile": True},
}


#: A torchvision model's family: the first whose prefix its name starts with (else its name).
_TV_FAMILIES = (("resnext", "ResNeXt"), ("wide_resnet", "ResNet"), ("resnet", "ResNet"), ("regnet", "RegNet"),
                ("efficientnet", "EfficientNet"), ("mobilenet", "MobileNet"), ("mnasnet", "MobileNet"),
                ("convnext", "ConvNeXt"), ("densenet", "DenseNet"), ("shufflenet", "ShuffleNet"),
                ("squeezenet", "SqueezeNet"), ("swin", "Swin"), ("vit", "ViT/DeiT"), ("vgg", "VGG"),
                ("maxvit", "MaxViT/CoAtNet"), ("googlenet", "Inception"), ("inception", "Inception"),
                ("alexnet", "AlexNet"))


def torchvision_specs() -> list[Spec]:
    """Every torchvision classification model."""
    import torchvision

    return [Spec(f"tv:{n}", next((f for p, f in _TV_FAMILIES if n.startswith(p)), n), **_TV.get(n, {}))
            for n in torchvision.models.list_models(module=torchvision.models)]


#: Hugging Face transformers image classifiers, from config classes: (``<prefix>Config`` and
#: ``<prefix>ForImageClassification``'s prefix, config kwargs).
HF_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "convnext": ("ConvNext", {}), "convnextv2": ("ConvNextV2", {}), "resnet": ("ResNet", {}),
    "resnet_small": ("ResNet", {"embedding_size": 16, "hidden_sizes": [32, 64, 128, 256], "depths": [1, 1, 1, 1]}),
    "regnet": ("RegNet", {}), "swin": ("Swin", {"image_size": SIZE, "window_size": 4}),
    "efficientnet": ("EfficientNet", {"image_size": SIZE}), "mobilevit": ("MobileViT", {"image_size": SIZE}),
}
HF = [Spec(f"hf:{n}", f"HF {n}", note="dict batch {pixel_values, labels}") for n in HF_MODELS]

#: One classifier per family, for sweeps too long for the whole zoo: per timm family its first model (a more
#: common one for MobileNet and Res2Net/ResNeSt), torchvision's own implementations of the common families and
#: its families timm lacks (ShuffleNet, SqueezeNet; VGG, AlexNet and torchvision's ViTs are over 30M parameters),
#: and the Hugging Face models but the two over 20M parameters whose code a smaller one shares (resnet, efficientnet).
FAMILY_SUBSET = [
    *(f"timm:{({'MobileNet': 'mobilenetv3_large_100', 'Res2Net/ResNeSt': 'resnest14d'}).get(family, names.split()[0])}"
      for family, names in _TIMM_FAMILIES.items()),
    *(f"tv:{n}" for n in ("resnet50", "resnext50_32x4d", "mobilenet_v3_large", "shufflenet_v2_x1_0", "squeezenet1_1")),
    *(f"hf:{n}" for n in ("resnet_small", "convnext", "convnextv2", "regnet", "swin", "mobilevit")),
]

_SMP = ("Unet", "UnetPlusPlus", "DeepLabV3Plus", "FPN", "Linknet", "PSPNet", "PAN", "MAnet")
SEGMENTATION = [Spec(f"smp:{a.lower()}_resnet18", f"SMP {a}", loss="dice_bce", note="Dice + BCE, binary masks")
                for a in _SMP]
DETECTION = [Spec(f"tv-det:{name}", family, loss="detection", note=note) for name, family, note in (
    ("fasterrcnn_mobilenet_v3_large_320_fpn", "Faster R-CNN", "RPN and RoI samplers draw at random"),
    ("ssdlite320_mobilenet_v3_large", "SSD", "images resized to 320 px by the model"),
    ("retinanet_resnet18_fpn", "RetinaNet", "torchvision's RetinaNet on a resnet18 FPN"),
    ("fcos_resnet18_fpn", "FCOS", "torchvision's FCOS on a resnet18 FPN"))]

_CLIP = {"size": 64, "frames": 8}
_TINY_VIT = {"patch_size": 16, "num_frames": 4, "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "intermediate_size": 128}
#: Hugging Face video classifiers: (the classes' prefix, ``...ForVideoClassification``, config kwargs).
HF_VIDEO: dict[str, tuple[str, dict[str, Any]]] = {
    "videomae": ("VideoMAE", {**_TINY_VIT, "tubelet_size": 2}), "timesformer": ("Timesformer", _TINY_VIT),
}
VIDEO = [Spec(f"tv-video:{n}", "Video ResNet", **_CLIP, note="(N, 3, T, H, W) clips")
         for n in ("r3d_18", "mc3_18", "r2plus1d_18")]
VIDEO += [Spec(f"hf:{n}", f"HF {n}", size=64, frames=4, note="dict batch {pixel_values (B, T, C, H, W), labels}")
          for n in HF_VIDEO]

TASK_SPECS = SEGMENTATION + DETECTION + VIDEO


PLANTED = [
    Spec("planted:wrong_grad", "planted", size=32, note="weight gradient 3.4x off under channels_last"),
    Spec("planted:crash", "planted", size=32, note="segfaults under channels_last"),
    Spec("planted:view_head", "planted", size=32, note="x.view(x.size(0), -1) in its head"),
]


def all_specs() -> list[Spec]:
    """The sweep's rows, planted models excluded (they run only when named)."""
    return TIMM + torchvision_specs() + HF + TASK_SPECS


def find(keys: list[str]) -> list[Spec]:
    """Specs by key (``timm:resnet50``) or bare name (every source that has it); ``ValueError`` for an unknown one."""
    specs = all_specs() + PLANTED
    found: list[Spec] = []
    for key in keys:
        hits = [s for s in specs if key in (s.key, s.name)]
        if not hits:
            raise ValueError(f"--models {key!r}: no such model in the zoo (see --list)")
        found += [h for h in hits if h not in found]
    return found


# ---- building one model and its batches -------------------------------------------------------------


def _faulty_path(x: torch.Tensor) -> bool:
    """Whether ``x`` is channels_last fp32 with oneDNN on: where the planted faults show."""
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return channels_last and torch.backends.mkldnn.enabled and x.dtype == torch.float32


class _WrongGradUnderChannelsLast(torch.autograd.Function):
    """Identity on the weight, whose gradient comes back 3.4x too large when the input is channels_last
    and oneDNN is on: a wrong oneDNN kernel, as #6035's silent case."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.scale = 3.4 if _faulty_path(x) else 1.0
        return weight.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _WrongGradConv(nn.Conv2d):
    """A convolution whose weight gradient is 3.4x off under channels_last (``_WrongGradUnderChannelsLast``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, _WrongGradUnderChannelsLast.apply(self.weight, x), self.bias)


class _Planted(nn.Module):
    """A conv and a head with a planted fault under channels_last: ``wrong_grad`` (the conv's weight gradient),
    ``crash`` (a native crash in the forward), ``view_head`` (``_ViewHead`` after 4x4 average pooling)."""

    def __init__(self, kind: str, size: int):
        super().__init__()
        self.kind = kind
        self.conv = (_WrongGradConv if kind == "wrong_grad" else nn.Conv2d)(3, 8, 3, padding=1)
        self.head = _ViewHead(8 * (size // 4) ** 2) if kind == "view_head" else nn.Linear(8, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "crash" and _faulty_path(x) and torch.is_grad_enabled():
            ctypes.string_at(0)  # a native crash, as a bad oneDNN kernel's
        h = self.conv(x).relu()
        return self.head(F.avg_pool2d(h, 4) if self.kind == "view_head" else h.mean((2, 3)))


class _ViewHead(nn.Module):
    """A LeNet-style head: ``x.view(x.size(0), -1)`` merges C with H and W, which only NCHW strides allow."""

    def __init__(self, features: int):
        super().__init__()
        self.fc = nn.Linear(features, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.view(x.size(0), -1))


def build(spec: Spec) -> nn.Module:
    """``spec``'s model with random weights and ``NUM_CLASSES`` outputs (one mask channel for segmentation)."""
    if spec.source in ("timm", "tv"):
        from cltrain.model_names import build_untrained_model

        source = "timm" if spec.source == "timm" else "torchvision"
        return build_untrained_model(spec.name, num_classes=NUM_CLASSES, source=source, **spec.kwargs)
    if spec.source == "hf":
        import transformers

        prefix, kwargs = HF_MODELS.get(spec.name) or HF_VIDEO[spec.name]
        video = {"image_size": spec.size} if spec.name in HF_VIDEO else {}  # a video config follows --size
        config = getattr(transformers, f"{prefix}Config")(num_labels=NUM_CLASSES, **kwargs, **video)
        return getattr(transformers, f"{prefix}For{'Video' if video else 'Image'}Classification")(config)
    if spec.source == "smp":
        import segmentation_models_pytorch as smp

        arch = next(a for a in _SMP if spec.name == f"{a.lower()}_resnet18")
        return getattr(smp, arch)(encoder_name="resnet18", encoder_weights=None, classes=1)
    if spec.source == "tv-det":
        return _detector(spec)
    if spec.source == "tv-video":
        from torchvision.models import video

        return getattr(video, spec.name)(weights=None, num_classes=NUM_CLASSES)
    if spec.source == "planted":
        return _Planted(spec.name, spec.size)
    raise ValueError(f"unknown source in {spec.key!r}")


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


def make_batch(spec: Spec, n: int, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> Any:
    """A random NCHW-contiguous batch of ``n`` with the targets of ``spec.loss``: ``(images, labels)`` (a dict
    for Hugging Face models; clips of ``spec.frames``), ``(images, masks)`` or ``(images, targets)``."""
    if spec.loss == "detection":
        images = [torch.rand(3, spec.size, spec.size, generator=generator).to(dtype) for _ in range(n)]
        targets = []
        for _ in range(n):  # two boxes an image, 8 px to a third of the image wide, class 1 .. NUM_CLASSES - 1
            corner = torch.rand(2, 2, generator=generator) * spec.size * 0.6
            extent = 8 + torch.rand(2, 2, generator=generator) * spec.size / 3
            targets.append({"boxes": torch.cat([corner, corner + extent], 1).to(dtype),
                            "labels": torch.randint(1, NUM_CLASSES, (2,), generator=generator)})
        return images, targets
    frames = () if not spec.frames else (spec.frames,)
    # a clip is (N, C, T, H, W); a Hugging Face image stack is (B, T, C, H, W)
    shape = (n, *frames, 3) if spec.dict_batch else (n, 3, *frames)
    x = torch.randn(*shape, spec.size, spec.size, generator=generator).to(dtype)
    if spec.loss == "dice_bce":
        return x, (torch.rand(n, 1, spec.size, spec.size, generator=generator) > 0.5).to(dtype)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=generator)
    return {"pixel_values": x, "labels": y} if spec.dict_batch else (x, y)


def clone_batch(batch: Any) -> Any:
    """A copy with new tensor objects (the callback restrides a batch's tensors in place)."""
    return apply_to_collection(batch, torch.Tensor, torch.Tensor.clone)


def batch_to(batch: Any, dtype: torch.dtype) -> Any:
    """The batch with its floating tensors in ``dtype``."""
    return apply_to_collection(batch, torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


def logits_of(net: nn.Module, x: torch.Tensor, dict_batch: bool) -> torch.Tensor:
    """The class scores ``net`` gives for images ``x``, whatever its output type."""
    out = net(pixel_values=x) if dict_batch else net(x)
    if isinstance(out, torch.Tensor):
        return out
    return out.logits if hasattr(out, "logits") else out[0]


def training_loss(net: nn.Module, batch: Any, spec: Spec) -> torch.Tensor:
    """``spec.loss`` of ``net`` on ``batch`` (in float32 or the batch's dtype, whichever is wider)."""
    if spec.loss == "detection":  # the sum of the loss dict a torchvision detector returns in training mode
        images, targets = batch
        return sum(net(list(images), list(targets)).values())
    x, y = (batch["pixel_values"], batch["labels"]) if spec.dict_batch else batch
    logits = logits_of(net, x, spec.dict_batch)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if spec.loss == "dice_bce":  # on the masks, as segmentation_models_pytorch's examples train
        from segmentation_models_pytorch.losses import DiceLoss

        return DiceLoss("binary", from_logits=True)(logits, y) + F.binary_cross_entropy_with_logits(logits, y)
    return F.cross_entropy(logits, y)


def quiet_random_layers(net: nn.Module) -> nn.Module:
    """Dropout, drop-path and stochastic-depth layers (by class name) in eval mode: their masks follow memory
    order, so the same seed drops different units in the two layouts."""
    for module in net.modules():
        name = type(module).__name__
        if isinstance(module, nn.modules.dropout._DropoutNd) or "Drop" in name or "StochasticDepth" in name:
            module.eval()
    return net


def conv_weights_cl(net: nn.Module) -> str:
    """``"n/m"``: how many of ``net``'s 2-D and 3-D convolution weights are channels_last."""
    from cltrain.layout import CONV_TYPES, is_channels_last

    weights = [m.weight for m in net.modules() if isinstance(m, CONV_TYPES) and m.weight.dim() in (4, 5)]
    return f"{sum(is_channels_last(w) for w in weights)}/{len(weights)}"


# ---- training one model -------------------------------------------------------------------------------

#: The optimizers the check is swept with, by name: SGD with momentum, Adam and AdamW.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}
OPTIMIZER_NAMES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
OPTIMIZER_SETTINGS = {"sgd": "momentum 0.9, lr 0.01", "adam": "lr 1e-3", "adamw": "lr 1e-3"}  #: as above, in words


def grads_of(net: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """A copy of each parameter's gradient by name (``None``: none), ``torch.compile``'s ``_orig_mod.`` left out."""
    return {n.removeprefix("_orig_mod."): None if p.grad is None else p.grad.detach().clone()
            for n, p in net.named_parameters()}


class ZooModule(LightningModule):
    """A zoo model with its spec's loss and an ``OPTIMIZERS`` optimizer; keeps the step-0 gradients and the losses."""

    def __init__(self, net: torch.nn.Module, spec: Spec, optimizer: str = "sgd"):
        super().__init__()
        self.net, self.spec, self.optimizer_name = net, spec, optimizer
        self.losses: list[torch.Tensor] = []
        self.step0_grads: dict[str, torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return logits_of(self.net, x, self.spec.dict_batch)

    def train(self, mode: bool = True):
        super().train(mode)
        quiet_random_layers(self)
        return self

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = training_loss(self.net, batch, self.spec)
        self.losses.append(loss.detach())
        return loss

    def on_after_backward(self) -> None:
        if self.step0_grads is None:
            self.step0_grads = grads_of(self.net)

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer_name](self.parameters())


def fit(net: torch.nn.Module, spec: Spec, batches: list[Any], callback: Any, max_steps: int,
        precision: str = "32-true", optimizer: str = "sgd") -> ZooModule:
    """``net`` trained for ``max_steps`` on ``batches`` (copies, in order) by a Trainer with ``callback``; the
    global RNG seeded with 0 first (a detector's samplers draw from it)."""
    module = ZooModule(net, spec, optimizer).train()  # Lightning keeps each submodule's mode: quiet them here
    trainer = quiet_trainer(accelerator="cpu", max_steps=max_steps, precision=precision,
                            callbacks=[callback] if callback else [])
    torch.manual_seed(0)
    trainer.fit(module, DataLoader([clone_batch(b) for b in batches], batch_size=None))
    return module
