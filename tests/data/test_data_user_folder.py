"""A folder as users have it (every quirk, OS junk, links) read the same way by every code path:
the index, the app's layout check, the data check and the packer; and the pack as trustworthy as the folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from cltrain.data import ShardsDataset, eval_transform
from cltrain.data.check import main as check_main
from cltrain.data.index import scan_split
from cltrain.data.pack import SKIPPED_LIST, main as pack_main
from tests.helpers.data_fixtures import QUIRKS_BAD, add_junk, write_image_folder, write_user_folder


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Path]]]:
    root = tmp_path_factory.mktemp("user") / "images"
    return root, write_user_folder(root)


def _rows(tsv: Path) -> dict[str, tuple[str, str]]:
    lines = [line.split("\t") for line in tsv.read_text(encoding="utf-8").splitlines() if not line.startswith("#")]
    return {path: (split, reason) for split, path, reason in lines}


def test_every_code_path_lists_the_images_and_nothing_hidden(user_folder, tmp_path: Path, capsys) -> None:
    from cltrain.app.datasource import _check_layout

    root, files = user_folder
    quirks = files["quirks"]
    images = {str(p) for p in files["plain"].values()} | {str(p) for p in quirks.values()}
    images.add(str(root / "train" / "c1" / "linked.jpg"))  # c0's image linked into c1: in both, as torchvision has it
    bad = {str(quirks[k]) for k in QUIRKS_BAD}

    train = scan_split(root / "train")  # the index: no hidden folder is a class, no junk file a sample or "not loaded"
    val = scan_split(root / "val", train.classes)
    assert train.classes == ["c0", "c1"] and train.ignored == {} and val.ignored == {} and train.shared == 1
    assert {p for p, _ in train.samples + val.samples} == images

    _check_layout(root, allow_missing_val_classes=False, evaluate_only=False)  # the app's check: no class is missing

    assert check_main([str(root), "--out", str(tmp_path / "bad.tsv"), "--workers", "2", "--no-progress"]) == 1
    assert set(_rows(tmp_path / "bad.tsv")) == bad  # the data check: exactly the unreadable files
    reasons = {path: reason for path, (_, reason) in _rows(tmp_path / "bad.tsv").items()}
    link = quirks["dangling_link"]
    assert reasons[str(link)] == f"a symbolic link to {link.parent / 'gone.jpg'}, which does not exist"

    out = tmp_path / "pack"  # the packer: every readable image once, the unreadable ones listed by path
    assert pack_main([str(root), str(out), "--shard-size", "8", "--workers", "2", "--no-progress"]) == 0
    assert f"5 unreadable file(s) left out, listed in {out / SKIPPED_LIST}" in capsys.readouterr().out
    assert _rows(out / SKIPPED_LIST) == {p: ("train", reasons[p]) for p in bad}
    packed = {}
    for split in ("train", "val"):
        ds = ShardsDataset(out, split, eval_transform(32, 36))
        packed |= {ds.sample_name(i): ds.read(i) for i in range(len(ds))}
    assert set(packed) == images - bad and all(Path(p).read_bytes() == data for p, data in packed.items())


@pytest.mark.parametrize("junk_only", [True, False])
def test_a_class_folder_of_junk_is_named_in_one_line_by_the_app_and_the_index(tmp_path: Path, junk_only: bool) -> None:
    from cltrain.app.config import ConfigError
    from cltrain.app.datasource import _check_layout
    from cltrain.data.errors import DataError

    root = write_image_folder(tmp_path / "images", classes=2, train=2, val=1, size=(32, 32))
    empty = root / "train" / "c2"
    empty.mkdir()
    (root / "val" / "c2").mkdir()
    (root / "val" / "c2" / "x.jpg").write_bytes((root / "val" / "c0" / "0_000.jpg").read_bytes())
    if junk_only:
        (empty / ".DS_Store").write_bytes(b"\0")
        (empty / "Thumbs.db").write_bytes(b"\0")
    what = "holds only .DS_Store, Thumbs.db" if junk_only else "is empty"
    with pytest.raises(ConfigError, match=rf"the class folder train/c2/ {what} \(allowed: remove it"):
        _check_layout(root, False, False)
    only = "it holds only .DS_Store, Thumbs.db" if junk_only else "it is empty"
    with pytest.raises(DataError, match=rf"class folder {empty} has no images \(suffixes .*; {only}\); add images"):
        scan_split(root / "train")


def test_junk_beside_the_classes_is_not_a_class_for_the_app(tmp_path: Path) -> None:
    from cltrain.app.datasource import _check_layout

    root = write_image_folder(tmp_path / "images", classes=2, train=2, val=1, size=(32, 32))
    add_junk(root / "train")  # .ipynb_checkpoints/ and __MACOSX/ in train/ only: no val/ folder for them
    _check_layout(root, False, False)
    assert scan_split(root / "train").classes == ["c0", "c1"]
