"""The evaluation transform is torchvision's decode + Resize + CenterCrop within one level, for every kind of
file a real folder holds; the DCT-scaled decode (``reduce=True``) is not, which is why it is opt-in."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from cltrain.data import eval_transform
from scripts.bench.eval_exact import torchvision_eval
from tests.helpers.data_fixtures import QUIRKS_READABLE, write_quirks

KINDS = [k for k in QUIRKS_READABLE if k != "one_pixel"]  # smaller than any crop
JPEGS = ("jpeg", "grey", "progressive", "exif_rotated", "unicode_name", "cmyk")


@pytest.fixture(scope="module")
def quirks(tmp_path_factory):
    return write_quirks(tmp_path_factory.mktemp("quirks"), size=(200, 150))  # at least twice the resize target


@pytest.mark.parametrize("kind", KINDS)
def test_eval_is_torchvision_within_one_level_for_every_kind_of_file(quirks, kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision's note on a CMYK JPEG
        ref = torchvision_eval(quirks[kind], 56, 64).astype(int)
    assert np.abs(eval_transform(56, 64)(quirks[kind]).astype(int) - ref).max() <= 1
    reduced = np.abs(eval_transform(56, 64, reduce=True)(quirks[kind]).astype(int) - ref).max()
    assert (reduced > 1) == (kind in JPEGS)  # DCT scaling applies to JPEGs only, and changes their pixels


def test_quick_run_prints_both_tables_of_the_docs(tmp_path, capsys):
    pytest.importorskip("sklearn")  # the bundled photographs
    from scripts.bench.eval_exact import main

    main(["--quick", "--photos", str(tmp_path / "photos")])
    out = capsys.readouterr().out
    assert "| kind | 224/256, default | 224/256, `reduce=True` | 64/73, default | 64/73, `reduce=True` |" in out
    assert "| jpeg | 0 / 0.000 | 0 / 0.000 | 0 / 0.000 | " in out and "| bmp | 1 / " in out  # exact for JPEGs
    assert "| run | 224/256 default | 224/256 `reduce=True` | 64/73 default | 64/73 `reduce=True` |" in out
    assert "| 8 photos x 1 repeats, load average " in out and out.startswith("Machine: CPU ")
