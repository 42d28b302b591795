"""Hugging Face datasets through the NHWC path: real ``datasets`` on disk (``save_to_disk``, Parquet files, a Hub
id from the local cache, streamed), the folder path's pixels, labels from the ClassLabel, JPEG rows never through
Pillow, bad rows skipped and listed by index or raised in one line, 0 and 2 workers, a stream under DDP."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from PIL import Image
from torch import nn

from cltrain.data import SKIPPED_FILES_NAME, BadImageError, HFImageDataModule, SkippedFilesReport, eval_transform, normalize
from cltrain.data.errors import error_line
from tests.helpers import REPO
from tests.helpers.plain_modules import Classifier

pytest.importorskip("datasets")
from tests.helpers.hf_data import HUB_ID, image_rows, png_bytes, write_hf_dataset  # noqa: E402 - needs datasets
from tests.helpers import warm

NAMES = ["cat", "dog", "fox"]
BAD_ROWS = {7: "truncated", 11: "html"}


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict:
    train, labels = image_rows(20, 3, seed=0)
    good = train[0]["bytes"]
    odd = {3: png_bytes(), 7: good[: len(good) // 2], 11: b"<!DOCTYPE html><html>404</html>"}
    train_odd = image_rows(20, 3, seed=0, odd=odd)
    val = image_rows(8, 3, seed=1)
    root = tmp_path_factory.mktemp("hf")
    paths = write_hf_dataset(root / "good", {"train": (train, labels), "validation": val}, NAMES)
    bad = write_hf_dataset(root / "bad", {"train": train_odd, "validation": val}, NAMES)
    return {"paths": paths, "bad": bad, "val": val, "train_odd": train_odd}


def _dm(root: Path, **kw) -> HFImageDataModule:
    args = dict(batch_size=4, num_workers=0, decode_threads=2, image_size=24, val_resize_size=28)
    return HFImageDataModule(root, **{**args, **kw})


@pytest.mark.parametrize("source,streaming", [("saved", False), ("parquet", False), ("parquet", True), ("saved", True)])
def test_rows_give_the_pixels_of_the_files_and_the_classlabel(hf, source, streaming):
    # no shuffle buffer: datasets sleeps 5 s where a shuffled Parquet stream ends (the streaming tests below shuffle)
    dm = _dm(hf["paths"][source], streaming=streaming, shuffle_buffer=None)
    assert dm.classes == NAMES and dm.num_classes == 3
    dm.setup("fit")
    cells, labels = hf["val"]
    seen = 0
    for images, targets in dm.val_dataloader():  # normalised on the CPU as they are collated, channels_last
        assert images.is_contiguous(memory_format=torch.channels_last) and images.dtype == torch.float32
        for image, target in zip(images, targets):
            expected = eval_transform(24, 28)(cells[seen]["bytes"])  # the folder path's transform on the same bytes
            torch.testing.assert_close(image, normalize(torch.from_numpy(expected).permute(2, 0, 1)[None])[0])
            assert int(target) == labels[seen]
            seen += 1
    assert seen == 8  # validation keeps every row, in order
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 24, 24) and y.dtype == torch.int64


def test_jpeg_rows_never_go_through_pillow_and_other_formats_do(hf, monkeypatch):
    opened = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append(1) or real_open(*a, **k))
    dm = _dm(hf["bad"]["saved"], batch_size=3, decode_threads=1)
    dm.setup("fit")
    dm.train_set.__getitems__([0, 1, 2])  # JPEG rows: libjpeg-turbo straight into the batch
    assert opened == []
    dm.train_set.__getitems__([3])  # an RGBA PNG row: through Pillow, as from a folder
    assert opened


def _fit(root: Path, run: Path, workers: int, bad_files: str, streaming: bool) -> tuple[L.Trainer, Classifier]:
    model = Classifier(nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)))
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=run,
                        callbacks=[SkippedFilesReport()])
    trainer.fit(model, datamodule=_dm(root, batch_size=5, num_workers=workers, bad_files=bad_files, streaming=streaming))
    return trainer, model


def test_a_bad_validation_row_counts_as_the_validation_splits(tmp_path):
    # the list names the split "validation", as the dataset does: data/skipped_val stayed 0
    splits = {"train": image_rows(10, 3, seed=0), "validation": image_rows(8, 3, seed=1, odd={3: b"<html>404</html>"})}
    trainer, _ = _fit(write_hf_dataset(tmp_path / "d", splits, NAMES)["saved"], tmp_path / "run", 0, "skip", False)
    assert trainer.callback_metrics["data/skipped_val"] == 1 and trainer.callback_metrics["data/skipped_train"] == 0


@pytest.mark.parametrize("streaming", [False, True])
def test_a_row_whose_empty_image_datasets_stored_as_no_bytes_is_said_as_such(tmp_path, monkeypatch, streaming):
    # datasets keeps an empty file's bytes as none and its bare name as the path (to_parquet of an imagefolder
    # keeps the path alone): the reason was a FileNotFoundError, or Pillow's "cannot identify image file" streamed
    from datasets import ClassLabel, Dataset, Features, Image as HFImage

    from cltrain.data.hf_dataset import HFImageDataset, HFStreamingDataset

    cells, labels = image_rows(2, 2)
    cells[1] = {"bytes": None if streaming else b"", "path": "zero.jpg"}
    dataset = Dataset.from_dict({"image": cells, "label": labels}, features=Features(
        {"image": HFImage(decode=False), "label": ClassLabel(names=NAMES[:2])}))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "zero.jpg").write_bytes(b"")
    if streaming:
        rows = list(HFStreamingDataset(dataset.to_iterable_dataset(), eval_transform(32, 36), split="train",
                                       bad_files="skip", skip_log=tmp_path / "skipped.tsv"))
        assert rows and (tmp_path / "skipped.tsv").read_text().rstrip().endswith("\tempty file (0 bytes)")
        return
    rows = HFImageDataset(dataset, eval_transform(32, 36), split="train")
    assert rows[0][0].shape == (32, 32, 3)
    with pytest.raises(BadImageError, match=r"row 1 \(zero\.jpg\): .*(\(empty file \(0 bytes\)\)|"
                                            r"no bytes and its path 'zero\.jpg' is no file here)"):
        rows[1]


def test_rows_of_turned_photos_come_upright_as_datasets_decodes_them(tmp_path):
    # datasets turns a photo upright by its EXIF orientation as it decodes: the source's default left it on its side
    import io

    import numpy as np
    from datasets import load_from_disk
    from torchvision.transforms import v2

    rows, labels = image_rows(8, 2, size=(64, 40))
    for row in rows[:4]:  # stored 64x40, to be shown 40x64
        with Image.open(io.BytesIO(row["bytes"])) as img:
            exif, buf = img.getexif(), io.BytesIO()
            exif[0x0112] = 6
            img.save(buf, format="JPEG", quality=95, exif=exif)
        row["bytes"] = buf.getvalue()
    root = write_hf_dataset(tmp_path / "d", {"train": (rows, labels), "validation": (rows, labels)}, NAMES[:2])["saved"]
    upright = _dm(root, image_size=(32, 20), val_resize_size=32)
    upright.setup("fit")
    theirs = v2.Compose([v2.PILToTensor(), v2.Resize(32, antialias=True), v2.CenterCrop((32, 20))])
    decoded = load_from_disk(str(root))["validation"]
    for k in range(8):
        mine = upright.val_set[k][0]
        ref = theirs(decoded[k]["image"].convert("RGB")).permute(1, 2, 0).numpy()
        assert mine.shape == ref.shape == (32, 20, 3)
        assert np.abs(mine.astype(int) - ref.astype(int)).max() <= 1, k
    sideways = _dm(root, image_size=(32, 20), val_resize_size=32, exif_transpose=False)
    sideways.setup("fit")
    assert not np.array_equal(sideways.val_set[0][0], upright.val_set[0][0])


@pytest.mark.parametrize("workers,streaming", [(0, False), (2, False), (2, True)])
def test_bad_rows_are_skipped_and_listed_by_index_or_raised_in_one_line(hf, tmp_path, workers, streaming):
    root = hf["bad"]["saved"]
    trainer, model = _fit(root, tmp_path / "skip", workers, "skip", streaming)
    assert len(model.seen["train"]) == 4  # 20 rows, batches of 5: the bad rows replaced, every batch whole
    assert trainer.callback_metrics["data/skipped_train"] == 2
    lines = [line.split("\t") for line in (tmp_path / "skip" / SKIPPED_FILES_NAME).read_text().splitlines()]
    names = {name for _, name, _ in lines}
    if streaming:  # no index in a shuffled stream: the place in the epoch's stream, and the file name
        assert {n.split(" (")[1] for n in names} == {"img_0007.jpg)", "img_0011.jpg)"}
        assert all(n.startswith("row ") and " of part " in n and " of epoch 0's stream (" in n for n in names), names
    else:
        assert names == {f"row {i} (img_{i:04d}.jpg)" for i in BAD_ROWS}
    assert {split for split, _, _ in lines} == {"train"}
    with pytest.raises(BadImageError) as raised:
        _fit(root, tmp_path / "raise", workers, "raise", streaming)
    line = error_line(raised.value)
    assert line.startswith(f"{root} (train) row ") and ": cannot be read as an image (" in line, line
    assert line.endswith("Pass bad_files='skip' to leave such rows out, or mend the row in the dataset."), line


def test_the_app_reads_a_hub_id_from_the_local_cache_offline(hf, monkeypatch):
    import datasets
    import huggingface_hub

    from cltrain.app.cli import compose_config
    from cltrain.app.config import ConfigError
    from cltrain.app.config.paths import check_paths
    from cltrain.app.train import build_datamodule

    # as HF_HUB_OFFLINE=1 HF_DATASETS_CACHE=<cache> set them when datasets is imported: no network, the cache only
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf["paths"]["hub-cache"])
    cfg = compose_config(["data=hf", f"data.root={HUB_ID}", "data.num_workers=0", "data.image_size=24",
                          "data.val_resize_size=28", "data.batch_size=4"])
    check_paths(cfg)  # a Hub id is not a folder, and needs none
    dm = build_datamodule(cfg)
    assert isinstance(dm, HFImageDataModule) and dm.root_name == HUB_ID and dm.classes == NAMES
    dm.setup("fit")
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (4, 3, 24, 24) and y.tolist() == hf["val"][1][:4]
    with pytest.raises(ConfigError, match=r"^data.root='cltrain-tests/not-cached': cltrain-tests/not-cached: cannot be "
                                          r"opened as a Hub dataset \(ConnectionError"):
        build_datamodule(compose_config(["data=hf", "data.root=cltrain-tests/not-cached", "data.num_workers=0"]))
    with pytest.raises(ConfigError, match="no such directory, and not a Hub id"):
        check_paths(compose_config(["data=hf", "data.root=./not/a/folder"]))


@pytest.mark.slow
def test_ddp_two_ranks_two_workers_read_each_streamed_row_once_per_epoch(tmp_path):
    # the map-style path is the folder's: Lightning's DistributedSampler (tests/data/test_data_image_folder.py)
    cells, _ = image_rows(24, 24, seed=2)  # each row its own class: a batch's targets are its row ids
    root = write_hf_dataset(tmp_path / "rows", {"train": (cells, list(range(24))), "validation": (cells[:8], list(range(8)))},
                            [f"r{i}" for i in range(24)])["saved"]
    command = ["-m", "tests.helpers.hf_data_ddp_run", str(root), str(tmp_path), "1", "2"]
    proc = warm.run([sys.executable, *command], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world_size"] == 2 for r in ranks) and ranks[0]["steps"] == ranks[1]["steps"]
    orders = []
    for epoch in (0, 1):
        steps = [[s for s in r["train"] if s["epoch"] == epoch] for r in ranks]
        assert len(steps[0]) == len(steps[1])  # ranks in step
        ids = [i for r in steps for s in r for i in s["ids"]]
        assert sorted(ids) == list(range(24)), (epoch, ids)  # each row exactly once over both ranks
        orders.append(ids)
        val = [i for r in ranks for s in r["val"] if s["epoch"] == epoch for i in s["ids"]]
        assert sorted(set(val)) == list(range(8))
    assert orders[0] != orders[1]  # a new order each epoch
