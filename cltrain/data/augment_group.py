"""``RandomCrop`` and ``Augmentation``: the training augmentation of the DataModules, as one group.

``RandomCrop`` is what every training sample gets, image or clip: the random-resized crop and a
horizontal flip. ``Augmentation``, the image DataModules' group, adds to it: the random crop and
flip and the HWC augmentation policy run on each training image in the loader
(``train_transform``); random erasing and mixup/cutmix run on the normalised training batch on its
device (``RandomErasing``, ``MixupCutmix``). Evaluation is never augmented.
The settings are checked when the group is made, so a bad value fails in the constructor,
not in a worker.

Example::

    >>> from cltrain.data import Augmentation, ImageFolderDataModule
    >>> strong = Augmentation(augment="trivialaugment", random_erasing=0.25, mixup_alpha=0.8, cutmix_alpha=1.0)
    >>> # ImageFolderDataModule(root, augmentation=strong), or the same fields as keywords:
    >>> # ImageFolderDataModule(root, augment="trivialaugment", random_erasing=0.25, ...)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from cltrain.data.augment_ops import HWCAugment, MixupCutmix, RandomErasing
from cltrain.data.constants import CROP_RATIO, CROP_SCALE
from cltrain.data.transforms import RandomResizedCropFlip, train_transform

__all__ = ["Augmentation", "RandomCrop"]


@dataclass(frozen=True)
class RandomCrop:
    """The random-resized crop and flip of every training sample (the clip DataModule's augmentation);
    the defaults are torchvision's ImageNet recipe.

    Args:
        scale: the random-resized crop's range of area (fractions of the image).
        ratio: its range of aspect ratio (width / height).
        hflip: the probability of a horizontal flip (0 for data whose label depends on left and right).

    Raises:
        ValueError: a value out of its range (the message quotes it).
    """

    #: The DataModule attribute that holds this group, and the argument that takes it whole.
    key: ClassVar[str] = "augmentation"

    scale: Sequence[float] = CROP_SCALE  # two numbers; kept as a tuple
    ratio: Sequence[float] = CROP_RATIO
    hflip: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", tuple(self.scale))  # lists from a config compare equal to the defaults
        object.__setattr__(self, "ratio", tuple(self.ratio))
        try:
            RandomResizedCropFlip(8, self.scale, self.ratio, self.hflip)  # checks scale, ratio and hflip
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None


@dataclass(frozen=True)
class Augmentation(RandomCrop):
    """What the training images go through beyond decoding: ``RandomCrop``'s crop and flip, then the
    policies below, all off by default (torchvision's ImageNet recipe: crop, flip, nothing more).

    Args:
        scale: the random-resized crop's range of area (fractions of the image).
        ratio: its range of aspect ratio (width / height).
        hflip: the probability of a horizontal flip.
        augment: ``"none"``, ``"trivialaugment"`` or ``"randaugment"`` on each training crop,
            in the loader (``HWCAugment``).
        random_erasing: probability of timm's per-image random erasing of the normalised
            training batch on the device (0: off).
        mixup_alpha: timm's mixup on the training batch on the device (0: off); targets become
            probabilities ``(N, classes)``. Needs an even batch.
        cutmix_alpha: timm's cutmix, as ``mixup_alpha`` (both 0: off).
        mixup_prob: the chance that a batch is mixed at all.
        mixup_switch_prob: with both on, the chance of cutmix rather than mixup.

    Raises:
        ValueError: a value out of its range, or an unknown policy (the message quotes it).
    """

    augment: str = "none"
    random_erasing: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.augment != "none":
            HWCAugment(self.augment)
        if not 0 <= self.random_erasing <= 1:
            raise ValueError(f"Augmentation: random_erasing={self.random_erasing!r} must be a probability in [0, 1] (0: off).")
        self.erasing()  # checks the rest (timm, imported only when erasing is on)
        for name in ("mixup_alpha", "cutmix_alpha"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Augmentation: {name}={getattr(self, name)!r} must be >= 0 (0: off).")
        for name in ("mixup_prob", "mixup_switch_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"Augmentation: {name}={getattr(self, name)!r} must be a probability in [0, 1].")
        self.mixup(2)

    def train_transform(self, size: int | tuple[int, int], channels: int = 3, interpolation: str = "bilinear",
                        exif_transpose: bool = False, decoder: str = "auto") -> RandomResizedCropFlip:
        """The per-image training transform (crop, flip, ``augment``) at ``size``, decoding with ``decoder``."""
        return train_transform(size, self.scale, self.ratio, self.hflip, channels=channels, interpolation=interpolation,
                               exif_transpose=exif_transpose, augment=self.augment, decoder=decoder)

    def erasing(self) -> RandomErasing | None:
        """The device-side random erasing, or ``None`` when ``random_erasing`` is 0."""
        return RandomErasing(self.random_erasing) if self.random_erasing > 0 else None

    def mixup(self, num_classes: int) -> MixupCutmix | None:
        """The device-side mixup/cutmix for ``num_classes``, or ``None`` when both alphas are 0."""
        if self.mixup_alpha <= 0 and self.cutmix_alpha <= 0:
            return None
        return MixupCutmix(num_classes, mixup_alpha=self.mixup_alpha, cutmix_alpha=self.cutmix_alpha,
                           prob=self.mixup_prob, switch_prob=self.mixup_switch_prob)

