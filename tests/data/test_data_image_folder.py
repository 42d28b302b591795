import shutil

import lightning as L
import numpy as np
import pytest
import torch
from lightning.fabric.utilities.data import _replace_dunder_methods
from lightning.pytorch.utilities.data import _update_dataloader
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from cltrain import is_channels_last
from cltrain.callback import ChannelsLast
from cltrain.data import (SKIPPED_FILES_NAME, BadImageError, DataError, SkippedFilesReport, ImageFolderDataModule,
                          ImageFolderDataset, ResumeMidEpoch, eval_transform)
from tests.helpers.data_fixtures import BAD, READABLE, write_image_folder, write_jpegs, write_odd_files

SIZE = 32


class PathRecorder:
    """A transform that takes paths: records what it got and torch's thread count where it ran."""

    takes_paths = True

    def __call__(self, img):
        return np.array([isinstance(img, str), torch.get_num_threads()]).reshape(1, 2, 1).astype(np.uint8)


class Recorder(L.LightningModule):
    """A tiny conv net that records what each step receives."""

    def __init__(self, num_classes=2, channels=3):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(channels, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes))
        self.seen = {}

    def _record(self, stage, batch):
        x, y = batch
        self.seen.setdefault(stage, []).append(
            (x.dtype, tuple(x.shape), is_channels_last(x), x.is_contiguous(), float(x.min()), float(x.max()), y.dtype))
        return nn.functional.cross_entropy(self.net(x).float(), y)

    def training_step(self, batch, batch_idx):
        return self._record("train", batch)

    def validation_step(self, batch, batch_idx):
        self._record("val", batch)

    def test_step(self, batch, batch_idx):
        self._record("test", batch)

    def predict_step(self, batch, batch_idx):
        self._record("predict", batch)
        return batch[1]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(tmp_path, callbacks=(), **kw):
    args = dict(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=3, limit_val_batches=2, limit_test_batches=2,
                limit_predict_batches=2, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    args.update(kw)
    return L.Trainer(callbacks=list(callbacks), **args)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("folder"), classes=2, train=5, val=3, size=(64, 48))


def test_end_to_end_with_channels_last_callback(folder, tmp_path):
    dm = ImageFolderDataModule(folder, batch_size=4, num_workers=2, image_size=SIZE, val_resize_size=36)
    assert dm.num_classes == 2 and dm.classes == ["c0", "c1"] and dm.input_shape == (4, 3, SIZE, SIZE)
    model = Recorder(dm.num_classes)
    trainer = _trainer(tmp_path, [ChannelsLast()])
    trainer.fit(model, datamodule=dm)
    trainer.test(model, datamodule=dm, verbose=False)
    trainer.predict(model, datamodule=dm)
    assert is_channels_last(model.net[0].weight)
    assert set(model.seen) == {"train", "val", "test", "predict"}
    for stage, records in model.seen.items():
        for dtype, shape, cl, _, lo, hi, ydtype in records:
            assert dtype == torch.float32 and cl and ydtype == torch.int64, stage
            assert shape[1:] == (3, SIZE, SIZE) and -2.2 <= lo < 0 < hi <= 2.7, stage  # normalised, not 0..255
    assert [r[1][0] for r in model.seen["val"]] == [4, 2]  # the ragged last batch keeps its layout too


def test_batches_are_channels_last_without_the_callback_and_nchw_on_request(folder, tmp_path):
    for channels_last in (True, False):
        dm = ImageFolderDataModule(folder, batch_size=4, num_workers=0, image_size=SIZE, val_resize_size=36,
                                   channels=1, mean=(0.5,), std=(0.5,), dtype=torch.bfloat16, channels_last=channels_last)
        model = Recorder(2, channels=1).to(torch.bfloat16)
        _trainer(tmp_path, limit_train_batches=1, limit_val_batches=1).fit(model, datamodule=dm)
        for dtype, shape, cl, contiguous, *_ in model.seen["train"] + model.seen["val"]:
            assert dtype == torch.bfloat16 and shape[1] == 1
            assert cl if channels_last else (contiguous and not cl)


