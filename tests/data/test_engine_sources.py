"""Datasets other engines wrote, read from a real S3 server (moto's, on 127.0.0.1) into NHWC batches: LitData's
optimized chunks give the folder's pixels (the JPEG bytes decoded by cltrain's decoder, never LitData's), each
sample once per epoch, and a run resumed mid-epoch ends where the uninterrupted run ends."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cltrain.data import ImageFolderDataModule
from cltrain.data.errors import DataError
from tests.helpers.data_fixtures import write_image_folder
from tests.helpers.s3 import S3Server, s3_env, s3_env_fixture, s3_server_fixture  # noqa: F401 - the fixtures server and env

pytest.importorskip("s3fs", reason="the object-storage tests need s3fs and moto: pip install -e '.[test]'")
pytest.importorskip("moto.server", reason="the object-storage tests need moto[server]: pip install -e '.[test]'")
litdata = pytest.importorskip("litdata", reason="the LitData source needs litdata: pip install -e '.[litdata]'")

KW = dict(batch_size=4, num_workers=2, image_size=24, val_resize_size=28, persistent_workers=False)


class _Item:
    """What LitData's README optimizes: the image opened from its file (stored as the file's bytes) and its class."""

    def __call__(self, path: str) -> dict:
        from PIL import Image

        return {"image": Image.open(path), "class": int(Path(path).parent.name[1:])}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("images") / "f", classes=2, train=6, val=3, size=(48, 40))


@pytest.fixture(scope="module")
def lit_url(folder: Path, server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> str:
    import multiprocessing

    out, method = tmp_path_factory.mktemp("litdata"), multiprocessing.get_start_method()
    try:
        for split in ("train", "val"):
            files = sorted(str(p) for p in (folder / split).rglob("*.jpg"))
            litdata.optimize(fn=_Item(), inputs=files, output_dir=str(out / split), chunk_bytes="20KB", num_workers=1,
                             mode="overwrite")  # several chunks per split
    finally:  # optimize() makes spawn the start method of the whole process: every later test's workers would spawn
        multiprocessing.set_start_method(method, force=True)
    return server.upload(out, "bucket", "litdata")


def test_litdata_chunks_give_the_folders_pixels_through_cltrains_decoder(folder, lit_url, env):
    from cltrain.data.datamodules.engines import LitDataModule

    lit = LitDataModule(lit_url, num_classes=2, cache_dir=str(env / "lit"), **KW)
    files = ImageFolderDataModule(folder, **KW)
    lit.setup("fit")
    files.setup("fit")
    assert len(lit.train_set) == 12 and len(lit.val_set) == 6
    by_bytes = {hashlib.sha1(Path(p).read_bytes()).digest(): (p, y) for p, y in files.val_set.samples}
    for i in range(len(lit.val_set)):
        data, label = lit.val_set.source(i)
        path, expected = by_bytes[hashlib.sha1(data).digest()]  # the file's own bytes, undecoded by LitData
        assert label == expected
        assert np.array_equal(lit.val_set.load(i)[0], files.eval_transform(path))  # cltrain's decode, pixel for pixel
    batches = list(lit.val_dataloader())  # two workers, normalised in them (a CPU run)
    assert sum(len(t) for _, t in batches) == 6
    assert all(x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last) for x, _ in batches)
    x, _ = next(iter(lit.train_dataloader()))
    assert x.shape == (4, 3, 24, 24) and x.is_contiguous(memory_format=torch.channels_last)


def test_a_litdata_run_resumed_mid_epoch_ends_where_the_uninterrupted_run_ends(lit_url, env):
    from tests.data.test_resume_state import _run, _state

    from cltrain.data.datamodules import engines

    options = dict(lit=True, num_classes=2, cache_dir=str(env / "lit"))
    whole, trainer, _ = _run(lit_url, env / "whole", 2, every=1, **options)
    assert trainer.global_step == 2 * 3
    resumed, again, said = _run(lit_url, env / "from4", 2, ckpt_path=str(env / "whole" / "step=4.ckpt"), **options)
    assert again.global_step == trainer.global_step
    assert all(torch.equal(a, b) for a, b in zip(_state(whole), _state(resumed)))
    assert not [m for m in said if "not resumable" in m]
    assert engines.LitDataModule.takes_urls


class _FileBytes:
    """An item whose image is the file's bytes, stored by LitData's own ``bytes`` serializer."""

    def __call__(self, path: str) -> dict:
        return {"image": Path(path).read_bytes(), "class": int(Path(path).parent.name[1:])}


def test_a_bucket_s_litdata_chunks_are_cached_whole_and_raw_bytes_items_read(folder, server, env, tmp_path):
    import multiprocessing

    from cltrain.data import eval_transform
    from cltrain.data.litdata_source import LitDataImages

    method = multiprocessing.get_start_method()
    try:
        files = sorted(str(p) for p in (folder / "val").rglob("*.jpg"))
        litdata.optimize(fn=_FileBytes(), inputs=files, output_dir=str(tmp_path / "raw"), chunk_bytes="20KB",
                         num_workers=1, mode="overwrite")
    finally:
        multiprocessing.set_start_method(method, force=True)
    url = server.upload(tmp_path / "raw", "bucket", "raw-bytes")
    # LitData's by-index read fetched each item by a ranged GET, caching nothing, and failed on raw bytes items
    images = LitDataImages(url, eval_transform(24, 28), cache_dir=str(env / "lit"))
    expected = {Path(p).read_bytes() for p in files}
    assert {images.source(i)[0] for i in range(len(images))} == expected
    assert len(list((env / "lit").rglob("chunk-*.bin"))) == len(litdata_index_chunks(tmp_path / "raw"))
    # a split larger than the cache is read by range, as LitData reads it: where LitData cannot, one line says why
    with pytest.raises(DataError, match=r"fails to read an item by byte range .* max_cache_size='1KB'; pass a "
                                        r"max_cache_size that holds it") as caught:
        LitDataImages(url, eval_transform(24, 28), cache_dir=str(env / "small"), max_cache_size="1KB")
    assert "\n" not in str(caught.value)


def litdata_index_chunks(root: Path) -> list:
    import json

    return json.loads((root / "index.json").read_text())["chunks"]


def test_not_a_litdata_dataset_is_one_line(env, server):
    from cltrain.data.datamodules.engines import LitDataModule

    with pytest.raises(DataError, match="is not a LitData optimized dataset") as caught:
        LitDataModule("s3://bucket/nothing-here", num_classes=2, **KW).setup("fit")
    assert "\n" not in str(caught.value)


def test_an_empty_litdata_dataset_is_one_line(tmp_path):
    from cltrain.data.datamodules.engines import LitDataModule

    for split in ("train", "val"):  # what a failed litdata.optimize() leaves
        (tmp_path / split).mkdir()
        (tmp_path / split / "index.json").write_text('{"chunks": [], "config": null}')
    with pytest.raises(DataError, match="an empty LitData dataset .*run litdata.optimize again") as caught:
        LitDataModule(str(tmp_path), num_classes=2, **KW).setup("fit")
    assert "\n" not in str(caught.value)


def test_an_empty_webdataset_is_one_line_not_a_run_on_nothing(tmp_path):
    import tarfile

    from cltrain.data.datamodules.engines import WebDatasetModule

    pytest.importorskip("webdataset")
    for split in ("train", "val"):  # valid tars without a sample
        (tmp_path / split).mkdir()
        tarfile.open(tmp_path / split / "shard-0000.tar", "w").close()
    dm = WebDatasetModule(str(tmp_path), num_classes=2, **{**KW, "num_workers": 0})
    dm.setup("fit")
    with pytest.raises(DataError, match="no sample to read") as caught:
        list(dm.train_dataloader())
    assert "\n" not in str(caught.value) and "train" in str(caught.value)
    _local_wds(tmp_path / "bad", [b"", b"not a jpeg"])  # samples, none readable: not "empty" alone
    dm = WebDatasetModule(str(tmp_path / "bad"), num_classes=2, bad_files="skip", train_split="train",
                          val_split="train", **{**KW, "num_workers": 0})
    dm.setup("fit")
    with pytest.raises(DataError, match="or each of its samples was unreadable and skipped"):
        list(dm.train_dataloader())


@pytest.fixture(scope="module")
def wds_url(folder: Path, server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The folder as WebDataset's own ShardWriter writes it: 2 training shards, 1 validation shard."""
    wds = pytest.importorskip("webdataset")
    out = tmp_path_factory.mktemp("wds")
    for split, per_shard in (("train", 6), ("val", 100)):
        (out / split).mkdir()
        with wds.ShardWriter(str(out / split / "shard-%04d.tar"), maxcount=per_shard, verbose=0) as sink:
            for p in sorted((folder / split).rglob("*.jpg")):
                sink.write({"__key__": f"{p.parent.name}_{p.stem}", "jpg": p.read_bytes(),
                            "cls": str(int(p.parent.name[1:])).encode()})
    return server.upload(out, "bucket", "wds")


