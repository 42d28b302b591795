"""ChannelsLast under the standalone ``pytorch_lightning`` package, as lightly's own modules and many older
projects use it (``tests/helpers/pl_standalone_run.py``, in its own process)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from tests.helpers import REPO
from tests.helpers import warm


@pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None, reason="pytorch_lightning is not installed")
def test_the_check_finds_the_view_and_training_matches_nchw_under_pytorch_lightning():
    proc = warm.run([sys.executable, "-m", "tests.helpers.pl_standalone_run"], cwd=REPO, capture_output=True,
                    text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    assert run["verdict"] in ("fallback", "contiguous") and "`net`" in run["line"] and "view" in run["line"], run
    torch.testing.assert_close(run["losses"], run["reference"], rtol=1e-5, atol=1e-6)
    if run["verdict"] == "fallback":
        assert run["conv_cl"] and run["swa_conv_cl"]  # the SWA copy follows the model's layout
    assert run["control"] and "view size is not compatible" in run["control"]  # without the check it raises


def test_the_standalone_package_s_trainer_takes_cltrain_pl_atomic_checkpoint_io(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    from cltrain import AtomicCheckpointIO
    from cltrain.pl import AtomicCheckpointIO as ForPytorchLightning

    with pytest.raises(MisconfigurationException, match="Found invalid type for plugin"):  # the control
        pl.Trainer(plugins=[AtomicCheckpointIO()], logger=False, accelerator="cpu")
    trainer = pl.Trainer(plugins=[ForPytorchLightning()], logger=False, accelerator="cpu")
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    trainer.strategy.checkpoint_io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    assert torch.equal(trainer.strategy.checkpoint_io.load_checkpoint(tmp_path / "a.ckpt")["w"], torch.ones(2))
