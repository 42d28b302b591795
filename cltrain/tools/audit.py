"""``cltrain-audit``: which operators of a torchvision or timm model drop channels_last.

    cltrain-audit resnet50                                   # one training step at 224 px on the CPU
    cltrain-audit convnext_tiny --dtype bf16 --image-size 160
    cltrain-audit r3d_18 --frames 8 --image-size 112 --device cuda

The model is built with random weights (nothing is downloaded), put in train mode,
converted with ``cltrain.to_channels_last`` and audited by ``cltrain.audit.audit_model``
on one random batch: ``(N, 3, S, S)``, or ``(N, 3, frames, S, S)`` for torchvision's video
models. Detection, optical-flow and quantized models are refused with the reason. Every
mistake is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from torch import nn

from cltrain.audit import AuditReport, audit_model
from cltrain.devices import DeviceError, resolve_device
from cltrain.layout import MODES, to_channels_last
from cltrain.model_names import SOURCES, UnknownModelError, build_untrained_model, torchvision_family

__all__ = ["main", "parser", "run"]

DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_REFUSED_FAMILIES = {
    "detection": "detection models train on images plus box targets",
    "optical_flow": "optical-flow models take two images per sample",
    "quantization": "quantized models run int8 kernels, not the float training step audited here",
}


class UsageError(ValueError):
    """A command-line mistake: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    p = _Parser(prog="cltrain-audit", description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:5]))
    p.add_argument("model", help="a torchvision or timm model name, e.g. resnet50")
    p.add_argument("--batch-size", type=_positive, default=2, help="images per batch (default 2)")
    p.add_argument("--image-size", type=_positive, default=224, help="height and width (default 224)")
    p.add_argument("--frames", type=_positive, default=8, help="frames per clip, video models (default 8)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="autocast dtype (default fp32: none)")
    p.add_argument("--mode", choices=MODES, default="full", help="what to_channels_last converts (default full)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    p.add_argument("--source", choices=SOURCES, default="auto", help="where to look the name up (default auto)")
    return p


def _build(args: argparse.Namespace) -> tuple[nn.Module, tuple[int, ...]]:
    family = torchvision_family(args.model) if args.source != "timm" else None
    if family in _REFUSED_FAMILIES:
        raise UsageError(f"{args.model} is a torchvision {family} model: {_REFUSED_FAMILIES[family]}; audit a "
                         "classification, video or segmentation model, or call cltrain.audit_model() on your own step")
    kwargs = {"image_size": args.image_size} if family == "" and args.model.startswith("vit_") else {}
    try:
        model = build_untrained_model(args.model, source=args.source, families=("", "video", "segmentation"), **kwargs)
    except UnknownModelError as err:
        raise UsageError(str(err)) from None
    spatial = (args.image_size, args.image_size)
    shape = (args.batch_size, 3, args.frames, *spatial) if family == "video" else (args.batch_size, 3, *spatial)
    return model, shape


def run(args: argparse.Namespace) -> AuditReport:
    """Build, convert and audit the model ``args`` names; print the report.

    Raises:
        UsageError: an unknown or refused model, a device not here, or an input the model cannot run on.
    """
    try:
        device = resolve_device(args.device)
    except DeviceError as err:
        raise UsageError(f"--device {args.device}: {err.reason} (allowed: {err.allowed})") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {args.device}: the audit runs on cpu or cuda")
    try:
        model, shape = _build(args)
        model = model.to(device).train()
        to_channels_last(model, mode=args.mode)
        report = audit_model(model, torch.randn(shape, device=device), autocast_dtype=DTYPES[args.dtype])
    except UsageError:
        raise
    except (RuntimeError, ValueError, AssertionError, TypeError) as err:  # e.g. a ViT's size check, BN on 1 value
        spatial = (args.image_size, args.image_size)
        shape = (args.batch_size, 3, *spatial)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise UsageError(f"{args.model} could not run one step on input {shape}: {first}; "
                         "try a larger --image-size or --batch-size") from None
    print(f"model={args.model} mode={args.mode} device={device} dtype={args.dtype} torch={torch.__version__}")
    print(report.format_table())
    return report


def audit(argv: Sequence[str] | None = None) -> AuditReport:
    """Run the command line (``argv`` defaults to ``sys.argv[1:]``); the report it printed.

    Raises:
        SystemExit: 2, after one line, for a usage error.
    """
    args = parser().parse_args(argv)
    try:
        return run(args)
    except UsageError as err:
        print(f"cltrain-audit: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: Sequence[str] | None = None) -> int:
    """``cltrain-audit``: :func:`audit`, exit status 0 (the console script exits with what this returns)."""
    audit(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
