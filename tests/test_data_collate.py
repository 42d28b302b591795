import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from cltrain import is_channels_last
from cltrain.data import ImageFolderDataset, NHWCCollate, nhwc_collate, train_transform
from data_fixtures import write_image_folder


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
