"""One row of the zoo: ``Spec``, the model's key, its family, its input and its loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
