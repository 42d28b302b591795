"""Deprecated: ``cltrain.app.config.errors`` (``ConfigError``); this module re-exports its names for one release."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_new = importlib.import_module("cltrain.app.config.errors")

__all__ = list(_new.__all__)

warnings.warn("cltrain.app.errors is deprecated; import from cltrain.app.config.errors", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(_new, name)
