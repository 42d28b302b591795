"""Shards: packing an ImageFolder (resumable, never overwrites), reading it through the NHWC path,
and each sample exactly once per epoch under DDP x workers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from cltrain.atomic import TEMP_PREFIX
from cltrain.data import ImageFolderDataModule, NHWCCollate, ShardsDataModule, ShardsDataset, eval_transform, normalize
from cltrain.data.errors import DataError
from cltrain.data.pack import MANIFEST, PackError, _plan, main, pack
from cltrain.data.shard_sampler import ShardBatchSampler, rank_batch_sizes
from tests.helpers.data_fixtures import write_image_folder, write_jpegs
from tests.helpers import warm

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def folder(tmp_path: Path) -> Path:
    # 3 classes: 33 train (odd: uneven over 2 ranks), 15 val.
    return write_image_folder(tmp_path / "images", classes=3, train=11, val=5)


def _files(split_dir: Path) -> Counter:
    return Counter((p.read_bytes(), p.parent.name) for p in split_dir.rglob("*.jpg"))


def test_pack_stores_the_files_bytes_labels_and_classes(folder: Path, tmp_path: Path) -> None:
    manifest = json.loads(pack(folder, tmp_path / "out", shard_size=7, progress=False).read_text())
    assert manifest["classes"] == ["c0", "c1", "c2"]
    assert manifest["splits"]["train"]["count"] == 33 and len(manifest["splits"]["train"]["shards"]) == 5
    for split in ("train", "val"):
        ds = ShardsDataset(tmp_path / "out", split, eval_transform(32, 36))
        stored = Counter((ds.read(i), ds.classes[int(ds.index[i, 2])]) for i in range(len(ds)))
        assert stored == _files(folder / split)  # the same bytes (no re-encoding), each with its class
        labels = [int(ds.index[i, 2]) for i in range(len(ds))]
        assert labels != sorted(labels)  # packed in a shuffled order: shards mix classes


def test_a_sample_whose_stored_name_is_not_text_is_named_by_its_place(folder: Path, tmp_path: Path) -> None:
    # a shard swapped for another of its size: the index's name bytes fall in a tar header, and the error carried
    # its NULs and newlines as the file's "path"
    from cltrain.data.image_folder_dataset import BadImageError

    pack(folder, tmp_path / "out", shard_size=7, progress=False)
    ds = ShardsDataset(tmp_path / "out", "train", eval_transform(32, 36))
    shard = tmp_path / "out" / ds.shards[int(ds.shard_of[0])]
    data = bytearray(shard.read_bytes())
    for start, size in ((ds.index[0, 0], ds.index[0, 1]), (ds.index[0, 3], ds.index[0, 4])):
        data[int(start):int(start) + int(size)] = b"\x00\n" * (int(size) // 2) + b"\x00" * (int(size) % 2)
    shard.write_bytes(bytes(data))
    with pytest.raises(BadImageError) as caught:
        ShardsDataset(tmp_path / "out", "train", eval_transform(32, 36)).load(0)
    line = str(caught.value)
    assert line.startswith(f"{ds.shards[int(ds.shard_of[0])]} sample 0: cannot be read as an image"), line
    assert line.isprintable() and line.endswith("pack the folder again."), line  # a local pack: nothing to upload


def test_shards_are_plain_webdataset_tars(folder: Path, tmp_path: Path) -> None:
    wds = pytest.importorskip("webdataset")
    pack(folder, tmp_path / "out", shard_size=7, progress=False)
    urls = sorted(str(p) for p in (tmp_path / "out" / "train").glob("*.tar"))
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    assert len(samples) == 33
    assert Counter((s["jpg"], f"c{int(s['cls'])}") for s in samples) == _files(folder / "train")


def test_pack_never_overwrites_a_foreign_folder(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep")
    assert main([str(folder), str(out), "--no-progress"]) == 2
    assert "not empty and is not a cltrain pack" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]


def test_pack_names_a_missing_split(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(folder), str(tmp_path / "out"), "--splits", "train", "test", "--no-progress"]) == 2
    assert "has no split folder test; it has ['train', 'val']" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_url_for_root_or_out_is_one_line_and_nothing_is_written(folder: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # a URL taken as a path wrote ./s3:/bucket/pack and said "complete"
    assert main([str(folder), "s3://key:secret42@bucket/pack", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "OUT s3://***@bucket/pack is a URL; pack writes a local folder" in err and "secret42" not in err, err
    assert main(["s3://bucket/images", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "ROOT s3://bucket/images is a URL; pack reads a local folder" in capsys.readouterr().err
    assert not list(work.iterdir()) and not (tmp_path / "out").exists()
    from cltrain.data.check import main as check

    assert check(["s3://bucket/images", "--no-progress"]) == 2
    assert "s3://bucket/images is a URL; the check reads a local folder" in capsys.readouterr().err


def test_pack_refuses_other_settings_and_a_changed_tree(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack(folder, out, shard_size=7, progress=False)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(PackError, match="shard_size"):
        pack(folder, out, shard_size=8, progress=False)
    write_jpegs(folder / "train" / "c0", 12, seed=5)  # one more image: another tree
    with pytest.raises(PackError, match="fingerprint"):
        pack(folder, out, shard_size=7, progress=False)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


@pytest.mark.parametrize("damage", ["tar missing", "index missing", "tar cut short", "index not an index",
                                    "another tar", "another index"])
def test_an_incomplete_pack_is_one_line_at_setup_naming_the_file(folder: Path, tmp_path: Path, damage: str) -> None:
    from cltrain.data.errors import DataError

    out = tmp_path / "out"
    pack(folder, out, shard_size=7, progress=False)
    tar = out / "train" / "shard-000002.tar"
    index = tar.with_name("shard-000002.idx.npy")
    bad = index if "index" in damage else tar
    if damage.endswith("missing"):
        bad.unlink()
    elif damage == "tar cut short":
        os.truncate(tar, tar.stat().st_size // 2)  # an interrupted copy
    elif damage.startswith("another"):  # a copy of another pack over part of this one (read as this one's before)
        if bad is index:  # two indexes of 7 samples: the same size
            other = bad.with_name("shard-000001.idx.npy")
        else:  # a tar's size is a multiple of 10 KiB: one that differs (the last shard holds fewer images)
            other = next(p for p in sorted(tar.parent.glob("*.tar")) if p.stat().st_size != tar.stat().st_size)
        assert other.read_bytes() != bad.read_bytes()
        shutil.copyfile(other, bad)
    else:
        bad.write_bytes(b"not an index")
    with pytest.raises(DataError) as caught:
        ShardsDataset(out, "train", eval_transform(32, 36))  # at setup, before any sample is read
    line = str(caught.value)
    assert line.startswith(f"{bad}: ") and "\n" not in line and f"cltrain-pack IMAGEFOLDER {out}" in line
    said = {"another tar": "bytes where the manifest says",
            "another index": "not the index the pack's manifest records"}
    assert said.get(damage, "") in line
    ShardsDataset(out, "val", eval_transform(32, 36))  # the other split is whole


def _wait_for(paths: list[Path], proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(any(p.parent.glob(p.name)) for p in paths):  # a name may be a glob pattern
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"the packer never wrote {paths}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO (POSIX)")
def test_a_killed_pack_resumes_without_redoing_finished_shards(folder: Path, tmp_path: Path) -> None:
    reference = json.loads(pack(folder, tmp_path / "reference", shard_size=7, progress=False).read_text())
    # Sample 20 of the packing order (in shard 2) becomes a FIFO: the packer blocks there, in the
    # middle of shard 2, until the test writes the file's bytes into it.
    victim = Path(_plan(folder, ["train", "val"], 0)[1]["train"][20][0])
    data = victim.read_bytes()
    victim.unlink()
    os.mkfifo(victim)
    out, train = tmp_path / "out", tmp_path / "out" / "train"
    cmd = [sys.executable, "-m", "cltrain.data.pack", str(folder), str(out), "--shard-size", "7", "--workers", "0"]
    first = warm.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for([train / "shard-000001.idx.npy", train / f"{TEMP_PREFIX}*-shard-000002.tar"], first)
    first.send_signal(signal.SIGKILL)
    assert first.wait(timeout=60) == -signal.SIGKILL
    assert not (out / MANIFEST).exists() and not (train / "shard-000002.tar").exists()
    with pytest.raises(DataError, match="not a complete cltrain pack"):
        ShardsDataset(out, "train", eval_transform(32, 36))
    kept = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in train.glob("shard-00000[01].*")}
    second = warm.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with open(victim, "wb") as fifo:  # blocks until the resumed packer opens it
        fifo.write(data)
    stdout, stderr = second.communicate(timeout=120)
    assert second.returncode == 0, stderr
    assert "pack train" in stderr and "train 33 images in 5 shards" in stdout  # progress bar, summary
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in kept} == kept  # finished shards not redone
    assert json.loads((out / MANIFEST).read_text()) == reference
    for split in ("train", "val"):  # the same shards as an uninterrupted pack, byte for byte
        for name in reference["splits"][split]["shards"]:
            assert (out / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()
    assert not list(out.rglob(f"{TEMP_PREFIX}*"))  # the killed pack's temporary shard was removed, and said so
    assert f"pack: removed 1 temporary file(s) left in {train} by a pack that was stopped" in stderr


@pytest.mark.parametrize("n,batch,world", [(33, 4, 2), (32, 4, 2), (17, 8, 2), (9, 2, 4), (1001, 64, 8), (5, 1, 5), (10, 3, 3)])
def test_rank_batch_sizes_give_equal_steps_and_every_sample_once(n: int, batch: int, world: int) -> None:
    sizes = [rank_batch_sizes(n, batch, world, r) for r in range(world)]
    assert len({len(s) for s in sizes}) == 1  # ranks stay in step
    assert sum(map(sum, sizes)) == n and all(1 <= b <= batch for s in sizes for b in s)


def test_rank_batch_sizes_make_no_batch_of_one_where_the_batch_size_allows() -> None:
    # 21 images in batches of 4 ended in a batch of 1: ResNet's BatchNorm at 32 px raised in training
    # ("Expected more than 1 value per channel"), where the folder's loader (drop_last) trained
    for n in range(2, 80):
        for batch in (3, 4, 5, 8):
            for world in (1, 2, 3):
                if n < 2 * world:
                    continue
                sizes = [rank_batch_sizes(n, batch, world, r) for r in range(world)]
                assert len({len(s) for s in sizes}) == 1 and sum(map(sum, sizes)) == n
                # where a rank's images fill its batches with two or more each
                assert all(min(s) >= 2 for s in sizes if sum(s) >= 2 * len(s)), (n, batch, world, sizes)


def test_rank_batch_sizes_refuse_what_cannot_stay_in_step() -> None:
    with pytest.raises(ValueError, match="batch_size=1"):
        rank_batch_sizes(5, 1, 2, 1)
    with pytest.raises(ValueError, match="3 samples cannot be split over 4 ranks"):
        rank_batch_sizes(3, 2, 4, 0)


def test_sampler_splits_each_epoch_exactly_once_in_a_new_order() -> None:
    data = range(33)
    orders = []
    for epoch in (0, 1):
        batches = []
        for rank in (0, 1):
            sampler = ShardBatchSampler(data, 4, num_replicas=2, rank=rank, seed=3)
            sampler.set_epoch(epoch)
            batches.append(list(sampler))
        assert len(batches[0]) == len(batches[1]) == len(ShardBatchSampler(data, 4, 2, 0))
        flat = [i for rank in batches for b in rank for i in b]
        assert sorted(flat) == list(range(33))
        orders.append(flat)
    assert orders[0] != orders[1]
    unshuffled = [i for b in ShardBatchSampler(data, 4, 1, 0, shuffle=False) for i in b]
    assert unshuffled == list(range(33))


class _Shards:
    """Just what the sampler reads of a dataset: its length and its shard sizes."""

    shard_sizes = [7, 7, 7, 7, 5]

    def __len__(self) -> int:
        return 33


def test_shuffle_window_mixes_runs_of_shards_exactly_once() -> None:
    shard_of = np.repeat(np.arange(5), _Shards.shard_sizes)
    orders = []
    for epoch in (0, 1):
        samplers = [ShardBatchSampler(_Shards(), 4, num_replicas=2, rank=r, seed=1, shuffle_window=2) for r in (0, 1)]
        for s in samplers:
            s.set_epoch(epoch)
        flat = [i for s in samplers for b in s for i in b]
        assert sorted(flat) == list(range(33)) and flat == list(samplers[0].order())
        shards, pos, windows = shard_of[flat].tolist(), 0, []
        while pos < 33:  # each window: the next two shards (one at the end), all their samples, nothing else
            first = shards[pos]
            window = {first, next((k for k in shards[pos:] if k != first), first)}
            end = pos + sum(_Shards.shard_sizes[k] for k in window)
            assert set(shards[pos:end]) == window, (epoch, shards)
            windows.append(shards[pos:end])
            pos = end
        assert [len(set(w)) for w in windows] == [2, 2, 1]
        assert any(w != sorted(w) and w != sorted(w, reverse=True) for w in windows)  # mixed within a window
        orders.append(flat)
    assert orders[0] != orders[1]
    with pytest.raises(ValueError, match="shuffle_window=0"):
        ShardBatchSampler(_Shards(), 4, shuffle_window=0)


def test_datamodule_gives_the_imagefolder_batches(folder: Path, tmp_path: Path) -> None:
    pack(folder, tmp_path / "out", shard_size=7, progress=False)
    kw = dict(batch_size=8, num_workers=2, image_size=32, val_resize_size=36)
    shards, files = ShardsDataModule(tmp_path / "out", **kw), ImageFolderDataModule(folder, **kw)
    assert (shards.num_classes, shards.input_shape, shards.classes) == (files.num_classes, files.input_shape, files.classes)
    shards.setup("fit")
    files.setup("fit")
    by_bytes = {Path(p).read_bytes(): (p, y) for p, y in files.val_set.samples}
    seen = []
    for images, targets in shards.val_dataloader():  # two worker processes, normalised there (a CPU run)
        assert images.dtype == torch.float32 and images.is_contiguous(memory_format=torch.channels_last)
        seen.append((images, targets))
    assert sum(len(t) for _, t in seen) == 15
    for i, (images, targets) in zip(range(0, 15, 8), seen):  # unshuffled: sample i is the i-th
        for j in range(len(targets)):
            path, label = by_bytes[shards.val_set.read(i + j)]
            assert int(targets[j]) == label
            expected = normalize(torch.from_numpy(files.eval_transform(path)).permute(2, 0, 1)[None])[0]
            torch.testing.assert_close(images[j], expected)  # the same decode path, pixel for pixel
    uint8 = NHWCCollate()([shards.val_set.load(i) for i in range(4)])  # as a loader for a GPU hands it over
    batch = shards.on_after_batch_transfer(uint8, 0)  # normalised on the device
    torch.testing.assert_close(batch[0], seen[0][0][:4])
    assert batch[0].is_contiguous(memory_format=torch.channels_last)
    x, y = next(iter(shards.train_dataloader()))
    assert x.shape == (8, 3, 32, 32) and x.is_contiguous(memory_format=torch.channels_last)


def test_app_builds_shards_from_data_shards(folder: Path, tmp_path: Path) -> None:
    from cltrain.app.cli import compose_config
    from cltrain.app.config import ConfigError
    from cltrain.app.train import build_datamodule

    pack(folder, tmp_path / "out", shard_size=7, progress=False)
    dm = build_datamodule(compose_config(["data=shards", f"data.root={tmp_path / 'out'}"]))
    assert isinstance(dm, ShardsDataModule) and dm.num_classes == 3 and dm.channels_last
    with pytest.raises(ConfigError) as caught:
        build_datamodule(compose_config(["data=shards", f"data.root={folder}"]))  # the folder, not its pack
    assert f"is an image folder, not a pack: pack it with `cltrain-pack {folder} {folder}-pack`" in str(caught.value)
    assert "(allowed: a pack cltrain-pack wrote" in str(caught.value) and "ImageNet-layout" not in str(caught.value)
    with pytest.raises(ConfigError, match="not a complete cltrain pack. Make one with `cltrain-pack IMAGEFOLDER"):
        build_datamodule(compose_config(["data=shards", f"data.root={tmp_path}"]))  # no pack, no folder


@pytest.mark.slow
def test_ddp_two_ranks_two_workers_every_sample_exactly_once_per_epoch(folder: Path, tmp_path: Path) -> None:
    pack(folder, tmp_path / "out", shard_size=7, progress=False)  # 33 train in 5 shards, 15 val
    proc = warm.run([sys.executable, "-m", "tests.helpers.shards_ddp_run", str(tmp_path / "out"), str(tmp_path), "2"],
                    cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world_size"] == 2 for r in ranks) and ranks[0]["steps"] == ranks[1]["steps"] == 2 * 5
    shard_of = ShardsDataset(tmp_path / "out", "train", eval_transform(32, 36)).shard_of
    for split, n in (("train", 33), ("val", 15)):
        orders = []
        for epoch in (0, 1):
            steps = [[s for s in r[split] if s["epoch"] == epoch] for r in ranks]
            assert len(steps[0]) == len(steps[1])  # ranks in step
            assert {s["worker"] for r in steps for s in r} == {0, 1}  # both workers of each rank read
            ids = [i for r in steps for s in r for i in s["ids"]]
            assert sorted(ids) == list(range(n)), (split, epoch, Counter(ids))  # exactly once: no duplicate, none missing
            orders.append([i for r in steps for s in r for i in s["ids"]])
        if split == "train":
            assert orders[0] != orders[1]  # a new order each epoch
            first = [s["ids"] for s in ranks[0]["train"] if s["epoch"] == 0][0]
            assert len({int(shard_of[i]) for i in first}) > 1  # a batch mixes shards
