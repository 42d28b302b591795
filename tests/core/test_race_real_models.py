"""The default's race of the layouts on real models whose faster layout is known on every CPU kind these machines
have (AVX-512 BF16, AMX, AVX2), each fit in a process of its own, a real ``Trainer``, real timings.

* ``ConvStack(norm="instance")``: an image-to-image generator's blocks (conv, InstanceNorm, ReLU). CPU
  ``InstanceNorm2d`` normalises a ``(1, N*C, H, W)`` view of its input, which a channels_last tensor cannot give
  without a copy each way: 1.24x slower in channels_last (fp32, 64 px, batch 16) on an AVX-512 EPYC, 1.34x with oneDNN
  held to AVX2 (``python -m scripts.bench.default_speed`` has the figures). The race must switch to NCHW.
* ``ConvStack()``: the same blocks with BatchNorm: channels_last 0.9x of NCHW's step on the EPYC, a tie with AVX2.
  The race must keep channels_last (a tie goes to the default).

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
    Classifier(net=ConvStack(norm=sys.argv[1])), loader(16 * 39, 16, size=64))
decision = callback.decision
print(json.dumps({"layout": callback.layout, "decision": decision.as_dict() if decision else None}))
"""


@pytest.mark.parametrize("model, kept", [("instance", "contiguous"), ("batch", "channels_last")])
def test_the_default_keeps_the_faster_layout_of_a_real_model(model, kept) -> None:
    proc = warm.run([sys.executable, "-c", FIT, model], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["decision"] is not None and result["decision"]["layout"] == kept, result
    assert result["layout"] == kept
