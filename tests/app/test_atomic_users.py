"""The files a user relies on besides checkpoints (the file index cache, metrics.json, a sweep
report) are written through cltrain.atomic, and the next use of their folder removes what a
killed writer left there, with one line."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from tests.helpers.data_fixtures import write_image_folder

from cltrain.app.metrics_file import write_metrics
from cltrain.tools.sweep_report import write_report
from cltrain.atomic import TEMP_PREFIX, _host_tag
from cltrain.data.index import index_split
from tests.helpers import warm


def _leftover(folder: Path, name: str) -> Path:
    """A temporary file as a writer killed mid-write leaves it (its process is gone)."""
    proc = warm.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    path = folder / f"{TEMP_PREFIX}{proc.pid}-{_host_tag()}-0000-{name}"
    path.write_text('{"half": ')
    return path


def test_the_index_cache_is_atomic_json_and_its_leftovers_are_removed(tmp_path: Path) -> None:
    root = write_image_folder(tmp_path / "data", classes=2, train=2, val=1, size=(32, 24))
    old = time.time() - 60
    for d, _, _ in os.walk(root):
        os.utime(d, (old, old))  # older than the index's racy window, so it is stored
    cache = tmp_path / "cache"
    cache.mkdir()
    leftover = _leftover(cache, "train-0123456789abcdef.json")
    with pytest.warns(UserWarning, match=rf"^index_split: removed 1 temporary file\(s\) left in {cache} by a run "
                                         rf"stopped while writing the file index: {leftover.name}$"):
        index = index_split(root / "train", cache_dir=cache)
    assert not leftover.exists()
    stored = [p for p in cache.iterdir() if p.suffix == ".json"]
    assert len(stored) == 1 and json.loads(stored[0].read_text())["key"]["classes"] == index.classes
    assert not [p for p in cache.iterdir() if p.name.startswith(TEMP_PREFIX)]


def test_metrics_json_is_never_replaced_unless_asked(tmp_path: Path) -> None:
    path = write_metrics(tmp_path, {"status": "completed"})
    with pytest.raises(FileExistsError, match="metrics.json exists and is not replaced"):
        write_metrics(tmp_path, {"status": "failed"})
    assert json.loads(path.read_text()) == {"status": "completed"}
    write_metrics(tmp_path, {"status": "requeued"}, replace=True)
    assert json.loads(path.read_text()) == {"status": "requeued"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_a_sweep_report_removes_the_leftovers_of_an_interrupted_one(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "0").mkdir()
    write_metrics(tmp_path / "0", {"model": "resnet18", "channels_last": False, "precision": "32-true",
                                   "images_per_second": 10.0, "global_batch": 8})
    leftover = _leftover(tmp_path, "report.png")
    md, png = write_report(tmp_path)
    assert not leftover.exists() and md.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().err.strip() == (f"cltrain-sweep-report: removed 1 temporary file(s) left in {tmp_path} by a "
                                               f"report stopped while writing: {leftover.name}")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)]
