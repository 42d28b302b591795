"""scripts.bench.shards at tiny settings: the paired check, the loader rounds, the machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cltrain.data import make_demo_dataset
from cltrain.data.pack import pack
from tests.helpers import REPO
from tests.helpers import warm


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return warm.run([sys.executable, "-m", "scripts.bench.shards", "--batch-size", "4", "--batches", "2",
                     "--rounds", "2", "--paired", "4", "--size", "32", *args],
                    cwd=REPO, capture_output=True, text=True, env=env, timeout=300)


def test_bench_shards_prints_paired_and_loader_ratios(tmp_path: Path) -> None:
    pytest.importorskip("webdataset")  # the packer
    root = make_demo_dataset(tmp_path / "demo", num_classes=2, train_per_class=8, val_per_class=2, image_size=(64, 48))
    out = _run("--root", str(root), "--pack", str(tmp_path / "pack"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"paired, same images and crops, 4 batches in one thread: shards/files \d+\.\d{3}x", out.stdout)
    assert re.search(r"round 0 \(files first\).*shards/files \d+\.\d\dx", out.stdout)
    assert re.search(r"round 1 \(shards first\)", out.stdout)
    assert "median shards/files" in out.stdout and "Machine:" in out.stdout
    assert (tmp_path / "pack" / "shards.json").is_file()  # packed on first use


def test_bench_shards_refuses_a_pack_of_other_images(tmp_path: Path) -> None:
    pytest.importorskip("webdataset")  # the packer
    root = make_demo_dataset(tmp_path / "demo", num_classes=2, train_per_class=8, val_per_class=2, image_size=(64, 48))
    other = make_demo_dataset(tmp_path / "other", num_classes=2, train_per_class=8, val_per_class=2, image_size=(64, 48), seed=1)
    pack(other, tmp_path / "pack", progress=False)
    out = _run("--root", str(root), "--pack", str(tmp_path / "pack"))
    assert out.returncode != 0 and "does not hold the folder's images" in out.stdout + out.stderr
