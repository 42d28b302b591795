"""The image-folder index: each real file once, unloaded suffixes counted, the cache and its invalidation."""

import json
import os
import time
from multiprocessing import get_context

import pytest

from cltrain.data import ImageFolderDataset, eval_transform
from cltrain.data.errors import DataError
from cltrain.data.index import LEGACY_DIR_NAME, default_cache_dir, index_split, scan_split
from tests.helpers.data_fixtures import write_image_folder, write_jpegs


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Each test's index files in its own folder (the default is the user's cache folder)."""
    monkeypatch.setenv("CLTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "index"


def _age(root, seconds=60):
    """Make every folder look older than the index's racy window (the walk then trusts its mtimes)."""
    old = time.time() - seconds
    for d, _, _ in os.walk(root):
        os.utime(d, (old, old))


def test_symlink_loop_and_links_to_the_same_file_count_each_image_once(tmp_path):
    root = write_image_folder(tmp_path / "data", classes=2, train=3, val=1, size=(32, 24))
    c0 = root / "train" / "c0"
    (c0 / "loop").symlink_to(c0, target_is_directory=True)  # walked naively: 40 levels deep, 41x the images
    (c0 / "up").symlink_to(root / "train", target_is_directory=True)  # reaches c1 again from inside c0
    (c0 / "again.jpg").symlink_to(c0 / "0_000.jpg")
    os.link(c0 / "0_001.jpg", c0 / "hard.jpg")  # a hard link is a second real path: counted (documented)
    index = scan_split(root / "train")
    names = sorted(os.path.basename(p) for p, label in index.samples if label == 0)
    assert names == ["0_000.jpg", "0_001.jpg", "0_002.jpg", "hard.jpg"]
    assert sorted(os.path.basename(p) for p, label in index.samples if label == 1) == ["1_000.jpg", "1_001.jpg", "1_002.jpg"]
    assert index.duplicates == 1 and index.summary(root / "train").endswith("1 link(s) to an image already listed in its class, counted once.")
    # The classic walk this replaces, for the record: it multiplies the images (only "loop" here, or it explodes).
    (c0 / "up").unlink()
    naive = [f for d, _, fs in os.walk(c0, followlinks=True) for f in fs if f.endswith(".jpg")]
    assert len(naive) > 20


def test_a_link_is_the_duplicate_of_its_image_and_one_from_another_class_is_listed_in_both(tmp_path):
    # the link, met first in the sorted walk, was kept and the image itself dropped: in another class the image was
    # relabelled, in silence (torchvision lists it in both classes)
    from torchvision.datasets import ImageFolder

    root = write_image_folder(tmp_path / "data", classes=2, train=3, val=1, size=(32, 24))
    c0, c1 = root / "train" / "c0", root / "train" / "c1"
    (c0 / "0_000 copy.jpg").symlink_to(c0 / "0_002.jpg")  # sorts before the image it links to
    index = scan_split(root / "train")
    assert sorted(os.path.relpath(p, root) for p, label in index.samples if label == 0) == [
        "train/c0/0_000.jpg", "train/c0/0_001.jpg", "train/c0/0_002.jpg"]
    assert index.duplicates == 1 and index.shared == 0
    (c0 / "0_000 copy.jpg").unlink()
    (c0 / "1_000 from c1.jpg").symlink_to(c1 / "1_000.jpg")
    (c0 / "1_000 again.jpg").symlink_to(c1 / "1_000.jpg")  # twice in c0: listed once there (the first in order)
    index = scan_split(root / "train")
    theirs = ImageFolder(str(root / "train")).samples
    assert sorted(index.samples) == sorted(s for s in theirs if not s[0].endswith("from c1.jpg"))
    assert (index.duplicates, index.shared) == (1, 1)
    assert index.summary("train") == ("train: 1 link(s) to an image already listed in its class, counted once; 1 "
                                      "image(s) linked into another class, listed in each (as torchvision lists them).")


def test_files_that_are_not_loaded_are_counted_and_reported(tmp_path):
    root = write_image_folder(tmp_path / "data", classes=1, train=2, val=1, size=(32, 24))
    c0 = root / "train" / "c0"
    for name in ("a.gif", "b.GIF", "notes.txt", "README"):
        (c0 / name).write_bytes(b"x")
    (c0 / ".DS_Store").write_bytes(b"x")  # hidden: skipped silently
    (c0 / "dangling.jpg").symlink_to(c0 / "nowhere.jpg")
    with pytest.warns(UserWarning, match=r"train: 4 file\(s\) not loaded \(\.gif: 2, .*; loaded: \.jpg"):
        ds = ImageFolderDataset(root / "train", eval_transform(16, 18), index_cache=False)
    assert ds.index.ignored == {".gif": 2, ".txt": 1, "": 1}
    assert sorted(os.path.basename(p) for p, _ in ds.samples) == ["0_000.jpg", "0_001.jpg", "dangling.jpg"]


