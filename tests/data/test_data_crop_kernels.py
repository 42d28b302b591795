"""Region decoding (only the MCUs under the crop), the crop distribution, reproducible crops,
EXIF orientation and the decompression-bomb limit, on real JPEG files written here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2.functional as TF
from PIL import Image
from torch.utils.data import DataLoader

from cltrain.data import ImageFolderDataset, RandomResizedCropFlip, eval_transform, nhwc_collate, train_transform
from cltrain.data import crop_kernels
from cltrain.data.decoders import jpeg_roi
from cltrain.data.crop_kernels import decode_jpeg, jpeg_resized_crop
from cltrain.data.decoders import BACKENDS, get_decoder
from tests.helpers.data_fixtures import photo, write_image_folder

needs_roi = pytest.mark.skipif(not jpeg_roi.available(), reason="no libturbojpeg 3 (pip install turbojpeg)")


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """JPEGs of odd sizes in 4:2:0, 4:2:2, 4:4:4, grey and progressive, so MCU edges fall inside crops."""
    folder = tmp_path_factory.mktemp("roi")
    rng = np.random.default_rng(3)
    out = []
    for i, (size, sub) in enumerate([((203, 150), 2), ((150, 203), 0), ((177, 131), 1), ((120, 97), 2)]):
        p = folder / f"{i}.jpg"
        photo(rng, size, i).save(p, quality=80 + i, subsampling=sub)
        out.append(p)
    g = folder / "grey.jpg"
    photo(rng, (131, 99), 9).convert("L").save(g, quality=90)
    prog = folder / "progressive.jpg"  # coefficients for the whole image first, then the region's IDCT
    photo(rng, (141, 113), 5).save(prog, quality=85, progressive=True, subsampling=2)
    return [*out, g, prog]


@pytest.mark.parametrize("factor", [1, 2, 4])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_each_decoder_decodes_a_box_as_the_whole_decode_sliced(photos, factor, name):
    backend = get_decoder(name)
    if not backend.available():
        pytest.skip(f"{name} is not installed")
    rng = np.random.default_rng(factor)
    for path in photos:
        data = path.read_bytes()
        header = backend.header(data)
        for channels in (3, 1):
            whole = decode_jpeg(data, channels, factor, decoder="simplejpeg")
            h, w = whole.shape[:2]
            for _ in range(12):
                left, top = int(rng.integers(0, w - 1)), int(rng.integers(0, h - 1))
                box = (left, top, int(rng.integers(left + 1, w + 1)), int(rng.integers(top + 1, h + 1)))
                got = backend.decode(data, header, box, factor, channels)
                np.testing.assert_array_equal(got, whole[box[1]:box[3], box[0]:box[2]], err_msg=f"{path.name} {box}")


@needs_roi
def test_region_path_equals_whole_image_path(photos):
    torch.manual_seed(0)
    t = train_transform(48)
    for path in photos:
        data = path.read_bytes()
        with Image.open(path) as img:
            params = [t.make_params(*img.size) for _ in range(6)]
        for p in params:
            fast = jpeg_resized_crop(data, p.box, (48, 48), 3, p.flip, region=True)
            whole = jpeg_resized_crop(data, p.box, (48, 48), 3, p.flip, region=False)
            np.testing.assert_array_equal(fast, whole)


def test_region_crop_matches_decode_then_crop_within_resampling_tolerance(photos):
    """The fast path against the anchors' way: Pillow decodes the whole image, torchvision v2
    crops and resizes it (antialiased bilinear, the same kernel)."""
    torch.manual_seed(1)
    t = train_transform(64)
    for path in photos[:4]:
        data = path.read_bytes()
        with Image.open(path) as img:
            whole = TF.pil_to_tensor(img.convert("RGB"))
        for _ in range(6):
            p = t.make_params(whole.shape[2], whole.shape[1])
            left, top, right, bottom = p.box
            ref = TF.resized_crop(whole, top, left, bottom - top, right - left, [64, 64], antialias=True)
            got = jpeg_resized_crop(data, p.box, (64, 64), 3, False)
            diff = np.abs(got.astype(int) - ref.permute(1, 2, 0).numpy().astype(int))
            # factor 1: the same decode and kernel (libjpeg versions may differ by a level); a
            # DCT-scaled decode rounds the box to its pixels and filters differently.
            bound = 0.5 if crop_kernels.decode_factor(p.box, (64, 64)) == 1 else 4.0
            assert diff.mean() < bound, (path.name, p.box, diff.mean())


@needs_roi
def test_region_arguments_the_library_would_refuse_are_errors_not_overruns(photos):
    data = photos[0].read_bytes()  # 203x150
    with pytest.raises(ValueError, match="factor=3"):
        jpeg_roi.decode_region(data, (0, 0, 10, 10), factor=3)
    with pytest.raises(ValueError, match="not inside"):
        jpeg_roi.decode_region(data, (0, 0, 204, 10))
    with pytest.raises(ValueError, match="not inside"):
        jpeg_roi.decode_region(data, (0, 0, 60, 40), factor=4)  # 51x38 at 1/4
    assert jpeg_roi.decode_region(data, (50, 37, 51, 38), factor=4).shape == (1, 1, 3)


def test_corrupt_region_raises_value_error(photos):
    data = photos[0].read_bytes()
    with pytest.raises(ValueError):
        jpeg_resized_crop(data[: len(data) // 2], (10, 10, 90, 90), (32, 32))


def test_crop_boxes_follow_random_resized_crop_statistics():
    """Scale and log-ratio of the drawn boxes against torchvision's RandomResizedCrop (two-sample KS)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    w, h, n = 500, 375, 2000
    torch.manual_seed(0)
    t = RandomResizedCropFlip(224, scale=(0.2, 0.9), ratio=(0.6, 1.5))
    ours = [t.make_params(w, h).box for _ in range(n)]
    torch.manual_seed(123)
    ref = [T.RandomResizedCrop.get_params(torch.empty(1, h, w), [0.2, 0.9], [0.6, 1.5]) for _ in range(n)]
    s_ours = [(r - l) * (b - t_) / (w * h) for l, t_, r, b in ours]
    s_ref = [hh * ww / (w * h) for _, _, hh, ww in ref]
    r_ours = [math.log((r - l) / (b - t_)) for l, t_, r, b in ours]
    r_ref = [math.log(ww / hh) for _, _, hh, ww in ref]
    assert scipy_stats.ks_2samp(s_ours, s_ref).pvalue > 1e-3
    assert scipy_stats.ks_2samp(r_ours, r_ref).pvalue > 1e-3
    assert 0.2 - 0.01 <= min(s_ours) and max(s_ours) <= 0.9 + 0.01
    # centres uniform over the free range: mean centre near the image centre
    assert abs(np.mean([(l + r) / 2 for l, _, r, _ in ours]) - w / 2) < 8


