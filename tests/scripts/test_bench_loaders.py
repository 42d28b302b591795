"""scripts.bench.loaders and scripts.bench.photo_folder run end to end at tiny settings (the figures are taken by hand,
see docs/performance.md)."""

from __future__ import annotations

import os
import re
import sys

import pytest
from PIL import Image, JpegImagePlugin

from scripts.bench.photo_folder import main, make_photo_folder
from tests.helpers import REPO
from tests.helpers import warm


def test_photo_folder_is_real_photographs_in_imagenet_layout(tmp_path):
    pytest.importorskip("sklearn")
    root = make_photo_folder(tmp_path / "photos", train=8, val=2, classes=2)
    files = sorted((root / "train").glob("*/*.jpg"))
    assert len(files) == 8 and len(list((root / "val").glob("*/*.jpg"))) == 2
    sampling = set()
    for f in files:
        with Image.open(f) as img:
            assert 333 <= min(img.size) and max(img.size) <= 800
            sampling.add(JpegImagePlugin.get_sampling(img))
    assert sampling == {0, 2}  # 4:4:4 and 4:2:0
    stamp = files[0].stat().st_mtime_ns
    assert make_photo_folder(root, train=8, val=2, classes=2) == root and files[0].stat().st_mtime_ns == stamp  # made once
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="other"):
        make_photo_folder(tmp_path / "other", train=2, val=1)
    main([str(tmp_path / "cli"), "--train", "2", "--val", "1"])  # the command makes one too
    assert len(list((tmp_path / "cli").glob("*/*/*.jpg"))) == 3


@pytest.mark.slow
def test_bench_loaders_prints_every_loader_both_tables_and_the_ratios(tmp_path):
    for module in ("timm", "sklearn", "skimage", "datasets"):
        pytest.importorskip(module)
    try:
        import nvidia.dali  # noqa: F401
        dali = []
    except ImportError:
        dali = ["--no-dali"]
    out = warm.run([sys.executable, "-m", "scripts.bench.loaders", "--quick", "--work", str(tmp_path), "--sets", "photos",
                    "--levers", "--augment", "--tables", "folders", "hf", "--workers", "0", *dali],
                   cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    header = [line for line in out.stdout.splitlines() if line.startswith("| folder | threads | ")][0]
    assert header == ("| folder | threads | " + ("" if dali else "DALI | ") + "cltrain float | cltrain uint8 | "
                      "cltrain N proc | torchvision | timm | decode | lever: normalize() after | "
                      "lever: whole-image decode | lever: batch by batch | cltrain+aug |")
    for row in ("| photos 333-800 px | 1 | ", "| photos 333-800 px | 2 | "):
        assert out.stdout.count(row) == 2, row  # the rates (median, lowest-highest), and the ratios
    assert "| float / DALI | uint8 / decode |" in out.stdout and "; flags " in out.stdout
    assert "| configuration | loader | img/s | vs (a) | vs (c) |" in out.stdout, out.stdout
    for row in ("| 0 workers (all) | (a) HF docs | ", "| 0 workers (all) | (b) cltrain hf | ",
                "| 0 workers (all) | (c) cltrain dir | ", "| cltrain's plan ("):
        assert row in out.stdout, out.stdout
    assert re.search(r"cltrain hf: \d+\.\d\dx the HF pipeline with the same workers, \d+\.\d\dx with its own plan",
                     out.stdout)
    assert (tmp_path / "photos-quick-hf" / "dataset_dict.json").is_file()  # the same photographs as a datasets dataset
