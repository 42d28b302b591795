"""DistributedDataParallel and parameters restrided after it wrapped them: wrong gradients, in plain PyTorch.

DDP builds its gradient buckets with the strides the parameters have when it wraps them (its first-iteration rebuild
takes those of that iteration). A parameter restrided later (channels_last to NCHW through ``.data``, as a layout
switch does) gets gradients that are not the average of the ranks' gradients: torch warns that the "grad strides do
not match bucket view strides" and that "this is not an error", yet the gradient is the ranks' average permuted (the
same norm, the values of one layout in the places of the other: relative error ~1). With the buckets built again after
the switch (``--rebuild``: ``cltrain.ddp.rebuild_buckets``, what every layout change of cltrain's session does under
several ranks) the gradient is right from the switch on. Each step the reference (an NCHW model stepped on both
ranks' batches) takes the model's weights, so each error is that step's alone.

    python -m scripts.repro.ddp_restrided_grads            # 2 CPU processes (gloo): the error per step, switch at 3
    python -m scripts.repro.ddp_restrided_grads --rebuild  # the buckets built again at the switch: errors 0
    python -m scripts.repro.ddp_restrided_grads --switch 99  # never switched: the control, errors ~1e-7
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from scripts.harness import options


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def _rank(rank: int, port: int, switch: int, steps: int, rebuild: bool, errors: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, reference = _net().to(memory_format=torch.channels_last), _net()  # the reference: both ranks' batches
    ddp = nn.parallel.DistributedDataParallel(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        x, y = torch.randn(2, 4, 3, 16, 16, generator=g), torch.randint(0, 4, (2, 4), generator=g)
        if step == switch:
            for p in model.parameters():
                if p.dim() == 4:
                    p.data = p.data.clone(memory_format=torch.contiguous_format)
            if rebuild:
                from cltrain.ddp import rebuild_buckets

                assert rebuild_buckets([ddp]) is None
        with torch.no_grad():
            for p, q in zip(model.parameters(), reference.parameters()):
                q.copy_(p)
        F.cross_entropy(ddp(x[rank]), y[rank]).backward()
        (sum(F.cross_entropy(reference(x[r]), y[r]) for r in (0, 1)) / 2).backward()
        got, want = model[0].weight.grad, reference[0].weight.grad
        if rank == 0:
            errors[step] = float((got - want).norm() / want.norm())
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[int, float]:
    args = options(__doc__, switch=(3, "the step whose parameters are restrided to NCHW first"),
                   steps=(6, "training steps"),
                   rebuild=(False, "build DDP's gradient buckets again at the switch")).parse_args(argv)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    errors = mp.Manager().dict()
    mp.spawn(_rank, args=(port, args.switch, args.steps, args.rebuild, errors), nprocs=2)
    for step in sorted(errors):
        print(f"step {step}: {'NCHW' if step >= args.switch else 'channels_last'} parameters, the first conv's "
              f"gradient off the right one by {errors[step]:.2e} (relative)")
    return dict(errors)


if __name__ == "__main__":
    main()
