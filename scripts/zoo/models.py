"""The models of ``scripts/zoo/sweep.py`` (timm, torchvision, Hugging Face, ``scripts/zoo/tasks.py``'s, and planted
ones only the tests name): how each is built (random weights, nothing downloaded), its batch and its loss.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from lightning_utilities.core.apply_func import apply_to_collection

from scripts.zoo import tasks
from scripts.zoo.spec import NUM_CLASSES, SIZE, Spec

__all__ = ["NUM_CLASSES", "SIZE", "Spec", "all_specs", "batch_to", "build", "clone_batch", "conv_weights_cl", "find",
           "logits_of", "image_of", "make_batch", "quiet_random_layers", "training_loss"]

def _timm(name: str, family: str, **kw: Any) -> Spec:
    return Spec(f"timm:{name}", family, **kw)


_VIT_SIZE = {"kwargs": {"img_size": SIZE}}  # fixed-size position embeddings / attention: built for 128 px
TIMM = [
    _timm("resnet18", "ResNet"), _timm("resnet26d", "ResNet", note="ill-conditioned gradients at batch 2"),
    _timm("resnet50", "ResNet"), _timm("resnet10t", "ResNet"), _timm("seresnext26d_32x4d", "ResNeXt/SE"),
    _timm("resnext26ts", "ResNeXt/SE"), _timm("ecaresnet26t", "ResNeXt/SE"), _timm("skresnet18", "ResNeXt/SE"),
    _timm("regnetx_002", "RegNet"), _timm("regnety_002", "RegNet"), _timm("regnetz_b16", "RegNet"),
    _timm("efficientnet_b0", "EfficientNet", compile=True), _timm("efficientnet_lite0", "EfficientNet"),
    _timm("tf_efficientnetv2_b0", "EfficientNet"), _timm("tinynet_a", "EfficientNet"), _timm("mixnet_s", "EfficientNet"),
    _timm("mobilenetv2_050", "MobileNet"), _timm("mobilenetv3_small_050", "MobileNet"),
    _timm("mobilenetv3_large_100", "MobileNet"), _timm("mobilenetv4_conv_small", "MobileNet"),
    _timm("mobilenetv4_hybrid_medium", "MobileNet"), _timm("lcnet_050", "MobileNet"), _timm("fbnetc_100", "MobileNet"),
    _timm("mnasnet_small", "MobileNet"), _timm("rexnet_100", "MobileNet"),
    _timm("convnext_atto", "ConvNeXt", compile=True), _timm("convnextv2_atto", "ConvNeXt"),
    _timm("repvgg_a0", "RepVGG/MobileOne/FastViT", note="1x1 stride-2 conv on the 3-channel stem"),
    _timm("mobileone_s0", "RepVGG/MobileOne/FastViT", note="1x1 stride-2 conv on the 3-channel stem"),
    _timm("fastvit_t8", "RepVGG/MobileOne/FastViT", note="1x1 stride-2 conv on the 3-channel stem"),
    _timm("repghostnet_050", "RepVGG/MobileOne/FastViT"), _timm("repvit_m0_9", "RepVGG/MobileOne/FastViT"),
    _timm("densenet121", "DenseNet"), _timm("hrnet_w18_small", "HRNet"), _timm("res2net50_14w_8s", "Res2Net/ResNeSt"),
    _timm("resnest14d", "Res2Net/ResNeSt"), _timm("dla34", "DLA"), _timm("ese_vovnet19b_dw", "VoVNet"),
    _timm("ghostnet_050", "GhostNet"), _timm("ghostnetv2_100", "GhostNet"), _timm("cspresnet50", "CSP/Darknet"),
    _timm("cs3darknet_s", "CSP/Darknet"), _timm("darknet17", "CSP/Darknet"), _timm("inception_v3", "Inception"),
    _timm("inception_next_tiny", "Inception"), _timm("legacy_xception", "Inception"), _timm("nf_resnet26", "NF-ResNet"),
    _timm("convmixer_768_32", "ConvMixer"), _timm("poolformer_s12", "PoolFormer"), _timm("poolformerv2_s12", "PoolFormer"),
    _timm("efficientformer_l1", "EfficientFormer", size=224, note="fixed 224 px attention bias"),
    _timm("efficientformerv2_s0", "EfficientFormer", **_VIT_SIZE), _timm("mobilevit_xxs", "MobileViT"),
    _timm("mobilevitv2_050", "MobileViT"), _timm("vit_tiny_patch16_224", "ViT/DeiT", **_VIT_SIZE),
    _timm("deit_tiny_patch16_224", "ViT/DeiT", **_VIT_SIZE), _timm("swin_tiny_patch4_window7_224", "Swin", **_VIT_SIZE),
    _timm("maxvit_nano_rw_256", "MaxViT/CoAtNet", **_VIT_SIZE), _timm("coatnet_nano_rw_224", "MaxViT/CoAtNet", **_VIT_SIZE),
    _timm("levit_128s", "LeViT", **_VIT_SIZE), _timm("efficientvit_b0", "EfficientViT"),
    _timm("efficientvit_m0", "EfficientViT"), _timm("edgenext_xx_small", "EdgeNeXt"), _timm("hgnetv2_b0", "HGNet"),
    _timm("starnet_s1", "StarNet"), _timm("tiny_vit_5m_224", "TinyViT"), _timm("pvt_v2_b0", "PVT"),
    _timm("mambaout_femto", "MambaOut"), _timm("xcit_nano_12_p16_224", "XCiT"), _timm("selecsls42b", "SelecSLS"),
    _timm("dpn48b", "DPN"), _timm("gernet_s", "GENet"), _timm("rdnet_tiny", "RDNet"),
    _timm("mixer_s32_224", "MLP", **_VIT_SIZE), _timm("resmlp_12_224", "MLP", **_VIT_SIZE),
]

#: torchvision builders that need more than ``num_classes``.
_TV_KWARGS: dict[str, dict[str, Any]] = {
    "googlenet": {"aux_logits": False, "init_weights": True},
    "inception_v3": {"aux_logits": False, "init_weights": True},
    **{f"vit_{v}": {"image_size": SIZE} for v in ("b_16", "b_32", "l_16", "l_32")},
    "vit_h_14": {"image_size": 112},  # patch 14 does not divide 128
}
_TV_SIZES = {"maxvit_t": 224, "vit_h_14": 112}
_TV_NOTES = {"googlenet": "no aux heads", "inception_v3": "no aux heads",
             "maxvit_t": "224 px: its partition size 7 does not divide 128 px maps", "vit_h_14": "112 px: patch 14"}
_TV_COMPILE = {"resnet50"}


def _tv_family(name: str) -> str:
    for prefix, family in (("resnext", "ResNeXt"), ("wide_resnet", "ResNet"), ("resnet", "ResNet"), ("regnet", "RegNet"),
                           ("efficientnet", "EfficientNet"), ("mobilenet", "MobileNet"), ("mnasnet", "MobileNet"),
                           ("convnext", "ConvNeXt"), ("densenet", "DenseNet"), ("shufflenet", "ShuffleNet"),
                           ("squeezenet", "SqueezeNet"), ("swin", "Swin"), ("vit", "ViT/DeiT"), ("vgg", "VGG"),
                           ("maxvit", "MaxViT/CoAtNet")):
        if name.startswith(prefix):
            return family
    return {"googlenet": "Inception", "inception_v3": "Inception", "alexnet": "AlexNet"}.get(name, name)


def torchvision_specs() -> list[Spec]:
    """Every torchvision classification model."""
    import torchvision

    return [
        Spec(f"tv:{n}", _tv_family(n), size=_TV_SIZES.get(n, SIZE), kwargs=_TV_KWARGS.get(n, {}),
             note=_TV_NOTES.get(n, ""), compile=n in _TV_COMPILE)
        for n in torchvision.models.list_models(module=torchvision.models)
    ]


#: Hugging Face transformers models, from config classes: (config class, model class, config kwargs).
HF_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification", {}),
    "convnextv2": ("ConvNextV2Config", "ConvNextV2ForImageClassification", {}),
    "resnet": ("ResNetConfig", "ResNetForImageClassification", {}),
    "resnet_small": ("ResNetConfig", "ResNetForImageClassification",
                     {"embedding_size": 16, "hidden_sizes": [32, 64, 128, 256], "depths": [1, 1, 1, 1]}),
    "regnet": ("RegNetConfig", "RegNetForImageClassification", {}),
    "swin": ("SwinConfig", "SwinForImageClassification", {"image_size": SIZE, "window_size": 4}),
    "efficientnet": ("EfficientNetConfig", "EfficientNetForImageClassification", {"image_size": SIZE}),
    "mobilevit": ("MobileViTConfig", "MobileViTForImageClassification", {"image_size": SIZE}),
}
HF = [Spec(f"hf:{n}", f"HF {n}", note="dict batch {pixel_values, labels}") for n in HF_MODELS]

#: One classifier per family, for sweeps too long for the whole zoo: per timm family its first model (a more
#: common one for MobileNet and Res2Net/ResNeSt), torchvision's own implementations of the common families and
#: its families timm lacks (ShuffleNet, SqueezeNet; VGG, AlexNet and torchvision's ViTs are over 30M parameters),
#: and the Hugging Face models but the two over 20M parameters whose code a smaller one shares (resnet, efficientnet).
FAMILY_SUBSET = [
    *(f"timm:{n}" for n in (
        "resnet18", "seresnext26d_32x4d", "regnetx_002", "efficientnet_b0", "mobilenetv3_large_100", "convnext_atto",
        "repvgg_a0", "densenet121", "hrnet_w18_small", "resnest14d", "dla34", "ese_vovnet19b_dw", "ghostnet_050",
        "cspresnet50", "inception_v3", "nf_resnet26", "convmixer_768_32", "poolformer_s12", "efficientformer_l1",
        "mobilevit_xxs", "vit_tiny_patch16_224", "swin_tiny_patch4_window7_224", "maxvit_nano_rw_256", "levit_128s",
        "efficientvit_b0", "edgenext_xx_small", "hgnetv2_b0", "starnet_s1", "tiny_vit_5m_224", "pvt_v2_b0",
        "mambaout_femto", "xcit_nano_12_p16_224", "selecsls42b", "dpn48b", "gernet_s", "rdnet_tiny", "mixer_s32_224")),
    *(f"tv:{n}" for n in ("resnet50", "resnext50_32x4d", "mobilenet_v3_large", "shufflenet_v2_x1_0", "squeezenet1_1")),
    *(f"hf:{n}" for n in ("resnet_small", "convnext", "convnextv2", "regnet", "swin", "mobilevit")),
]

PLANTED = [
    Spec("planted:wrong_grad", "planted", size=32, note="weight gradient 3.4x off under channels_last"),
    Spec("planted:crash", "planted", size=32, note="segfaults under channels_last"),
    Spec("planted:view_head", "planted", size=32, note="x.view(x.size(0), -1) in its head"),
]


def all_specs() -> list[Spec]:
    """The sweep's rows, planted models excluded (they run only when named)."""
    return TIMM + torchvision_specs() + HF + tasks.SPECS


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


