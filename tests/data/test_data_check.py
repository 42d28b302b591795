"""`python -m cltrain.data.check`: real files, real worker processes, a real subprocess."""

import os
import struct
import zlib
import shutil
import subprocess
import sys

import pytest

from cltrain.data import ImageFolderDataModule
from cltrain.data.check import check_file, check_files, main
from tests.helpers.data_fixtures import BAD, READABLE, write_image_folder, write_odd_files


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    return write_odd_files(tmp_path_factory.mktemp("odd"))


@pytest.mark.parametrize("full", [True, False])
def test_bad_files_are_found_and_readable_ones_pass(odd, full):
    for kind in BAD:
        assert check_file(str(odd[kind]), full=full), kind
    for kind in READABLE:
        assert check_file(str(odd[kind]), full=full) is None, kind


def test_what_only_the_full_decode_catches(odd, tmp_path):
    # A PNG whose compressed pixels are scrambled but whose chunk checksums are right: its header
    # and checksums pass the quick check; only decoding finds it.
    data = bytearray(odd["rgba"].read_bytes())
    at = data.index(b"IDAT")
    length = struct.unpack(">I", data[at - 4: at])[0]
    body = at + 4
    data[body + 2: body + length] = bytes(length - 2)  # keep the zlib header, zero the deflate stream
    data[body + length: body + length + 4] = struct.pack(">I", zlib.crc32(data[at: body + length]))
    broken = tmp_path / "scrambled.png"
    broken.write_bytes(bytes(data))
    assert check_file(str(broken), full=False) is None
    assert check_file(str(broken), full=True) is not None


def test_workers_give_the_same_answer(odd):
    paths = [str(p) for p in odd.values()] * 3
    assert check_files(paths, "quick", workers=2) == check_files(paths, "quick", workers=0)
    assert set(check_files(paths, "full", workers=2)) == {str(odd[k]) for k in BAD}
    with pytest.raises(ValueError, match="'deep'"):
        check_files(paths, "deep")


def test_command_lists_bad_files_exits_1_and_the_datamodule_leaves_them_out(odd, tmp_path, capsys):
    root = write_image_folder(tmp_path / "data", classes=2, train=2, val=2, size=(64, 48))
    shutil.copy(odd["truncated"], root / "train" / "c0" / "truncated.jpg")
    shutil.copy(odd["text"], root / "val" / "c1" / "text.jpg")
    out = tmp_path / "bad.tsv"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-m", "cltrain.data.check", str(root), "--workers", "2", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 1, run.stderr
    assert "it/s" in run.stderr or "file/s" in run.stderr  # the progress bar
    assert "10 files checked (full)" in run.stdout and "2 bad" in run.stdout
    lines = [line.split("\t") for line in out.read_text().splitlines() if not line.startswith("#")]
    assert sorted((split, os.path.basename(path)) for split, path, _ in lines) == [("train", "truncated.jpg"), ("val", "text.jpg")]
    dm = ImageFolderDataModule(root, num_workers=0, exclude_files=out)
    dm.setup("fit")
    assert len(dm.train_set) == 4 and len(dm.val_set) == 4
    assert dm.train_set.excluded == 1 and dm.val_set.excluded == 1
    # A clean tree: exit 0 and an empty list; a bad argument: exit 2.
    (root / "train" / "c0" / "truncated.jpg").unlink()
    (root / "val" / "c1" / "text.jpg").unlink()
    assert main([str(root), "--quick", "--no-progress", "--workers", "0", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 1 and "0 bad" in capsys.readouterr().out
    assert main([str(tmp_path / "nowhere")]) == 2 and "nowhere is not a folder" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="exclude_files=.*missing.tsv.*python -m cltrain.data.check"):
        ImageFolderDataModule(root, num_workers=0, exclude_files=tmp_path / "missing.tsv").setup("fit")