@pytest.mark.parametrize("kind", BAD)
def test_raise_policy_names_the_file_and_the_reason(tmp_path, kind):
    root = write_image_folder(tmp_path / "data", classes=1, train=1, val=1, size=(64, 48))
    odd = write_odd_files(tmp_path / "odd")
    shutil.copy(odd[kind], root / "val" / "c0" / odd[kind].name)
    ds = ImageFolderDataset(root / "val", eval_transform(SIZE, 36))
    bad_index = [p for p, _ in ds.samples].index(str(root / "val" / "c0" / odd[kind].name))
    with pytest.raises(BadImageError, match=rf"{odd[kind].name}: cannot be read as an image \(\w+.*bad_files='skip'.*"
                                            rf"'cltrain-data-check {root}' lists them all") as caught:
        ds[bad_index]
    assert str(caught.value).count(odd[kind].name) == 1, caught.value  # Pillow's own naming of the path left out


def test_a_split_of_only_unreadable_files_says_how_many_there_are_under_skip(tmp_path):
    for k in range(3):
        (tmp_path / "val" / "c0").mkdir(parents=True, exist_ok=True)
        (tmp_path / "val" / "c0" / f"{k}.jpg").write_bytes(b"")
    ds = ImageFolderDataset(tmp_path / "val", eval_transform(SIZE, 36), bad_files="skip")
    with pytest.raises(BadImageError, match=r"val: all 3 images are unreadable; the data is not usable"):
        ds[1]


def test_raise_policy_stops_training_and_odd_modes_are_read(tmp_path):
    root = write_image_folder(tmp_path / "data", classes=2, train=2, val=1, size=(64, 48))
    odd = write_odd_files(tmp_path / "odd")
    for kind in READABLE:
        shutil.copy(odd[kind], root / "train" / "c0" / odd[kind].name)
    dm = ImageFolderDataModule(root, batch_size=11, num_workers=0, image_size=SIZE, val_resize_size=36)
    _trainer(tmp_path, limit_train_batches=1, limit_val_batches=1).fit(Recorder(), datamodule=dm)  # all readable
    shutil.copy(odd["truncated"], root / "train" / "c1" / "truncated.jpg")
    dm = ImageFolderDataModule(root, batch_size=12, num_workers=0, image_size=SIZE, val_resize_size=36)
    with pytest.raises(BadImageError, match="truncated.jpg"):
        _trainer(tmp_path, limit_train_batches=1, limit_val_batches=1).fit(Recorder(), datamodule=dm)


def test_skip_policy_replaces_logs_and_lists_the_files(tmp_path):
    root = write_image_folder(tmp_path / "data", classes=2, train=3, val=2, size=(64, 48))
    odd = write_odd_files(tmp_path / "odd")
    for kind in BAD:
        shutil.copy(odd[kind], root / "train" / "c1" / odd[kind].name)
    shutil.copy(odd["empty"], root / "val" / "c0" / "empty.jpg")
    for kind in ("cmyk", "gray16", "rgba"):  # 12 training files: whole batches, so no file is dropped by drop_last
        shutil.copy(odd[kind], root / "train" / "c0" / odd[kind].name)
    dm = ImageFolderDataModule(root, batch_size=4, num_workers=2, image_size=SIZE, val_resize_size=36, bad_files="skip")
    model = Recorder()
    trainer = _trainer(tmp_path / "run", [ChannelsLast(), SkippedFilesReport()], max_epochs=2, limit_train_batches=None,
                       limit_val_batches=None)
    with pytest.warns(UserWarning) as record:
        trainer.fit(model, datamodule=dm)
    messages = [str(w.message) for w in record]
    assert any("skipped 3 unreadable file(s) of 'train' in epoch 0" in m for m in messages)
    # The bad validation file is found by the check in setup and left out before training starts.
    assert any("left out 1 unreadable validation file(s) before training" in m and "empty.jpg" in m for m in messages)
    assert any("skipped 1 unreadable file(s) of 'val' in epoch 0" in m for m in messages)
    assert len(model.seen["train"]) == 2 * 3  # 12 files, 3 of them replaced, in full batches of 4, two epochs
    assert [s[1][0] for s in model.seen["val"]] == [4, 4]  # the 4 readable val files (5 less the empty one), each epoch
    assert trainer.callback_metrics["data/skipped_train"] == 3 and trainer.callback_metrics["data/skipped_val"] == 0
    lines = (tmp_path / "run" / SKIPPED_FILES_NAME).read_text().splitlines()
    assert {line.split("\t")[0] for line in lines} == {"train", "val"}
    assert {line.split("\t")[1].rsplit("/", 1)[1] for line in lines} == {"truncated.jpg", "empty.jpg", "text.jpg"}
    # the reasons as cltrain-data-check gives them: not Pillow's "cannot identify image file <_io.BufferedReader ...>"
    reasons = {line.split("\t")[1].rsplit("/", 1)[1]: line.split("\t")[2] for line in lines}
    assert reasons["empty.jpg"] == "empty file (0 bytes)" and "<_io" not in "".join(reasons.values()), reasons



