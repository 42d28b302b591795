"""scripts.bench.loader and scripts.bench.photo_folder run end to end at tiny settings (the lead takes the figures)."""

from __future__ import annotations

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
def test_bench_loader_prints_the_ratios(tmp_path):
    pytest.importorskip("timm")
    pytest.importorskip("sklearn")
    out = warm.run([sys.executable, "-m", "scripts.bench.loader", "--photos", str(tmp_path / "p"),
                    "--photos-count", "12", "--batches", "1", "--batch-size", "4", "--workers", "0",
                    "--size", "32", "--whole", "--augment"],
                   cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for row in ("(a) cltrain", "(b) torchvision", "(c) timm", "(d) decode only", "(a0) cltrain whole", "(e) cltrain+aug"):
        assert row in out.stdout
    assert "x whole-image simplejpeg decode" in out.stdout and "x torchvision" in out.stdout
