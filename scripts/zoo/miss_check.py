"""Examine the zoo sweep's MISS rows: is the layer's kernel wrong, or is the gradient ill-conditioned? (the method:
docs/benchmarks.md#miss-check). Adds the finding to each row of ``<out>.json`` and renders the table again.

    python -m scripts.zoo.miss_check                 # every MISS in docs/zoo.json
    python -m scripts.zoo.miss_check --models tv:resnet34
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch

from scripts.harness import options
from scripts.zoo.models import build, find, make_batch, training_loss
from scripts.zoo.pages import record, write_page
from scripts.zoo.parity import grad_errors
from scripts.zoo.sweep import recorded_args

#: The layer alone is "right" when both layouts' weight gradients are within this of float64.
RIGHT_ALONE = 1e-4


def layer_alone(module: torch.nn.Module, shape: tuple[int, ...], leaf: str = "weight") -> dict[str, float]:
    """``module``'s ``leaf`` gradient error against float64, NCHW and channels_last, on random input of ``shape``."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen)
    reference = copy.deepcopy(module).double()
    out = reference(x.double())
    grad_out = torch.randn(out.shape, generator=gen)
    out.backward(grad_out.double())
    exact = {leaf: getattr(reference, leaf).grad.detach()}
    errors = {}
    for layout, fmt in (("contiguous", torch.contiguous_format), ("channels_last", torch.channels_last)):
        fmt = fmt if x.dim() == 4 else torch.contiguous_format  # channels_last is a 4-D layout
        layer = copy.deepcopy(module).float().to(memory_format=fmt)
        layer.zero_grad(set_to_none=True)
        y = layer(x.contiguous(memory_format=fmt))
        y.backward(grad_out.contiguous(memory_format=fmt) if grad_out.dim() == 4 else grad_out)
        errors[layout] = grad_errors({leaf: getattr(layer, leaf).grad}, exact)[leaf]
    return errors


def examine(spec: Any, row: dict[str, Any]) -> dict[str, Any]:
    """The layer-alone errors for ``row``'s worst parameter, and the verdict they support."""
    param = row["grad"]["worst_param"]
    module_name, _, leaf = param.rpartition(".")
    torch.manual_seed(0)
    net = build(spec).train()
    module = net.get_submodule(module_name)
    shapes: list[tuple[int, ...]] = []  # the layer's input shape in the model, on the sweep's batch of 2
    handle = module.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    with torch.no_grad():
        training_loss(net, make_batch(spec, 2, torch.Generator().manual_seed(0)), spec)
    handle.remove()
    shape = shapes[0]
    errors = layer_alone(module, shape, leaf)
    right = all(e <= RIGHT_ALONE for e in errors.values())
    noise = row["grad"].get("noise_by_run") or {}
    return {
        "param": param,
        "layer": f"{type(module).__name__} {tuple(getattr(module, leaf).shape)}",
        "input_shape": list(shape),
        "alone_error": errors,
        "grad_scale": row["grad"].get("grad_scale"),
        "fp32_spread": [min(noise.values()), max(noise.values())] if noise else None,
        "verdict": "numerics" if right else "kernel",
        "why": (f"{type(module).__name__} alone on input {tuple(shape)}: {leaf} gradient error "
                f"{errors['channels_last']:.1e} channels_last, {errors['contiguous']:.1e} NCHW against float64: "
                + ("the kernel is right; the model's gradient of this parameter is ill-conditioned at batch 2"
                   if right else "the kernel is off alone: a fault to report and guard")),
    }


def main(argv: list[str] | None = None) -> int:
    args = options(__doc__, out=(Path("docs/zoo"), "the sweep's output stem"),
                   models=("", "comma-separated keys; default: every MISS row")).parse_args(argv)
    data = record(args.out)
    keys = set(args.models.split(",")) if args.models else set()
    for row in data["rows"]:
        if (row.get("grad") or {}).get("verdict") == "MISS" and (not keys or row["key"] in keys):
            row["examined"] = examine(find([row["key"]])[0], row)
            print(f"{row['key']} {row['examined']['param']}: {row['examined']['verdict']}: {row['examined']['why']}",
                  flush=True)
    # the table, re-rendered
    write_page(args.out, data, recorded_args(data["command"]))
    kernel = [r["key"] for r in data["rows"] if (r.get("examined") or {}).get("verdict") == "kernel"]
    print(f"kernel faults: {', '.join(kernel) or 'none'}; wrote {args.out.with_suffix('.md')}")
    return 1 if kernel else 0


if __name__ == "__main__":
    sys.exit(main())
