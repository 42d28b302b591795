import pickle
import random

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from cltrain.data import CropParams, RandomResizedCropFlip, eval_transform, train_transform
from cltrain.data.decode import decode_factor
from data_fixtures import READABLE, write_jpegs, write_odd_files


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    return write_jpegs(tmp_path_factory.mktemp("jpegs"), 4, size=(96, 72))


@pytest.fixture(scope="module")
def big_jpeg(tmp_path_factory):
    return write_jpegs(tmp_path_factory.mktemp("big"), 1, size=(200, 150))[0]


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    return write_odd_files(tmp_path_factory.mktemp("odd"))


@pytest.mark.parametrize("channels", [3, 1])
def test_output_shape_and_dtype(jpegs, channels):
    for t in (train_transform(32, channels=channels), eval_transform(32, 40, channels=channels)):
        for p in jpegs:
            with Image.open(p) as img:
                out = t(img)
            assert isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.shape == (32, 32, channels)


def test_non_square_size_and_path_input(jpegs):
    out = train_transform((24, 40))(jpegs[0])
    assert out.shape == (24, 40, 3)


def test_crop_boxes_inside_image_and_follow_torchvision_distribution():
    t = RandomResizedCropFlip(224, rng=random.Random(0))
    areas = []
    for w, h in [(500, 375), (375, 500), (64, 64), (1000, 100), (100, 1000)]:
        for _ in range(300):
            left, top, right, bottom = t.make_params(w, h).box
            assert 0 <= left < right <= w and 0 <= top < bottom <= h
            if (w, h) == (500, 375):
                areas.append((right - left) * (bottom - top) / (w * h))
                assert 3 / 4 - 0.02 <= (right - left) / (bottom - top) <= 4 / 3 + 0.02
    assert min(areas) >= 0.08 - 0.01 and max(areas) <= 1.0
    torch.manual_seed(0)
    img = Image.new("RGB", (500, 375))
    ref = [h * w / (500 * 375) for _, _, h, w in (T.RandomResizedCrop.get_params(img, (0.08, 1.0), (3 / 4, 4 / 3))
                                                  for _ in range(300))]
    assert abs(float(np.mean(areas)) - float(np.mean(ref))) < 0.05


def test_fallback_is_torchvision_central_crop():
    # An extreme aspect ratio makes all ten tries fail: torchvision's central crop.
    t = RandomResizedCropFlip(224, scale=(0.99, 1.0), rng=random.Random(0))
    torch_box = T.RandomResizedCrop.get_params(Image.new("RGB", (1000, 100)), (0.99, 1.0), (3 / 4, 4 / 3))
    i, j, h, w = torch_box
    assert t.make_params(1000, 100).box == (j, i, j + w, i + h) == (433, 0, 566, 100)


def test_flip_probability_and_pinned_params(jpegs):
    t = RandomResizedCropFlip(32, hflip=0.5, rng=random.Random(1))
    flips = [t.make_params(96, 72).flip for _ in range(2000)]
    assert 0.45 < np.mean(flips) < 0.55
    assert not any(RandomResizedCropFlip(32, hflip=0.0).make_params(96, 72).flip for _ in range(50))
    with Image.open(jpegs[0]) as img:
        box = (10, 5, 70, 65)
        plain = t.apply(img, CropParams(box, flip=False))
    with Image.open(jpegs[0]) as img:
        mirrored = t.apply(img, CropParams(box, flip=True))
    np.testing.assert_array_equal(mirrored, plain[:, ::-1])


def test_apply_matches_torchvision_crop_then_resize(jpegs):
    box = (7, 3, 80, 60)
    with Image.open(jpegs[1]) as img:
        ours = train_transform(32).apply(img, CropParams(box))
    ref = T.functional.resized_crop(Image.open(jpegs[1]).convert("RGB"), 3, 7, 57, 73, [32, 32],
                                    interpolation=T.InterpolationMode.BILINEAR, antialias=True)
    diff = np.abs(ours.astype(int) - np.asarray(ref).astype(int))
    # Same samples; only the outermost pixels differ: the box resample reads the pixels just
    # outside the crop where a crop-then-resize clamps at its edge.
    assert diff[2:-2, 2:-2].max() <= 1 and diff.mean() < 1


def test_eval_matches_torchvision_resize_center_crop(jpegs):
    for p in jpegs:
        with Image.open(p) as img:
            ours = eval_transform(48, 56)(img)
        ref = np.asarray(T.Compose([T.Resize(56), T.CenterCrop(48)])(Image.open(p).convert("RGB")))
        assert np.abs(ours.astype(int) - ref.astype(int)).max() <= 1


def test_reduced_size_decoding_keeps_output_size(big_jpeg):
    size = (40, 40)
    box = (10, 10, 170, 140)  # 160x130 crop: >= 2x the output, so a 1/2 decode
    assert decode_factor(box, size) == 2 and decode_factor((0, 0, 79, 79), size) == 1
    t = train_transform(size)
    with Image.open(big_jpeg) as img:
        reduced = t.apply(img, CropParams(box))
        assert img.size == (100, 75)  # the decoder really produced the reduced image
    with Image.open(big_jpeg) as img:
        img.load()  # already decoded: no reduction possible
        full = t.apply(img, CropParams(box))
    assert reduced.shape == full.shape == (40, 40, 3)
    assert np.abs(reduced.astype(int) - full.astype(int)).mean() < 4  # same picture
    with Image.open(big_jpeg) as img:
        assert eval_transform(40, 80)(img).shape == (40, 40, 3)  # 150 -> 80: a 1/2 decode as well


@pytest.mark.parametrize("kind", READABLE)
@pytest.mark.parametrize("channels", [3, 1])
def test_any_mode_becomes_rgb_or_gray(odd, kind, channels):
    with Image.open(odd[kind]) as img:
        out = train_transform(24, channels=channels)(img)
    assert out.shape == (24, 24, channels) and out.dtype == np.uint8
    if kind == "gray16":  # scaled from 16 bits, not clipped to white
        assert 20 < out.mean() < 235


def test_transforms_pickle_and_reject_bad_arguments():
    for t in (train_transform(32), eval_transform(32, 40, channels=1)):
        assert repr(pickle.loads(pickle.dumps(t))) == repr(t)
    for bad in (dict(size=0), dict(scale=(0.5, 0.1)), dict(ratio=(2, 1)), dict(hflip=1.5), dict(channels=2)):
        with pytest.raises(ValueError, match=str(next(iter(bad.values()))).replace("(", r"\(").replace(")", r"\)")):
            train_transform(**bad)
    with pytest.raises(ValueError, match="resize_size=16"):
        eval_transform(32, 16)
    with pytest.raises(TypeError, match="PIL image or a path"):
        train_transform(32)(np.zeros((8, 8, 3), np.uint8))
