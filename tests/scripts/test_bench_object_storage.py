"""scripts.bench.object_storage at tiny settings: a real S3 server, the local pack and the bucket, the peers' lines;
shards against the same images as files (paired, then a pass each)."""

from __future__ import annotations

import os
import re
import sys

import pytest

from cltrain.data import make_demo_dataset
from cltrain.data.pack import pack
from tests.helpers import REPO, shm_entries, shm_left_behind, warm


@pytest.mark.slow
def test_the_benchmark_prints_each_case_against_the_local_pack(tmp_path) -> None:
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    out = warm.run([sys.executable, "-m", "scripts.bench.object_storage", "--train", "24", "--shard-size", "8",
                    "--rounds", "1", "--workers", "auto", "--work", str(tmp_path), "--cases", "local", "s3-cold", "s3-warm", "wds-fsspec"],
                   cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| case | img/s | vs local | each round | CPU s per pass: main process | workers | S3 server |" in out.stdout, \
        out.stdout
    for case in ("local", "s3-cold", "s3-warm", "wds-fsspec"):
        assert f"| {case} | " in out.stdout, out.stdout
    assert "| local | " in out.stdout and "| 1.00x |" in out.stdout and "s3-cold / wds-fsspec: " in out.stdout
    assert "auto workers (others " in out.stdout and "CPU " in out.stdout


@pytest.mark.slow
def test_the_benchmark_times_mosaics_pipeline_and_leaves_no_shared_memory(tmp_path) -> None:
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    pytest.importorskip("streaming", reason="Mosaic's pipeline needs mosaicml-streaming (the mds extra; not in test: it "
                                            "pins numpy<2.2 and transformers<5)")
    shm = shm_entries()
    out = warm.run([sys.executable, "-m", "scripts.bench.object_storage", "--train", "24", "--shard-size", "8",
                    "--rounds", "1", "--work", str(tmp_path), "--cases", "s3-cold", "mosaic"],
                   cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| mosaic | " in out.stdout and "s3-cold / mosaic: " in out.stdout, out.stdout
    assert (tmp_path / "mosaic-24" / "train" / "index.json").is_file()
    assert "left in /dev/shm by the passes: " in out.stdout, out.stdout
    assert not shm_left_behind(shm)  # the line's names may be a test's beside this one, still held


def _files_and_shards(tmp_path, *args: str):
    return warm.run([sys.executable, "-m", "scripts.bench.object_storage", "--cases", "files", "local", "--paired", "4",
                     "--batch-size", "4", "--rounds", "2", "--workers", "0", "--work", str(tmp_path), *args],
                    cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_shards_against_files_paired_then_a_pass_each_without_a_server(tmp_path) -> None:
    pytest.importorskip("webdataset")  # the packer
    root = make_demo_dataset(tmp_path / "demo", num_classes=2, train_per_class=8, val_per_class=2, image_size=(64, 48))
    out = _files_and_shards(tmp_path, "--root", str(root), "--pack", str(tmp_path / "pack"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"paired, same images and crops, 4 batches in one thread: shards/files \d+\.\d{3}x", out.stdout)
    for case in ("files", "local"):
        assert re.search(rf"^\| {case} \| [\d,.]+ \| \d\.\d\dx \| \d+, \d+ \| ", out.stdout, re.M), out.stdout
    assert re.search(r"^local / files: \d+\.\d\dx$", out.stdout, re.M)
    assert (tmp_path / "pack" / "shards.json").is_file()  # packed on first use


def test_shards_against_files_refuses_a_pack_of_other_images(tmp_path) -> None:
    pytest.importorskip("webdataset")  # the packer
    root = make_demo_dataset(tmp_path / "demo", num_classes=2, train_per_class=8, val_per_class=2, image_size=(64, 48))
    other = make_demo_dataset(tmp_path / "other", num_classes=2, train_per_class=8, val_per_class=2,
                              image_size=(64, 48), seed=1)
    pack(other, tmp_path / "pack", progress=False)
    out = _files_and_shards(tmp_path, "--root", str(root), "--pack", str(tmp_path / "pack"))
    assert out.returncode != 0 and "does not hold the folder's images" in out.stdout + out.stderr
