"""Deprecated alias of ``cltrain.model_names``, kept for one release; ``build_model`` here is
``cltrain.model_names.build_untrained_model``."""

from __future__ import annotations

import warnings

from cltrain.model_names import (
    CLASSIFIERS,
    SOURCES,
    UnknownModelError,
    closest_model_names,
    model_source,
    optional_timm,
    torchvision_family,
)
from cltrain.model_names import build_untrained_model as build_model

__all__ = ["CLASSIFIERS", "SOURCES", "UnknownModelError", "build_model", "closest_model_names", "model_source", "optional_timm",
           "torchvision_family"]

warnings.warn("cltrain.zoo is deprecated: import cltrain.model_names (build_model is build_untrained_model there)",
              DeprecationWarning, stacklevel=2)
