"""scripts/bench_shards.py (the paired check, the loader rounds, the machine) and scripts/cpu_bf16_conv3d.py, at tiny settings."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cltrain.data import make_demo_dataset
from cltrain.data.pack import pack

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS.parent), os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, str(SCRIPTS / "bench_shards.py"), "--batch-size", "4", "--batches", "2",
                           "--rounds", "2", "--paired", "4", "--size", "32", *args],
                          capture_output=True, text=True, env=env, timeout=300)


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


def test_cpu_bf16_conv3d_counts_each_dtype_and_layout() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(SCRIPTS / "cpu_bf16_conv3d.py"), "--calls", "3", "--shape", "2", "8", "2", "4", "4"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(r"^(bfloat16|float32) (contiguous|channels_last_3d): (\d) of 3 calls non-finite", out.stdout, re.M)
    assert [r[:2] for r in rows] == [("bfloat16", "contiguous"), ("bfloat16", "channels_last_3d"), ("float32", "contiguous")]
    assert rows[2][2] == "0" and "Machine:" in out.stdout  # fp32 is finite