@pytest.mark.parametrize(("stage", "before"), [("validate", "validation"), ("test", "testing")])
def test_an_evaluation_leaves_a_bad_validation_file_out_before_it_starts(tmp_path, stage, before):
    # as fit does: not replaced by the next file, which would count twice in the metrics
    root = write_image_folder(tmp_path / "data", classes=2, train=1, val=2, size=(64, 48))
    shutil.copy(write_odd_files(tmp_path / "odd")["empty"], root / "val" / "c0" / "empty.jpg")
    dm = ImageFolderDataModule(root, batch_size=8, num_workers=0, image_size=SIZE, val_resize_size=36, bad_files="skip")
    model = Recorder()
    with pytest.warns(UserWarning, match=rf"left out 1 unreadable validation file\(s\) before {before}: .*empty.jpg"):
        getattr(_trainer(tmp_path / "run", limit_val_batches=None, limit_test_batches=None), stage)(model, datamodule=dm)
    assert [s[1][0] for s in model.seen["val" if stage == "validate" else "test"]] == [4]  # 5 files less the empty one
    raising = ImageFolderDataModule(root, batch_size=8, num_workers=0, image_size=SIZE, val_resize_size=36)
    with pytest.raises(BadImageError, match=rf"1 unreadable file\(s\) found before {before}: .*empty.jpg"):
        getattr(_trainer(tmp_path / "run"), stage)(Recorder(), datamodule=raising)

def test_layout_errors_come_before_training(tmp_path):
    def fit(root):
        _trainer(tmp_path, limit_train_batches=1).fit(Recorder(), datamodule=ImageFolderDataModule(root, num_workers=0))

    # a DataError, as every data problem is (a FileNotFoundError too)
    with pytest.raises(DataError, match="root .*nowhere does not exist") as missing:
        fit(tmp_path / "nowhere")
    assert isinstance(missing.value, FileNotFoundError)
    root = write_image_folder(tmp_path / "data", classes=2, train=1, val=1, size=(64, 48))
    shutil.rmtree(root / "val")
    with pytest.raises(DataError, match=r"val is not a folder.*ImageNet layout"):
        fit(root)
    (root / "val").mkdir()
    with pytest.raises(ValueError, match="val holds no class folders"):
        fit(root)
    (root / "val" / "c0").mkdir()
    (root / "val" / "c0" / "notes.txt").write_text("no images here")
    with pytest.raises(ValueError, match=r"val lacks the class folders \['c1'\].*allow_missing_val_classes=True"):
        fit(root)
    write_jpegs(root / "val" / "c1", 1, k=1)
    with pytest.raises(ValueError, match=r"class folder .*val/c0 has no images"):
        fit(root)
    with pytest.raises(ValueError, match=r"ImageFolderDataModule: bad_files='ignore' must be one of \('raise', 'skip'\)"):
        ImageFolderDataModule(root, bad_files="ignore")


