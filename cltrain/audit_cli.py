"""The ``python -m cltrain.audit`` command: audit a torchvision or timm model by name.

Usage::

    python -m cltrain.audit model=resnet50 [batch_size=2] [image_size=224] [frames=8] \
        [dtype=fp32|bf16|fp16] [mode=full|conv] [device=cpu|cuda|cuda:1] [source=auto|torchvision|timm]

The model is built with random weights (torchvision ``weights=None`` and, for segmentation
models, ``weights_backbone=None``; timm ``pretrained=False``), so nothing is ever downloaded.
It is put in train mode, converted with :func:`cltrain.to_channels_last` in ``mode``, and
:func:`cltrain.audit.audit` runs one step on a random batch: ``(N, 3, S, S)`` for image
models, ``(N, 3, frames, S, S)`` for torchvision's video models.

Families that need more than one image tensor to train (detection, optical flow) and
quantized models are refused with a one-line reason. Every mistake on the command line (an
unknown model, with the closest names; a number that is not an int >= 1; an unknown dtype,
mode, device or source; a size the model cannot run on) is one line on stderr and exit
status 2.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cltrain.audit import AuditReport, audit
from cltrain.layout import MODES, to_channels_last
from cltrain.model_names import closest_model_names, optional_timm

__all__ = ["AuditArgs", "UsageError", "build_model", "input_shape", "main", "parse_args", "run"]

DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None, "32": None, "bf16": torch.bfloat16, "bf16-mixed": torch.bfloat16,
    "fp16": torch.float16, "16-mixed": torch.float16,
}
SOURCES = ("auto", "torchvision", "timm")
_INTS = {"batch_size": 2, "image_size": 224, "frames": 8}
_REFUSED_FAMILIES = {
    "detection": "detection models train on images plus box targets",
    "optical_flow": "optical-flow models take two images per sample",
    "quantization": "quantized models run int8 kernels, not the float training step audited here",
}


class UsageError(ValueError):
    """A command-line mistake; :func:`main` prints it as one line and exits with status 2."""


@dataclass(frozen=True)
class AuditArgs:
    """The parsed, checked command line."""

    model: str
    batch_size: int = 2
    image_size: int = 224
    frames: int = 8
    dtype: str = "fp32"
    mode: str = "full"
    device: str | None = None
    source: str = "auto"


def _positive_int(key: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise UsageError(f"{key}={value!r} is not an integer; give an int >= 1, e.g. {key}={_INTS[key]}.") from None
    if number < 1:
        raise UsageError(f"{key}={number} must be >= 1, e.g. {key}={_INTS[key]}.")
    return number


def parse_args(argv: Sequence[str]) -> AuditArgs:
    """Parse and check ``key=value`` arguments.

    Raises:
        UsageError: an unknown key, a bad value, or no ``model=``.
    """
    keys = [f.name for f in AuditArgs.__dataclass_fields__.values()]
    raw: dict[str, str] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in keys:
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f" (did you mean {close[0]}=?)" if close and sep else ""
            raise UsageError(f"bad argument {arg!r}{hint}; expected key=value with key in {', '.join(keys)}.")
        raw[key] = value
    if not raw.get("model"):
        raise UsageError("model=NAME is required (a torchvision or timm model name, e.g. model=resnet50).")
    values: dict[str, Any] = {k: _positive_int(k, raw[k]) for k in _INTS if k in raw}
    for key, allowed in (("dtype", DTYPES), ("mode", MODES), ("source", SOURCES)):
        if key in raw:
            if raw[key] not in allowed:
                raise UsageError(f"{key}={raw[key]!r} is not one of {', '.join(allowed)}.")
            values[key] = raw[key]
    if "device" in raw:
        values["device"] = _check_device(raw["device"])
    return AuditArgs(model=raw["model"], **values)


def _check_device(value: str) -> str:
    try:
        device = torch.device(value)
    except RuntimeError:
        raise UsageError(f"device={value!r} is not a torch device; use cpu, cuda or cuda:N.") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device={value} but CUDA is not available here; use device=cpu.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"device={value} but only {torch.cuda.device_count()} CUDA device(s) exist.")
    elif device.type != "cpu":
        raise UsageError(f"device={value!r}: only cpu and cuda are supported.")
    return str(device)


_timm = optional_timm


def _family(name: str) -> str | None:
    """The torchvision module family holding ``name`` (``""`` for classification), or None."""
    import torchvision.models as tvm

    families = {"": tvm, "video": tvm.video, "segmentation": tvm.segmentation, "detection": tvm.detection,
                "optical_flow": tvm.optical_flow, "quantization": tvm.quantization}
    for family, module in families.items():
        if name in tvm.list_models(module=module):
            return family
    return None


def _unknown(name: str, source: str) -> UsageError:
    import torchvision.models as tvm

    close, lists = closest_model_names(name, source, tvm.list_models() if source != "timm" else ())
    hint = f"closest: {', '.join(close)}" if close else "e.g. resnet50, r3d_18, efficientnet_b0"
    where = " or ".join(lists) if lists else "timm (not installed: pip install timm)"
    return UsageError(f"model={name!r} is not in {where}; {hint}.")


def build_model(args: AuditArgs) -> tuple[nn.Module, tuple[int, ...]]:
    """The model named by ``args`` with random weights (never downloaded), and :func:`input_shape`.

    Raises:
        UsageError: an unknown name (with the closest names), or a refused family.
    """
    family = _family(args.model) if args.source != "timm" else None
    if family is not None:
        if family in _REFUSED_FAMILIES:
            raise UsageError(
                f"model={args.model} is a torchvision {family} model: {_REFUSED_FAMILIES[family]}; "
                "audit a classification, video or segmentation model, or call cltrain.audit() on your own step."
            )
        import torchvision

        kwargs: dict[str, Any] = {"weights": None}
        if family == "segmentation":
            kwargs["weights_backbone"] = None  # its default is ImageNet backbone weights: a download
        if args.model.startswith("vit_"):
            kwargs["image_size"] = args.image_size
        model = torchvision.models.get_model(args.model, **kwargs)
    else:
        timm = _timm() if args.source != "torchvision" else None
        if timm is None or not timm.is_model(args.model):
            raise _unknown(args.model, args.source)
        model = timm.create_model(args.model, pretrained=False)
    return model, input_shape(args)


def input_shape(args: AuditArgs) -> tuple[int, ...]:
    """``(N, 3, S, S)``, or ``(N, 3, frames, S, S)`` for torchvision's video models."""
    spatial = (args.image_size, args.image_size)
    video = args.source != "timm" and _family(args.model) == "video"
    return (args.batch_size, 3, args.frames, *spatial) if video else (args.batch_size, 3, *spatial)