# ---- building and running one model -------------------------------------------------------------


class _WrongGradUnderChannelsLast(torch.autograd.Function):
    """Identity on the weight, whose gradient comes back 3.4x too large when the input is channels_last
    and oneDNN is on: a wrong oneDNN kernel, as #6035's silent case."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        ctx.scale = 3.4 if channels_last and torch.backends.mkldnn.enabled and x.dtype == torch.float32 else 1.0
        return weight.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _WrongGradConv(nn.Conv2d):
    """A convolution whose weight gradient is 3.4x off under channels_last (``_WrongGradUnderChannelsLast``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, _WrongGradUnderChannelsLast.apply(self.weight, x), self.bias)


class _Planted(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.conv = (_WrongGradConv if kind == "wrong_grad" else nn.Conv2d)(3, 8, 3, padding=1)
        self.head = nn.Linear(8, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        onednn_fp32 = torch.backends.mkldnn.enabled and x.dtype == torch.float32
        if self.kind == "crash" and channels_last and onednn_fp32 and torch.is_grad_enabled():
            ctypes.string_at(0)  # a native crash, as a bad oneDNN kernel's
        return self.head(self.conv(x).relu().mean((2, 3)))


class _ViewHead(nn.Module):
    """A LeNet-style head: ``x.view(x.size(0), -1)`` merges C with H and W, which only NCHW strides allow."""

    def __init__(self, features: int):
        super().__init__()
        self.fc = nn.Linear(features, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.view(x.size(0), -1))


class _PlantedViewHead(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AvgPool2d(4)
        self.head = _ViewHead(8 * (size // 4) ** 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.conv(x).relu()))


def build(spec: Spec) -> nn.Module:
    """``spec``'s model with random weights and ``NUM_CLASSES`` outputs (one mask channel for segmentation)."""
    if tasks.is_task_model(spec):
        return tasks.build_task_model(spec)
    if spec.source in ("timm", "tv"):
        from cltrain.model_names import build_untrained_model

        source = "timm" if spec.source == "timm" else "torchvision"
        return build_untrained_model(spec.name, num_classes=NUM_CLASSES, source=source, **spec.kwargs)
    if spec.source == "hf":
        import transformers

        config_cls, model_cls, kwargs = HF_MODELS[spec.name]
        config = getattr(transformers, config_cls)(num_labels=NUM_CLASSES, **kwargs)
        return getattr(transformers, model_cls)(config)
    if spec.key == "planted:view_head":
        return _PlantedViewHead(spec.size)
    if spec.source == "planted":
        return _Planted(spec.name)
    raise ValueError(f"unknown source in {spec.key!r}")


def make_batch(spec: Spec, n: int, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> Any:
    """A random NCHW-contiguous batch of ``n`` with the targets of ``spec.loss``: ``(images, labels)`` (a dict
    for Hugging Face models; clips of ``spec.frames``), ``(images, masks)`` or ``(images, targets)``."""
    if spec.loss != "cross_entropy":
        return tasks.task_batch(spec, n, generator, dtype)
    frames = () if not spec.frames else (spec.frames,)
    # a clip is (N, C, T, H, W); a Hugging Face image stack is (B, T, C, H, W)
    shape = (n, *frames, 3) if spec.dict_batch else (n, 3, *frames)
    x = torch.randn(*shape, spec.size, spec.size, generator=generator).to(dtype)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=generator)
    return {"pixel_values": x, "labels": y} if spec.dict_batch else (x, y)


def image_of(batch: Any, spec: Spec) -> Any:
    """The model's input in ``batch``: its image tensor (a list of images for a detector)."""
    return batch["pixel_values"] if spec.dict_batch else batch[0]


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
    if spec.loss == "dice_bce":
        return tasks.dice_bce(net, batch)
    if spec.loss == "detection":
        return tasks.detection_loss(net, batch)
    x, y = (batch["pixel_values"], batch["labels"]) if spec.dict_batch else batch
    logits = logits_of(net, x, spec.dict_batch)
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), y)


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
