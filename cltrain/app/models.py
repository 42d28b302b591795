"""The application's classifier by name (any torchvision image or video classifier, or a timm model) and its
pretrained weights from a local file.

Video models (``r3d_18``, ``mc3_18``, ``r2plus1d_18``, ``s3d``, ``mvit_*``,
``swin3d_*``: ``torchvision.models.list_models(module=torchvision.models.video)``)
take ``(N, C, T, H, W)`` clips; train them with ``data=video_demo`` or a
``ClipFolderDataModule``.

Nothing is ever downloaded: ``pretrained`` is a local file (``.safetensors``, a ``state_dict``,
a Lightning checkpoint, or torchvision's and timm's training checkpoints, EMA weights preferred)
read by ``read_checkpoint``; the formats it takes: docs/guides/app.md.

Example::

    >>> model = build_classifier("resnet18", num_classes=10)
    >>> model.fc.out_features
    10
    >>> build_classifier("r3d_18", num_classes=6).fc.out_features
    6
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cltrain.app.config.errors import ConfigError
from cltrain.app.config.resolve import check_model_name
from cltrain.model_names import build_untrained_model

__all__ = ["EMA_KEYS", "build_classifier", "check_input_size", "load_pretrained", "read_checkpoint"]

#: Keys of a checkpoint dict that hold EMA weights, in order of preference (timm's order).
EMA_KEYS: tuple[str, ...] = ("state_dict_ema", "model_ema")
#: Wrapper prefixes stripped from every key, in either order (timm's ``clean_state_dict``).
_WRAPPER_PREFIXES: tuple[str, ...] = ("_orig_mod.", "module.", "_orig_mod.")
_SAFETENSORS_EXAMPLE = "a state_dict saved with torch.save, a Lightning .ckpt, or a .safetensors file"


def build_classifier(
    name: str,
    num_classes: int,
    source: str = "auto",
    pretrained: str | Path | None = None,
    kwargs: dict[str, Any] | None = None,
) -> nn.Module:
    """A freshly initialised classifier with ``num_classes`` outputs (weights from ``pretrained`` if given)."""
    check_model_name(name, source)
    model = build_untrained_model(name, num_classes, source, **dict(kwargs or {}))
    if pretrained is not None:
        load_pretrained(model, pretrained)
    return model


def check_input_size(name: str, source: str, image_size: int, num_frames: int | None = None) -> None:
    """The crop (and a clip's frames) are at least what torchvision's ``name`` takes (its weights' ``min_size`` and
    ``min_temporal_size``: S3D 224 px and 14 frames, MViT 224 px and 16, Inception v3 75 px): a smaller input fails
    inside the model's first step.

    Raises:
        ConfigError: ``data.image_size`` or ``data.num_frames`` below the model's minimum.
    """
    from cltrain.model_names import CLASSIFIERS, model_source

    if model_source(name, source, CLASSIFIERS) != "torchvision":
        return
    import torchvision

    try:
        meta = next(iter(torchvision.models.get_model_weights(name))).meta
    except (ValueError, KeyError, StopIteration):  # a model without published weights states no minimum
        return
    side, frames = max(meta.get("min_size", (1, 1))), meta.get("min_temporal_size")
    if image_size < side:
        raise ConfigError("data.image_size", image_size, f"model.name={name!r} (torchvision) takes images of at least "
                          f"{side} px", allowed=f"data.image_size={side} or more, or another model")
    if num_frames is not None and frames is not None and num_frames < frames:
        raise ConfigError("data.num_frames", num_frames, f"model.name={name!r} (torchvision) takes clips of at least "
                          f"{frames} frames", allowed=f"data.num_frames={frames} or more, or another model")


def _first_line(err: BaseException) -> str:
    """``Type: first sentence`` of an error (torch's zip-reader errors run to several)."""
    text = str(err).strip().splitlines()
    first = text[0].split(". ")[0].rstrip(".") if text else ""
    return f"{type(err).__name__}: {first}".rstrip(": ")


def _what_it_is(path: Path) -> str | None:
    """``"empty"`` or ``"text"`` for files that plainly hold no weights, else None."""
    with open(path, "rb") as f:
        head = f.read(512)
    if not head:
        return "empty"
    try:
        decoded = head.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return "text" if all(c.isprintable() or c.isspace() for c in decoded) else None


def _is_safetensors(path: Path) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then a JSON header."""
    with open(path, "rb") as f:
        head = f.read(9)
    return path.suffix == ".safetensors" or (len(head) == 9 and head[8:9] == b"{")


def _load_file(path: Path) -> Any:
    if _is_safetensors(path):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ConfigError("model.pretrained", str(path), "a .safetensors file needs the safetensors package",
                              "pip install 'cltrain[safetensors]'") from None
        try:
            return load_file(path, device="cpu")
        except Exception as err:  # SafetensorError: a truncated file, a bad header
            raise ConfigError("model.pretrained", str(path), f"not a readable safetensors file ({_first_line(err)})",
                              _SAFETENSORS_EXAMPLE) from None
    what = _what_it_is(path)
    if what is not None:
        raise ConfigError("model.pretrained", str(path), f"not a checkpoint: the file is {what}", _SAFETENSORS_EXAMPLE)
    from cltrain.checkpoint_io import UnreadableCheckpointError, UnsafeCheckpointError, load_checkpoint_file

    try:
        return load_checkpoint_file(path, map_location="cpu")  # weights_only
    except UnsafeCheckpointError as err:
        raise ConfigError("model.pretrained", str(path), f"refused to load: it holds {', '.join(err.types)}; unpickling "
                          "it could run code", _SAFETENSORS_EXAMPLE) from None
    except UnreadableCheckpointError as err:
        raise ConfigError("model.pretrained", str(path), f"not a checkpoint torch.load can read ({err.reason})",
                          _SAFETENSORS_EXAMPLE) from None


def _strip_prefixes(state: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in state.items():
        for prefix in _WRAPPER_PREFIXES:
            key = key.removeprefix(prefix)
        out[key] = value
    return out


def read_checkpoint(path: str | Path, use_ema: bool = True) -> tuple[dict[str, torch.Tensor], str]:
    """The weights in the local file ``path`` and where they were found (``"state_dict_ema"``,
    ``"model_ema"``, ``"state_dict"``, ``"model"`` or ``""`` for a plain state_dict), with the
    wrapper prefixes ``module.`` / ``_orig_mod.`` stripped (see the module docstring).

    Args:
        path: a ``torch.save`` file, a Lightning checkpoint or a ``.safetensors`` file.
        use_ema: take the EMA weights when the file has them (timm's default).

    Raises:
        ConfigError: (``model.pretrained``) the file is not a checkpoint (text, truncated,
            empty) or holds no tensors.
    """
    path = Path(path).expanduser()
    checkpoint = _load_file(path)
    where = ""
    if isinstance(checkpoint, dict):
        keys = (*(EMA_KEYS if use_ema else ()), "state_dict", "model")
        where = next((k for k in keys if isinstance(checkpoint.get(k), dict)), "")
        if where:
            checkpoint = checkpoint[where]
    state = {k: v for k, v in checkpoint.items() if isinstance(k, str) and isinstance(v, torch.Tensor)} \
        if isinstance(checkpoint, dict) else {}
    state.pop("n_averaged", None)  # torch.optim.swa_utils.AveragedModel's counter, not a weight
    if not state:
        raise ConfigError("model.pretrained", str(path), f"holds no weights (a {type(checkpoint).__name__} without tensors)",
                          _SAFETENSORS_EXAMPLE)
    return _strip_prefixes(state), where


def load_pretrained(model: nn.Module, path: str | Path, use_ema: bool = True) -> list[str]:
    """Copy weights from the local file ``path`` (see ``read_checkpoint``) into ``model``;
    returns the keys it skipped.

    ``load_state_dict`` copies into the existing parameters, so the model keeps its layout.

    Raises:
        ConfigError: the file is not a checkpoint, or no weight in it matches the model.
    """
    state, _ = read_checkpoint(path, use_ema)
    own = model.state_dict()
    # A LightningModule's checkpoint names the network by its attribute ("model." for ours).
    if not any(k.startswith("model.") for k in own) and any(k.startswith("model.") for k in state):
        state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    skipped = [k for k, v in state.items() if k not in own or own[k].shape != v.shape]
    missing = [k for k in own if k not in state or k in skipped]  # a head of another shape keeps its initial values
    if not set(state) - set(skipped):
        raise ConfigError("model.pretrained", str(path), "no weight in the file matches the model",
                          "weights saved from the same architecture")
    model.load_state_dict({k: v for k, v in state.items() if k not in skipped}, strict=False)
    if skipped or missing:
        warnings.warn(
            f"pretrained weights from {path}: skipped {len(skipped)} unmatched key(s) {skipped[:4]}, "
            f"{len(missing)} model key(s) left at their initial values {missing[:4]}",
            stacklevel=2,
        )
    return skipped