def _pixels(samples) -> list[tuple[bytes, int]]:
    return sorted((hashlib.sha1(np.ascontiguousarray(x).tobytes()).digest(), int(y)) for x, y in samples)


def test_webdataset_shards_give_the_folders_pixels_through_cltrains_decoder(folder, wds_url, env):
    from cltrain.data import eval_transform
    from cltrain.data.webdataset_source import WebDatasetImages

    tf = eval_transform(24, 28)
    val = WebDatasetImages(wds_url, "val", tf, shuffle_buffer=None, cache_dir=str(env / "c"))
    expected = [(tf(str(p)), int(p.parent.name[1:])) for p in (folder / "val").rglob("*.jpg")]
    assert _pixels(val) == _pixels(expected)  # every sample once, decoded by cltrain from the stored bytes


def test_a_webdataset_shard_removed_during_the_run_is_one_line_naming_it_and_the_fix(folder, server, env, tmp_path):
    # said as a wrong URL was ("check the bucket and prefix ..., or make a pack with cltrain-pack")
    wds = pytest.importorskip("webdataset")
    from cltrain.data import eval_transform
    from cltrain.data.remote import RemoteError
    from cltrain.data.webdataset_source import WebDatasetImages

    (tmp_path / "w" / "train").mkdir(parents=True)
    with wds.ShardWriter(str(tmp_path / "w" / "train" / "shard-%04d.tar"), maxcount=6, verbose=0) as sink:
        for p in sorted((folder / "train").rglob("*.jpg")):
            sink.write({"__key__": f"{p.parent.name}_{p.stem}", "jpg": p.read_bytes(), "cls": b"0"})
    url = server.upload(tmp_path / "w", "bucket", "wds-removed")
    ds = WebDatasetImages(url, "train", eval_transform(24, 28), shuffle_buffer=None, cache_dir=str(env / "gone"))
    server.client().delete_object(Bucket="bucket", Key="wds-removed/train/shard-0001.tar")
    with pytest.raises(RemoteError) as caught:
        list(ds)
    line = str(caught.value)
    assert "\n" not in line and f"{url}/train/shard-0001.tar: not found" in line and "cltrain-pack" not in line
    assert f"{url}/train lost a shard listed when the run began: upload the split's shards again whole" in line


