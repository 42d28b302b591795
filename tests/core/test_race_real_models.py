"""The default's race of the layouts on real models whose faster layout is known on every CPU kind these machines
have (AVX-512 BF16, AMX, AVX2), each fit in a process of its own, a real ``Trainer``, real timings.

* ``ConvStack(norm="instance", kernel=1)``: an image-to-image generator's blocks (conv, InstanceNorm, ReLU). CPU
  ``InstanceNorm2d`` normalises a ``(1, N*C, H, W)`` view of its input, which a channels_last tensor cannot give
  without a copy each way: with 1x1 convs, 1.43x slower in channels_last (one thread, fp32, 64 px, batch 16) on an
  AVX-512 EPYC, 1.70x with oneDNN and ATen held to AVX2. The race must switch to NCHW.
* ``ConvStack()``: 3x3 convs with BatchNorm: channels_last 0.81-0.87x of NCHW's step on the EPYC. The race must keep
  channels_last (a tie goes to the default).

Which layout is faster on a given model is a benchmark's business (``scripts/bench``); these two are chosen so that the
answer does not depend on the machine.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import REPO, warm

pytestmark = pytest.mark.slow

FIT = """
import json, sys, torch
import lightning.pytorch as pl
from cltrain import ChannelsLast
from tests.helpers.plain_modules import Classifier, ConvStack, loader
torch.set_num_threads(1)
callback = ChannelsLast()
pl.Trainer(max_steps=39, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
           enable_model_summary=False, callbacks=[callback]).fit(
    Classifier(net=ConvStack(norm=sys.argv[1], kernel=1 if sys.argv[1] == "instance" else 3)), loader(16 * 39, 16, size=64))
decision = callback.decision
print(json.dumps({"layout": callback.layout, "decision": decision.as_dict() if decision else None}))
"""


def _fit(model: str) -> dict:
    proc = warm.run([sys.executable, "-c", FIT, model], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["decision"] is not None and result["layout"] == result["decision"]["layout"], result
    return result


@pytest.mark.parametrize("model, kept", [("instance", "contiguous"), ("batch", "channels_last")])
def test_the_default_keeps_the_faster_layout_of_a_real_model(model, kept) -> None:
    """The fit keeps the faster layout; after a fit that did not, the next two must: the tests' other worker shares
    the cores, and a fit it made too noisy to tell keeps the default (as the race does on any busy machine)."""
    first = _fit(model)
    if first["layout"] != kept:
        again = [_fit(model), _fit(model)]
        assert all(r["layout"] == kept for r in again), [first, *again]
