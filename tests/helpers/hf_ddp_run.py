"""Two Hugging Face ``Trainer`` runs of a model whose head assumes NCHW, in one DDP process group (gloo, CPU):
without cltrain, then with ``ChannelsLastCallback``. Each rank writes ``rank<N>.json`` into OUTDIR.

Run as ``python -m torch.distributed.run --nproc_per_node 2 -m tests.helpers.hf_ddp_run OUTDIR``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from cltrain.integrations.transformers import ChannelsLastCallback
from tests.helpers.hf_trainer_run import Probe, trainer
from tests.integrations.test_transformers import FlattenWithView


def run(out: Path, callbacks: list) -> dict:
    torch.manual_seed(0)
    model = FlattenWithView()
    probe = Probe(model)
    fitted = trainer("resnet", out, model, callbacks, ddp_backend="gloo", max_steps=2)
    fitted.train()
    return {"losses": probe.losses, "wrapped": type(fitted.model_wrapped).__name__,
            "weights": [p.detach().tolist() for p in model.parameters()]}


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    nchw = run(out / "nchw", [])
    callback = ChannelsLastCallback()
    checked = run(out / "checked", [callback])
    check = callback.layout_checks["train"]
    result = {"nchw": nchw, "checked": checked, "verdict": check.verdict,
              "fallbacks": [str(f) for f in check.fallbacks]}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
