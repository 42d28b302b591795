"""PrefetchDataLoader off CUDA: a plain DataLoader (the CUDA path is checked in tests/test_cuda.py)."""

import inspect

import numpy as np
import pytest
import torch

from cltrain import is_channels_last
from cltrain.data import NHWCCollate, PrefetchDataLoader


def _samples(n=6):
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 256, (8, 6, 3), dtype=np.uint8), i % 3) for i in range(n)]


@pytest.mark.parametrize("device", [None, "cpu", "cuda"])
@pytest.mark.parametrize("workers", [0, 1])
def test_without_cuda_batches_are_those_of_a_plain_loader(device, workers):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("the CUDA path is tested in tests/test_cuda.py")
    loader = PrefetchDataLoader(_samples(), batch_size=4, num_workers=workers, collate_fn=NHWCCollate(), drop_last=True,
                                prefetch_device=device)
    for _ in range(2):  # two epochs
        batches = list(loader)
        assert len(batches) == 1
        x, y = batches[0]
        assert x.device.type == "cpu" and is_channels_last(x) and y.tolist() == [0, 1, 2, 0]
    assert loader._prefetcher is None  # no side stream is made off CUDA


def test_cuda_prefetch_is_opt_in(tmp_path):
    """The side-stream prefetch has not been measured on a GPU: a DataModule on a CUDA device
    gives a loader without it unless ``cuda_prefetch=True``."""
    from cltrain.data import ImageFolderDataModule
    from cltrain.data.video import ClipFolderDataModule
    from tests.helpers.data_fixtures import write_image_folder

    root = write_image_folder(tmp_path / "data", classes=2, train=4, val=1, size=(40, 32))
    for cls in (ImageFolderDataModule, ClipFolderDataModule):
        assert inspect.signature(cls).parameters["cuda_prefetch"].default is False, cls.__name__
    for opt_in in (False, True):
        dm = ImageFolderDataModule(root, batch_size=2, num_workers=0, image_size=16, val_resize_size=18,
                                   cuda_prefetch=opt_in)
        dm.setup("fit")
        dm._device = torch.device("cuda", 0)  # as _choose_device sets it under a GPU trainer
        loader = dm.train_dataloader()
        assert loader.prefetch_device == (torch.device("cuda", 0) if opt_in else None)