def test_crop_params_are_reproducible_under_the_torch_seed():
    t = train_transform(32)
    torch.manual_seed(7)
    a = [t.make_params(300, 200) for _ in range(20)]
    torch.manual_seed(7)
    b = [t.make_params(300, 200) for _ in range(20)]
    torch.manual_seed(8)
    c = [t.make_params(300, 200) for _ in range(20)]
    assert a == b and a != c


def _epoch(root, workers, seed):
    ds = ImageFolderDataset(root / "train", train_transform(24))
    g = torch.Generator().manual_seed(seed)
    loader = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=nhwc_collate, generator=g)
    return torch.cat([x for x, _ in loader])


def test_crops_reproducible_across_workers_and_differ_between_workers(tmp_path):
    root = write_image_folder(tmp_path, classes=2, train=4, val=1, size=(64, 48))
    a, b = _epoch(root, 2, seed=5), _epoch(root, 2, seed=5)
    assert torch.equal(a, b)  # same seed, same crops, whichever worker did which batch
    assert not torch.equal(a, _epoch(root, 2, seed=6))
    # the two workers get different seeds: the same image list would otherwise repeat crops
    ds = ImageFolderDataset(root / "train", train_transform(24))
    ds.samples = [ds.samples[0]] * 8
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=nhwc_collate,
                        generator=torch.Generator().manual_seed(1))
    first, second = (x for x, _ in loader)
    assert not torch.equal(first, second)


def _rotated_jpeg(path, orientation):
    """A JPEG stored 60x40 whose EXIF says to turn it (6: 90 degrees clockwise)."""
    img = Image.new("RGB", (60, 40), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 20, 40))  # a red band on the stored image's left
    exif = Image.Exif()
    exif[0x0112] = orientation
    img.save(path, quality=95, exif=exif)
    return path


