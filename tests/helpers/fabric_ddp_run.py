"""Run by test_loops.py: a real two-process DDP loop on CPU (gloo) through Lightning Fabric.

    python -m tests.helpers.fabric_ddp_run OUT_DIR [before|after|united|alone]     # from the repository root

``before`` converts with :func:`cltrain.loops.convert_model` before ``fabric.setup`` (the way it
is meant to be used); ``after`` restrides once Fabric has wrapped the model in DDP (the pitfall of
pytorch#47163), to show the check can fail. Every rank writes OUT_DIR/rank<N>.json with the
layout of its parameters and gradients and the warnings it saw.

``united`` trains an 8-channel 1x1 stride-2 stem (a Conv2d subclass: its guard puts its weight in NCHW) where rank 0
sees oneDNN's AVX-512 channel block (16) and rank 1 its AVX2 one (8), as on two kinds of machine: only rank 0 finds
the stem hazardous, and ``convert_model`` guards it on both. ``alone``, the negative control, guards what each rank
finds: the ranks' weight strides differ and DDP refuses them. Both first call ``verify_layout`` on their own batch
with a step that raises in channels_last on rank 1 alone: rank 0's verdict (passed) must be every rank's, or the
ranks' strides differ again.
"""

import json
import sys
import warnings
from pathlib import Path

import torch
import torchvision
from lightning.fabric import Fabric
from torch.nn import functional as F

from cltrain import is_channels_last, to_channels_last
from cltrain.loops import convert_batch, convert_model, verify_layout
from tests.helpers.plain_modules import loader
from tests.helpers import warm


class UserConv2d(torch.nn.Conv2d):
    """A user's Conv2d subclass (its own forward): the guard keeps it and puts its weight and input in NCHW."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class EightChannelStem(torch.nn.Module):
    """8 input channels into a 1x1 stride-2 conv: below oneDNN's AVX-512 channel block (16), not its AVX2 one."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = UserConv2d(8, 16, 1, stride=2)
        self.body = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)).mean((2, 3)))


def stems(out: Path, united: bool) -> None:
    import cltrain.session
    from cltrain.guardrails import guard_of
    from cltrain.platform import Platform

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    # rank 0 as on a machine with AVX-512 (block 16), rank 1 as on one with AVX2 only (block 8), whatever this CPU is
    Platform.channel_block = property(lambda self: 16 if fabric.global_rank == 0 else 8)
    if not united:
        cltrain.session.hazards_over_ranks = lambda model, found, total: found
    torch.manual_seed(0)
    model = convert_model(EightChannelStem())
    g = torch.Generator().manual_seed(fabric.global_rank)

    def step(m: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if fabric.global_rank == 1 and is_channels_last(batch[0]):
            raise RuntimeError("planted: rank 1's batch takes a path written for NCHW")
        return F.cross_entropy(m(batch[0]), batch[1])

    check = verify_layout(model, (torch.randn(4, 8, 32, 32, generator=g), torch.randint(0, 5, (4,), generator=g)), step)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    for _ in range(2):
        x, y = convert_batch((torch.randn(4, 8, 32, 32, generator=g), torch.randint(0, 5, (4,), generator=g)))
        fabric.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    inner = model.module
    result = {"rank": fabric.global_rank, "check": check.verdict, "guarded": sorted(n for n, m in inner.named_modules() if guard_of(m)),
              "strides": {n: list(p.stride()) for n, p in inner.named_parameters() if p.dim() == 4}}
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))


def main(out: Path, when: str) -> None:
    if when in ("united", "alone"):
        return stems(out, when == "united")
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4)
    if when == "before":
        model = convert_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    if when == "after":
        to_channels_last(model)
    params_cl, grads_match, inputs_cl = [], [], []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for x, y in fabric.setup_dataloaders(loader(24, 4)):
            x, y = convert_batch((x, y))
            inputs_cl.append(is_channels_last(x))
            fabric.backward(F.cross_entropy(model(x), y))
            four_d = [p for p in model.parameters() if p.dim() == 4]
            params_cl.append(all(is_channels_last(p) for p in four_d))
            grads_match.append(all(p.grad is not None and p.grad.stride() == p.stride() for p in four_d))
            optimizer.step()
            optimizer.zero_grad()
            if len(params_cl) == 3:
                break
    result = {"rank": fabric.global_rank, "world_size": fabric.world_size, "params_cl": params_cl,
              "grads_match": grads_match, "inputs_cl": inputs_cl, "warnings": [str(w.message) for w in seen]}
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    warm.lightning_ranks_forked()
    main(Path(sys.argv[1]), sys.argv[2])
