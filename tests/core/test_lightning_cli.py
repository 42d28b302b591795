"""`--trainer.callbacks+=cltrain.ChannelsLast` on a LightningCLI app written without cltrain."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from tests.helpers import warm

pytestmark = pytest.mark.slow

APP = Path(__file__).resolve().parents[1] / "helpers" / "lightning_cli_app.py"


def _fit(*args: str, cwd: Path, package: str = "lightning", ok: bool = True) -> str:
    result = warm.run([sys.executable, str(APP), "fit", "--trainer.max_steps=2", *args], capture_output=True,
                      text=True, timeout=300, cwd=cwd, env={**os.environ, "CLI_PACKAGE": package, "PYTHONWARNINGS": ""})
    assert (result.returncode == 0) == ok, result.stderr[-2000:]
    return result.stdout if "--print_config" in args else result.stdout + result.stderr


def test_channels_last_added_from_the_lightning_cli(tmp_path: Path) -> None:
    pytest.importorskip("jsonargparse")
    out = _fit("--trainer.callbacks+=cltrain.ChannelsLast", cwd=tmp_path)
    assert "step 0: weight_cl=True batch_cl=True" in out and "step 1: weight_cl=True batch_cl=True" in out
    # the config the CLI prints (and saves) runs again: a default of () was written "Unable to serialize instance []"
    saved = tmp_path / "config.yaml"
    saved.write_text(_fit("--trainer.callbacks+=cltrain.ChannelsLast", "--print_config", cwd=tmp_path))
    assert "ChannelsLast" in saved.read_text() and "Unable" not in saved.read_text()
    assert "step 0: weight_cl=True batch_cl=True" in _fit("--config", str(saved), cwd=tmp_path)
    # its arguments too: mode=conv converts only the convolution weights, inputs untouched
    out = _fit("--trainer.callbacks+=cltrain.ChannelsLast", "--trainer.callbacks.mode=conv",
               "--trainer.callbacks.convert_inputs=false", cwd=tmp_path)
    assert "step 0: weight_cl=True batch_cl=False" in out


def test_without_the_callback_nothing_is_channels_last(tmp_path: Path) -> None:  # the control
    pytest.importorskip("jsonargparse")
    assert "step 0: weight_cl=False batch_cl=False" in _fit(cwd=tmp_path)


def test_the_standalone_package_s_cli_takes_cltrain_pl_channels_last(tmp_path: Path) -> None:
    pytest.importorskip("jsonargparse")
    pytest.importorskip("pytorch_lightning")
    out = _fit("--trainer.callbacks+=cltrain.pl.ChannelsLast", cwd=tmp_path, package="pytorch_lightning")
    assert "step 0: weight_cl=True batch_cl=True" in out
    # the control: the lightning package's callback class is not a pytorch_lightning Callback to its parser
    out = _fit("--trainer.callbacks+=cltrain.ChannelsLast", cwd=tmp_path, package="pytorch_lightning", ok=False)
    assert "does not correspond to a subclass of Callback" in out
