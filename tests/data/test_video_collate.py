"""ndhwc_collate: (T, H, W, C) clips into one NDHWC buffer, handed out as its channels_last_3d NCDHW view."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from cltrain.data.video import NDHWCCollate, ndhwc_collate

CL3D = torch.channels_last_3d


def _clips(n, t=4, h=9, w=7, c=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (t, h, w, c), dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize("c", [3, 1])
@pytest.mark.parametrize("n", [1, 5])
def test_strides_and_values_equal_ncthw_reference(c: int, n: int) -> None:
    clips = _clips(n, c=c)
    x, y = ndhwc_collate([(clip, i) for i, clip in enumerate(clips)])
    ref = torch.stack([torch.from_numpy(clip).permute(3, 0, 1, 2) for clip in clips]).contiguous()
    assert x.shape == (n, c, 4, 9, 7) and x.dtype == torch.uint8
    assert x.is_contiguous(memory_format=CL3D) and x.stride() == (4 * 9 * 7 * c, 1, 9 * 7 * c, 7 * c, c)
    assert torch.equal(x, ref)
    assert y.dtype == torch.int64 and y.tolist() == list(range(n))


def test_frame_lists_tensors_pil_frames_and_grayscale() -> None:
    clips = _clips(3)
    frames_pil = [Image.fromarray(f) for f in clips[1]]
    batch = [(clips[0], 0), (frames_pil, 1), (torch.from_numpy(clips[2]), 2)]
    x, _ = NDHWCCollate()(batch)
    for i in range(3):
        assert torch.equal(x[i].permute(1, 2, 3, 0), torch.from_numpy(clips[i]))
    gray = [(np.full((2, 4, 4), v, np.uint8), 0) for v in (1, 2)]  # (T, H, W): one channel
    xg, _ = ndhwc_collate(gray)
    assert xg.shape == (2, 1, 2, 4, 4) and xg.is_contiguous(memory_format=CL3D) and xg[1].eq(2).all()


def test_float_targets_stay_float_and_extra_fields_are_collated() -> None:
    clips = _clips(2)
    x, y, name = ndhwc_collate([(clips[0], 1.7, "a"), (clips[1], 0.25, "b")])
    assert y.dtype == torch.float64 and y.tolist() == [1.7, 0.25]
    assert list(name) == ["a", "b"]  # as default_collate gives them


def test_errors_name_the_clip_and_both_shapes() -> None:
    with pytest.raises(ValueError, match="batch is empty"):
        ndhwc_collate([])
    a, b = _clips(1)[0], _clips(1, t=5)[0]
    with pytest.raises(ValueError, match=r"clip 1 has shape \(T, H, W, C\) = \(5, 9, 7, 3\) but clip 0 has \(4, 9, 7, 3\)"):
        ndhwc_collate([(a, 0), (b, 1)])
    with pytest.raises(TypeError, match="clip 0 has dtype float32; expected uint8"):
        ndhwc_collate([(a.astype(np.float32), 0)])
    with pytest.raises(TypeError, match=r"looks \(C, T, H, W\)"):
        ndhwc_collate([(torch.from_numpy(a).permute(3, 0, 1, 2), 0)])
    with pytest.raises(TypeError, match="single PIL image"):
        ndhwc_collate([(Image.fromarray(a[0]), 0)])
    with pytest.raises(TypeError, match=r"clip 0: image 1 has dtype float64"):  # the image collate's frame check
        ndhwc_collate([([a[0], a[1].astype(np.float64)], 0)])
    with pytest.raises(ValueError, match="clip 0: frame 1 has shape"):
        ndhwc_collate([([a[0], a[1, :5]], 0)])
    with pytest.raises(ValueError, match="clip 0 has no frames"):
        ndhwc_collate([([], 0)])
    with pytest.raises(TypeError, match=r"expected \(clip, target, \.\.\.\)"):
        ndhwc_collate([a])


class _Clips(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return np.full((3, 6, 5, 3), i, np.uint8), i


def test_channels_last_3d_survives_worker_processes() -> None:
    # the default start method: a batch crosses from a worker by the same pickling whichever method started it
    loader = DataLoader(_Clips(), batch_size=4, num_workers=2, collate_fn=ndhwc_collate)
    batches = list(loader)
    assert len(batches) == 2
    for x, y in batches:
        assert x.shape == (4, 3, 3, 6, 5) and x.is_contiguous(memory_format=CL3D)
        assert torch.equal(x.amax(dim=(1, 2, 3, 4)), y.to(torch.uint8))
