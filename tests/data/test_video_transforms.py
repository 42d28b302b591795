"""Clip transforms: temporal sampling, and one crop box + flip shared by every frame of a clip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cltrain.data import RandomResizedCropFlip, ResizeCenterCrop
from cltrain.data.video import ClipTransform, TemporalSample, eval_clip_transform, train_clip_transform


def write_clip(folder: Path, frames: int = 12, size: tuple[int, int] = (80, 60), same: bool = False) -> list[str]:
    """JPEG frames of a textured scene; frame t has a bright bar at x = 4 t (unless ``same``)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 200, (size[1], size[0], 3), dtype=np.uint8)
    paths = []
    for t in range(frames):
        img = base.copy()
        if not same:
            img[:, 4 * t:4 * t + 3] = 255
        paths.append(str(folder / f"{t:03d}.jpg"))
        Image.fromarray(img).save(paths[-1], quality=95)
    return paths


def test_random_segment_has_the_stride_and_is_seeded_by_torch() -> None:
    sample = TemporalSample(4, stride=3, mode="random")
    torch.manual_seed(0)
    first = [sample(20) for _ in range(20)]
    torch.manual_seed(0)
    assert [sample(20) for _ in range(20)] == first  # the torch RNG, as seed_everything / worker seeding set it
    starts = {idx[0] for idx in first}
    assert len(starts) > 3 and all(0 <= s <= 20 - 10 for s in starts)
    assert all(idx == [idx[0] + 3 * i for i in range(4)] for idx in first)


def test_center_uniform_and_short_clips() -> None:
    assert TemporalSample(4, 2, "center")(11) == [2, 4, 6, 8]
    assert TemporalSample(4, 1, "uniform")(16) == [2, 6, 10, 14]
    assert TemporalSample(4, 2, "random")(3) == [0, 2, 2, 2]  # shorter than the segment: the last frame repeats
    assert TemporalSample(3, 1, "uniform")(1) == [0, 0, 0]
    for bad in (dict(num_frames=0), dict(num_frames=2, stride=0), dict(num_frames=2, mode="loop"),
                dict(num_frames=2, stride=2, mode="uniform")):
        with pytest.raises(ValueError, match="TemporalSample"):
            TemporalSample(**bad)


def test_every_frame_gets_the_same_box_and_flip(tmp_path: Path) -> None:
    paths = write_clip(tmp_path / "clip", same=True)  # identical frames: any per-frame box would show
    t = train_clip_transform(num_frames=6, stride=2, size=32, scale=(0.1, 0.3), hflip=0.5)
    torch.manual_seed(1)
    for _ in range(5):
        clip = t(paths)
        assert clip.shape == (6, 32, 32, 3) and clip.dtype == np.uint8
        assert all(np.array_equal(clip[0], frame) for frame in clip[1:])


def test_apply_is_the_image_transform_with_one_params(tmp_path: Path) -> None:
    paths = write_clip(tmp_path / "clip")
    t = train_clip_transform(num_frames=4, stride=3, size=(24, 32), hflip=1.0)
    params = t.make_params(len(paths), 80, 60)
    clip = t.apply(paths, params)
    image = RandomResizedCropFlip((24, 32), hflip=1.0)
    for i, index in enumerate(params.indices):
        assert np.array_equal(clip[i], image.apply(paths[index], params.crop))
    assert params.crop.flip


def test_frames_stay_in_order_and_decoded_arrays_work(tmp_path: Path) -> None:
    paths = write_clip(tmp_path / "clip", frames=12)
    arrays = [np.asarray(Image.open(p).convert("RGB")) for p in paths]  # as read from a video file
    t = eval_clip_transform(num_frames=4, stride=2, size=(60, 80), resize_size=None)
    for frames in (paths, arrays):
        clip = t(frames)
        bars = [int(np.argmax(frame[:, :, 0].astype(int).sum(0))) for frame in clip]
        assert bars == sorted(bars) and len(set(bars)) == 4  # the bar moves right frame after frame
        assert [b // 4 for b in bars] == [2, 4, 6, 8]  # centre segment of 12: frames 2, 4, 6, 8


def test_eval_centre_crop_equals_the_image_eval_transform(tmp_path: Path) -> None:
    paths = write_clip(tmp_path / "clip", frames=8)
    clip = eval_clip_transform(num_frames=8, size=32, resize_size=40)(paths)
    image = ResizeCenterCrop(32, 40)
    for t in range(8):
        assert np.array_equal(clip[t], image(paths[t]))


def test_frames_of_different_sizes_are_refused(tmp_path: Path) -> None:
    paths = write_clip(tmp_path / "clip", frames=3)
    Image.new("RGB", (40, 30)).save(paths[2])
    with pytest.raises(ValueError, match="frame 2 is 40x30 but frame 0 is 80x60"):
        ClipTransform(ResizeCenterCrop(16, None), TemporalSample(3, 1, "center"))(paths)
    with pytest.raises(ValueError, match="no frames"):
        eval_clip_transform(2, size=16)([])
