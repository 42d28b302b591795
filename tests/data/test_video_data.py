"""The clip-folder dataset and DataModule, the video demo, video files, and 5-D normalisation."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn

from cltrain.data.constants import IMAGENET_MEAN, IMAGENET_STD
from PIL import Image

from cltrain.data import SKIPPED_FILES_NAME, BadImageError, SkippedFilesReport, normalize
from cltrain.data.errors import DataError
from cltrain.data.video import (ClipFolderDataModule, ClipFolderDataset, eval_clip_transform, find_clips, make_demo_videos,
                                normalize_clips, read_video)

CL3D = torch.channels_last_3d
SMALL = dict(num_classes=2, train_per_class=5, val_per_class=2, num_frames=6, frame_size=32)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_videos(tmp_path_factory.mktemp("video") / "demo", **SMALL)


def test_demo_is_a_clip_folder_made_once(demo: Path) -> None:
    classes = sorted(p.name for p in (demo / "train").iterdir())
    assert classes == ["00_right", "01_left"]
    clip = demo / "train" / classes[0] / "00003"
    assert sorted(os.listdir(clip)) == [f"{t:03d}.jpg" for t in range(6)] and Image.open(clip / "000.jpg").size == (32, 32)
    before = (clip / "000.jpg").stat().st_mtime_ns
    assert make_demo_videos(demo, **SMALL) == demo and (clip / "000.jpg").stat().st_mtime_ns == before  # reused
    with pytest.raises(FileExistsError, match="make_demo_videos: .* made with other arguments"):
        make_demo_videos(demo, **{**SMALL, "seed": 1})
    with pytest.raises(ValueError, match="num_classes=7"):
        make_demo_videos(demo.parent / "x", num_classes=7)


def test_demo_classes_are_motions_and_no_single_frame_tells_them(tmp_path: Path) -> None:
    root = make_demo_videos(tmp_path / "demo", num_classes=6, train_per_class=4, val_per_class=1, num_frames=8, frame_size=64)

    def centre_and_area(path: Path) -> tuple[float, float, int]:
        img = np.asarray(Image.open(path)).astype(float)
        shape = np.abs(img - np.median(img.reshape(-1, 3), 0)).sum(-1) > 60  # the shape covers well under half the frame
        ys, xs = np.nonzero(shape)
        return float(xs.mean()), float(ys.mean()), int(shape.sum())

    moves = {"00_right": (0, 1), "01_left": (0, -1), "02_down": (1, 1), "03_up": (1, -1)}
    sizes_seen = set()
    for cls in sorted((root / "train").iterdir()):
        for clip in sorted(cls.iterdir()):
            first, last = centre_and_area(clip / "000.jpg"), centre_and_area(clip / "007.jpg")
            sizes_seen.add(first[2] // 50)
            if cls.name in moves:
                axis, sign = moves[cls.name]
                assert sign * (last[axis] - first[axis]) > 5, (clip, first, last)
            elif cls.name == "04_grow":
                assert last[2] > 1.3 * first[2], (clip, first, last)
            else:
                assert cls.name == "05_shrink" and first[2] > 1.3 * last[2], (clip, first, last)
    assert len(sizes_seen) > 3  # sizes (and shapes, colours, places) vary within a class


def test_datamodule_gives_normalised_channels_last_3d_batches_from_workers(demo: Path) -> None:
    dm = ClipFolderDataModule(demo, batch_size=3, num_workers=2, persistent_workers=False, num_frames=4, frame_stride=1,
                              image_size=24, val_resize_size=28, hflip=0.0)
    assert dm.num_classes == 2 and dm.input_shape == (3, 3, 4, 24, 24)
    dm.setup("fit")
    train = [dm.on_after_batch_transfer(b, 0) for b in dm.train_dataloader()]
    assert len(train) == 3  # 10 clips, batch 3: the partial last batch is dropped
    val = [dm.on_after_batch_transfer(b, 0) for b in dm.val_dataloader()]
    assert [len(b[1]) for b in val] == [2, 2]  # validation keeps every clip (the last batches share the rest)
    for clips, targets in train + val:
        assert clips.dtype == torch.float32 and clips.shape[1:] == (3, 4, 24, 24) and clips.is_contiguous(memory_format=CL3D)
        assert -3 < float(clips.mean()) < 3 and targets.dtype == torch.int64


def test_normalize_clips_is_exact_and_keeps_the_layout() -> None:
    rng = np.random.default_rng(0)
    thwc = torch.from_numpy(rng.integers(0, 256, (2, 3, 5, 6, 3), dtype=np.uint8))
    clips = thwc.permute(0, 4, 1, 2, 3)  # what ndhwc_collate gives
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    ref = (clips.double() / 255 - torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1, 1)) / torch.tensor(
        std, dtype=torch.float64).view(1, 3, 1, 1, 1)
    out = normalize_clips(clips, mean, std)
    assert out.is_contiguous(memory_format=CL3D) and torch.allclose(out.double(), ref, atol=1e-5)
    plain = normalize_clips(clips, mean, std, channels_last=False)
    assert plain.is_contiguous() and torch.allclose(plain.double(), ref, atol=1e-5)
    half = normalize_clips(clips, mean, std, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.is_contiguous(memory_format=CL3D)
    with pytest.raises(TypeError, match=r"\(N, C, T, H, W\) uint8"):
        normalize_clips(clips[0])


def test_normalize_itself_takes_5d_channels_last_3d_batches() -> None:
    clips = torch.full((2, 4, 5, 6, 3), 255, dtype=torch.uint8).permute(0, 4, 1, 2, 3)
    out = normalize(clips)
    assert out.shape == (2, 3, 4, 5, 6) and out.is_contiguous(memory_format=CL3D)
    ref = (torch.ones(3) - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    torch.testing.assert_close(out, ref.view(1, 3, 1, 1, 1).expand_as(out))


def _frames(folder: Path, n: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for t in range(n):
        Image.new("RGB", (16, 16), (10 * t, 0, 0)).save(folder / f"{t}.jpg")


def test_clip_folder_errors_name_the_folder(tmp_path: Path) -> None:
    root = tmp_path / "clips"
    _frames(root / "train" / "a" / "clip1", 3)
    (root / "train" / "b" / "clip1").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"clip folder .*train/b/clip1 has no frames"):
        find_clips(root / "train", ["a", "b"])
    _frames(root / "train" / "b" / "clip1", 3)
    (root / "train" / "b" / "notes.txt").write_text("x")  # not a clip: left out (and said)
    assert [(Path(p).name, len(f), k) for p, f, k in find_clips(root / "train", ["a", "b"])] == [("clip1", 3, 0), ("clip1", 3, 1)]
    (root / "train" / "c").mkdir()
    with pytest.raises(ValueError, match=r"class folder .*train/c has no clips"):
        find_clips(root / "train", ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"has class folders \['a', 'b', 'c'\] but the training split has \['a', 'b'\]"):
        find_clips(root / "train", ["a", "b"])
    with pytest.raises(FileNotFoundError, match="root .*missing does not exist"):
        ClipFolderDataModule(tmp_path / "missing").num_classes


def test_files_a_clip_folder_does_not_load_are_said_once_per_split(tmp_path: Path) -> None:
    # as an image folder says them: a video of a suffix not loaded (which OpenCV might read) was left out silently
    for cls in ("a", "b"):
        _frames(tmp_path / "train" / cls / "clip1", 3)
    (tmp_path / "train" / "a" / "clip.m4v").write_bytes(b"x")
    (tmp_path / "train" / "b" / "README.txt").write_text("labels")
    (tmp_path / "train" / "b" / ".DS_Store").write_bytes(b"")  # hidden: neither a clip nor counted
    with pytest.warns(UserWarning, match=r"train: 2 file\(s\) not loaded \(\.m4v: 1, \.txt: 1; loaded: folders of frames, "
                                         r"\.mp4, \.avi, \.mkv, \.webm, \.mov\)\.$") as record:
        dataset = ClipFolderDataset(tmp_path / "train", eval_clip_transform(2, size=16, resize_size=None))
    assert len(record) == 1 and len(dataset) == 2


def test_a_bad_frame_is_named_in_the_reason_and_an_empty_one_is_an_empty_file(tmp_path: Path) -> None:
    # Pillow's "Truncated File Read" names no file, and a 0-byte frame read "UnidentifiedImageError ..."
    for clip in ("cut", "empty", "good"):
        _frames(tmp_path / "train" / "a" / clip, 3)
    data = (tmp_path / "train" / "a" / "cut" / "1.jpg").read_bytes()
    (tmp_path / "train" / "a" / "cut" / "1.jpg").write_bytes(data[: len(data) // 2])
    (tmp_path / "train" / "a" / "empty" / "2.jpg").write_bytes(b"")
    log = tmp_path / SKIPPED_FILES_NAME
    dataset = ClipFolderDataset(tmp_path / "train", eval_clip_transform(3, size=16, resize_size=None), bad_files="skip",
                                skip_log=log)
    for i in range(len(dataset)):
        dataset.fetch(i)
    reasons = {line.split("\t")[1].rsplit("/", 1)[1]: line.split("\t")[2] for line in log.read_text().splitlines()}
    assert reasons.keys() == {"cut", "empty"} and reasons["empty"] == "2.jpg: empty file (0 bytes)"
    assert reasons["cut"].startswith("1.jpg: ") and "Error" in reasons["cut"], reasons
    raising = ClipFolderDataset(tmp_path / "train", eval_clip_transform(3, size=16, resize_size=None))
    with pytest.raises(BadImageError, match=r"train/a/empty: cannot be read as a clip \(2\.jpg: empty file \(0 bytes\)\)"):
        raising[1]


def test_frames_are_taken_in_natural_order(tmp_path: Path) -> None:
    _frames(tmp_path / "a" / "clip", 12)  # 0.jpg ... 11.jpg: "10" must come after "9"
    dataset = ClipFolderDataset(tmp_path, eval_clip_transform(12, size=16, resize_size=None))
    clip, _ = dataset[0]
    reds = clip[:, 8, 8, 0].astype(int)
    assert (np.diff(reds) > 0).all()


def test_video_files_are_clips(tmp_path: Path) -> None:
    cv2 = pytest.importorskip("cv2")
    folder = tmp_path / "train" / "a"
    folder.mkdir(parents=True)
    writer = cv2.VideoWriter(str(folder / "clip.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 25, (32, 24))
    for t in range(10):
        frame = np.zeros((24, 32, 3), np.uint8)
        frame[:, 3 * t:3 * t + 4] = 255  # a white bar moving right
        writer.write(frame)
    writer.release()
    frames = read_video(folder / "clip.mp4")
    assert len(frames) == 10 and frames[0].shape == (24, 32, 3)
    dataset = ClipFolderDataset(tmp_path / "train", eval_clip_transform(4, 3, size=(24, 32), resize_size=None))
    clip, target = dataset[0]
    bars = [int(np.argmax(f[:, :, 0].astype(int).sum(0))) for f in clip]
    assert clip.shape == (4, 24, 32, 3) and target == 0 and bars == sorted(bars) and bars[-1] - bars[0] >= 20
    (folder / "broken.mp4").write_bytes(b"not a video")
    with pytest.raises(Exception, match=r"broken.mp4: cannot be read as a clip") as caught:
        ClipFolderDataset(tmp_path / "train", eval_clip_transform(4, 3, size=16, resize_size=None))[0]
    assert str(caught.value).count("broken.mp4") == 1, caught.value  # read_video's own naming of it left out


class _ClipNet(L.LightningModule):
    """A tiny 3-D conv net."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv3d(3, 2, 1), nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(2, 2))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_setup_called_before_the_trainers_lists_the_skipped_clips(tmp_path: Path) -> None:
    # dm.setup("fit") first, to size a model: its datasets, built without a trainer, wrote no list and said nothing
    for split, n in (("train", 2), ("val", 1)):
        for cls in ("a", "b"):
            for k in range(n):
                _frames(tmp_path / "clips" / split / cls / f"clip{k}", 3)
        bad = tmp_path / "clips" / split / "b" / "bad"
        bad.mkdir()
        for t in range(3):
            (bad / f"{t}.jpg").write_text("not an image")
    dm = ClipFolderDataModule(tmp_path / "clips", batch_size=5, num_workers=0, num_frames=2, image_size=16,
                              val_resize_size=16, hflip=0.0, bad_files="skip")
    dm.setup("fit")
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path / "run",
                        callbacks=[SkippedFilesReport()])
    with pytest.warns(UserWarning) as record:
        trainer.fit(_ClipNet(), datamodule=dm)
    messages = [str(w.message) for w in record]
    for split in ("train", "val"):
        assert any(f"skipped 1 unreadable file(s) of '{split}' in epoch 0" in m for m in messages), messages
    lines = (tmp_path / "run" / SKIPPED_FILES_NAME).read_text().splitlines()
    assert sorted(line.split("\t")[0] + " " + line.split("\t")[1].rsplit("/", 1)[1] for line in lines) == [
        "train bad", "val bad"]
    # the list the run wrote (clip folders) leaves the bad clips out of the next run from the start
    again = ClipFolderDataModule(tmp_path / "clips", batch_size=5, num_workers=0, num_frames=2, image_size=16,
                                 val_resize_size=16, exclude_files=tmp_path / "run" / SKIPPED_FILES_NAME)
    again.setup("fit")
    assert (again.train_set.excluded, again.val_set.excluded, len(again.train_set)) == (1, 1, 4)


