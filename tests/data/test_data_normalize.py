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


def test_statistics_in_0_255_units_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"0-255 units.*divide by 255"):
        normalize(_batch(), mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375))
    with pytest.raises(ValueError, match="0-255 units"):
        normalize(_batch(), mean=IMAGENET_MEAN, std=(58.395, 57.12, 57.375))


def _clips(n=2, c=3, t=4, h=6, w=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, t, h, w, c), dtype=torch.uint8, generator=g).permute(0, 4, 1, 2, 3)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("fmt", [torch.channels_last, torch.channels_last_3d, torch.contiguous_format])
@pytest.mark.parametrize("c,n", [(3, 18), (1, 1)])
def test_clip_batches_5d(dtype, fmt, c, n):
    x = _clips(n=n, c=c)
    assert x.is_contiguous(memory_format=torch.channels_last_3d)
    mean, std = IMAGENET_MEAN[:c], IMAGENET_STD[:c]
    y = normalize(x, mean, std, dtype=dtype, memory_format=fmt)
    want = torch.contiguous_format if fmt is torch.contiguous_format else torch.channels_last_3d
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous(memory_format=want)
    if want is torch.channels_last_3d:
        assert y.permute(0, 2, 3, 4, 1).is_contiguous()  # real NTHWC strides, also for C == 1
    m = torch.tensor(mean, dtype=torch.float64).view(1, -1, 1, 1, 1)
    s = torch.tensor(std, dtype=torch.float64).view(1, -1, 1, 1, 1)
    assert (y.double() - (x.double() / 255 - m) / s).abs().max() <= TOL[dtype]
    assert (normalize(x.contiguous(), mean, std, dtype=dtype).double() - y.double()).abs().max() == 0  # NCTHW input too


def test_clip_batches_refuse_the_2d_format():
    with pytest.raises(ValueError, match="channels_last_3d or torch.contiguous_format for a 5-D"):
        normalize(_clips(), memory_format=torch.preserve_format)
    with pytest.raises(ValueError, match="for a 4-D"):
        normalize(_batch(), memory_format=torch.channels_last_3d)
    with pytest.raises(TypeError, match=r"\(N, C, T, H, W\)"):
        normalize(torch.zeros(1, 3, 4, 4, 4, 4, dtype=torch.uint8))
