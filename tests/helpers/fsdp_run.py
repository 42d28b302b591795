"""Run by tests/core/test_sharding.py: FSDP2 (``fully_shard``) in two gloo processes on the CPU, without and with
cltrain, under one engine per call. Every rank writes OUT_DIR/rank<N>.json.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.helpers.fsdp_run OUT_DIR ENGINE

ENGINE is ``loop`` (a plain loop calling ``fully_shard``; also the old order as the negative control:
``convert_model`` without ``sharded=True``, then ``fully_shard``), ``fabric`` (Fabric's ``ModelParallelStrategy``)
or ``lightning`` (a ``Trainer`` with ``ModelParallelStrategy``, whose ``configure_model`` calls ``fully_shard``;
also a model that arrives channels_last, under ``mode="auto"`` and ``audit=True``).
Each run records, per step, the loss and what the first convolution got: whether its input is channels_last,
whether its weight is contiguous, whether its output is channels_last (the NHWC kernel ran); and the log lines
cltrain wrote.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from cltrain.layout import is_channels_last
from cltrain.loops import ChannelsLastRun, contiguous_copy, convert_batch, convert_model, verify_layout
from tests.helpers import warm

STEPS = 3


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches: NCHW-contiguous, as a DataLoader gives them."""
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(STEPS)]


def shard(net: nn.Module, mesh: Any = None) -> nn.Module:
    """FSDP2's usual wrapping: each convolution, then the root."""
    for module in net.modules():
        if isinstance(module, nn.Conv2d):
            fully_shard(module, mesh=mesh)
    return fully_shard(net, mesh=mesh)