def test_loader_can_be_rebuilt_with_a_distributed_sampler(folder):
    # What Lightning does under DDP: re-create the DataLoader (our subclass) with its sampler.
    dm = ImageFolderDataModule(folder, batch_size=2, num_workers=0, image_size=SIZE, val_resize_size=36)
    trainer = _trainer(folder.parent / "ddp")
    trainer.strategy.connect(Recorder())
    dm.trainer = trainer
    dm.setup("fit")
    with _replace_dunder_methods(DataLoader, "dataset"):
        loader = dm.train_dataloader()
    sampler = DistributedSampler(dm.train_set, num_replicas=2, rank=1, shuffle=False)
    rebuilt = _update_dataloader(loader, sampler)
    assert type(rebuilt) is type(loader) and rebuilt.sampler is sampler and not getattr(rebuilt, "resumable", False)
    x, y = next(iter(rebuilt))
    assert is_channels_last(x) and len(y) == 2


@pytest.mark.parametrize("world,batch", [(2, 4), (2, 7), (3, 4), (4, 5)])
def test_validation_under_ddp_reads_every_image_once_with_the_ranks_in_step(tmp_path, world, batch):
    # Lightning's DistributedSampler pads each rank's share with repeated images: 15 validation images on 2 ranks
    # gave val top-1 5/16 (one image counted twice). Lightning injects its sampler as it does under DDP.
    from torch.utils.data import BatchSampler

    root = write_image_folder(tmp_path / "data", classes=3, train=2, val=5, size=(40, 32))
    dm = ImageFolderDataModule(root, batch_size=batch, num_workers=0, image_size=SIZE, val_resize_size=36)
    dm.setup("fit")
    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        loader = dm.val_dataloader()
    alone = torch.cat([x for x, _ in loader]).flatten(1)
    seen, batches = [], []
    for rank in range(world):
        rebuilt = _update_dataloader(loader, DistributedSampler(dm.val_set, num_replicas=world, rank=rank,
                                                                shuffle=False))
        images = [x for x, _ in rebuilt]
        batches.append(len(images))
        seen.append(torch.cat(images).flatten(1))
        assert len(rebuilt) == len(images)
    everyone = torch.cat(seen)
    assert len(set(batches)) == 1, batches  # every rank as many batches: the ranks stay in step
    assert everyone.shape == alone.shape and torch.equal(everyone, alone)  # each of the 15 images once, in order


def test_dataset_hands_paths_to_transforms_that_take_them(folder):
    ds = ImageFolderDataset(folder / "val", PathRecorder())
    assert ds[0][0].ravel()[0] == 1  # a path, so cltrain's transforms decode JPEGs with libjpeg-turbo
    assert ImageFolderDataset(folder / "val", eval_transform(SIZE, 36))[0][0].shape == (SIZE, SIZE, 3)
    images, _ = next(iter(DataLoader(ds, batch_size=2, num_workers=1)))
    assert images[:, :, 1].eq(1).all()  # torch runs single-threaded in a DataLoader worker


def test_classes_missing_from_val_are_an_error_unless_allowed(tmp_path):
    root = write_image_folder(tmp_path / "data", classes=2, train=2, val=2, size=(64, 48))
    shutil.rmtree(root / "val" / "c1")
    dm = ImageFolderDataModule(root, batch_size=2, num_workers=0, image_size=SIZE, val_resize_size=36)
    with pytest.raises(ValueError, match=r"data/val lacks the class folders \['c1'\] that the training split has"):
        _trainer(tmp_path).fit(Recorder(), datamodule=dm)
    dm = ImageFolderDataModule(root, batch_size=2, num_workers=0, image_size=SIZE, val_resize_size=36,
                               allow_missing_val_classes=True)
    _trainer(tmp_path).fit(Recorder(), datamodule=dm)
    assert dm.num_classes == 2 and {t for _, t in dm.val_set.samples} == {0}


def test_training_drops_the_last_partial_batch_and_validation_keeps_every_image(tmp_path):
    # 9 training images in batches of 4: 9 % 4 == 1, the batch of 1 that breaks BatchNorm.
    root = write_image_folder(tmp_path / "data", classes=1, train=9, val=5, size=(64, 48))
    model = Recorder(num_classes=1)
    model.net.insert(1, nn.BatchNorm2d(4))
    dm = ImageFolderDataModule(root, batch_size=4, num_workers=0, image_size=SIZE, val_resize_size=36)
    _trainer(tmp_path, max_epochs=2, limit_train_batches=None, limit_val_batches=None).fit(model, datamodule=dm)
    assert [seen[1][0] for seen in model.seen["train"]] == [4, 4] * 2
    assert [seen[1][0] for seen in model.seen["val"]] == [3, 2] * 2  # all 5, the last two batches sharing them
    with pytest.raises(ValueError, match=r"has 9 images, fewer than batch_size=10"):
        dm = ImageFolderDataModule(root, batch_size=10, num_workers=0, image_size=SIZE, val_resize_size=36)
        _trainer(tmp_path).fit(Recorder(num_classes=1), datamodule=dm)


