"""``Augmentation``: the training augmentation of the image DataModules, as one group.

The random crop and flip and the HWC augmentation policy run on each training image in the
loader (``train_transform``); random erasing and mixup/cutmix run on the normalised training
batch on its device (``RandomErasing``, ``MixupCutmix``). Evaluation is never augmented.
The settings are checked when the group is made, so a bad value fails in the constructor,
not in a worker.

Example::

    >>> from cltrain.data import Augmentation, ImageFolderDataModule
    >>> strong = Augmentation(augment="trivialaugment", random_erasing=0.25, mixup_alpha=0.8, cutmix_alpha=1.0)
    >>> # ImageFolderDataModule(root, augmentation=strong), or the same fields as keywords:
    >>> # ImageFolderDataModule(root, augment="trivialaugment", random_erasing=0.25, ...)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cltrain.data.augment_ops import HWCAugment, MixupCutmix, RandomErasing
from cltrain.data.transforms import RandomResizedCropFlip, train_transform

__all__ = ["Augmentation"]


@dataclass(frozen=True)
class Augmentation:
    """What the training images go through beyond decoding; the defaults are torchvision's
    ImageNet recipe (random-resized crop, flip, nothing more).

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

    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    augment: str = "none"
    random_erasing: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", tuple(self.scale))  # lists from a config compare equal to the defaults
        object.__setattr__(self, "ratio", tuple(self.ratio))
        RandomResizedCropFlip(8, self.scale, self.ratio, self.hflip)  # checks scale, ratio and hflip
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

    @classmethod
    def build(cls, augmentation: Augmentation | None, owner: str, **fields: Any) -> Augmentation:
        """``augmentation``, or one made of ``fields`` (the same names as keywords of a DataModule);
        ``ValueError`` when both are given (``owner`` names the DataModule)."""
        if augmentation is None:
            return cls(**fields)
        if not isinstance(augmentation, Augmentation):
            raise TypeError(f"{owner}: augmentation={augmentation!r} must be a cltrain.data.Augmentation.")
        changed = sorted(name for name, value in fields.items() if _differs(value, _DEFAULTS[name]))
        if changed:
            raise ValueError(f"{owner}: pass {', '.join(changed)} inside augmentation=Augmentation(...), "
                             "or leave augmentation out; not both.")
        return augmentation

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


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Augmentation)}


def _differs(value: Any, default: Any) -> bool:
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(value) != tuple(default)
    return value != default
