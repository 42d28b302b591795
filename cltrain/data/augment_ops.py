"""Augmentations that keep the NHWC path: policies on the HWC uint8 crop in the workers,
random erasing and mixup / cutmix on the channels_last batch on the device.

* ``HWCAugment``: torchvision v2's ``TrivialAugmentWide`` or ``RandAugment`` on the
  crop, in the worker, after ``RandomResizedCropFlip``.
  torchvision wants CHW: the HWC array's ``permute(2, 0, 1)`` *is* a CHW tensor (with
  channels-last strides, no copy), and the v2 kernels give the same pixels on it as on a
  contiguous copy (tested). Draws from the torch RNG (seeded per worker).
* ``RandomErasing``: timm's ``RandomErasing`` (per image, in place; the same code
  timm's ``PrefetchLoader`` runs after normalising on the GPU). Writing a patch into a
  slice of the batch keeps its strides: channels_last in, channels_last out, no copy.
* ``MixupCutmix``: timm's ``Mixup`` (mixup or cutmix per batch, ``switch_prob``
  between them, cutmix's lambda corrected to the clipped box), in place on the batch.
  Targets become probabilities ``(N, num_classes)``.

What the LightningModule must do with mixed targets: ``nn.CrossEntropyLoss`` takes
probability targets as they are (and applies its own ``label_smoothing`` to them,
which gives exactly timm's smoothed mixup targets, so leave ``label_smoothing`` here at
0 and keep it in the loss); accuracy is measured against ``targets.argmax(1)``, the
dominant label, as torchvision's references do (``utils.accuracy``).

Example::

    >>> import torch
    >>> x = torch.randn(4, 3, 32, 32).to(memory_format=torch.channels_last)
    >>> y = torch.tensor([0, 1, 2, 3])
    >>> x, y = MixupCutmix(10, mixup_alpha=0.8, cutmix_alpha=1.0)(RandomErasing(0.25)(x), y)
    >>> x.is_contiguous(memory_format=torch.channels_last), y.shape
    (True, torch.Size([4, 10]))
"""

from __future__ import annotations

import numpy as np
import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import v2

__all__ = ["AUGMENT_POLICIES", "HWCAugment", "MixupCutmix", "RandomErasing"]

AUGMENT_POLICIES = ("none", "trivialaugment", "randaugment")
_INTERPOLATION = {"nearest": InterpolationMode.NEAREST, "bilinear": InterpolationMode.BILINEAR}


def _timm(what: str):
    try:
        from timm.data import mixup, random_erasing
    except ImportError as err:  # pragma: no cover - timm is in the test extra
        raise ImportError(f"{what} uses timm's implementation: pip install 'cltrain[augment]' (timm).") from err
    return random_erasing.RandomErasing if what == "RandomErasing" else mixup.Mixup


class HWCAugment:
    """torchvision's ``TrivialAugmentWide`` / ``RandAugment`` on an HWC uint8 array, HWC uint8 out.

    Args:
        policy: ``"trivialaugment"`` or ``"randaugment"``.
        num_ops: RandAugment's number of ops (ignored by TrivialAugmentWide).
        magnitude: RandAugment's magnitude (ignored by TrivialAugmentWide, which draws its own).
        interpolation: ``"nearest"`` (torchvision's default) or ``"bilinear"``, for the geometric ops.

    Raises:
        ValueError: an unknown ``policy`` or ``interpolation``.
    """

    def __init__(self, policy: str = "trivialaugment", num_ops: int = 2, magnitude: int = 9,
                 interpolation: str = "nearest") -> None:
        if policy not in AUGMENT_POLICIES[1:]:
            raise ValueError(f"HWCAugment: policy={policy!r} must be one of {AUGMENT_POLICIES[1:]}.")
        if interpolation not in _INTERPOLATION:
            raise ValueError(f"HWCAugment: interpolation={interpolation!r} must be one of {sorted(_INTERPOLATION)}.")
        self.policy, self.num_ops, self.magnitude, self.interpolation = policy, num_ops, magnitude, interpolation
        mode = _INTERPOLATION[interpolation]
        self.op = (v2.TrivialAugmentWide(interpolation=mode) if policy == "trivialaugment"
                   else v2.RandAugment(num_ops=num_ops, magnitude=magnitude, interpolation=mode))

    def __call__(self, hwc: np.ndarray) -> np.ndarray:
        chw = torch.from_numpy(hwc).permute(2, 0, 1)  # a view: CHW with channels-last strides
        out = self.op(chw)
        return np.ascontiguousarray(out.permute(1, 2, 0).numpy())

    def __repr__(self) -> str:
        extra = f", num_ops={self.num_ops}, magnitude={self.magnitude}" if self.policy == "randaugment" else ""
        return f"{type(self).__name__}({self.policy!r}{extra}, interpolation={self.interpolation!r})"


