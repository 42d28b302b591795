"""Build a classification model by name: any torchvision classification model, or a timm model.

Nothing is ever downloaded: ``pretrained`` is a local file, loaded with
:func:`load_pretrained` (a plain ``state_dict``, ``{"state_dict": ...}`` from a
Lightning checkpoint, or ``{"model": ...}``). Weights whose shape does not fit
(an ImageNet classifier head on a 10-class model) are skipped with a warning.

Example::

    >>> model = build_model("resnet18", num_classes=10)
    >>> model.fc.out_features
    10
"""

from __future__ import annotations

import difflib
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cltrain.app.errors import ConfigError

__all__ = ["SOURCES", "build_model", "check_model_name", "load_pretrained", "model_source"]

SOURCES = ("auto", "torchvision", "timm")


@lru_cache(maxsize=1)
def _torchvision_names() -> tuple[str, ...]:
    import torchvision

    return tuple(torchvision.models.list_models(module=torchvision.models))


def _timm():
    try:
        import timm
    except ImportError:
        return None
    return timm


def model_source(name: str, source: str = "auto") -> str | None:
    """Where ``name`` comes from ("torchvision" or "timm"), or None if neither has it."""
    if source in ("auto", "torchvision") and name in _torchvision_names():
        return "torchvision"
    if source in ("auto", "timm"):
        timm = _timm()
        if timm is not None and timm.is_model(name):
            return "timm"
    return None


def check_model_name(name: Any, source: str = "auto") -> str:
    """The source of ``name``; raises :class:`ConfigError` naming close matches if it is unknown."""
    if source not in SOURCES:
        raise ConfigError("model.source", source, "unknown model source", ", ".join(SOURCES))
    if source == "timm" and _timm() is None:
        raise ConfigError("model.source", source, "timm is not installed (pip install timm)", "auto, torchvision")
    found = model_source(str(name), source) if isinstance(name, str) else None
    if found is None:
        pool = list(_torchvision_names()) if source != "timm" else []
        lists = ["torchvision.models.list_models()"] if source != "timm" else []
        if source != "torchvision" and _timm() is not None:
            pool += _timm().list_models()
            lists.append("timm.list_models()")
        close = list(dict.fromkeys(difflib.get_close_matches(str(name), pool, n=6, cutoff=0.6)))[:4]
        allowed = "a name from " + " or ".join(lists)
        allowed += f"; closest: {', '.join(close)}" if close else "; e.g. resnet50, resnet18, efficientnet_b0"
        raise ConfigError("model.name", name, "unknown model", allowed)
    return found


def build_model(
    name: str,
    num_classes: int,
    source: str = "auto",
    pretrained: str | Path | None = None,
    kwargs: dict[str, Any] | None = None,
) -> nn.Module:
    """A freshly initialised classifier with ``num_classes`` outputs (weights from ``pretrained`` if given)."""
    kwargs = dict(kwargs or {})
    found = check_model_name(name, source)
    if found == "torchvision":
        import torchvision

        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
    else:
        model = _timm().create_model(name, pretrained=False, num_classes=num_classes, **kwargs)
    if pretrained is not None:
        load_pretrained(model, pretrained)
    return model


def load_pretrained(model: nn.Module, path: str | Path) -> list[str]:
    """Copy weights from the local file ``path`` into ``model``; returns the keys it skipped.

    ``load_state_dict`` copies into the existing parameters, so the model keeps its layout.
    """
    state = torch.load(Path(path).expanduser(), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:  # a Lightning checkpoint: keys are "model.<name>"
        state = {k.removeprefix("model."): v for k, v in state["state_dict"].items() if k.startswith("model.")}
    elif isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    state = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in state.items()}
    own = model.state_dict()
    skipped = [k for k, v in state.items() if k not in own or own[k].shape != v.shape]
    missing = [k for k in own if k not in state]
    model.load_state_dict({k: v for k, v in state.items() if k not in skipped}, strict=False)
    if skipped or missing:
        warnings.warn(
            f"pretrained weights from {path}: skipped {len(skipped)} unmatched key(s) {skipped[:4]}, "
            f"{len(missing)} model key(s) left at their initial values {missing[:4]}",
            stacklevel=2,
        )
    if not set(state) - set(skipped):
        raise ConfigError("model.pretrained", str(path), "no weight in the file matches the model",
                          "weights saved from the same architecture")
    return skipped
