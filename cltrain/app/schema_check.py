"""Deprecated: ``cltrain.app.config.check`` (checking a config against the schema); this module re-exports its names for one release."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_new = importlib.import_module("cltrain.app.config.check")

__all__ = list(_new.__all__)

warnings.warn("cltrain.app.schema_check is deprecated; import from cltrain.app.config.check", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(_new, name)
