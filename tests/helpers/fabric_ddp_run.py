"""Run by test_loops.py: a real two-process DDP loop on CPU (gloo) through Lightning Fabric.

    python -m tests.helpers.fabric_ddp_run OUT_DIR [before|after]     # from the repository root

``before`` converts with :func:`cltrain.loops.convert_model` before ``fabric.setup`` (the way it
is meant to be used); ``after`` restrides once Fabric has wrapped the model in DDP (the pitfall of
pytorch#47163), to show the check can fail. Every rank writes OUT_DIR/rank<N>.json with the
layout of its parameters and gradients and the warnings it saw.
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
from cltrain.loops import convert_batch, convert_model
from tests.helpers.plain_modules import loader
from tests.helpers import warm


def main(out: Path, when: str) -> None:
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
