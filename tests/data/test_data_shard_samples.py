"""A pack's samples under the bad-file policy of every source: named by the file they were packed from,
skipped and listed or raised, in worker processes too; a pack of format 1 (no paths stored) still trains."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
from torch import nn

from cltrain.data import SKIPPED_FILES_NAME, BadImageError, ShardsDataModule, SkippedFilesReport
from cltrain.data.errors import error_line
from cltrain.data.pack import pack
from tests.helpers.data_fixtures import write_format1_pack, write_image_folder, write_quirks
from tests.helpers.plain_modules import Classifier

BAD = ("truncated", "html", "empty")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_image_folder(tmp_path_factory.mktemp("bad") / "images", classes=2, train=5, val=2, size=(48, 40))
    quirks = write_quirks(root / "train" / "c1", size=(48, 40))
    for kind, path in quirks.items():  # 3 unreadable files and 2 readable ones stay: 15 training files in all
        if kind not in (*BAD, "cmyk", "png_named_jpeg"):
            path.unlink()
    return root


def _fit(root: Path, run: Path, workers: int, bad_files: str) -> tuple[L.Trainer, Classifier]:
    dm = ShardsDataModule(root, batch_size=5, num_workers=workers, decode_threads=1, image_size=24, val_resize_size=28,
                          bad_files=bad_files)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    model = Classifier(net)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=run,
                        callbacks=[SkippedFilesReport()])
    trainer.fit(model, datamodule=dm)
    return trainer, model


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bad_sample_is_named_by_its_file_and_skipped_and_listed_or_raised(folder: Path, tmp_path: Path, workers: int):
    out = pack(folder, tmp_path / "pack", shard_size=4, check="off", progress=False).parent  # packed without the check
    names = {folder / "train" / "c1" / n for n in ("n01_0101.JPEG", "n01_0102.JPEG", "n01_0103.jpg")}
    trainer, model = _fit(out, tmp_path / "skip", workers, "skip")
    assert len(model.seen["train"]) == 3  # 15 samples, batches of 5: every batch whole, bad samples replaced
    assert trainer.callback_metrics["data/skipped_train"] == 3
    lines = [line.split("\t") for line in (tmp_path / "skip" / SKIPPED_FILES_NAME).read_text().splitlines()]
    assert {(split, Path(path)) for split, path, _ in lines} == {("train", p) for p in names}
    with pytest.raises(BadImageError) as raised:
        _fit(out, tmp_path / "raise", workers, "raise")
    line = error_line(raised.value)
    assert any(line.startswith(f"{p} (in {out / 'train'}/shard-") for p in names), line
    assert ": cannot be read as an image (" in line and line.endswith("replace the file and pack the folder again.")


def test_a_pack_of_format_1_still_trains_and_names_a_bad_sample_by_its_place(folder: Path, tmp_path: Path):
    out = write_format1_pack(folder, tmp_path / "old", shard_size=4)
    trainer, model = _fit(out, tmp_path / "run", 2, "skip")
    assert len(model.seen["train"]) == 3 and len(model.seen["val"]) == 1
    lines = [line.split("\t") for line in (tmp_path / "run" / SKIPPED_FILES_NAME).read_text().splitlines()]
    named = {p for _, p, _ in lines}  # a sample met twice (also as another's replacement) is listed twice
    assert len(named) == 3 and all(p.startswith(f"{out / 'train'}/shard-") and " sample " in p for p in named)