def test_webdataset_ranks_stay_in_step_with_fewer_shards_than_ranks_times_workers(folder, wds_url, env):
    from torch.utils.data import DataLoader

    from cltrain.data import train_transform
    from cltrain.data.webdataset_source import WebDatasetImages

    seen = []
    for rank in (0, 1):  # 2 shards for 2 ranks x 2 workers
        ds = WebDatasetImages(wds_url, "train", train_transform(24), rank=rank, world_size=2, shuffle_buffer=4,
                              cache_dir=str(env / "c"))
        ds.set_epoch(1)
        seen.append([y for _, y in DataLoader(ds, batch_size=None, num_workers=2)])
    assert len(seen[0]) == len(seen[1]) == 6  # each worker's shard of 6 split over 2 ranks: as many on each
    assert len(list((env / "c").rglob("*.tar"))) == 2  # the shards came once into the node's cache


def test_a_webdataset_run_trains_and_says_it_starts_a_stopped_epoch_again(wds_url, env):
    from cltrain.data.datamodules.engines import WebDatasetModule

    dm = WebDatasetModule(wds_url, num_classes=2, cache_dir=str(env / "c"), **KW)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    # each of the 2 workers reads one shard of 6: a batch of 4 and a partial one, dropped in training (drop_last)
    assert [len(t) for _, t in batches] == [4, 4]
    assert all(x.is_contiguous(memory_format=torch.channels_last) for x, _ in batches)
    from cltrain.data.resume_state import is_resumable
    from cltrain.data.stream_place import is_stream

    assert not is_stream(dm.train_set) and not is_resumable(None)  # no place kept: Lightning restarts the epoch
    # a run stopped after its first step and resumed: one line says the epoch starts again
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.data.test_resume_state import Net

    def fit(ckpt_path: str | None = None, epochs: int = 1, steps: int = -1, folder: str = "wds-run") -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            saves = ModelCheckpoint(dirpath=env / folder, every_n_train_steps=1, save_top_k=-1, filename="{step}") \
                if steps < 0 else ModelCheckpoint(dirpath=env / folder, save_last=True)  # last.ckpt: at the fit's end
            trainer = pl.Trainer(max_epochs=epochs, max_steps=steps, accelerator="cpu", logger=False,
                                 enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                                 num_sanity_val_steps=0, callbacks=[saves])
            trainer.fit(Net(), datamodule=WebDatasetModule(wds_url, num_classes=2, cache_dir=str(env / "c"), **KW),
                        ckpt_path=ckpt_path)
        steps_run.append(trainer.global_step)
        return [str(w.message) for w in caught if "WebDataset keeps no place" in str(w.message)]

    steps_run: list[int] = []
    assert fit() == []
    said = fit(str(env / "wds-run" / "step=1.ckpt"))
    assert len(said) == 1 and "epoch 0 is read again from its first batch, after 1 batch(es)" in said[0], said
    # max_steps stopped it in its second epoch: Lightning's last.ckpt counts that epoch done; it is read again
    assert fit(epochs=2, steps=3, folder="wds-steps") == []
    said = fit(str(env / "wds-steps" / "last.ckpt"), epochs=2, folder="wds-steps")
    assert len(said) == 1 and "epoch 1 is read again from its first batch, after 1 batch(es)" in said[0], said
    assert steps_run[-2:] == [3, 5], steps_run  # the second epoch's two batches, from its first


