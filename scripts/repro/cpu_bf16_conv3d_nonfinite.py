"""How often bf16 Conv3d weight gradients come out non-finite on this CPU, for the same tensors every call.

One ``F.conv3d`` backward on an (8, 256, 2, 4, 4) input (r3d_18's layer3 on 32 px clips), the same input,
weight and output gradient each call, in bf16 (contiguous and channels_last_3d) and in fp32; prints the
count of calls whose weight gradient has a NaN or inf, and how many finite results differ from the first
one, then the machine. The finite ones are wrong too: scripts/repro/cpu_bf16_conv3d_grad.py compares them
with float64 and maps the shapes (an input shallower than the kernel); docs/troubleshooting.md has the table.

    python -m scripts.repro.cpu_bf16_conv3d_nonfinite --calls 100
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from cltrain.timing.machine import machine, machine_line
from cltrain.timing.clock import Stopwatch


def count(dtype: torch.dtype, channels_last: bool, calls: int, shape: tuple[int, ...]) -> tuple[int, int, float]:
    """(non-finite weight gradients, finite ones differing from the first, ms per call)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    grad_out = (torch.randn(shape, generator=gen) * 1e-4).to(dtype)
    weight = (torch.randn(shape[1], shape[1], 3, 3, 3, generator=gen) * 0.02).to(dtype)
    if channels_last:
        x, grad_out, weight = (t.to(memory_format=torch.channels_last_3d) for t in (x, grad_out, weight))
    bad, differ, first = 0, 0, None
    with Stopwatch() as watch:
        for _ in range(calls):
            w = weight.clone().requires_grad_(True)
            F.conv3d(x, w, None, 1, 1).backward(grad_out)
            if not bool(torch.isfinite(w.grad).all()):
                bad += 1
            elif first is None:
                first = w.grad
            elif not torch.equal(w.grad, first):
                differ += 1
    return bad, differ, watch.seconds / calls * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--shape", type=int, nargs=5, default=[8, 256, 2, 4, 4], metavar=("N", "C", "T", "H", "W"))
    args = parser.parse_args(argv)
    for dtype, channels_last in ((torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)):
        bad, differ, ms = count(dtype, channels_last, args.calls, tuple(args.shape))
        layout = "channels_last_3d" if channels_last else "contiguous"
        print(f"{str(dtype).removeprefix('torch.')} {layout}: {bad} of {args.calls} calls non-finite, "
              f"{differ} finite ones differ from the first, {ms:.1f} ms/call", flush=True)
    print(f"Machine: {machine_line(machine())}")


if __name__ == "__main__":
    main()
