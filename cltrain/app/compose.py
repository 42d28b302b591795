"""Deprecated: ``cltrain.app.config.compose`` (composing and checking a command line's config); this module re-exports its names for one release."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_new = importlib.import_module("cltrain.app.config.compose")

__all__ = list(_new.__all__)

warnings.warn("cltrain.app.compose is deprecated; import from cltrain.app.config.compose", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(_new, name)
