"""Run by test_callback_ddp.py: a real two-process DDP fit on CPU (gloo) through Lightning.

    python -m tests.helpers.ddp_run OUT_DIR callback|late|user:PATTERN [...]

Each fit (one after another in the same two processes) has every rank write OUT_DIR/<fit>/rank<N>.json (``:``
as ``-`` in the folder's name) with the layout of its parameters and gradients and the warnings it saw. "late" converts only after DDP has wrapped the model (the pitfall of
pytorch#47163), to show the check can fail. "user:PATTERN" trains one of ``tests.helpers.user_code``'s
projects whose code assumes NCHW, under ``ChannelsLast()``. "race" trains 12 steps of a model whose channels_last
steps are slow: every rank switches to NCHW at the same step, on rank 0's decision.
"""

import json
import sys
import warnings
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer

from cltrain import ChannelsLast, is_channels_last, to_channels_last
from tests.helpers.plain_modules import Classifier, SlowIn, loader, steady_clock
from tests.helpers import warm


class Probe(Callback):
    def __init__(self):
        self.grads_match = []
        self.params_cl = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        four_d = [p for p in pl_module.parameters() if p.dim() == 4]
        self.params_cl.append(all(is_channels_last(p) for p in four_d))
        self.grads_match.append(all(p.grad is not None and p.grad.stride() == p.stride() for p in four_d))


class LateConversion(Callback):
    def on_train_start(self, trainer, pl_module):
        to_channels_last(pl_module)


def main(out: Path, how: str) -> None:
    from tests.helpers import user_code

    out = out / how.replace(":", "-")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    probe = Probe()
    first = {"late": LateConversion()}
    callbacks = [first.get(how) or ChannelsLast(), probe]
    module, data = Classifier(), loader(24, 4)
    if how == "race":
        module, data = Classifier(net=SlowIn("channels_last", seconds=0.2)), loader(48, 2)
    if how.startswith("user:"):
        pattern = how.split(":", 1)[1]
        module, data = user_code.PATTERNS[pattern](), user_code.data(pattern)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=12 if how == "race" else 3, logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    rank = trainer.global_rank
    result = {
        "rank": rank,
        "world_size": trainer.world_size,
        "steps": trainer.global_step,
        "params_cl": probe.params_cl,
        "grads_match": probe.grads_match,
        "warnings": [str(w.message) for w in seen],
        "losses": getattr(module, "losses", None),
        "layout": callbacks[0].layout if how != "late" else None,
        "fallbacks": [f.as_dict() for f in callbacks[0].fallbacks] if how != "late" else None,
        "checks": {k: c.verdict for k, c in callbacks[0].layout_checks.items()} if how != "late" else None,
        "timings": callbacks[0].timings if how == "race" else None,
        "params_nchw_at_end": all(p.is_contiguous() for p in module.parameters() if p.dim() == 4),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    warm.lightning_ranks_forked()
    for fit in sys.argv[2:] or ["callback"]:
        with steady_clock():
            main(Path(sys.argv[1]), fit)
