import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest
from PIL import Image

from cltrain.atomic import this_machine
from cltrain.data import ImageFolderDataModule, make_demo_dataset
from cltrain.data.demo import MARKER, draw_demo_folder
from tests.helpers import warm


def _digest(root):
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.jpg")):
        h.update(p.relative_to(root).as_posix().encode() + p.read_bytes())
    return h.hexdigest()


def test_layout_real_jpegs_and_determinism(tmp_path):
    root = make_demo_dataset(tmp_path / "a", num_classes=10, train_per_class=2, val_per_class=1, image_size=(160, 120), seed=3)
    assert sorted(p.name for p in root.iterdir()) == [MARKER, "train", "val"]
    dm = ImageFolderDataModule(root)
    assert dm.num_classes == 10 and dm.classes[0] == "00_red_circle"
    files = sorted(root.rglob("*.jpg"))
    assert len(files) == 30
    with Image.open(files[0]) as img:
        assert img.format == "JPEG" and img.size == (160, 120) and img.mode == "RGB"
    again = make_demo_dataset(tmp_path / "b", num_classes=10, train_per_class=2, val_per_class=1, image_size=(160, 120), seed=3)
    assert _digest(root) == _digest(again)
    draw_demo_folder(tmp_path / "e", 10, 2, 1, (160, 120), seed=3, workers=2)  # in two processes: the same files
    assert _digest(root) == _digest(tmp_path / "e")
    other = make_demo_dataset(tmp_path / "c", num_classes=10, train_per_class=2, val_per_class=1, image_size=(160, 120), seed=4)
    assert _digest(root) != _digest(other)


def test_classes_differ_in_colour_and_shape(tmp_path):
    root = make_demo_dataset(tmp_path / "d", num_classes=10, train_per_class=1, val_per_class=1, image_size=(96, 72))
    names = [p.name for p in sorted((root / "train").iterdir())]
    colours = [n.split("_")[1] for n in names]
    shapes = [n.split("_")[2] for n in names]
    assert len(set(names)) == 10 and len(set(colours)) == 5 and len(set(shapes)) == 5
    assert len(set(zip(colours, shapes))) == 10  # neither colour nor shape alone tells all classes apart


def test_reused_once_written_and_never_overwrites(tmp_path):
    root = make_demo_dataset(tmp_path / "e", train_per_class=1, val_per_class=1, image_size=(64, 48))
    stamp = (root / MARKER).stat().st_mtime_ns
    assert make_demo_dataset(tmp_path / "e", train_per_class=1, val_per_class=1, image_size=(64, 48)) == root
    assert (root / MARKER).stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError, match="other arguments"):
        make_demo_dataset(tmp_path / "e", train_per_class=2, val_per_class=1, image_size=(64, 48))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not a cltrain demo folder") as raised:
        make_demo_dataset(mine)
    # the user's own folder: read it as an image folder; never "delete it to have it written again"
    assert "delete" not in str(raised.value) and "ImageFolderDataModule" in str(raised.value)
    assert (mine / "thesis.txt").read_text() == "precious" and not list(tmp_path.glob(".*tmp*"))


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_classes=26"):
        make_demo_dataset("/nonexistent", num_classes=26)
    with pytest.raises(ValueError, match="train_per_class=0"):
        make_demo_dataset("/nonexistent", train_per_class=0)


def test_a_killed_generation_leaves_nothing_behind_for_long(tmp_path):
    # A real generation, killed with SIGKILL mid-way, leaves its temporary folder ...
    code = "import sys; from cltrain.data import make_demo_dataset; make_demo_dataset(sys.argv[1], train_per_class=400)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = warm.Popen([sys.executable, "-c", code, str(tmp_path / "demo")], env=env)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".demo.tmp-*/train/*/*.jpg")) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stale = list(tmp_path.glob(".demo.tmp-*"))
    assert len(stale) == 1 and not (tmp_path / "demo").exists()
    # ... which the next generation deletes, while a live writer's folder is left alone.
    writer = subprocess.Popen(["sleep", "60"])
    try:
        live = tmp_path / f".demo.tmp-{this_machine()}-{writer.pid}"
        live.mkdir()
        make_demo_dataset(tmp_path / "demo", num_classes=2, train_per_class=1, val_per_class=1, image_size=(32, 32))
        assert not stale[0].exists() and live.exists()
    finally:
        writer.kill()
        writer.wait()
