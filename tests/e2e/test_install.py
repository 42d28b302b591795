"""The built wheel, installed as a user installs it: non-editable, into fresh virtual environments.

* The full install trains from an unrelated folder that holds some other project's
  ``conf/config.yaml``: the app uses its own configs, never the current folder's.
* ``pip install cltrain`` on the oldest torch and Lightning it claims (torch 2.13, Lightning 2.6.0)
  imports ``ChannelsLast`` and trains under it, without Hydra, torchvision or matplotlib.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, demo_overrides

pytestmark = pytest.mark.slow

FOREIGN_CONFIG = "# another project's Hydra config\ndefaults:\n  - _self_\nproject: not-cltrain\nlr: 3\n"


def _run(args: list[str], cwd: Path, timeout: int = 900, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CLTRAIN_CONFIG_DIR")}
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**clean, **env})
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    source = tmp_path_factory.mktemp("source")  # a copy: building writes build/ and *.egg-info beside the sources
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    for name in ("cltrain", "conf"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(source)], cwd=source)
    (found,) = out.glob("cltrain-*.whl")
    return found


def _venv(path: Path, inherit: bool) -> Path:
    """A fresh virtual environment at ``path`` (its ``bin/``); with ``inherit`` it also imports what the
    environment running these tests has installed (torch, Lightning, Hydra, ...), after its own packages."""
    venv.EnvBuilder(with_pip=True).create(path)
    if inherit:
        # system_site_packages=True would add the *base* interpreter's site-packages, which lack torch when
        # the tests run in a virtual environment: list the running interpreter's site directories instead.
        # As plain lines their own .pth files stay unread, so the checkout's editable install is not importable
        # there and `cltrain` can only be the wheel installed into the new environment.
        site_dirs = [d for d in (*site.getsitepackages(), site.getusersitepackages()) if d in sys.path]
        purelib = _run([str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       cwd=path).stdout.strip()
        (Path(purelib) / "_tests_environment.pth").write_text("".join(f"{d}\n" for d in site_dirs))
    return path / "bin"


def test_the_wheel_trains_from_a_folder_with_another_projects_config(wheel: Path, tmp_path: Path,
                                                                    demo_root: Path) -> None:
    bin_dir = _venv(tmp_path / "venv", inherit=True)  # the dependencies come from the environment running the tests
    _run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)], cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "conf").mkdir(parents=True)
    (elsewhere / "conf" / "config.yaml").write_text(FOREIGN_CONFIG)

    where = _run([str(bin_dir / "python"), "-c", "import cltrain, importlib.resources as r, torch; "
                  "print(cltrain.__file__); print(r.files('cltrain.conf')); print(torch.__file__)"],
                 cwd=elsewhere).stdout.split()
    assert all(Path(p).is_relative_to(tmp_path / "venv") for p in where[:2]), where  # the wheel, not the checkout
    assert Path(where[2]).resolve() == Path(torch.__file__).resolve(), where  # torch: the one running these tests

    run_dir = elsewhere / "run"
    _run([str(bin_dir / "cltrain-train"), "experiment=smoke", *demo_overrides(demo_root), f"run_dir={run_dir}",
          "device=cpu", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
          "trainer.enable_progress_bar=false"], cwd=elsewhere)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["global_step"] == 2
    assert Path(metrics["last_checkpoint"]).is_file()
    job = metrics["config"]  # what the run composed: the wheel's config, not the folder's
    assert job["channels_last"] is True and job["optim"]["name"] == "sgd" and "not-cltrain" not in json.dumps(job)


MINIMAL_TRAINING = """
import importlib.util, sys
import lightning as L, torch
from torch import nn
from cltrain import ChannelsLast, is_channels_last
assert all(importlib.util.find_spec(m) is None for m in ("hydra", "torchvision", "matplotlib", "omegaconf")), sys.modules

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(8, 2))
    def training_step(self, batch, i):
        x, y = batch
        assert is_channels_last(x) and is_channels_last(self.net[0].weight)
        return nn.functional.cross_entropy(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = torch.utils.data.TensorDataset(torch.randn(8, 3, 16, 16), torch.randint(0, 2, (8,)))
trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, callbacks=[ChannelsLast()])
trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=4))
print("trained", trainer.global_step, torch.__version__, L.__version__)
"""


@pytest.mark.long  # downloads torch 2.13 (about a minute): python -m pytest -m long
def test_the_library_alone_on_its_oldest_torch_and_lightning(wheel: Path, tmp_path: Path) -> None:
    bin_dir = _venv(tmp_path / "venv", inherit=False)
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--quiet"]
    _run([*pip, "torch==2.13.0", "lightning==2.6.0"], cwd=tmp_path)
    _run([*pip, str(wheel)], cwd=tmp_path)  # its dependencies are already there: nothing else comes in
    out = _run([str(bin_dir / "python"), "-c", MINIMAL_TRAINING], cwd=tmp_path).stdout
    assert "trained 2 2.13.0" in out and " 2.6.0" in out