def test_the_checks_list_of_bad_frames_leaves_their_clips_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from cltrain.data.check import main

    for split, n in (("train", 3), ("val", 1)):
        for k in range(n):
            _frames(tmp_path / "clips" / split / "a" / f"clip{k}", 3)
    (tmp_path / "clips" / "train" / "a" / "clip1" / "2.jpg").write_text("not an image")
    listed = tmp_path / "bad.tsv"
    assert main([str(tmp_path / "clips"), "--no-progress", "--workers", "0", "--out", str(listed)]) == 1
    dm = ClipFolderDataModule(tmp_path / "clips", batch_size=2, num_workers=0, num_frames=2, image_size=16,
                              val_resize_size=16, exclude_files=listed)
    with caplog.at_level("INFO"):
        dm.setup("fit")
    assert [os.path.basename(s[0]) for s in dm.train_set.samples] == ["clip0", "clip2"] and dm.val_set.excluded == 0
    assert f"left out 1 clip(s) of the 1 file(s) listed in {listed} (train 1, val 0)" in caplog.text
    listed.write_text(f"train\t{tmp_path / 'clips' / 'val' / 'a' / 'clip0'}\tbad\n")
    with pytest.raises(DataError, match=r"val: all 1 clips are in the exclude list"):  # the app: one line, exit 2
        ClipFolderDataModule(tmp_path / "clips", batch_size=2, num_workers=0, num_frames=2, image_size=16,
                             exclude_files=listed).setup("validate")