@pytest.mark.parametrize("source", ["path", "pil"])
def test_exif_transpose_option(tmp_path, source):
    path = _rotated_jpeg(tmp_path / "r.jpg", 6)

    def run(t):
        if source == "path":
            return t(path)
        with Image.open(path) as img:
            return t(img)

    stored = run(eval_transform((40, 60), None))
    assert stored.shape == (40, 60, 3) and stored[20, 5, 0] > 200  # off by default: red on the left
    upright = run(eval_transform((60, 40), None, exif_transpose=True))
    assert upright.shape == (60, 40, 3)
    assert upright[5, 20, 0] > 200 and upright[55, 20, 2] > 200  # turned: the red band is now on top
    torch.manual_seed(0)
    assert train_transform(16, scale=(1.0, 1.0), ratio=(2 / 3, 2 / 3), hflip=0.0, exif_transpose=True)(path)[0, 8, 0] > 200


def test_pixel_limit_on_the_libjpeg_turbo_path(tmp_path, monkeypatch):
    path = tmp_path / "big.jpg"
    Image.new("RGB", (100, 80), (10, 20, 30)).save(path, quality=90)
    t = train_transform(16)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100 * 80 // 2 - 1)  # over twice the limit
    with pytest.raises(Image.DecompressionBombError, match="big.jpg.*data.exclude_files"):
        t(path)
    with pytest.raises(Image.DecompressionBombError):
        t(path.read_bytes())
    with pytest.raises(Image.DecompressionBombError):
        t.apply(path, t.make_params(100, 80))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100 * 80 - 1)  # over the limit: Pillow's warning
    with pytest.warns(Image.DecompressionBombWarning):
        t(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert t(path).shape == (16, 16, 3)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_interpolation_option_on_both_paths(photos, interpolation):
    torch.manual_seed(2)
    t = train_transform(32, interpolation=interpolation)
    p = t.make_params(203, 150)
    fast = t.apply(photos[0], p)
    with Image.open(photos[0]) as img:
        slow = t.apply(img, p)
    assert np.abs(fast.astype(int) - slow.astype(int)).mean() < 3
    other = train_transform(32, interpolation="bicubic" if interpolation == "bilinear" else "bilinear")
    assert not np.array_equal(fast, other.apply(photos[0], p))
    with pytest.raises(ValueError, match="interpolation='lanczos'"):
        train_transform(32, interpolation="lanczos")


@needs_roi
def test_a_bad_header_does_not_spoil_the_next_good_one(photos):
    data = photos[0].read_bytes()
    good = jpeg_roi.read_header(data)
    assert jpeg_roi.read_header(b"\xff\xd8\xff\xe0 not a jpeg") is None
    assert jpeg_roi.read_header(data) == good
    with pytest.raises(jpeg_roi.JpegRegionError):
        jpeg_roi.decode_region(data[:200], (0, 0, 8, 8))
    assert jpeg_roi.read_header(data) == good


def test_a_back_end_is_one_module_and_one_line(photos, tmp_path, monkeypatch):
    from cltrain.data import decoders
    from cltrain.data.transforms import train_transform

    (tmp_path / "counting_backend.py").write_text(
        "from cltrain.data.decoders.simplejpeg_whole import SimpleJpegWhole\n"
        "class Counting(SimpleJpegWhole):\n"
        "    name, calls = 'counting', 0\n"
        "    def decode(self, *args, **kwargs):\n"
        "        type(self).calls += 1\n"
        "        return super().decode(*args, **kwargs)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="decoder='counting' is not a decoder"):  # the control: not there yet
        train_transform(48, decoder="counting")
    monkeypatch.setitem(decoders.BACKENDS, "counting", "counting_backend:Counting")  # the one line
    t = train_transform(48, decoder="counting")
    torch.manual_seed(0)
    out = t(photos[0])
    backend = decoders.get_decoder("counting")
    assert type(backend).calls == 1 and out.shape == (48, 48, 3)
    torch.manual_seed(0)
    np.testing.assert_array_equal(out, train_transform(48, decoder="simplejpeg")(photos[0]))
    monkeypatch.delitem(decoders._INSTANCES, "counting")
