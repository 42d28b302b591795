import contextlib
import math
import pickle

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2.functional as TF
from PIL import Image

from cltrain.data import CropParams, RandomResizedCropFlip, eval_transform, train_transform
from cltrain.data.crop_kernels import decode_factor, decode_jpeg, jpeg_resized_crop, jpeg_size
from tests.helpers.data_fixtures import BAD, READABLE, write_jpegs, write_odd_files

simplejpeg = pytest.importorskip("simplejpeg")


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
    torch.manual_seed(0)
    t = RandomResizedCropFlip(224)
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
    t = RandomResizedCropFlip(224, scale=(0.99, 1.0))
    torch_box = T.RandomResizedCrop.get_params(Image.new("RGB", (1000, 100)), (0.99, 1.0), (3 / 4, 4 / 3))
    i, j, h, w = torch_box
    assert t.make_params(1000, 100).box == (j, i, j + w, i + h) == (433, 0, 566, 100)


def test_flip_probability_and_pinned_params(jpegs):
    torch.manual_seed(1)
    t = RandomResizedCropFlip(32, hflip=0.5)
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


def _pillow(t, path, params):
    with Image.open(path) as img:
        return t.apply(img, params)


@pytest.mark.parametrize("channels", [3, 1])
def test_fast_path_agrees_with_pillow_path(jpegs, big_jpeg, channels):
    t = train_transform(48, channels=channels)
    torch.manual_seed(3)
    for path in [*jpegs, big_jpeg]:
        data = path.read_bytes()
        assert jpeg_size(data) == Image.open(path).size
        for tr in (t, eval_transform(48, 56, channels=channels)):
            for params in [tr.make_params(*jpeg_size(data)) for _ in range(4)]:
                fast = tr.apply(path, params)
                # A path (or bytes) of a JPEG really goes through libjpeg-turbo + torch.
                np.testing.assert_array_equal(fast, jpeg_resized_crop(data, params.box, tr.size, channels, params.flip,
                                                                      params.resize, tr.reduce))
                np.testing.assert_array_equal(fast, tr.apply(data, params))
                slow = _pillow(tr, path, params)
                assert fast.shape == slow.shape == (48, 48, channels) and fast.dtype == slow.dtype == np.uint8
                assert fast.flags["C_CONTIGUOUS"]
                # Same decode and samples (0.1 grey levels apart); a reduced decode rounds the box to
                # its pixels, moving the crop by up to half an output pixel (of a noisy picture here).
                reduced = params.resize is None and decode_factor(params.box, tr.size) > 1
                assert np.abs(fast.astype(int) - slow.astype(int)).mean() <= (2.0 if reduced else 0.5)


def test_fast_eval_is_torchvision_resize_center_crop_exactly(jpegs):
    for path in jpegs:
        decoded = torch.from_numpy(simplejpeg.decode_jpeg(path.read_bytes(), colorspace="RGB")).permute(2, 0, 1)
        ref = TF.center_crop(TF.resize(decoded, 40, antialias=True), 32).permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(eval_transform(32, 40)(path), ref)


def test_fast_train_is_torchvision_resized_crop_and_flip(jpegs):
    decoded = torch.from_numpy(simplejpeg.decode_jpeg(jpegs[0].read_bytes(), colorspace="RGB")).permute(2, 0, 1)
    ref = TF.horizontal_flip(TF.resized_crop(decoded, 3, 7, 57, 73, [32, 32], antialias=True)).permute(1, 2, 0).numpy()
    np.testing.assert_array_equal(train_transform(32).apply(jpegs[0], CropParams((7, 3, 80, 60), flip=True)), ref)


def test_reduced_size_jpeg_decoding(big_jpeg):
    data = big_jpeg.read_bytes()  # 200x150
    for factor in (1, 2, 4, 8):
        assert decode_jpeg(data, 3, factor).shape == (math.ceil(150 / factor), math.ceil(200 / factor), 3)
        assert decode_jpeg(data, 1, factor).shape == (math.ceil(150 / factor), math.ceil(200 / factor), 1)
    size, box = (40, 40), (10, 10, 170, 140)  # 160x130 crop: a 1/2 decode (see decode_factor)
    assert decode_factor(box, size) == 2
    reduced = jpeg_resized_crop(data, box, size)
    full = jpeg_resized_crop(data, box, size, reduce=False)
    assert reduced.shape == full.shape == (40, 40, 3)
    assert 0 < np.abs(reduced.astype(int) - full.astype(int)).mean() < 4  # decoded differently, same picture
    pillow = _pillow(train_transform(size), big_jpeg, CropParams(box))  # Pillow's draft: a 1/2 decode as well
    assert np.abs(reduced.astype(int) - pillow.astype(int)).mean() <= 1.5
    t = eval_transform(32, 64)  # 200x150 -> 85x64: a 1/2 decode of the whole image
    params = t.make_params(200, 150)
    assert params.resize == (64, 85) and decode_factor((0, 0, 200, 150), params.resize) == 2
    out = t(big_jpeg)
    assert out.shape == (32, 32, 3)
    assert np.abs(out.astype(int) - _pillow(t, big_jpeg, params).astype(int)).mean() <= 1.5


