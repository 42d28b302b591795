import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, default_collate

from cltrain import is_channels_last
from cltrain.data import ImageFolderDataset, NHWCCollate, nhwc_collate, train_transform
from tests.helpers.data_fixtures import write_image_folder


def _images(n, h=9, w=7, c=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, c), dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize("c", [3, 1])
@pytest.mark.parametrize("n", [1, 5])
def test_strides_and_values_equal_nchw_reference(c, n):
    imgs = _images(n, c=c)
    x, y = nhwc_collate([(im, i) for i, im in enumerate(imgs)])
    ref = torch.stack([torch.from_numpy(im).permute(2, 0, 1) for im in imgs]).contiguous()
    assert x.shape == (n, c, 9, 7) and x.dtype == torch.uint8
    assert is_channels_last(x) and x.stride() == (9 * 7 * c, 1, 7 * c, c)
    assert torch.equal(x, ref)
    assert y.dtype == torch.int64 and y.tolist() == list(range(n))


def test_numpy_pil_tensor_and_grayscale_2d_inputs():
    imgs = _images(3)
    batch = [(imgs[0], 0), (Image.fromarray(imgs[1]), np.int64(1)), (torch.from_numpy(imgs[2]), torch.tensor(2))]
    x, y = NHWCCollate()(batch)
    for i in range(3):
        assert torch.equal(x[i].permute(1, 2, 0), torch.from_numpy(imgs[i]))
    gray = [(np.full((4, 4), v, np.uint8), 0) for v in (1, 2)]
    xg, _ = nhwc_collate(gray)
    assert xg.shape == (2, 1, 4, 4) and is_channels_last(xg) and xg[1].eq(2).all()


def test_different_sizes_name_both_sizes_and_positions():
    batch = [(im, 0) for im in _images(2)] + [(np.zeros((8, 7, 3), np.uint8), 0)]
    with pytest.raises(ValueError, match=r"image 2 has shape \(H, W, C\) = \(8, 7, 3\) but image 0 has \(9, 7, 3\)"):
        nhwc_collate(batch)


def test_rejects_chw_tensors_wrong_dtype_and_empty_batch():
    with pytest.raises(TypeError, match="looks CHW"):
        nhwc_collate([(torch.zeros(3, 8, 8, dtype=torch.uint8), 0)])
    with pytest.raises(TypeError, match="float32"):
        nhwc_collate([(np.zeros((8, 8, 3), np.float32), 0)])
    with pytest.raises(ValueError, match="empty"):
        nhwc_collate([])


def test_worker_processes_keep_strides_and_ragged_last_batch(tmp_path):
    root = write_image_folder(tmp_path, classes=2, train=5, val=1, size=(64, 48))
    ds = ImageFolderDataset(root / "train", train_transform(32))
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=NHWCCollate())
    batches = list(loader)
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    for x, y in batches:
        assert x.shape[1:] == (3, 32, 32) and is_channels_last(x) and x.stride()[1] == 1
        assert y.dtype == torch.int64


def test_float_targets_stay_float_and_int_targets_int64():
    imgs = _images(2)
    _, y = nhwc_collate([(imgs[0], 1.7), (imgs[1], 0.25)])
    assert y.dtype == torch.float64 and y.tolist() == [1.7, 0.25]
    _, y = nhwc_collate([(imgs[0], np.float32(0.5)), (imgs[1], np.float32(1.5))])
    assert y.is_floating_point() and y.tolist() == [0.5, 1.5]
    _, y = nhwc_collate([(imgs[0], 3), (imgs[1], 4)])
    assert y.dtype == torch.int64


def test_extra_fields_are_collated_like_default_collate():
    imgs = _images(2)
    soft = [torch.tensor([0.1, 0.9]), torch.tensor([0.6, 0.4])]
    samples = [(imgs[0], 1, soft[0], "a.jpg"), (imgs[1], 0, soft[1], "b.jpg")]
    x, y, w, name = nhwc_collate(samples)
    _, *reference = default_collate(samples)
    assert is_channels_last(x) and y.tolist() == [1, 0] and y.dtype == reference[0].dtype
    assert torch.equal(w, torch.stack(soft)) and list(name) == ["a.jpg", "b.jpg"] and name == reference[2]
    out = NHWCCollate(image_key="img")([{"img": imgs[0], "label": 1, "weight": 0.5}, {"img": imgs[1], "label": 0, "weight": 2.0}])
    assert set(out) == {"img", "label", "weight"} and is_channels_last(out["img"])
    assert torch.equal(out["img"][1].permute(1, 2, 0), torch.from_numpy(imgs[1]))
    assert out["label"].dtype == torch.int64 and out["weight"].tolist() == [0.5, 2.0]
    with pytest.raises(TypeError, match="need the key 'image'"):
        nhwc_collate([{"img": imgs[0]}])


class _SharedProbe(torch.utils.data.Dataset):
    """Collates inside the worker and reports whether the buffer it made is in shared memory."""

    def __init__(self, images):
        self.images = images

    def __len__(self):
        return 1

    def __getitem__(self, i):
        x, y = nhwc_collate([(im, k) for k, im in enumerate(self.images)])
        return x, y, x.is_shared()


def test_batches_made_in_workers_are_in_shared_memory_and_keep_layout_and_values():
    imgs = _images(3, h=8, w=6)
    x, y, shared_in_worker = next(iter(DataLoader(_SharedProbe(imgs), batch_size=None, num_workers=1)))
    assert shared_in_worker  # allocated in shared memory where it was made, as default_collate does
    assert is_channels_last(x) and x.stride() == (8 * 6 * 3, 1, 6 * 3, 3)
    assert torch.equal(x, torch.stack([torch.from_numpy(im).permute(2, 0, 1) for im in imgs]))
    assert not nhwc_collate([(imgs[0], 0)])[0].is_shared()  # not in the main process
    loader = DataLoader([(im, k) for k, im in enumerate(imgs)], batch_size=3, num_workers=1, collate_fn=nhwc_collate)
    xb, yb = next(iter(loader))
    assert is_channels_last(xb) and torch.equal(xb, x) and yb.tolist() == [0, 1, 2]
