"""Run by tests/core/test_ddp_grads.py: a plain DDP loop through ``ChannelsLastRun``, two processes on the CPU (gloo),
with every step's gradient compared to the right one: an NCHW reference holding the model's weights of that step,
stepped on both ranks' batches. Each rank writes ``OUT_DIR/rank<N>.json``: per step, the layout of the first conv's
weight and its gradient's relative error; the run's lines.

    python -m tests.helpers.ddp_grads SCENARIO[,SCENARIO...] OUT_DIR [--no-rebuild | --old-torch]

The scenarios (run one after another in the same two processes, each with its own model and DDP):

* ``race``: a model slower in channels_last: the race switches every rank to NCHW after DDP wrapped it;
* ``sizes``: the ``race`` model, rank 0 on 16 px images and rank 1 on 24 px at every step (multi-scale training);
* ``verdict``: a model whose own forward reads its input's memory as NCHW: the first batch's check puts the whole
  model in NCHW, after DDP wrapped it;
* ``unused``: the ``race`` model under ``DDP(find_unused_parameters=True)``, which never builds its buckets again by
  itself (it gets a new reducer).
* ``late``: the ``race`` model, ``ChannelsLastRun`` given the ``DDP(find_unused_parameters=True)`` already made: the
  conversion restrides the parameters under DDP's buckets;
* ``alone``: the ``race`` model in a DDP of one rank (``torchrun --nproc_per_node=1``, ``Fabric(strategy="ddp",
  devices=1)``): its buckets follow every change of layout too (launched alone, in one process);
* ``accelerate``: the ``race`` model through Accelerate's door (``prepare_channels_last``, then ``accelerator.prepare``),
  whose forward hook switches the layout inside DDP's forward, under ``find_unused_parameters=True`` (a new reducer
  there) and without it (``race``'s buckets built again), one after the other; then with BatchNorm (DDP broadcasts
  its buffers at each forward) and an evaluation on rank 0 alone after each step.

``--no-rebuild``: DDP's buckets are not built again after a layout change (the negative control: wrong gradients).
``--old-torch``: a torch whose DDP lacks a private method ``cltrain.ddp`` needs: the layouts are not raced.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from tests.helpers.plain_modules import SlowIn, steady_clock
from tests.helpers.user_code import SpaceToDepth

STEPS, SIZE = 20, 16


class _RawStem(nn.Module):
    """Its own forward reads the input's memory as NCHW (no submodule to blame): the whole model is kept in NCHW."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(12, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(SpaceToDepth()(x)).mean((2, 3)))


def _model(scenario: str) -> nn.Module:
    torch.manual_seed(0)
    if scenario == "verdict":
        return _RawStem()
    scenario = "race" if scenario == "sizes" else scenario
    norm = nn.BatchNorm2d(8) if scenario == "batchnorm" else nn.Identity()
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm, nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    return SlowIn("channels_last", net=net, seconds=0.3)


def _rank(rank: int, port: int, scenario: str, out: str, flag: str) -> None:
    with steady_clock():
        _scenarios(rank, port, scenario, out, flag)


def _scenarios(rank: int, port: int, scenario: str, out: str, flag: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("cltrain").addHandler(handler)
    logging.getLogger("cltrain").setLevel(logging.INFO)
    if flag == "--no-rebuild":
        import cltrain.session

        cltrain.session.rebuild_buckets = lambda ddps: None  # claims done, builds nothing
    elif flag == "--old-torch":
        import cltrain.ddp

        cltrain.ddp._RESET += ("_not_in_this_torch",)
        cltrain.ddp._NEW += ("_not_in_this_torch",)
    from cltrain.loops import ChannelsLastRun

    runs = {}
    if scenario == "accelerate":
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
        runs = {f"unused={unused}": _accelerate(unused) for unused in (True, False)}
        runs["eval0"] = _accelerate(False, "batchnorm")
    else:
        dist.init_process_group("gloo", rank=rank, world_size=_world(scenario))
    for scenario in [] if scenario == "accelerate" else scenario.split(","):
        model = _model(scenario)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        late = scenario == "late"  # the door made after DDP, given it; else the door first, as the guide says
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if late else None
        run = ChannelsLastRun(ddp or model, optimizer, step=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        ddp = ddp or nn.parallel.DistributedDataParallel(model, find_unused_parameters=scenario == "unused")
        steps = _train(scenario, model, ddp, optimizer, run.batches, rank)
        run.end()
        runs[scenario] = _summary(steps, run.session)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"runs": runs, "lines": lines}))
    dist.destroy_process_group()


def _summary(steps: list[dict], session) -> dict:
    decision = session.decision
    return {"steps": steps, "decision": decision.layout if decision is not None else None,
            "verdict": session.layout_checks["train"].verdict}


def _accelerate(unused: bool, scenario: str = "race") -> dict:
    from accelerate import Accelerator, DistributedDataParallelKwargs

    from cltrain.integrations.accelerate import prepare_channels_last
    from cltrain.integrations.inputs_hook import ChannelsLastInputs

    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=unused)])
    model = _model(scenario)
    prepare_channels_last(model, accelerator)
    ddp, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert isinstance(ddp, nn.parallel.DistributedDataParallel) and ddp.find_unused_parameters == unused
    steps = _train(scenario, model, ddp, optimizer, iter, accelerator.process_index,
                   evaluate=scenario == "batchnorm" and accelerator.is_main_process)
    return _summary(steps, ChannelsLastInputs.of(model).session)


def _train(scenario: str, model: nn.Module, ddp: nn.Module, optimizer, batches_of, rank: int,
           evaluate: bool = False) -> list[dict]:
    """``STEPS`` steps of ``ddp`` on this rank's half of each batch, each gradient against the reference's; with
    ``evaluate``, an evaluation of the model on this rank alone after each step."""
    reference = _model(scenario)  # NCHW, with no door's hooks; given the model's weights each step
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    sizes = (SIZE, SIZE + 8) if scenario == "sizes" else (SIZE, SIZE)  # each rank's image size
    batches = [[(torch.randn(2, 3, s, s, generator=g), torch.randint(0, 4, (2,), generator=g)) for s in sizes]
               for _ in range(STEPS)]
    mine = [(ranks[rank][0].clone(), ranks[rank][1]) for ranks in batches]
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    ref_conv = next(m for m in reference.modules() if isinstance(m, nn.Conv2d))
    steps = []
    for i, (x, y) in enumerate(batches_of(mine)):
        reference.load_state_dict(model.state_dict())
        reference.zero_grad()
        (sum(F.cross_entropy(reference(rx), ry) for rx, ry in batches[i][:world]) / world).backward()
        F.cross_entropy(ddp(x), y).backward()
        got, want = conv.weight.grad, ref_conv.weight.grad
        steps.append({"nchw": conv.weight.is_contiguous(), "error": float((got - want).norm() / want.norm())})
        optimizer.step()
        optimizer.zero_grad()
        if evaluate:
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
    return steps


def main(scenario: str, out: str, flag: str = "") -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, scenario, out, flag), nprocs=_world(scenario))


def _world(scenarios: str) -> int:
    return 1 if scenarios == "alone" else 2


if __name__ == "__main__":
    main(*sys.argv[1:4])