def test_a_bad_validation_file_stops_the_run_before_the_first_training_step(tmp_path):
    root = write_image_folder(tmp_path / "data", classes=2, train=2, val=2, size=(64, 48))
    odd = write_odd_files(tmp_path / "odd")
    shutil.copy(odd["truncated"], root / "val" / "c1" / "truncated.jpg")
    kw = dict(batch_size=2, num_workers=0, image_size=SIZE, val_resize_size=36)
    model = Recorder()
    with pytest.raises(BadImageError, match=r"val: 1 unreadable file\(s\) found before training: .*truncated.jpg.*"
                                            r"cltrain-data-check .* exclude_files=<that list>"):
        _trainer(tmp_path, limit_val_batches=None).fit(model, datamodule=ImageFolderDataModule(root, **kw))
    assert "train" not in model.seen
    # Negative control: without the check the same file is met only after the training epoch.
    model = Recorder()
    with pytest.raises(BadImageError, match="truncated.jpg"):
        _trainer(tmp_path, limit_val_batches=None).fit(model, datamodule=ImageFolderDataModule(root, check_val="off", **kw))
    assert len(model.seen["train"]) == 2
    with pytest.raises(ValueError, match="check_val='thorough'"):
        ImageFolderDataModule(root, check_val="thorough")


def test_skipped_files_list_is_in_the_run_directory_not_the_loggers(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    root = write_image_folder(tmp_path / "data", classes=2, train=2, val=2, size=(64, 48))
    shutil.copy(write_odd_files(tmp_path / "odd")["empty"], root / "train" / "c0" / "empty.jpg")
    run = tmp_path / "run"
    trainer = _trainer(run, [SkippedFilesReport()], logger=CSVLogger(save_dir=run, name="csv", version=""),
                       limit_train_batches=None)
    assert trainer.log_dir != str(run)
    with pytest.warns(UserWarning, match="skipped 1 unreadable"):
        trainer.fit(Recorder(), datamodule=ImageFolderDataModule(root, batch_size=5, num_workers=0, image_size=SIZE,
                                                                 val_resize_size=36, bad_files="skip"))
    assert (run / SKIPPED_FILES_NAME).is_file() and not (run / "csv" / SKIPPED_FILES_NAME).exists()


def test_a_setup_called_before_the_trainers_lists_the_skipped_files_as_the_trainers_alone_does(tmp_path):
    # dm.setup("fit") first, to size a model: its datasets, built without a trainer, wrote no list and said nothing
    root = write_image_folder(tmp_path / "data", classes=2, train=2, val=2, size=(64, 48))
    odd = write_odd_files(tmp_path / "odd")
    shutil.copy(odd["empty"], root / "train" / "c0" / "empty.jpg")
    shutil.copy(odd["text"], root / "val" / "c1" / "text.jpg")  # found by the check in that first setup
    dm = ImageFolderDataModule(root, batch_size=5, num_workers=0, image_size=SIZE, val_resize_size=36, bad_files="skip")
    with pytest.warns(UserWarning, match="left out 1 unreadable validation file"):
        dm.setup("fit")
    with pytest.warns(UserWarning) as record:
        _trainer(tmp_path / "run", [SkippedFilesReport()], limit_train_batches=None).fit(Recorder(), datamodule=dm)
    messages = [str(w.message) for w in record]
    for split in ("train", "val"):
        assert any(f"skipped 1 unreadable file(s) of '{split}' in epoch 0" in m for m in messages), messages
    lines = (tmp_path / "run" / SKIPPED_FILES_NAME).read_text().splitlines()
    assert sorted((line.split("\t")[0], line.split("\t")[1].rsplit("/", 1)[1]) for line in lines) == [
        ("train", "empty.jpg"), ("val", "text.jpg")]


def test_statistics_in_0_255_units_are_refused_at_construction(folder):
    with pytest.raises(ValueError, match=r"ImageFolderDataModule: mean=.* look like 0-255 units.*divide by 255"):
        ImageFolderDataModule(folder, mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))


