"""oneDNN #6035: the backward of a strided 1x1 convolution on a channels_last input with few input channels.

oneDNN's ``jit_1x1`` backward-weights kernel copies a strided nhwc source into a unit-stride workspace
("rtus") and writes past that workspace when the input channels are fewer than the kernel's channel
block (8 on AVX2, 16 on AVX-512). Depending on the machine and thread count the process segfaults,
hangs, or gets weight gradients that are silently wrong. Plain PyTorch only::

    python -m scripts.repro.onednn_1x1_strided_conv                  # Conv2d(3, 48, 1, stride=2), 8x3x128x128
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python -m scripts.repro.onednn_1x1_strided_conv
    python -m scripts.repro.onednn_1x1_strided_conv --cin 7 --threads 2 --repeats 10

Prints the machine, then one line per repeat: the largest elementwise error of the weight and input
gradients against a float64 reference computed with oneDNN disabled, relative to the reference's largest
value. Exits 1 when a gradient is wrong or not finite; a crash or hang is the fault too (``--timeout``
turns a hang into exit 1 with the stack printed). ``--json`` prints one JSON object instead (for scripts/repro/onednn_1x1_boundary.py).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

# mkldnn.flags() sets allow_tf32 too, which warns on builds without Intel GPU support.
warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
CPUINFO = Path("/proc/cpuinfo")

#: Relative error above which a gradient counts as wrong: fp32 kernels land near 1e-6 here, bf16 near 4e-3.
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2}
#: One case: an option per field (``input_layout``: ``--input-layout``) with its default; ``size`` is the height, width
#: (and depth for conv3d), ``dtype`` bf16 is ``torch.autocast("cpu", torch.bfloat16)``, ``threads`` 0 torch's default.
CASE = dict(op="conv2d", cin=3, cout=48, kernel=1, stride=2, padding=0, groups=1, size=128, batch=8, dtype="fp32",
            threads=0, input_layout="channels_last", weight_layout="channels_last")
LAYOUTS = ("channels_last", "contiguous")
CONVS = {"conv2d": F.conv2d, "conv3d": F.conv3d, "conv_transpose2d": F.conv_transpose2d}
CHOICES = {"op": tuple(CONVS), "dtype": tuple(TOLERANCE), "input_layout": LAYOUTS,
           "weight_layout": LAYOUTS}


def _machine() -> str:
    """The CPU model, its vector flags, torch, oneDNN and the ISA torch dispatches to."""
    info = CPUINFO.read_text() if CPUINFO.exists() else ""
    field = lambda name: (re.findall(rf"^{name}\s*: (.*)$", info, re.M) or [""])[0]  # noqa: E731
    vector = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in field("flags").split())
    onednn = re.search(r"MKL-DNN v([\d.]+)", torch.__config__.show())
    return (f"{field('model name') or platform.processor() or '?'} [{vector}], {os.cpu_count()} cpus; torch "
            f"{torch.__version__}, oneDNN {onednn.group(1) if onednn else '?'}, ATen "
            f"{torch.backends.cpu.get_cpu_capability()}, ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')}, "
            f"{torch.get_num_threads()} threads")


def _layout(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    # clone, not contiguous(): a C == 1 channels_last tensor counts as contiguous and would be kept as it is.
    return t.clone(memory_format=fmt if channels_last else torch.contiguous_format)


def grads(args: argparse.Namespace, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor, *, reference: bool):
    """Weight and input gradients of one conv: oneDNN in the case's dtype and layouts, or the float64 reference."""
    if reference:
        x, w, gy = (t.double().contiguous() for t in (x, w, gy))
    else:
        x, w = _layout(x, args.input_layout == "channels_last"), _layout(w, args.weight_layout == "channels_last")
    x, w = x.requires_grad_(True), w.requires_grad_(True)
    bf16 = args.dtype == "bf16" and not reference
    with torch.backends.mkldnn.flags(enabled=not reference):
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            y = CONVS[args.op](x, w, None, args.stride, args.padding, groups=args.groups)
        y.backward(gy.to(y.dtype))
    return w.grad.float(), x.grad.float()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (inf when ``got`` is not finite)."""
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def case_tensors(args: argparse.Namespace):
    gen = torch.Generator().manual_seed(0)
    dims = 3 if args.op == "conv3d" else 2
    x = torch.randn(args.batch, args.cin, *(args.size,) * dims, generator=gen)
    io = (args.cin, args.cout // args.groups) if args.op == "conv_transpose2d" else (args.cout, args.cin // args.groups)
    w = torch.randn(*io, *(args.kernel,) * dims, generator=gen) * 0.1
    out = CONVS[args.op](x, w, None, args.stride, args.padding, groups=args.groups)
    return x, w, torch.randn(out.shape, generator=gen)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in CASE.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default, choices=CHOICES.get(name))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=0, help="exit 1 after this many seconds (a hang)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.timeout:
        faulthandler.dump_traceback_later(args.timeout, exit=True)
    if not args.json:
        print(f"Machine: {_machine()}", flush=True)
    x, w, gy = case_tensors(args)
    want_w, want_x = grads(args, x, w, gy, reference=True)
    worst_w = worst_x = 0.0
    for i in range(args.repeats):
        got_w, got_x = grads(args, x, w, gy, reference=False)
        err_w, err_x = relative_error(got_w, want_w), relative_error(got_x, want_x)
        worst_w, worst_x = max(worst_w, err_w), max(worst_x, err_x)
        if not args.json:
            print(f"repeat {i}: weight grad error {err_w:.2e}, input grad error {err_x:.2e}", flush=True)
    tol = TOLERANCE[args.dtype]
    bad = not (worst_w <= tol and worst_x <= tol)
    if args.json:
        print(json.dumps({"weight_error": worst_w, "input_error": worst_x, "wrong": bad}), flush=True)
    else:
        print("FAULT: wrong or non-finite gradients" if bad else f"ok (tolerance {tol:g})", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
