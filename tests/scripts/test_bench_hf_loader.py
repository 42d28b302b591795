"""scripts.bench.hf_loader at tiny settings: the three loaders on the same photographs, both configurations, the ratios."""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests.helpers import REPO
from tests.helpers import warm


def test_bench_hf_loader_prints_the_three_loaders_and_the_ratios(tmp_path):
    pytest.importorskip("datasets")
    pytest.importorskip("sklearn")  # the bundled photographs
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = warm.run([sys.executable, "-m", "scripts.bench.hf_loader", "--photos", str(tmp_path / "photos"),
                    "--photos-count", "16", "--batch-size", "4", "--batches", "1", "--repeats", "1", "--size", "32",
                    "--workers", "0"], cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| configuration | loader | img/s | vs (a) | vs (c) |" in out.stdout, out.stdout
    for row in ("| 0 workers (all) | (a) HF docs | ", "| 0 workers (all) | (b) cltrain hf | ",
                "| 0 workers (all) | (c) cltrain dir | ", "| cltrain's plan ("):
        assert row in out.stdout, out.stdout
    assert re.search(r"cltrain hf: \d+\.\d\dx the HF pipeline with the same workers, \d+\.\d\dx with its own plan", out.stdout)
    assert (tmp_path / "photos-hf" / "dataset_dict.json").is_file()  # the same photographs as a datasets dataset
