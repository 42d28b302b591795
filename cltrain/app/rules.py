"""Deprecated: ``cltrain.app.config.rules`` (the rules of config values); this module re-exports its names for one release."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_new = importlib.import_module("cltrain.app.config.rules")

_DATA_CHOICES = {"AUGMENT_POLICIES": "cltrain.data.augment", "BAD_FILE_POLICIES": "cltrain.data.dataset",
                 "CHECK_MODES": "cltrain.data.constants", "INTERPOLATIONS": "cltrain.data.decode"}

__all__ = ["AUGMENT_POLICIES", "BAD_FILE_POLICIES", "CHECK_MODES", "INTERPOLATIONS", "OPTIMIZERS", "SCHEDULES", "Rule",
           "choices", "key", "optimizer_name"]

warnings.warn("cltrain.app.rules is deprecated; import from cltrain.app.config.rules", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    if name in _DATA_CHOICES:
        return tuple(getattr(importlib.import_module(_DATA_CHOICES[name]), name))
    if name == "SCHEDULES":
        return importlib.import_module("cltrain.app.schedule").SCHEDULES
    return getattr(_new, name)