def _local_wds(root: Path, images: list[bytes]) -> Path:
    wds = pytest.importorskip("webdataset")
    (root / "train").mkdir(parents=True)
    with wds.TarWriter(str(root / "train" / "shard-0000.tar")) as sink:
        for k, data in enumerate(images):  # the class is the sample's number: each sample known by its label
            sink.write({"__key__": f"s{k:03d}", "jpg": data, "cls": str(k).encode()})
    return root


def test_a_webdataset_sample_under_any_of_the_folders_image_suffixes_is_read(folder, tmp_path):
    # cltrain-pack keeps each file's suffix as its field: a BMP, TIFF or PPM was "no image field" (a skip put the
    # sample before it in its place)
    import io

    from PIL import Image

    from cltrain.data import eval_transform
    from cltrain.data.webdataset_source import WebDatasetImages

    wds = pytest.importorskip("webdataset")
    (tmp_path / "w" / "train").mkdir(parents=True)
    photo = sorted((folder / "train").rglob("*.jpg"))[0]
    files = []
    with wds.TarWriter(str(tmp_path / "w" / "train" / "shard-0000.tar")) as sink:
        for k, (field, fmt) in enumerate({"bmp": "BMP", "TIF": "TIFF", "ppm": "PPM", "png": "PNG"}.items()):
            data = io.BytesIO()
            Image.open(photo).save(data, fmt)
            files.append(data.getvalue())
            sink.write({"__key__": f"s{k}", field: files[-1], "cls": str(k).encode()})
    tf = eval_transform(24, 28)
    samples = list(WebDatasetImages(str(tmp_path / "w"), "train", tf, shuffle_buffer=None))
    assert sorted(int(y) for _, y in samples) == [0, 1, 2, 3]
    assert all(np.array_equal(x, tf(files[int(y)])) for x, y in samples)  # as the folder decodes the file