def test_cache_is_reused_while_the_tree_is_unchanged_and_invalidated_when_it_changes(tmp_path, cache_dir):
    root = write_image_folder(tmp_path / "data", classes=2, train=3, val=1, size=(32, 24))
    _age(root)
    first = index_split(root / "train")
    cache_files = list(cache_dir.glob("train-*.json"))
    assert len(cache_files) == 1
    # Doctor the cache: a reused index gives the doctored content back, a rebuilt one does not.
    data = json.loads(cache_files[0].read_text())
    data["files"][0] = data["files"][0] + "\n" + str(root / "train" / "c0" / "phantom.jpg")
    cache_files[0].write_text(json.dumps(data))
    assert len(index_split(root / "train").samples) == len(first.samples) + 1  # reused
    changes = [
        lambda: write_jpegs(root / "train" / "c1", 1, k=7, size=(32, 24)),  # a file added
        lambda: (root / "train" / "c0" / "0_000.jpg").unlink(),  # a file removed
        lambda: (root / "train" / "c0" / "sub").mkdir(),  # a folder added
        lambda: write_jpegs(root / "train" / "c0" / "sub", 1, size=(32, 24)),  # a file in a nested folder
        lambda: (root / "train" / "c2").mkdir(),  # a class added: a different key (and an empty class error)
    ]
    expected = [7, 6, 6, 7, None]
    for change, n in zip(changes, expected):
        _age(root)
        index_split(root / "train") if n is not None else None
        change()
        if n is None:
            with pytest.raises(ValueError, match="c2 has no images"):
                index_split(root / "train")
            continue
        _age(root, 30)  # older than the window, but different from what the cache recorded
        got = index_split(root / "train")
        assert len(got.samples) == n and not any("phantom" in p for p, _ in got.samples)


def test_no_cache_is_stored_for_a_tree_changed_just_now(tmp_path, cache_dir):
    root = write_image_folder(tmp_path / "data", classes=1, train=2, val=1, size=(32, 24))
    index_split(root / "train")
    assert not list(cache_dir.glob("*.json"))  # folders modified within 2 s: not trusted
    _age(root)
    index_split(root / "train")
    assert len(list(cache_dir.glob("train-*.json"))) == 1


