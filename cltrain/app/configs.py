"""Deprecated: ``cltrain.app.config.compose`` (where the configs are (``config_dir``)); this module re-exports its names for one release."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_new = importlib.import_module("cltrain.app.config.compose")

__all__ = ["CONFIG_DIR", "config_dir"]

warnings.warn("cltrain.app.configs is deprecated; import from cltrain.app.config.compose", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    if name == "CONFIG_DIR":
        return _new.config_dir()
    return getattr(_new, name)
