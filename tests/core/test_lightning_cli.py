"""`--trainer.callbacks+=cltrain.ChannelsLast` on a LightningCLI app written without cltrain."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tests.helpers import warm

pytestmark = pytest.mark.slow

APP = Path(__file__).resolve().parents[1] / "helpers" / "lightning_cli_app.py"


def _fit(*args: str, cwd: Path) -> str:
    result = warm.run([sys.executable, str(APP), "fit", "--trainer.max_steps=2", *args],
                      capture_output=True, text=True, timeout=300, cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_channels_last_added_from_the_lightning_cli(tmp_path: Path) -> None:
    pytest.importorskip("jsonargparse")
    out = _fit("--trainer.callbacks+=cltrain.ChannelsLast", cwd=tmp_path)
    assert "step 0: weight_cl=True batch_cl=True" in out and "step 1: weight_cl=True batch_cl=True" in out
    # its arguments too: mode=conv converts only the convolution weights, inputs untouched
    out = _fit("--trainer.callbacks+=cltrain.ChannelsLast", "--trainer.callbacks.mode=conv",
               "--trainer.callbacks.convert_inputs=false", cwd=tmp_path)
    assert "step 0: weight_cl=True batch_cl=False" in out


def test_without_the_callback_nothing_is_channels_last(tmp_path: Path) -> None:  # the control
    pytest.importorskip("jsonargparse")
    assert "step 0: weight_cl=False batch_cl=False" in _fit(cwd=tmp_path)
