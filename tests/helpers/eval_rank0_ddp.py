"""Run by tests/core/test_loops.py under two processes (``python -m tests.helpers.torchrun --standalone
--nproc_per_node 2 -m tests.helpers.eval_rank0_ddp OUT_DIR``): a plain DDP loop under ``ChannelsLastRun`` trains 2
steps, then rank 0 alone evaluates (``if rank == 0:``, a common pattern), then the ranks meet and train on. Every rank
writes ``OUT_DIR/rank<N>.json`` with its checks' verdicts and its conv weights' layout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from cltrain.loops import ChannelsLastRun


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = ChannelsLastRun(model, optimizer, step=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    wrapped = DistributedDataParallel(model)
    g = torch.Generator().manual_seed(rank)
    data = TensorDataset(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
    for round_ in range(2):
        for x, y in run.batches(DataLoader(data, batch_size=4)):
            F.cross_entropy(wrapped(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        if rank == 0:  # the evaluation on rank 0 alone
            with torch.no_grad():
                for x, _ in run.batches(DataLoader(data, batch_size=4), train=False):
                    model(x)
        dist.barrier()
    run.end()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "checks": {k: c.verdict for k, c in run.layout_checks.items()},
        "weights_cl": model[0].weight.is_contiguous(memory_format=torch.channels_last)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