def test_the_index_goes_to_the_user_cache_folder_never_into_the_dataset(tmp_path, monkeypatch):
    root = write_image_folder(tmp_path / "data", classes=1, train=2, val=1, size=(32, 24))
    _age(root)
    monkeypatch.delenv("CLTRAIN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "cltrain" / "index"
    ImageFolderDataset(root / "train", eval_transform(16, 18))
    assert len(list((tmp_path / "xdg" / "cltrain" / "index").glob("train-*.json"))) == 1
    own = tmp_path / "own"
    ImageFolderDataset(root / "train", eval_transform(16, 18), index_cache=own)  # a path: kept there
    assert len(list(own.glob("train-*.json"))) == 1
    assert not (root / LEGACY_DIR_NAME).exists() and sorted(p.name for p in root.iterdir()) == ["train", "val"]


def test_an_index_in_the_dataset_root_is_moved_to_the_cache_folder(tmp_path, cache_dir, caplog):
    root = write_image_folder(tmp_path / "data", classes=2, train=3, val=1, size=(32, 24))
    _age(root)
    index_split(root / "train")
    (written,) = cache_dir.glob("train-*.json")
    data = json.loads(written.read_text())
    data["files"][0] += "\n" + "c0/phantom.jpg"  # marks the index as the one read from the old place
    legacy = root / LEGACY_DIR_NAME
    legacy.mkdir()
    (legacy / written.name).write_text(json.dumps(data))
    (legacy / (written.name + ".lock")).write_text("")
    written.unlink()
    with caplog.at_level("INFO", logger="cltrain.data.index"):
        got = index_split(root / "train")
    assert any(p.endswith("phantom.jpg") for p, _ in got.samples)  # the old index was reused, not rebuilt
    assert written.is_file() and not legacy.exists()  # moved, and the emptied folder removed
    assert [r.getMessage() for r in caplog.records if "moved the file index" in r.getMessage()] == [
        f"moved the file index of {root / 'train'} from {legacy / written.name} to {written}"]


def _index_in_process(split, queue):
    queue.put(len(index_split(split).samples))


def test_ranks_share_one_index_through_the_lock(tmp_path):
    root = write_image_folder(tmp_path / "data", classes=2, train=4, val=1, size=(32, 24))
    _age(root)
    ctx = get_context("fork")  # ranks are separate processes; fork keeps the test fast
    queue = ctx.Queue()
    procs = [ctx.Process(target=_index_in_process, args=(root / "train", queue)) for _ in range(3)]
    for p in procs:
        p.start()
    counts = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert counts == [8, 8, 8] and len(list(default_cache_dir().glob("train-*.json"))) == 1


def test_a_cached_index_serves_the_tree_named_from_another_folder(tmp_path, monkeypatch):
    root = write_image_folder(tmp_path / "data", classes=1, train=2, val=1, size=(32, 24))
    _age(root)
    monkeypatch.chdir(tmp_path)
    first = [os.path.realpath(p) for p, _ in index_split("data/train").samples]
    assert len(list(default_cache_dir().glob("train-*.json"))) == 1
    monkeypatch.chdir(root)
    second = index_split("train")  # the same real folder: the cache is reused, paths as named now
    assert first == [os.path.realpath(p) for p, _ in second.samples]
    assert all(p.startswith("train/") and os.path.isfile(p) for p, _ in second.samples)


@pytest.mark.parametrize("where", ["class", "inside"])
def test_a_class_folder_listed_already_through_a_link_is_one_line_naming_the_class(tmp_path, where):
    from cltrain.data.errors import DataError

    root = write_image_folder(tmp_path / "data", classes=2, train=2, val=1, size=(32, 24))
    train = root / "train"
    if where == "class":  # c2 -> c0: the same images under a second class
        (train / "c2").symlink_to(train / "c0", target_is_directory=True)
        said = r"class folder .*c2 is a link to .*c0, whose images are listed under class 'c0' already"
    else:  # a link inside c0 reaches c1's folder first
        (train / "c0" / "more").symlink_to(train / "c1", target_is_directory=True)
        said = r"class folder .*c1 is reached through a link inside another class's folder: .* class 'c0' already"
    with pytest.raises(DataError, match=said + ".*remove the link"):
        scan_split(train)


def test_nested_folders_give_torchvisions_order(tmp_path):
    from torchvision.datasets import ImageFolder

    root = write_image_folder(tmp_path / "data", classes=1, train=1, val=1, size=(32, 24))
    c0 = root / "train" / "c0"
    for sub, name in (("sub/deeper", "1.jpg"), ("sub-x", "2.jpg"), ("sub", "3.jpg"), ("a", "4.jpg")):
        (c0 / sub).mkdir(parents=True, exist_ok=True)
        (c0 / sub / name).write_bytes((c0 / "0_000.jpg").read_bytes())
    ours = [(str(p), label) for p, label in scan_split(root / "train").samples]
    assert ours == ImageFolder(str(root / "train")).samples  # sub-x before sub/deeper: "-" sorts before "/"


def test_a_class_named_in_other_unicode_code_points_in_val_says_so(tmp_path):
    # 'café' written NFC in train/ (Linux) and NFD in val/ (copied from macOS): two names that print the same
    import unicodedata

    nfc = unicodedata.normalize("NFC", "café")
    nfd = unicodedata.normalize("NFD", "café")
    write_jpegs(tmp_path / "train" / nfc, 1, (16, 16))
    write_jpegs(tmp_path / "val" / nfd, 1, (16, 16))
    with pytest.raises(DataError, match=r"that the training split does not have \('.+' is the training split's "
                                        r"'.+' in other Unicode code points, 'cafe\\u0301' against 'caf\\xe9': rename one\)"):
        scan_split(tmp_path / "val", [nfc])


def test_images_outside_a_class_folder_are_said_once(tmp_path):
    # ImageNet's raw val/ is flat: its images beside the class folders were left out without a word
    import warnings

    from cltrain.data.index import find_classes

    root = write_image_folder(tmp_path / "data", classes=2, train=1, val=1, size=(16, 16))
    (root / "train" / "loose.jpg").write_bytes((root / "train" / "c0").iterdir().__next__().read_bytes())
    with pytest.warns(UserWarning, match=r"1 image\(s\) lie in it outside a class folder and are left out"):
        assert find_classes(root / "train") == ["c0", "c1"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        find_classes(root / "train")  # said once
        find_classes(root / "val")  # none loose