@pytest.mark.parametrize("kind", ["cmyk", "rgba", "gray16", "palette"])
def test_png_and_cmyk_fall_back_to_pillow(odd, kind):
    data = odd[kind].read_bytes()
    assert jpeg_size(data) is None
    t = train_transform(24)
    params = t.make_params(*Image.open(odd[kind]).size)
    expected = _pillow(t, odd[kind], params)
    np.testing.assert_array_equal(t.apply(odd[kind], params), expected)
    np.testing.assert_array_equal(t.apply(data, params), expected)
    assert t(odd[kind]).shape == t(data).shape == (24, 24, 3)


@pytest.mark.parametrize("kind", BAD)
def test_unreadable_files_raise_pillows_error(odd, kind):
    # A truncated JPEG has a readable header but simplejpeg (strict) refuses the data:
    # Pillow then reads it and raises, as the Pillow-only path did.
    t = eval_transform(24, 32)
    with pytest.raises(Exception) as fast:
        t(odd[kind])
    with pytest.raises(Exception) as pillow, Image.open(odd[kind]) as img:
        t(img)
    assert type(fast.value) is type(pillow.value) and str(fast.value) == str(pillow.value)
    if kind != "truncated":
        assert odd[kind].name in str(fast.value)


@pytest.mark.parametrize("kind", ["cut", "cut_preview", "motion", "good"])
def test_a_region_decode_refuses_a_truncated_jpeg_for_every_crop(odd, tmp_path, kind):
    # the region back end stops after the crop's last row: a crop above a partial download's cut decoded, one
    # below it was refused, so bad_files skipped (or raised for) the file in some epochs and trained on it in others
    from cltrain.data.decoders import get_decoder

    if get_decoder("auto") is None or get_decoder("auto").name != "turbojpeg":
        pytest.skip("needs the turbojpeg region back end")
    path = odd.get(kind, tmp_path / "cut.jpg")
    if kind == "cut":  # a partial download: 90 % of the file
        data = odd["good"].read_bytes()
        path.write_bytes(data[: len(data) * 9 // 10])
    t = train_transform(24, decoder="turbojpeg")
    decoded = 0
    for seed in range(40):
        torch.manual_seed(seed)
        with contextlib.suppress(OSError, ValueError):
            t(path)
            decoded += 1
    assert decoded == (40 if kind in ("motion", "good") else 0)


def test_without_a_jpeg_back_end_everything_goes_through_pillow(odd, monkeypatch):
    from cltrain.data import decoders
    from cltrain.data.decoders import jpeg_roi
    from cltrain.data.decoders import simplejpeg_whole

    t = train_transform(24)
    params = t.make_params(96, 72)
    expected = _pillow(t, odd["good"], params)
    assert jpeg_size(odd["good"].read_bytes()) is not None  # the control: a back end reads it
    monkeypatch.setattr(simplejpeg_whole, "simplejpeg", None)
    monkeypatch.setattr(jpeg_roi, "_LIB", None)
    monkeypatch.setattr(decoders, "_INSTANCES", {})
    assert decoders.get_decoder("auto") is None
    assert jpeg_size(odd["good"].read_bytes()) is None
    np.testing.assert_array_equal(t.apply(odd["good"], params), expected)


def test_the_pillow_decoder_reads_every_file_with_pillow(odd, monkeypatch):
    from cltrain.data.decoders import simplejpeg_whole, turbojpeg_region

    def refuse(*args, **kwargs):
        raise AssertionError("a JPEG back end was used")

    monkeypatch.setattr(simplejpeg_whole.SimpleJpegWhole, "decode", refuse)
    monkeypatch.setattr(turbojpeg_region.TurboJpegRegion, "decode", refuse)
    t = train_transform(24, decoder="pillow")
    params = t.make_params(96, 72)
    np.testing.assert_array_equal(t.apply(odd["good"], params), _pillow(t, odd["good"], params))
    with pytest.raises(AssertionError, match="back end was used"):  # the control: "auto" decodes with one
        train_transform(24).apply(odd["good"], params)


@pytest.mark.parametrize("shape", [(512, 512), (1900, 17)], ids=["photo", "thin"])
def test_a_training_crop_read_by_pillow_is_torchvisions_crop_then_resize(shape):
    # a PNG (or any file Pillow reads): the resample stops at the crop's edges, as torchvision's and the JPEG path's
    import skimage.data

    from cltrain.data.crop_kernels import resized_crop

    pixels = np.asarray(Image.fromarray(skimage.data.astronaut()).resize(shape[::-1]))
    tensor = torch.from_numpy(pixels).permute(2, 0, 1)
    rng = np.random.default_rng(0)
    worst = 0
    for _ in range(20):
        top, left = int(rng.integers(0, shape[0] // 2)), int(rng.integers(0, shape[1] // 2))
        h, w = int(rng.integers(4, shape[0] - top)), int(rng.integers(4, shape[1] - left))
        ours = resized_crop(Image.fromarray(pixels), (left, top, left + w, top + h), (32, 32), reduce=False)
        theirs = TF.resized_crop(tensor, top, left, h, w, [32, 32], antialias=True).permute(1, 2, 0).numpy()
        worst = max(worst, int(np.abs(ours.astype(int) - theirs).max()))
    assert worst <= 1, worst