def test_without_the_report_the_datamodule_adds_no_report_and_says_where_the_list_is(tmp_path):
    root = write_image_folder(tmp_path / "data", classes=2, train=2, val=2, size=(64, 48))
    shutil.copy(write_odd_files(tmp_path / "odd")["empty"], root / "train" / "c0" / "empty.jpg")
    trainer = _trainer(tmp_path / "run", limit_train_batches=None)
    before = list(trainer.callbacks)
    with pytest.warns(UserWarning, match=r"add cltrain.data.SkippedFilesReport\(\)"):
        trainer.fit(Recorder(), datamodule=ImageFolderDataModule(root, batch_size=5, num_workers=0, image_size=SIZE,
                                                                 val_resize_size=36, bad_files="skip"))
    added = [cb for cb in trainer.callbacks if cb not in before]
    assert [type(cb) for cb in added] == [ResumeMidEpoch] and (tmp_path / "run" / SKIPPED_FILES_NAME).is_file()


def test_two_bad_files_in_a_row_are_each_listed_once(tmp_path):
    root = write_image_folder(tmp_path / "data", classes=1, train=3, val=1, size=(64, 48))
    odd = write_odd_files(tmp_path / "odd")
    for name, kind in (("00_trunc.jpg", "truncated"), ("01_empty.jpg", "empty")):  # sorted first: places 0 and 1
        shutil.copy(odd[kind], root / "train" / "c0" / name)
    log = tmp_path / SKIPPED_FILES_NAME
    ds = ImageFolderDataset(root / "train", eval_transform(SIZE, 36), bad_files="skip", skip_log=log)
    assert [p.rsplit("/", 1)[1] for p, _ in ds.samples][:2] == ["00_trunc.jpg", "01_empty.jpg"]
    for i in range(len(ds)):  # place 0's stand-in, place 1, fails too before place 2 stands in
        ds[i]
    names = [line.split("\t")[1].rsplit("/", 1)[1] for line in log.read_text().splitlines()]
    assert sorted(names) == ["00_trunc.jpg", "01_empty.jpg"]


def test_the_skip_warning_names_a_sample_once(caplog):
    from cltrain.data.bad_samples import NamedSplit, SkipsBadSamples

    class Rows(NamedSplit, SkipsBadSamples):
        what, split = "item", "train"

    rows = Rows()
    rows._set_policy("skip", None)
    with caplog.at_level("WARNING", logger="cltrain.data.bad_samples"):
        rows.skip(rows.sample_name(15), "empty file (0 bytes)")
        rows.skip("/data/train/c0/a.jpg", "empty file (0 bytes)")
    assert [r.getMessage() for r in caplog.records] == ["skipping unreadable item 15 (empty file (0 bytes))",
                                                        "skipping unreadable item /data/train/c0/a.jpg (empty file (0 bytes))"]


def test_a_reason_leaves_out_the_path_the_line_names_and_reads_whole() -> None:
    from PIL import UnidentifiedImageError

    from cltrain.data.bad_samples import unreadable

    path = "/data/train/cat/a b.jpg"  # gone since the index was made
    assert unreadable(FileNotFoundError(2, "No such file or directory", path), path) == \
        "FileNotFoundError: [Errno 2] No such file or directory"  # not "...directory:" (a dangling colon)
    assert unreadable(UnidentifiedImageError(f"cannot identify image file {path!r}"), path) == \
        "UnidentifiedImageError: cannot identify image file"
    assert unreadable(ValueError(f"{path}: OpenCV cannot open it as a video."), path) == \
        "ValueError: OpenCV cannot open it as a video."


