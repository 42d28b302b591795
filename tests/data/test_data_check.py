"""`python -m cltrain.data.check`: real files, real worker processes, a real subprocess; the full check
against what a real dataset with each decoder fails on."""

import logging
import os
import struct
import zlib
import shutil
import sys

import pytest

from cltrain.data import ImageFolderDataModule
from cltrain.data.check import check_file, check_files, main
from cltrain.data.errors import DataError
from cltrain.data.image_folder_dataset import BadImageError
from cltrain.data.decoders import DECODER_NAMES
from tests.helpers.data_fixtures import BAD, ENDS_ELSEWHERE, READABLE, write_image_folder, write_odd_files
from tests.helpers import warm


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    return write_odd_files(tmp_path_factory.mktemp("odd"))


@pytest.mark.parametrize("full", [True, False])
def test_bad_files_are_found_and_readable_ones_pass(odd, full):
    for kind in BAD:
        reason = check_file(str(odd[kind]), full=full)
        assert reason and "<_io" not in reason, (kind, reason)  # Pillow's "<_io.BufferedReader name=...>" left out
    for kind in READABLE:
        assert check_file(str(odd[kind]), full=full) is None, kind


@pytest.mark.parametrize("full", [True, False])
def test_a_jpegs_own_end_marker_is_found_where_a_quick_look_at_its_end_misses(odd, full):
    # a Motion Photo (a video after the image's end marker) is readable; a cut camera file whose preview's end marker
    # lies in its last bytes is not
    for kind, readable in ENDS_ELSEWHERE.items():
        assert (check_file(str(odd[kind]), full=full) is None) == readable, (kind, full)


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
    bad = {str(odd[k]) for k in BAD} | {str(odd[k]) for k, readable in ENDS_ELSEWHERE.items() if not readable}
    assert set(check_files(paths, "full", workers=2)) == bad
    with pytest.raises(ValueError, match="'deep'"):
        check_files(paths, "deep")