def run(args: AuditArgs) -> AuditReport:
    """Build, convert and audit the model ``args`` names; print the report.

    Raises:
        UsageError: see :func:`build_model`, or the model cannot run on the requested input.
    """
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        model, shape = build_model(args)
        model = model.to(device).train()
        to_channels_last(model, mode=args.mode)
        report = audit(model, torch.randn(shape, device=device), autocast_dtype=DTYPES[args.dtype])
    except UsageError:
        raise
    except (RuntimeError, ValueError, AssertionError, TypeError) as err:  # e.g. a ViT's size check, BN on 1 value
        shape = input_shape(args)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise UsageError(
            f"model={args.model} could not run one step on input {shape} "
            f"(batch_size={args.batch_size}, image_size={args.image_size}): {first}; "
            "try a larger image_size or batch_size."
        ) from None
    print(f"model={args.model} mode={args.mode} device={device} torch={torch.__version__}")
    print(report.format_table())
    return report


def main(argv: Sequence[str] | None = None) -> AuditReport:
    """Run the command line (``argv`` defaults to ``sys.argv[1:]``); see the module docstring.

    Exits with status 2 and one line on stderr on any usage mistake; ``-h``/``--help`` prints the usage.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or any(a in ("-h", "--help") for a in args):
        print(__doc__)
        raise SystemExit(0 if args else 2)
    try:
        return run(parse_args(args))
    except UsageError as err:
        print(f"cltrain.audit: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