def test_a_checkpoint_of_other_classes_is_one_line_at_resume_and_evaluation(tmp_path):
    # a class folder renamed (dog/ -> ant/, now sorted first): evaluation and resume ran, labels swapped, no word
    root = write_image_folder(tmp_path / "data", classes=2, train=4, val=2, size=(64, 48))
    dm = ImageFolderDataModule(root, batch_size=4, num_workers=0, image_size=SIZE, val_resize_size=36)
    model = Recorder(dm.num_classes)
    _trainer(tmp_path, limit_train_batches=1, limit_val_batches=0).fit(model, datamodule=dm)
    ckpt = tmp_path / "last.ckpt"
    model.trainer.save_checkpoint(ckpt)
    same = ImageFolderDataModule(root, batch_size=4, num_workers=0, image_size=SIZE, val_resize_size=36)
    _trainer(tmp_path).validate(model, datamodule=same, ckpt_path=ckpt, verbose=False)  # the same classes: runs
    for split in ("train", "val"):
        (root / split / "c1").rename(root / split / "a1")
    for run in ("validate", "fit"):
        moved = ImageFolderDataModule(root, batch_size=4, num_workers=0, image_size=SIZE, val_resize_size=36)
        with pytest.raises(DataError, match=r"trained on other classes \(label 0 is 'c0' there and 'a1' here\)"):
            getattr(_trainer(tmp_path, max_epochs=2), run)(model, datamodule=moved, ckpt_path=ckpt)
    (root / "val" / "a1").rename(root / "val" / "c1")
    shutil.rmtree(root / "train")  # a folder to evaluate on: val/ alone, its classes compared with the checkpoint's
    val_only = ImageFolderDataModule(root, batch_size=4, num_workers=0, image_size=SIZE, val_resize_size=36)
    _trainer(tmp_path).validate(model, datamodule=val_only, ckpt_path=ckpt, verbose=False)
    assert val_only.classes == ["c0", "c1"]


@pytest.mark.parametrize("size, broken, raises", [(10_000, 60, False), (200, 60, True), (40, 40, True)])
def test_a_run_of_unreadable_samples_is_skipped_unless_it_is_most_of_the_data(size, broken, raises) -> None:
    # a class folder of 60 zero-byte files (a failed copy) in a large set ended the run "from index 43", with no fix
    from cltrain.data.bad_samples import NamedSplit, SkipsBadSamples

    class Rows(NamedSplit, SkipsBadSamples):
        what, split = "image", "train"
        source_name = "/data/train"

        def __len__(self) -> int:
            return size

        def sample_name(self, i: int) -> str:
            return f"/data/train/c0/{i:05d}.jpg"

        def load(self, i: int) -> tuple[int]:
            if i < broken:
                raise BadImageError("empty file (0 bytes)")
            return (i,)

    rows, loads = Rows(), []
    rows.load = lambda i, load=rows.load: (loads.append(i), load(i))[1]  # counted
    rows._set_policy("skip", None)
    if not raises:
        assert [rows.fetch(i) for i in range(broken)] == [(broken,)] * broken
        # each broken one loaded twice at most, and a stand-in for each: not broken**2 / 2
        assert len(loads) <= 3 * broken, len(loads)
        return
    with pytest.raises(BadImageError) as caught:
        rows.fetch(0)
    line = str(caught.value)
    assert ("all 40 images are unreadable" if size == broken else "50 unreadable images in a row from "
            "/data/train/c0/00000.jpg") in line and "'cltrain-data-check ROOT'" in line and "\n" not in line, line


def test_a_sample_readable_again_stands_in_again() -> None:
    # a file fixed during the run stayed "known bad" for the walk: its neighbours walked past it
    from cltrain.data.bad_samples import NamedSplit, SkipsBadSamples

    broken = {0, 1, 2}

    class Rows(NamedSplit, SkipsBadSamples):
        what, split, source_name = "image", "train", "/data/train"

        def __len__(self) -> int:
            return 100

        def sample_name(self, i: int) -> str:
            return f"/data/train/c0/{i:05d}.jpg"

        def load(self, i: int) -> tuple[int]:
            if i in broken:
                raise BadImageError("empty file (0 bytes)")
            return (i,)

    rows = Rows()
    rows._set_policy("skip", None)
    assert rows.fetch(0) == (3,)
    broken.discard(2)  # fixed
    assert rows.fetch(2) == (2,) and rows.fetch(1) == (2,)
