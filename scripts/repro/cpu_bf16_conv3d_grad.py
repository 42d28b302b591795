"""oneDNN's bf16 Conv3d backward-weights on the CPU: wrong (often huge or non-finite) weight gradients.

Plain PyTorch only. One ``F.conv3d`` backward in bf16 (plain bf16 tensors, or fp32 tensors under
``torch.autocast("cpu", torch.bfloat16)``), its weight gradient compared elementwise with a float64
reference computed with oneDNN disabled::

    python -m scripts.repro.cpu_bf16_conv3d_grad                 # (8, 256, 2, 4, 4), 3x3x3, the r3d_18 layer3 case
    python -m scripts.repro.cpu_bf16_conv3d_grad --mode fp32-in-autocast
    python -m scripts.repro.cpu_bf16_conv3d_grad --transposed     # F.conv_transpose3d: the same fault
    python -m scripts.repro.cpu_bf16_conv3d_grad --sweep         # the table in docs/troubleshooting.md
    python -m scripts.repro.cpu_bf16_conv3d_grad --count --calls 100

Prints the machine and the worst relative error over ``--calls`` calls (bf16 kernels land near 4e-3);
exits 1 when a weight gradient is wrong or not finite. ``--mode fp32-in-autocast`` runs the same conv
with autocast turned off for it and fp32 inputs: what cltrain's guardrail does to such a layer. ``--count``
prints, for bf16 (contiguous and channels_last_3d) and fp32, how many calls on the same tensors gave a
non-finite weight gradient and how many finite ones differ from the first (exits 0).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")  # from mkldnn.flags()
TOLERANCE = 5e-2  # bf16 weight gradients land near 4e-3 here; the faulty ones at 1 to 1e37, or inf/nan
MODES = ("bf16", "autocast", "fp32-in-autocast")
CPUINFO = Path("/proc/cpuinfo")


def _machine() -> str:
    """The CPU's vector flags, torch, oneDNN and the threads."""
    flags = re.findall(r"^flags\s*: (.*)$", CPUINFO.read_text(), re.M) if CPUINFO.exists() else []
    vector = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in " ".join(flags[:1]).split())
    onednn = re.search(r"MKL-DNN v([\d.]+)", torch.__config__.show())
    return (f"[{vector}] {os.cpu_count()} cpus; torch {torch.__version__}, oneDNN {onednn.group(1) if onednn else '?'}, "
            f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')}, {torch.get_num_threads()} threads")


def weight_grads(shape, cout, kernel, stride, padding, channels_last, mode, calls, transposed=False):
    """The float64 reference's weight gradient (oneDNN off), and the weight gradients of ``calls`` calls in ``mode``
    on the same tensors (``transposed``: ``F.conv_transpose3d``)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    conv = F.conv_transpose3d if transposed else F.conv3d
    w = torch.randn(*((shape[1], cout) if transposed else (cout, shape[1])), *kernel, generator=gen) * 0.02
    y_shape = conv(x, w, None, stride, padding).shape
    gy = torch.randn(y_shape, generator=gen) * 1e-4

    def grad(dtype, reference=False):
        xx, ww, gg = (t.to(dtype, copy=True) for t in (x, w, gy))  # a fresh leaf each call
        if channels_last:
            xx, ww, gg = (t.to(memory_format=torch.channels_last_3d) for t in (xx, ww, gg))
        ww.requires_grad_(True)
        autocast = mode != "bf16" and not reference
        with torch.backends.mkldnn.flags(enabled=not reference):
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                if mode == "fp32-in-autocast" and not reference:
                    with torch.autocast("cpu", enabled=False):
                        y = conv(xx.float(), ww, None, stride, padding)
                else:
                    y = conv(xx, ww, None, stride, padding)
            y.backward(gg.to(y.dtype))
        return ww.grad.double()

    return grad(torch.float64, reference=True), [grad(torch.bfloat16 if mode == "bf16" else torch.float32)
                                                 for _ in range(calls)]


def weight_error(*case) -> float:
    """The worst max|g - ref| / max|ref| of the weight gradient over the calls (inf when one is not finite)."""
    want, grads = weight_grads(*case)
    if not all(bool(torch.isfinite(g).all()) for g in grads):
        return float("inf")
    return max((float((g - want).abs().max() / want.abs().max()) for g in grads), default=0.0)


def sweep(calls: int) -> int:
    """The boundary table: depth x kernel depth x stride x padding x channels x layout, bf16 and fp32-in-autocast."""
    print("| input (N, C, D, H, W) | out C | kernel | stride | pad | layout | bf16 | autocast | fp32-in-autocast |")
    print("|---|---|---|---|---|---|---|---|---|")
    cases = [((4, 64, d, 8, 8), 64, (3, 3, 3), 1, 1) for d in (1, 2, 3, 4, 8)]
    cases += [((4, c, 2, 8, 8), c, (3, 3, 3), 1, 1) for c in (3, 16, 256)]
    cases += [((4, 64, 2, hw, hw), 64, (3, 3, 3), 1, 1) for hw in (2, 16, 28)]
    cases += [((4, 64, 2, 8, 8), 64, k, 1, p) for k, p in (((3, 1, 1), (1, 0, 0)), ((1, 3, 3), (0, 1, 1)),
                                                        ((1, 1, 1), 0), ((2, 3, 3), (0, 1, 1)), ((2, 3, 3), 1),
                                                        ((3, 3, 3), (2, 1, 1)), ((5, 3, 3), (2, 1, 1)))]
    cases += [((4, 64, d, 8, 8), 64, (3, 3, 3), (2, 1, 1), 1) for d in (3, 4, 5)]
    cases += [((4, 64, d, 8, 8), 64, (3, 3, 3), 1, (0, 1, 1)) for d in (3, 4, 5)]
    cases += [((4, 64, d, 8, 8), 64, (5, 3, 3), 1, (2, 1, 1)) for d in (1, 3, 4)]
    bad = 0
    for (shape, cout, kernel, stride, padding), cl in itertools.product(cases, (False, True)):
        cells = []
        for mode in MODES:
            err = weight_error(shape, cout, kernel, stride, padding, cl, mode, calls)
            cells.append(f"**{err:.1e}**" if not err <= TOLERANCE else f"{err:.1e}")
            bad += mode == "bf16" and not err <= TOLERANCE
        print(f"| {shape} | {cout} | {kernel} | {stride} | {padding} | {'cl3d' if cl else 'ncdhw'} | " + " | ".join(cells) + " |",
              flush=True)
    return bad


def count(case: tuple, calls: int) -> None:
    """Per dtype and layout: the calls whose weight gradient is not finite, and the finite ones unlike the first."""
    for mode, dtype, channels_last in (("bf16", "bfloat16", False), ("bf16", "bfloat16", True),
                                       ("fp32-in-autocast", "float32", False)):
        _, grads = weight_grads(*case, channels_last, mode, calls)
        finite = [g for g in grads if bool(torch.isfinite(g).all())]
        differ = sum(not torch.equal(g, finite[0]) for g in finite)
        print(f"{dtype} {'channels_last_3d' if channels_last else 'contiguous'}: {len(grads) - len(finite)} of "
              f"{calls} calls non-finite, {differ} finite ones differ from the first", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=5, default=[8, 256, 2, 4, 4], metavar=("N", "C", "D", "H", "W"))
    p.add_argument("--cout", type=int, default=0, help="output channels (0: the input's)")
    p.add_argument("--kernel", type=int, nargs=3, default=[3, 3, 3])
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--padding", type=int, default=1)
    p.add_argument("--channels-last", action="store_true", help="channels_last_3d tensors")
    p.add_argument("--transposed", action="store_true", help="F.conv_transpose3d (a 3-D decoder's layer)")
    p.add_argument("--mode", choices=MODES, default="bf16")
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--count", action="store_true", help="count non-finite and differing calls (exits 0)")
    args = p.parse_args(argv)
    print(f"Machine: {_machine()}", flush=True)
    case = (tuple(args.shape), args.cout or args.shape[1], tuple(args.kernel), args.stride, args.padding)
    if args.count:
        count(case, args.calls)
        return 0
    if args.sweep:
        return 1 if sweep(args.calls) else 0
    err = weight_error(*case, args.channels_last, args.mode, args.calls, args.transposed)
    print(f"{args.mode}: worst weight-gradient error {err:.2e} over {args.calls} calls "
          f"({'FAULT' if not err <= TOLERANCE else 'ok'}, tolerance {TOLERANCE:g})", flush=True)
    return 1 if not err <= TOLERANCE else 0


if __name__ == "__main__":
    sys.exit(main())