def test_command_lists_bad_files_exits_1_and_the_datamodule_leaves_them_out(odd, tmp_path, capsys):
    root = write_image_folder(tmp_path / "data", classes=2, train=2, val=2, size=(64, 48))
    shutil.copy(odd["truncated"], root / "train" / "c0" / "truncated.jpg")
    shutil.copy(odd["text"], root / "val" / "c1" / "text.jpg")
    os.symlink(tmp_path / "gone.jpg", root / "train" / "c1" / "dangling.jpg")  # listed by its own path, not the target
    out = tmp_path / "bad.tsv"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = warm.run([sys.executable, "-m", "cltrain.data.check", str(root), "--workers", "2", "--out", str(out)],
                   capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 1, run.stderr
    assert "it/s" in run.stderr or "file/s" in run.stderr  # the progress bar
    assert "11 files checked (full)" in run.stdout and "3 bad" in run.stdout
    lines = [line.split("\t") for line in out.read_text().splitlines() if not line.startswith("#")]
    assert sorted((split, os.path.basename(path)) for split, path, _ in lines) == [
        ("train", "dangling.jpg"), ("train", "truncated.jpg"), ("val", "text.jpg")]
    dm = ImageFolderDataModule(root, num_workers=0, exclude_files=out)
    dm.setup("fit")
    assert len(dm.train_set) == 4 and len(dm.val_set) == 4
    assert dm.train_set.excluded == 2 and dm.val_set.excluded == 1
    # A clean tree: exit 0 and an empty list; a bad argument: exit 2.
    (root / "train" / "c1" / "dangling.jpg").unlink()
    (root / "train" / "c0" / "truncated.jpg").unlink()
    (root / "val" / "c1" / "text.jpg").unlink()
    assert main([str(root), "--quick", "--no-progress", "--workers", "0", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 1 and "0 bad" in capsys.readouterr().out
    assert main([str(tmp_path / "nowhere")]) == 2 and "nowhere is not a folder" in capsys.readouterr().err
    with pytest.raises(DataError, match="exclude_files=.*missing.tsv.*python -m cltrain.data.check"):
        ImageFolderDataModule(root, num_workers=0, exclude_files=tmp_path / "missing.tsv").setup("fit")


def test_a_list_written_from_a_relative_root_serves_a_run_started_elsewhere_and_the_run_says_what_it_left_out(
        odd, tmp_path, monkeypatch, caplog):
    # the list named files relative to where the check ran: a run started elsewhere matched none of them, silently
    root = write_image_folder(tmp_path / "data", classes=2, train=2, val=2, size=(64, 48))
    shutil.copy(odd["truncated"], root / "train" / "c0" / "truncated.jpg")
    shutil.copy(odd["text"], root / "val" / "c1" / "text.jpg")
    monkeypatch.chdir(tmp_path)
    assert main(["data", "--no-progress", "--workers", "0", "--out", "bad.tsv"]) == 1
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    dm = ImageFolderDataModule(root, num_workers=0, exclude_files=tmp_path / "bad.tsv")
    with caplog.at_level(logging.INFO):
        dm.setup("fit")
    assert dm.train_set.excluded == 1 and dm.val_set.excluded == 1
    assert f"left out 2 image(s) of the 2 file(s) listed in {tmp_path / 'bad.tsv'} (train 1, val 1)" in caplog.text
    # a list of relative paths from elsewhere (written by hand, or by an older check): said, not silently ignored
    relative = tmp_path / "relative.tsv"
    relative.write_text("train\tdata/train/c0/truncated.jpg\tcut\n")
    with pytest.warns(UserWarning, match=r"none of the 1 file\(s\) listed in .*relative\.tsv is under .*data \(a "
                                         r"relative path in the list is read from the working directory"):
        with pytest.raises(BadImageError):  # the validation file, not left out, is found before training
            ImageFolderDataModule(root, num_workers=0, exclude_files=relative).setup("fit")


def test_a_dangling_link_in_the_list_counts_once_in_what_the_run_says_it_left_out(odd, tmp_path, caplog):
    # kept as its own path and as its target's, it was counted twice: "left out 3 of the 4 file(s) listed"
    root = write_image_folder(tmp_path / "data", classes=2, train=2, val=2, size=(64, 48))
    shutil.copy(odd["truncated"], root / "train" / "c0" / "truncated.jpg")
    shutil.copy(odd["text"], root / "val" / "c1" / "text.jpg")
    os.symlink(tmp_path / "gone.jpg", root / "train" / "c1" / "dangling.jpg")
    listed = tmp_path / "bad.tsv"
    assert main([str(root), "--quick", "--no-progress", "--workers", "0", "--out", str(listed)]) == 1
    with caplog.at_level(logging.INFO):
        ImageFolderDataModule(root, num_workers=0, exclude_files=listed).setup("fit")
    assert f"left out 3 image(s) of the 3 file(s) listed in {listed} (train 2, val 1)" in caplog.text


# --- the full check decodes as the loader with its decoder ------------------------------------------

def _jpeg_cases(folder):
    """A good JPEG; one whose header Pillow cannot parse but libjpeg-turbo reads (an Adobe APP14
    segment of 5 bytes: Pillow reads a 16-bit field past its end, libjpeg ignores a short one); one
    with corrupt entropy-coded data, which libjpeg-turbo refuses and Pillow decodes, filling it in."""
    good = write_odd_files(folder)["good"]
    data = good.read_bytes()
    short_app14 = folder / "short_app14.jpg"
    short_app14.write_bytes(data[:2] + b"\xff\xee\x00\x07Adobe" + data[2:])
    corrupt = bytearray(data)
    start = data.index(b"\xff\xda") + 20  # inside the scan
    for k in range(start, start + 40):
        if corrupt[k] != 0xFF and corrupt[k - 1] != 0xFF:  # no new markers
            corrupt[k] = (corrupt[k] * 7 + 13) & 0x7F
    (folder / "corrupt_scan.jpg").write_bytes(bytes(corrupt))
    return {"good": good, "short_app14": short_app14, "corrupt_scan": folder / "corrupt_scan.jpg"}


def _loader_fails(path, decoder):
    """Whether a real dataset with that decoder fails on ``path`` (both transforms)."""
    from cltrain.data import ImageFolderDataset, eval_transform, train_transform
    from cltrain.data.image_folder_dataset import BadImageError

    split = path.parent.parent
    for transform in (train_transform(24, decoder=decoder), eval_transform(24, 28, decoder=decoder)):
        ds = ImageFolderDataset(split, transform, index_cache=False)
        i = next(k for k, (p, _) in enumerate(ds.samples) if p == str(path))
        try:
            ds[i]
        except BadImageError:
            return True
    return False


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    from cltrain.data.decoders import get_decoder

    if get_decoder("auto") is None:
        pytest.skip("no JPEG back end installed")
    return _jpeg_cases(tmp_path_factory.mktemp("split") / "c0")


def test_the_back_ends_and_pillow_disagree_on_real_files(jpegs):
    """The premise of the tests below, shown with the libraries themselves."""
    from PIL import Image

    from cltrain.data.decoders import BACKENDS, get_decoder

    data = jpegs["short_app14"].read_bytes()
    with pytest.raises(Exception, match="cannot identify image file"):
        Image.open(jpegs["short_app14"])
    for name in BACKENDS:
        backend = get_decoder(name)
        assert backend.decode(data, backend.header(data)).shape == (72, 96, 3)
    corrupt = jpegs["corrupt_scan"].read_bytes()
    with Image.open(jpegs["corrupt_scan"]) as img:
        img.load()  # Pillow fills the damage in
    for name in BACKENDS:
        backend = get_decoder(name)
        with pytest.raises(ValueError, match="Corrupt JPEG data"):
            backend.decode(corrupt, backend.header(corrupt))


@pytest.mark.parametrize("decoder", DECODER_NAMES)
def test_the_full_check_says_what_the_loader_with_that_decoder_fails_on(jpegs, decoder):
    for kind, path in jpegs.items():
        assert (check_file(str(path), full=True, decoder=decoder) is not None) == _loader_fails(path, decoder), kind
    # The file whose verdict depends on the decoder: read by a back end, refused by Pillow.
    assert (check_file(str(jpegs["short_app14"]), full=True, decoder=decoder) is None) == (decoder != "pillow")
    assert check_file(str(jpegs["corrupt_scan"]), full=True, decoder=decoder) is None  # the loader falls back to Pillow


def test_the_pillow_decoder_never_calls_a_back_end_and_the_default_does(jpegs, monkeypatch):
    from cltrain.data.decoders import simplejpeg_whole, turbojpeg_region

    def refuse(*args, **kwargs):
        raise AssertionError("a JPEG back end was used")

    monkeypatch.setattr(simplejpeg_whole.SimpleJpegWhole, "decode", refuse)
    monkeypatch.setattr(turbojpeg_region.TurboJpegRegion, "decode", refuse)
    good = str(jpegs["good"])
    assert check_file(good, full=True, decoder="pillow") is None
    assert "back end was used" in check_file(good, full=True)  # the control: the default decodes with one
    assert check_file(good, full=False) is None  # the quick check decodes nothing


def test_decoder_reaches_the_worker_processes_the_command_and_check_val(jpegs, tmp_path, capsys):
    paths = [str(p) for p in jpegs.values()]
    assert set(check_files(paths, "full", workers=2, decoder="pillow")) == {str(jpegs["short_app14"])}
    assert check_files(paths, "full", workers=2) == {}
    with pytest.raises(ValueError, match="decoder='libjpeg' is not a decoder"):
        check_files(paths, "full", decoder="libjpeg")
    root = write_image_folder(tmp_path / "data", classes=1, train=2, val=2, size=(64, 48))
    shutil.copy(jpegs["short_app14"], root / "val" / "c0" / "short_app14.jpg")
    out = tmp_path / "bad.tsv"
    args = [str(root), "--no-progress", "--workers", "0", "--out", str(out)]
    assert main(args) == 0
    assert main([*args, "--decoder", "pillow"]) == 1 and "short_app14.jpg" in out.read_text()
    with pytest.raises(SystemExit):
        main([*args, "--decoder", "libjpeg"])
    assert "invalid choice: 'libjpeg'" in capsys.readouterr().err
    ImageFolderDataModule(root, num_workers=0, check_val="full").setup("fit")
    with pytest.raises(BadImageError, match="short_app14.jpg"):
        ImageFolderDataModule(root, num_workers=0, check_val="full", decoder="pillow").setup("fit")


def test_a_file_name_that_is_not_utf8_is_listed_skipped_and_left_out_by_its_bytes(odd, tmp_path, capsys):
    # a Latin-1 name from a Windows archive: the check's list, the skip list and the skip warning each ended the run
    # with UnicodeEncodeError (surrogates not allowed)
    from cltrain.data.datamodules.skipped_files import SKIPPED_FILES_NAME
    from cltrain.data.image_folder_dataset import ImageFolderDataset
    from cltrain.data.transforms import eval_transform

    root = write_image_folder(tmp_path / "data", classes=2, train=2, val=2, size=(64, 48))
    bad = root / "train" / "c0" / os.fsdecode(b"caf\xe9.jpg")
    shutil.copy(odd["text"], bad)
    out = tmp_path / "bad.tsv"
    assert main([str(root), "--quick", "--no-progress", "--workers", "0", "--out", str(out)]) == 1
    assert os.fsencode(bad) in out.read_bytes() and "1 bad" in capsys.readouterr().out
    dm = ImageFolderDataModule(root, num_workers=0, exclude_files=out)
    dm.setup("fit")
    assert dm.train_set.excluded == 1 and len(dm.train_set) == 4
    log = tmp_path / SKIPPED_FILES_NAME
    ds = ImageFolderDataset(root / "train", eval_transform(32, 36), bad_files="skip", skip_log=log)
    run_log = logging.FileHandler(tmp_path / "train.log", encoding="utf-8")  # as Hydra's: strict UTF-8
    logging.getLogger("cltrain").addHandler(run_log)
    try:
        for i in range(len(ds)):
            ds[i]
    finally:
        logging.getLogger("cltrain").removeHandler(run_log)
        run_log.close()
    assert os.fsencode(bad) in log.read_bytes()
    assert "skipping unreadable" in (tmp_path / "train.log").read_text() and "caf\\udce9.jpg" in (
        tmp_path / "train.log").read_text()
    dm = ImageFolderDataModule(root, num_workers=0, exclude_files=log)  # the skip list serves as the exclude list
    dm.setup("fit")
    assert dm.train_set.excluded == 1


@pytest.mark.parametrize("damage", ["no IEND", "a text chunk's checksum after the pixels"])
def test_a_png_that_loads_passes_the_quick_check(odd, tmp_path, damage):
    # Pillow's verify() wants every chunk whole; its loader does not: the run refused files that cltrain-data-check's
    # full decode then called good, leaving the user no list to exclude
    data = bytearray(odd["rgba"].read_bytes())
    if damage == "no IEND":
        data = data[:data.index(b"IEND") - 4]
    else:
        end = data.index(b"IEND") - 4
        text = b"tEXt" + b"Comment\x00hi"
        data[end:end] = struct.pack(">I", len(text) - 4) + text + b"\x00\x00\x00\x00"  # a wrong checksum
    png = tmp_path / "damaged.png"
    png.write_bytes(bytes(data))
    assert check_file(str(png), full=False) is None and check_file(str(png), full=True) is None
