import pytest
import torch

from cltrain import is_channels_last
from cltrain.data import IMAGENET_MEAN, IMAGENET_STD, nhwc_collate, normalize

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _batch(n=3, c=3, h=10, w=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, h, w, c), dtype=torch.uint8, generator=g)
    return nhwc_collate([(img.numpy(), 0) for img in x])[0]


def _reference(x, mean, std):
    m = torch.tensor(mean, dtype=torch.float64).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float64).view(1, -1, 1, 1)
    return (x.double() / 255 - m) / s


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("fmt", [torch.channels_last, torch.contiguous_format])
def test_matches_float_reference(dtype, fmt):
    x = _batch(n=20)  # more than one 16-image chunk for the low-precision path
    y = normalize(x, dtype=dtype, memory_format=fmt)
    assert y.dtype == dtype and y.shape == x.shape
    assert is_channels_last(y) if fmt is torch.channels_last else y.is_contiguous()
    assert (y.double() - _reference(x, IMAGENET_MEAN, IMAGENET_STD)).abs().max() <= TOL[dtype]


def test_grayscale_and_single_image_keep_channels_last():
    x = _batch(n=1, c=1)
    y = normalize(x, mean=(0.5,), std=(0.25,))
    assert is_channels_last(y) and y.stride() == (120, 1, 12, 1)
    assert (y.double() - _reference(x, (0.5,), (0.25,))).abs().max() <= 1e-5


def test_nchw_input_is_accepted():
    x = _batch().contiguous()
    assert (normalize(x).double() - _reference(x, IMAGENET_MEAN, IMAGENET_STD)).abs().max() <= 1e-5


def test_bad_inputs_are_named():
    with pytest.raises(TypeError, match="uint8"):
        normalize(torch.zeros(1, 3, 4, 4))
    with pytest.raises(TypeError, match="float64"):
        normalize(_batch(), dtype=torch.float64)
    with pytest.raises(ValueError, match="2 values"):
        normalize(_batch(), mean=(0.5, 0.5))
    with pytest.raises(ValueError, match="zero"):
        normalize(_batch(), std=(1.0, 0.0, 1.0))


def test_normalisation_constants_are_made_once_per_device():
    # Rebuilding mean/std tensors per batch meant a blocking host-to-device copy every step on CUDA.
    from cltrain.data.normalize import _affine_cached

    x = torch.randint(0, 256, (2, 8, 8, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
    normalize(x, mean=(0.1, 0.2, 0.3), std=[0.4, 0.5, 0.6])
    hits = _affine_cached.cache_info().hits
    normalize(x, mean=[0.1, 0.2, 0.3], std=(0.4, 0.5, 0.6), dtype=torch.bfloat16)
    assert _affine_cached.cache_info().hits == hits + 1
