"""Two gloo processes whose training step calls ``torch.distributed.all_gather`` (a contrastive loss's negatives from
every rank), behind the plain loop's door or the Lightning callback (``python -m tests.helpers.collective_step plain|
lightning``). Each rank prints ``FINISHED`` at the end; rank 0 prints the door's lines."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=8),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def gathered_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    z = model(x)
    every = [torch.empty_like(z) for _ in range(dist.get_world_size())]
    dist.all_gather(every, z.detach())
    return F.cross_entropy(z, y) + 0.0 * torch.cat(every).sum()


def _batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(dist.get_rank())
    return [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(n)]


def _plain() -> None:
    from cltrain.loops import ChannelsLastRun

    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = ChannelsLastRun(model, optimizer, step=gathered_loss, layout="channels_last")
    ddp = nn.parallel.DistributedDataParallel(model)
    for batch in run.batches(_batches()):
        gathered_loss(ddp, batch).backward()
        optimizer.step()
        optimizer.zero_grad()


def _lightning() -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from cltrain import ChannelsLast

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
            return gathered_loss(self.net, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    pl.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False,
               callbacks=[ChannelsLast(layout="channels_last")]).fit(Module(), DataLoader(TensorDataset(*map(
                   torch.cat, zip(*_batches()))), batch_size=4))


def _worker(rank: int, port: int, door: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    _plain() if door == "plain" else _lightning()
    print(f"FINISHED rank {rank}", flush=True)
    dist.barrier()
    os._exit(0)  # gloo's and DDP's threads torn down at exit aborted a process now and then ("terminate called")


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(_worker, args=(free, sys.argv[1]), nprocs=2)
