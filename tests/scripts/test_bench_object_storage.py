"""scripts.bench.object_storage at tiny settings: a real S3 server, the local pack and the bucket, the peers' lines."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import REPO, warm


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
    out = warm.run([sys.executable, "-m", "scripts.bench.object_storage", "--train", "24", "--shard-size", "8",
                    "--rounds", "1", "--work", str(tmp_path), "--cases", "s3-cold", "mosaic"],
                   cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| mosaic | " in out.stdout and "s3-cold / mosaic: " in out.stdout, out.stdout
    assert (tmp_path / "mosaic-24" / "train" / "index.json").is_file()
    assert "left in /dev/shm by the passes: nothing" in out.stdout, out.stdout
