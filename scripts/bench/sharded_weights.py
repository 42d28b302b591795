"""What sharding costs channels_last: a training step with channels_last activations and contiguous weights, as FSDP2
keeps them (the variants: docs/benchmarks.md#sharded-weights).

    python -m scripts.bench.sharded_weights                                   # CPU: resnet50, convnext_tiny, bf16
    python -m scripts.bench.sharded_weights --device cuda --batch-size 256 --fsdp
    python -m scripts.bench.sharded_weights --quick                           # a minute: checks the script works
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from cltrain.layout import is_channels_last, to_channels_last
from cltrain.precision import autocast_for
from scripts.bench.models import build_model, unknown_model
from scripts.harness import machine_line, options, random_batches, table, time_steps, training_step

PLAIN = ("contiguous", "channels_last", "cl_activations")
SHARDED = ("fsdp2 contiguous", "fsdp2 cl_activations")
COLUMNS = ["model", "weights / input", "img/s (median)", "min-max", "vs contiguous", "first conv output"]


@contextlib.contextmanager
def one_process_group(device: torch.device) -> Iterator[None]:
    """A world of one (gloo on CPU, nccl on CUDA) for ``fully_shard``, torn down afterwards."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(model: nn.Module) -> nn.Module:
    """``fully_shard`` on each direct child holding a 4-D weight, then on the root (FSDP2's usual wrapping)."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if any(p.dim() == 4 for p in child.parameters()):
            fully_shard(child)
    return fully_shard(model)


def first_conv_output_layout(model: nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> str:
    """``NHWC`` or ``NCHW``: the memory order of the first Conv2d's output on ``x``."""
    seen: list[str] = []
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    handle = conv.register_forward_hook(lambda m, i, out: seen.append("NHWC" if is_channels_last(out) else "NCHW"))
    try:
        with torch.no_grad(), autocast_for(x.device, dtype):
            model(x[:1])
    finally:
        handle.remove()
    return seen[0]


def bench_model(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype | None,
                names: tuple[str, ...]) -> list[list[str]]:
    """The table's row of each variant of model ``name``: median images/s over rounds, spread, ratio to
    ``contiguous``, first-conv output layout."""
    torch.manual_seed(0)
    base = build_model(name, args.image_size)
    ((x, y),) = random_batches(1, (args.batch_size, 3, args.image_size, args.image_size), device=device)
    x_cl, steps, layouts = to_channels_last(x.clone()), {}, {}
    for n in names:  # a fresh copy of the model, its weights as the variant says
        model = copy.deepcopy(base).to(device)
        if n == "channels_last":
            to_channels_last(model)
        model, xi = sharded(model) if n.startswith("fsdp2") else model, x if n.endswith("contiguous") else x_cl
        layouts[n] = first_conv_output_layout(model, xi, dtype)
        steps[n] = training_step(model, lambda model=model, xi=xi: F.cross_entropy(model(xi).float(), y),
                                 optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                 autocast_dtype=dtype, device=device)
    rates = time_steps(steps, rounds=args.repeats, warmup=args.warmup, min_steps=args.steps, max_steps=args.steps,
                       sync=device).rates(units=args.batch_size)
    return [[name, n, f"{r.median:,.1f}", f"{r.low:,.1f}-{r.high:,.1f}",
             f"{r.median / rates['contiguous'].median:.2f}x", layouts[n]] for n, r in rates.items()]


def main(argv: list[str] | None = None) -> int:
    parser = options(__doc__, device="cpu", models=["resnet50", "convnext_tiny"], image_size=224, warmup=3, steps=3,
                     repeats=5, fsdp=(False, "add the two fully_shard variants (one-process group)"),
                     quick=(dict(models=["resnet18"], batch_size=2, image_size=64, warmup=1, steps=1, repeats=3),
                            "resnet18, batch 2, 64 px, one step per round"),
                     batch_size=(int, "default: 256 on CUDA, 32 on CPU"),
                     dtype=(("bf16", "fp16", "fp32"), "autocast dtype"))
    args = parser.parse_args(argv)
    if why := unknown_model(args.models):
        parser.error(why)
    device = torch.device(args.device)
    args.batch_size = args.batch_size or (256 if device.type == "cuda" else 32)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[args.dtype]
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    names = PLAIN + (SHARDED if args.fsdp else ())
    print(machine_line(device))
    print(f"batch {args.batch_size} at {args.image_size} px, autocast {args.dtype}, {args.warmup} warm-up steps, "
          f"{args.repeats} interleaved rounds of {args.steps} steps")
    rows: list[list[str]] = []
    with one_process_group(device) if args.fsdp else contextlib.nullcontext():
        for name in args.models:
            model_rows = bench_model(name, args, device, dtype, names)
            print(table(COLUMNS, model_rows, align="llrrrl"), flush=True)
            rows += model_rows
    print()
    print(table(COLUMNS, rows, align="llrrrl"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