class RandomErasing:
    """timm's per-image random erasing of a normalised ``(N, C, H, W)`` batch, in place (layout kept).

    Args:
        probability: chance that an image gets erased boxes.
        mode: ``"pixel"`` (normal noise per pixel, timm's training default), ``"rand"``
            (one random colour per box) or ``"const"`` (zeros, i.e. the mean after normalising).
        min_area: timm's smallest box, as a fraction of the image.
        max_area: timm's largest box, as a fraction of the image.
        min_aspect: timm's smallest box aspect ratio.
        max_count: timm's largest number of boxes per image.
    """

    def __init__(self, probability: float = 0.25, mode: str = "pixel", min_area: float = 0.02,
                 max_area: float = 1 / 3, min_aspect: float = 0.3, max_count: int = 1) -> None:
        if not 0 <= probability <= 1:
            raise ValueError(f"RandomErasing: probability={probability!r} must be in [0, 1].")
        if mode not in ("pixel", "rand", "const"):
            raise ValueError(f"RandomErasing: mode={mode!r} must be 'pixel', 'rand' or 'const'.")
        self.probability, self.mode = float(probability), mode
        self.impl = _timm("RandomErasing")(probability, min_area, max_area, min_aspect, mode=mode,
                                                         max_count=max_count, device="cpu")

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        if self.probability == 0:
            return batch
        self.impl.device = batch.device  # its noise is made where the batch is
        return self.impl(batch)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(probability={self.probability}, mode={self.mode!r})"


class MixupCutmix:
    """timm's ``Mixup`` (per batch) on a ``(N, C, H, W)`` batch in place; int targets -> probabilities.

    Args:
        num_classes: width of the probability targets.
        mixup_alpha: mixup's Beta parameter (0 turns it off).
        cutmix_alpha: cutmix's Beta parameter (0 turns it off).
        prob: chance that a batch is mixed at all.
        switch_prob: with both on, the chance of cutmix rather than mixup.
        label_smoothing: timm's; leave 0 and let ``nn.CrossEntropyLoss(label_smoothing=...)``
            smooth the mixed targets (the same targets).

    An odd batch (a sharded epoch split exactly once over ranks can end in one) mixes its first
    ``N - 1`` images, in place through a view, and leaves the last one as it is with its own
    (one-hot) target: timm pairs image ``i`` with ``N - 1 - i`` and refuses odd batches.

    Raises:
        ValueError: both alphas 0.
    """

    def __init__(self, num_classes: int, mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0, prob: float = 1.0,
                 switch_prob: float = 0.5, label_smoothing: float = 0.0) -> None:
        if mixup_alpha <= 0 and cutmix_alpha <= 0:
            raise ValueError(f"MixupCutmix: mixup_alpha={mixup_alpha!r} and cutmix_alpha={cutmix_alpha!r}: "
                             "set at least one > 0 (or leave mixing off).")
        self.num_classes = int(num_classes)
        self.impl = _timm("MixupCutmix")(mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha, prob=prob,
                                               switch_prob=switch_prob, label_smoothing=label_smoothing,
                                               num_classes=self.num_classes)

    def __call__(self, batch: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if batch.shape[0] % 2 == 0:
            return self.impl(batch, targets)
        from timm.data.mixup import mixup_target

        last = mixup_target(targets[-1:], self.num_classes, lam=1.0, smoothing=self.impl.label_smoothing)
        if batch.shape[0] == 1:
            return batch, last
        _, mixed = self.impl(batch[:-1], targets[:-1])  # timm mixes in place: the view writes into batch
        return batch, torch.cat([mixed, last.to(mixed.dtype)])

    def __repr__(self) -> str:
        m = self.impl
        return (f"{type(self).__name__}(num_classes={self.num_classes}, mixup_alpha={m.mixup_alpha}, "
                f"cutmix_alpha={m.cutmix_alpha}, prob={m.mix_prob}, switch_prob={m.switch_prob})")