class FirstConv:
    """What the first convolution gets on each call: its input's and weight's layout, and its output's."""

    def __init__(self, net: nn.Module) -> None:
        self.calls: list[dict[str, bool]] = []
        conv = next(m for m in net.modules() if isinstance(m, nn.Conv2d))
        # Registered after fully_shard: FSDP2's own pre-hook (the all-gather) runs first, so `weight` is what
        # the convolution computes with.
        self.handles = [conv.register_forward_pre_hook(self.before), conv.register_forward_hook(self.after)]

    def before(self, module: nn.Module, args: tuple) -> None:
        weight = module.weight
        self.calls.append({"input_cl": is_channels_last(args[0]), "weight_contiguous": weight.is_contiguous(),
                           "weight_plain": not isinstance(weight, torch.distributed.tensor.DTensor)})

    def after(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.calls[-1]["output_cl"] = is_channels_last(output)


class Lines(logging.Handler):
    """The messages of cltrain's log lines (and Lightning's rank-zero ones, which carry the callback's)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        for name in ("cltrain", "lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
            logging.getLogger(name).addHandler(self)
            logging.getLogger(name).setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def train(model: nn.Module, data: list, channels_last: bool, backward: Any = None) -> dict[str, Any]:
    probe = FirstConv(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for batch in data:
        x, y = convert_batch(tuple(t.clone() for t in batch)) if channels_last else batch
        loss = step(model, (x, y))
        (backward or torch.Tensor.backward)(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    for handle in probe.handles:
        handle.remove()
    return {"losses": losses, "first_conv": probe.calls}


def run_loop(rank: int, lines: Lines) -> dict[str, Any]:
    result: dict[str, Any] = {}
    try:  # the negative control: the order the loops guide gave for unsharded models
        shard(convert_model(tiny_net()))
        result["old_order"] = None
    except NotImplementedError as error:
        result["old_order"] = str(error)
    result["nchw"] = train(shard(tiny_net()), batches(rank), channels_last=False)
    model = convert_model(tiny_net(), sharded=True)
    check_batch = convert_batch(batches(0)[0])  # the same batch on every rank: the same verdict
    result["check_before"] = verify_layout(model, check_batch, step).verdict
    shard(model)
    result["cltrain"] = train(model, batches(rank), channels_last=True)
    after = verify_layout(model, check_batch, step)  # sharded now: not checked, and says how instead
    result["check_after"] = {"verdict": after.verdict, "reason": after.reason}
    convert_model(model)  # on a sharded model: the engine's layout is kept
    result["after_convert"] = train(model, batches(rank)[:1], channels_last=True)["first_conv"]
    try:
        contiguous_copy(model)
        result["copy"] = None
    except ValueError as error:
        result["copy"] = str(error)
    result["lines"] = list(lines.lines)
    # a ChannelsLastRun made before fully_shard (sharded=True): its check names the engine that sharded the model
    model = tiny_net()
    run = ChannelsLastRun(model, step=step, sharded=True)
    shard(model)
    run.optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    for x, y in run.batches(batches(rank)[:1]):
        step(model, (x, y)).backward()
        run.optimizers[0].step()
    result["run_check"] = {"verdict": run.layout_checks["train"].verdict, "reason": run.layout_checks["train"].reason,
                           "sharding": run.session.sharding}
    return result


def run_fabric(rank: int, lines: Lines) -> dict[str, Any]:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(lambda model, mesh: shard(model, mesh["data_parallel"]),
                                     data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    result: dict[str, Any] = {}
    result["nchw"] = train(fabric.setup_module(tiny_net()), batches(rank), False, fabric.backward)
    model = convert_model(tiny_net(), sharded=True)
    result["check_before"] = verify_layout(model, convert_batch(batches(0)[0]), step).verdict
    result["cltrain"] = train(fabric.setup_module(model), batches(rank), True, fabric.backward)
    result["lines"] = lines.lines
    return result


def run_lightning(rank: int, lines: Lines) -> dict[str, Any]:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    from cltrain import ChannelsLast

    class Sharded(LightningModule):
        def __init__(self, channels_last: bool = False) -> None:
            super().__init__()
            self.net = tiny_net()
            if channels_last:  # the PyTorch tutorial's advice, which fully_shard refuses
                self.net.to(memory_format=torch.channels_last)
            self.losses: list[float] = []
            self.probe: FirstConv | None = None

        def configure_model(self) -> None:
            shard(self.net, self.device_mesh["data_parallel"])
            self.probe = FirstConv(self.net)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = step(self.net, batch)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def fit(callbacks: list, module: Sharded) -> dict[str, Any]:
        trainer = Trainer(accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
                          strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                          enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                          use_distributed_sampler=False)  # each rank has its own batches already
        trainer.fit(module, DataLoader(batches(rank), batch_size=None, shuffle=False))
        return {"losses": module.losses, "first_conv": module.probe.calls}

    result: dict[str, Any] = {"nchw": fit([], Sharded())}
    callback = ChannelsLast()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result["cltrain"] = fit([callback], Sharded())
    # A model that arrives channels_last: the callback's setup gives fully_shard contiguous parameters. The race of the
    # layouts and audit=True, which would copy or restride the model: neither runs, and neither ends the run.
    with warnings.catch_warnings(record=True) as seen_auto:
        warnings.simplefilter("always")
        auto = ChannelsLast(audit=True)
        result["arrived_cl"] = fit([auto], Sharded(channels_last=True))
    result["auto"] = {"layout": auto.layout, "timings": auto.timings, "check": auto.layout_checks["train"].verdict,
                      "warnings": [str(w.message) for w in seen_auto if "ChannelsLast" in str(w.message)]}
    result["sharding"] = callback.sharding
    result["check"] = {k: {"verdict": c.verdict, "reason": c.reason} for k, c in callback.layout_checks.items()}
    result["lines"] = lines.lines
    result["warnings"] = [str(w.message) for w in seen]
    return result


def main(out: Path, engine: str) -> None:
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    torch.set_num_threads(1)
    lines = Lines()
    if engine == "loop":  # Fabric and Lightning start the process group themselves
        dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    result = {"loop": run_loop, "fabric": run_fabric, "lightning": run_lightning}[engine](rank, lines)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():  # a gloo group left to the interpreter's exit can abort ("terminate called ...")
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    warm.lightning_ranks_forked()
    main(Path(sys.argv[1]), sys.argv[2])