def test_a_bad_sample_of_a_pack_read_as_webdataset_names_the_file_it_was_made_from(tmp_path):
    # cltrain-pack keeps each file's path beside its bytes: the line named the sample's number alone
    from cltrain.data import eval_transform
    from cltrain.data.errors import BadImageError
    from cltrain.data.webdataset_source import WebDatasetImages

    wds = pytest.importorskip("webdataset")
    (tmp_path / "w" / "train").mkdir(parents=True)
    with wds.TarWriter(str(tmp_path / "w" / "train" / "shard-0000.tar")) as sink:
        sink.write({"__key__": "000000000", "jpg": b"", "cls": b"0", "path": b"train/c0/empty.jpg"})
    with pytest.raises(BadImageError, match=r"train/shard-0000\.tar sample 0 \(000000000: train/c0/empty\.jpg\): "
                                            r"cannot be read as an image \(empty file"):
        list(WebDatasetImages(str(tmp_path / "w"), "train", eval_transform(24, 28), shuffle_buffer=None))


def test_a_label_of_no_class_is_a_bad_sample_named_by_its_key(folder, tmp_path):
    from cltrain.data.datamodules.engines import WebDatasetModule
    from cltrain.data.errors import BadImageError

    jpegs = [p.read_bytes() for p in sorted((folder / "train").rglob("*.jpg"))][:8]
    root = _local_wds(tmp_path / "wds", jpegs)  # labels 0 .. 7
    (root / "val").mkdir()
    shutil.copy(root / "train" / "shard-0000.tar", root / "val")
    settings = {**KW, "num_workers": 0, "batch_size": 2, "shuffle_buffer": None}
    raising = WebDatasetModule(str(root), num_classes=3, **settings)
    raising.setup("fit")
    with pytest.raises(BadImageError, match=r"sample 3 \(s003\): label 3 is no class of num_classes=3\. Set "
                                            r"num_classes to the number of classes, or mend the label \(bad_files"):
        list(raising.train_dataloader())
    skipping = WebDatasetModule(str(root), num_classes=3, bad_files="skip", **settings)
    skipping.setup("fit")
    labels = torch.cat([y for _, y in skipping.train_dataloader()]).tolist()
    assert labels == [0, 1, 2, 2, 2, 2, 2, 2], labels  # the last readable sample stands in for each


def test_webdataset_ranks_stay_in_step_when_a_bad_sample_comes_first_and_shuffle_apart(folder, tmp_path):
    from cltrain.data import eval_transform
    from cltrain.data.webdataset_source import WebDatasetImages

    jpegs = [p.read_bytes() for p in sorted((folder / "train").rglob("*.jpg"))][:12]
    root = _local_wds(tmp_path / "wds", [jpegs[0][:200], *jpegs[1:]])  # the first sample is cut short
    labels = []
    for rank in (0, 1):
        ds = WebDatasetImages(root, "train", eval_transform(24, 28), rank=rank, world_size=2, shuffle_buffer=None,
                              bad_files="skip", skip_log=tmp_path / f"skipped{rank}.tsv")
        labels.append([y for _, y in ds])
    assert len(labels[0]) == len(labels[1]) == 6  # rank 0's first sample is bad: the next readable one stands in
    assert labels[0][:2] == [2, 2] and sorted(set(labels[0] + labels[1])) == list(range(1, 12))
    shuffled, whole = [], _local_wds(tmp_path / "whole", jpegs)
    for rank in (0, 1):
        ds = WebDatasetImages(whole, "train", eval_transform(24, 28), rank=rank, world_size=2, shuffle_buffer=4)
        shuffled.append([y for _, y in ds])
    assert sorted(shuffled[0] + shuffled[1]) == list(range(12))  # every sample once over the ranks
    # each rank's buffer has its own order: rank 1's samples are not rank 0's tar neighbours, place by place
    assert [b - a for a, b in zip(*shuffled)] != [1] * 6, shuffled


