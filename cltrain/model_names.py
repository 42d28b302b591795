"""Models by name, from torchvision or timm, with random weights: nothing is ever downloaded.

Shared by the training application (``model.name``), the audit command and the benchmark
scripts, so a name means the same model everywhere and an unknown name gets the same
closest-names answer.

Example::

    >>> from cltrain.model_names import build_untrained_model, model_source
    >>> model_source("resnet18")
    'torchvision'
    >>> build_untrained_model("resnet18", num_classes=10).fc.out_features
    10
"""

from __future__ import annotations

import difflib
import importlib.util
from functools import lru_cache
from types import ModuleType
from typing import Any

from torch import nn

__all__ = ["CLASSIFIERS", "SOURCES", "UnknownModelError", "build_untrained_model", "closest_model_names", "model_source",
           "optional_timm", "torchvision_family"]

#: Where a name may be looked up: ``auto`` tries torchvision, then timm.
SOURCES = ("auto", "torchvision", "timm")
#: The torchvision families that classify (images, clips): what ``model.name`` may be.
CLASSIFIERS = ("", "video")


class UnknownModelError(LookupError):
    """``name`` is in neither library (or not in the one asked for); ``close`` lists the nearest names."""

    def __init__(self, name: str, source: str, close: list[str], lists: list[str]) -> None:
        self.name, self.source, self.close, self.lists = name, source, close, lists
        libraries = (("torchvision", "pip install 'cltrain[data]'", source != "timm"),
                     ("timm", "pip install timm", source != "torchvision"))
        missing = [f"{library} is not installed ({how})" if importlib.util.find_spec(library) is None else
                   f"{library} is installed but does not import (python -c 'import {library}' says why)"
                   for library, how, wanted in libraries if wanted and not any(n.startswith(library) for n in lists)]
        if not lists:
            super().__init__(f"{name!r}: no library to build it from: {'; '.join(missing)}")
            return
        hint = f"closest: {', '.join(close)}" if close else "e.g. resnet50, r3d_18, efficientnet_b0"
        super().__init__(f"{name!r} is not in {' or '.join(lists)}; {hint}" + "".join(f"; {m}" for m in missing))


def optional_timm() -> ModuleType | None:
    """``timm`` when it is installed, else ``None``."""
    try:
        import timm
    except ImportError:
        return None
    return timm


@lru_cache(maxsize=1)
def _families() -> dict[str, frozenset[str]]:
    import torchvision.models as tvm

    modules = {"": tvm, "video": tvm.video, "segmentation": tvm.segmentation, "detection": tvm.detection,
               "optical_flow": tvm.optical_flow, "quantization": tvm.quantization}
    return {family: frozenset(tvm.list_models(module=module)) for family, module in modules.items()}


def torchvision_family(name: str) -> str | None:
    """The torchvision family of ``name``: ``""`` (classification), ``"video"``, ``"segmentation"``,
    ``"detection"``, ``"optical_flow"``, ``"quantization"``; ``None`` when torchvision has no such
    model (or is not installed)."""
    try:
        families = _families()
    except ImportError:
        return None
    return next((family for family, names in families.items() if name in names), None)


def model_source(name: str, source: str = "auto", families: tuple[str, ...] = CLASSIFIERS) -> str | None:
    """``"torchvision"`` (a model of one of the torchvision ``families``) or ``"timm"``, or ``None``
    if neither has ``name``."""
    if source not in SOURCES:
        raise ValueError(f"source={source!r} is not one of {', '.join(SOURCES)}")
    if source in ("auto", "torchvision") and torchvision_family(name) in families:
        return "torchvision"
    if source in ("auto", "timm"):
        timm = optional_timm()
        if timm is not None and timm.is_model(name):
            return "timm"
    return None


def closest_model_names(name: str, source: str = "auto") -> tuple[list[str], list[str]]:
    """Up to four known names closest to ``name``, and the listing functions they came from."""
    pool: list[str] = []
    lists: list[str] = []
    if source != "timm":
        try:
            pool += sorted(_families()[""] | _families()["video"])
            lists.append("torchvision.models.list_models()")
        except ImportError:
            pass
    timm = optional_timm()
    if source != "torchvision" and timm is not None:
        pool += timm.list_models()
        lists.append("timm.list_models()")
    return list(dict.fromkeys(difflib.get_close_matches(name, pool, n=6, cutoff=0.6)))[:4], lists


def build_untrained_model(name: str, num_classes: int | None = None, source: str = "auto",
                          families: tuple[str, ...] = CLASSIFIERS, **kwargs: Any) -> nn.Module:
    """A freshly initialised model named ``name`` (random weights; torchvision's and timm's
    pretrained weights are never fetched).

    Args:
        name: a torchvision classification or video model, or a timm model.
        num_classes: classifier outputs; ``None`` keeps the library's default (1000 for ImageNet).
        source: ``"auto"`` (torchvision first), ``"torchvision"`` or ``"timm"``.
        families: the torchvision families accepted (``"segmentation"`` too for the audit).
        kwargs: more constructor arguments.

    Raises:
        UnknownModelError: ``name`` is not a model of ``source``.
    """
    found = model_source(name, source, families)
    if found is None:
        close, lists = closest_model_names(name, source)
        raise UnknownModelError(name, source, close, lists)
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    if found == "torchvision":
        import torchvision

        if torchvision_family(name) == "segmentation":
            kwargs.setdefault("weights_backbone", None)  # its default is ImageNet backbone weights: a download
        return torchvision.models.get_model(name, weights=None, **kwargs)
    return optional_timm().create_model(name, pretrained=False, **kwargs)
