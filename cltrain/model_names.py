"""Model names from torchvision and timm, and the ones closest to a name that is in neither.

Shared by the app (``model.name``) and the audit command (``model=``), so both errors list
close names the same way.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from types import ModuleType

__all__ = ["closest_model_names", "optional_timm"]


def optional_timm() -> ModuleType | None:
    """``timm`` when it is installed, else ``None``."""
    try:
        import timm
    except ImportError:
        return None
    return timm


def closest_model_names(name: str, source: str, torchvision_names: Iterable[str]) -> tuple[list[str], list[str]]:
    """Up to four names closest to ``name`` among ``torchvision_names`` (unless ``source="timm"``) and timm's
    (unless ``source="torchvision"`` or timm is missing), and the listing functions those came from."""
    pool: list[str] = []
    lists: list[str] = []
    if source != "timm":
        pool += list(torchvision_names)
        lists.append("torchvision.models.list_models()")
    timm = optional_timm()
    if source != "torchvision" and timm is not None:
        pool += timm.list_models()
        lists.append("timm.list_models()")
    return list(dict.fromkeys(difflib.get_close_matches(name, pool, n=6, cutoff=0.6)))[:4], lists