@pytest.fixture(scope="module")
def mds_url(folder: Path, server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The folder as Mosaic's MDSWriter writes it (its README's columns: a PIL JPEG opened from the file, an int)."""
    streaming = pytest.importorskip("streaming", reason="the MDS source needs mosaicml-streaming (the mds extra; not in "
                                                        "test: it pins numpy<2.2 and transformers<5)")
    from PIL import Image

    out = tmp_path_factory.mktemp("mds")
    for split in ("train", "val"):
        with streaming.MDSWriter(out=str(out / split), columns={"image": "jpeg", "class": "int"},
                                 size_limit=6_000) as sink:  # several shards per split
            for p in sorted((folder / split).rglob("*.jpg")):
                sink.write({"image": Image.open(p), "class": int(p.parent.name[1:])})
    return server.upload(out, "bucket", "mds")


@pytest.mark.parametrize("image_key", [None, "pixels"])
def test_an_mds_column_of_decoded_pixels_is_one_line_saying_so(folder, tmp_path, image_key):
    # Mosaic's "pil" encoding: "no image column ...; pass image_key=<column>", and with it every sample unreadable
    streaming = pytest.importorskip("streaming", reason="the MDS source needs mosaicml-streaming (the mds extra)")
    from PIL import Image

    from cltrain.data import eval_transform
    from cltrain.data.mds_source import MDSImages

    photo = sorted((folder / "val").rglob("*.jpg"))[0]
    for columns in ({"pixels": "pil", "class": "int"}, {"pixels": "pil", "image": "jpeg", "class": "int"}):
        out = tmp_path / str(len(columns)) / "val"
        with streaming.MDSWriter(out=str(out), columns=columns) as sink:
            sink.write({c: Image.open(photo) if c != "class" else 0 for c in columns})
        if "image" in columns and image_key is None:  # the file's bytes beside: that column is read
            assert MDSImages(out.parent, "val", eval_transform(24, 28)).image_key == "image"
            continue
        with pytest.raises(DataError, match=r"/val: its column 'pixels' holds 'pil' \(decoded pixels\), not an "
                                            r"image file's bytes; write the files' bytes \(a 'jpeg', 'png' or 'bytes'"):
            MDSImages(out.parent, "val", eval_transform(24, 28), image_key=image_key)


def test_mds_shards_give_the_folders_pixels_and_a_resumed_run_ends_where_the_whole_run_ends(folder, mds_url, env):
    from cltrain.data import eval_transform
    from cltrain.data.mds_source import MDSImages
    from tests.data.test_resume_state import _run, _state

    tf = eval_transform(24, 28)
    val = MDSImages(mds_url, "val", tf, cache_dir=str(env / "c"))
    assert len(val.readers) > 1 and len(val) == 6
    expected = [(tf(str(p)), int(p.parent.name[1:])) for p in (folder / "val").rglob("*.jpg")]
    assert _pixels(val[i] for i in range(len(val))) == _pixels(expected)
    options = dict(mds=True, num_classes=2, cache_dir=str(env / "c"))
    whole, trainer, _ = _run(mds_url, env / "whole", 2, every=1, **options)
    resumed, _, said = _run(mds_url, env / "from4", 2, ckpt_path=str(env / "whole" / "step=4.ckpt"), **options)
    assert trainer.global_step == 6 and all(torch.equal(a, b) for a, b in zip(_state(whole), _state(resumed)))
    assert not [m for m in said if "not resumable" in m]


def test_a_storage_failure_is_never_skipped_as_a_bad_sample(server, env, monkeypatch, tmp_path):
    import fsspec.config

    from cltrain.data import ShardsDataset, eval_transform
    from cltrain.data.pack import pack
    from cltrain.data.remote import RemoteError
    from tests.helpers.s3 import FaultProxy

    pack(write_image_folder(tmp_path / "f", classes=2, train=3, val=1), tmp_path / "p", shard_size=3, progress=False)
    url = server.upload(tmp_path / "p", "bucket", "skip-pack")
    proxy = FaultProxy(server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"retries": {"max_attempts": 1}}})
    ds = ShardsDataset(url, "train", eval_transform(24, 28), bad_files="skip")  # manifest and indexes read
    proxy.stop()  # then the store goes away
    with pytest.raises(RemoteError, match="cannot be reached"):
        ds[[0, 1]]
    assert not ds._warned  # nothing was listed as a bad sample


def test_the_sources_pass_a_storage_failure_on_under_bad_files_skip(tmp_path):
    # what the engines' sources (LitData, MDS) raise when their store or cache fails: never skipped as bad items
    from cltrain.data import eval_transform
    from cltrain.data.image_samples import ImageSamples
    from cltrain.data.remote import RemoteError

    class Lost(ImageSamples):
        transform = eval_transform(24, 28)

        def __init__(self) -> None:
            self._set_policy("skip", tmp_path / "skipped.tsv")

        def __len__(self) -> int:
            return 4

        def source(self, index: int):
            raise RemoteError(f"s3://bucket/data item {index}: the storage endpoint cannot be reached")

        def unreadable_message(self, index: int, reason: str) -> str:
            return f"item {index}: {reason}"

    lost = Lost()
    with pytest.raises(RemoteError, match="cannot be reached"):
        lost.__getitems__([0, 1])
    assert not lost._warned and not (tmp_path / "skipped.tsv").exists()


def test_an_empty_sample_is_said_as_every_source_says_it_and_named_by_its_key(folder, tmp_path):
    from cltrain.data import eval_transform
    from cltrain.data.errors import BadImageError
    from cltrain.data.webdataset_source import WebDatasetImages

    jpegs = [p.read_bytes() for p in sorted((folder / "train").rglob("*.jpg"))][:4]
    root = _local_wds(tmp_path / "wds", [jpegs[0], b"", *jpegs[1:]])
    log = tmp_path / "skipped.tsv"
    ds = WebDatasetImages(root, "train", eval_transform(24, 28), shuffle_buffer=None, bad_files="skip", skip_log=log)
    assert len(list(ds)) == 5  # the one before stands in
    assert log.read_text().split("\t")[1:] == ["train/shard-0000.tar sample 1 (s001)", "empty file (0 bytes)\n"]
    raising = WebDatasetImages(root, "train", eval_transform(24, 28), shuffle_buffer=None)
    with pytest.raises(BadImageError, match=r"sample 1 \(s001\): cannot be read as an image \(empty file \(0 bytes\)\)"
                                            r"\. Pass bad_files='skip' .*, or write the shard again\."):
        list(raising)


def test_a_bucket_s_litdata_items_read_by_many_decode_threads_at_once_are_their_own(lit_url, env, tmp_path):
    # LitData's reader is not thread-safe: the app's decode threads reading from a cold chunk cache at once failed
    # (AssertionError, struct.error of an empty buffer) or got another item, so identical runs trained differently
    import random
    from concurrent.futures import ThreadPoolExecutor

    from cltrain.data import eval_transform
    from cltrain.data.litdata_source import LitDataImages

    url = f"{lit_url}/train"
    expected = [LitDataImages(url, eval_transform(24, 28), cache_dir=str(tmp_path / "one")).source(i)
                for i in range(12)]
    for attempt in range(3):
        images = LitDataImages(url, eval_transform(24, 28), cache_dir=str(tmp_path / f"many{attempt}"))
        order = random.Random(attempt).sample(range(len(images)), len(images)) * 2
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(images.source, order))
        assert got == [expected[i] for i in order]
