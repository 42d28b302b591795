"""A batch decoded on threads of one process: the same pixels as one by one, reproducible crops,
bad files and augmentations handled as in the sequential path, worker processes with threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cltrain import is_channels_last
from cltrain.data import ImageFolderDataModule, ImageFolderDataset, NHWCCollate, eval_transform, train_transform
from cltrain.data import loader_threads
from cltrain.data.image_folder_dataset import BadImageError
from cltrain.data.crop_kernels import jpeg_resized_crop
from cltrain.data.loader_threads import one_thread
from tests.helpers.data_fixtures import write_image_folder


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("pool"), classes=2, train=6, val=2, size=(120, 90))


def _batch(ds, indices, seed):
    torch.manual_seed(seed)
    return ds.__getitems__(indices)


def test_threaded_batch_is_the_sequential_kernel_with_each_samples_own_generator(root):
    t = train_transform(32)
    ds = ImageFolderDataset(root / "train", t, threads=3, index_cache=False)
    indices = list(range(len(ds)))
    got = _batch(ds, indices, seed=0)
    torch.manual_seed(0)
    seeds = torch.randint(0, 2**62, (len(indices),)).tolist()  # what load_batch draws in the calling thread
    for i, seed in zip(indices, seeds):
        loader_threads._LOCAL.generator = torch.Generator().manual_seed(seed)  # as a pool thread sets it
        try:
            params = t.make_params(120, 90)
        finally:
            loader_threads._LOCAL.generator = None
        np.testing.assert_array_equal(got[i][0], t.apply(ds.samples[i][0], params))
        assert got[i][1] == ds.samples[i][1]


def test_threaded_crops_are_reproducible_and_follow_the_seed(root):
    ds = ImageFolderDataset(root / "train", train_transform(32), threads=2, index_cache=False)
    a, b, c = _batch(ds, range(8), 1), _batch(ds, range(8), 1), _batch(ds, range(8), 2)
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(a, b))
    assert not all(np.array_equal(x[0], y[0]) for x, y in zip(a, c))
    assert len({x[0].tobytes() for x in a}) == 8  # every sample its own crop


def test_deterministic_transform_gives_the_same_batch_on_threads(root):
    one = ImageFolderDataset(root / "val", eval_transform(32, 36), threads=1, index_cache=False)
    two = ImageFolderDataset(root / "val", eval_transform(32, 36), threads=2, index_cache=False)
    for (x, tx), (y, ty) in zip(one.__getitems__(range(4)), two.__getitems__(range(4))):
        np.testing.assert_array_equal(x, y)
        assert tx == ty


def test_augmentation_runs_in_the_calling_thread_in_order(root):
    ds = ImageFolderDataset(root / "train", train_transform(32, augment="trivialaugment"), threads=3, index_cache=False)
    a, b = _batch(ds, range(12), 5), _batch(ds, range(12), 5)
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(a, b))  # TrivialAugment draws from the global RNG


@pytest.fixture()
def with_bad(tmp_path):
    root = write_image_folder(tmp_path / "d", classes=1, train=4, val=1, size=(64, 48))
    bad = root / "train" / "c0" / "0_001.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    return root, bad


def test_bad_file_raises_naming_it_or_is_skipped(with_bad):
    root, bad = with_bad
    ds = ImageFolderDataset(root / "train", train_transform(16), threads=2, index_cache=False)
    with pytest.raises(BadImageError, match="0_001.jpg"):
        ds.__getitems__([0, 1, 2])
    log = root / "skipped.tsv"
    ds = ImageFolderDataset(root / "train", train_transform(16), bad_files="skip", skip_log=log, threads=2,
                            index_cache=False)
    out = ds.__getitems__([0, 1, 2])
    assert [t for _, t in out] == [0, 0, 0] and all(x.shape == (16, 16, 3) for x, _ in out)
    assert str(bad) in log.read_text()


def test_workers_with_threads_give_channels_last_batches(root):
    ds = ImageFolderDataset(root / "train", train_transform(24), threads=2, index_cache=False)
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=NHWCCollate(),
                        generator=torch.Generator().manual_seed(0))
    first = [x for x, _ in loader]
    again = [x for x, _ in DataLoader(ds, batch_size=4, num_workers=2, collate_fn=NHWCCollate(),
                                      generator=torch.Generator().manual_seed(0))]
    assert len(first) == 3 and all(is_channels_last(x) and x.shape == (4, 3, 24, 24) for x in first)
    assert all(torch.equal(x, y) for x, y in zip(first, again))  # per-worker seeding decides the crops


def test_datamodule_passes_decode_threads_and_checks_it(root):
    dm = ImageFolderDataModule(root, batch_size=2, num_workers=0, image_size=16, val_resize_size=18, decode_threads=2)
    dm.setup("fit")
    assert dm.train_set.threads == 2 and dm.val_set.threads == 2
    with pytest.raises(ValueError, match="decode_threads=0"):
        ImageFolderDataModule(root, decode_threads=0)


def test_per_image_kernels_run_on_one_thread_and_leave_the_callers_setting(root):
    data = (root / "train" / "c0" / "0_000.jpg").read_bytes()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        with one_thread():
            seen.append(torch.get_num_threads())
        out = jpeg_resized_crop(data, (5, 5, 100, 80), (32, 32))
        assert seen == [1] and torch.get_num_threads() == 2 and out.shape == (32, 32, 3)
    finally:
        torch.set_num_threads(before)


FIT_ON_DECODE_THREADS = """
import json, sys, threading, torch
import lightning.pytorch as pl
import torch.nn.functional as F
from cltrain.data import ImageFolderDataModule

def fresh_thread():  # the process's default, as a thread that has run no kernel yet starts with it
    seen = []
    worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    worker.start(); worker.join()
    return seen[0]

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net, self.seen = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2)), []
    def training_step(self, batch, batch_idx):
        self.seen.append(torch.get_num_threads())
        return F.cross_entropy(self.net(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), 0.1)

default = fresh_thread()
model = Net()
pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
           enable_model_summary=False, num_sanity_val_steps=0).fit(
    model, datamodule=ImageFolderDataModule(sys.argv[1], batch_size=4, num_workers=0, decode_threads=2, image_size=16,
                                            val_resize_size=18))
print(json.dumps({"default": default, "steps": model.seen, "after": fresh_thread()}))
"""


def test_decode_threads_leave_the_training_step_all_of_torchs_threads(root):
    # The decode threads' one intra-op thread each was torch.set_num_threads(1), which also set the process's
    # default: the main thread, whose first kernel came after the first batch, trained on 1 of 2 cores, and a resumed
    # run (whose checkpoint's load ran a kernel first) on 2, so a resume without the callback was not bit for bit
    import json
    import subprocess
    import sys

    from tests.helpers import REPO

    import os

    env = {**os.environ, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}  # a user's default (the tests' share is 1 each)
    done = subprocess.run([sys.executable, "-c", FIT_ON_DECODE_THREADS, str(root)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["default"] == 1:
        pytest.skip("one core here: torch runs one intra-op thread, nothing to lose")
    assert result["steps"] == [result["default"]] * 3 and result["after"] == result["default"], result
    seen = []
    loader_threads._pool(2).submit(lambda: seen.append(torch.get_num_threads())).result()
    assert seen == [1]  # and the decode threads still run their kernels on one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [(224, 224), (37, 23)])
def test_collate_normalised_in_the_loader_equals_normalize_of_the_uint8_batch(dtype, size):
    from cltrain.data import normalize
    from cltrain.data.normalize import ImageNormalizer

    rng = np.random.default_rng(0)
    samples = [(rng.integers(0, 256, (*size, 3), dtype=np.uint8), i) for i in range(5)]
    expected = normalize(NHWCCollate()(samples)[0], dtype=dtype)
    for threads in (1, 2):
        images, targets = NHWCCollate(normalize=ImageNormalizer(dtype=dtype), threads=threads)(samples)
        assert images.dtype == dtype and is_channels_last(images) and targets.tolist() == [0, 1, 2, 3, 4]
        assert torch.equal(images, expected)


def test_loader_normalised_batches_cross_worker_processes(root):
    from cltrain.data.normalize import ImageNormalizer

    ds = ImageFolderDataset(root / "val", eval_transform(24, 28), index_cache=False)
    plain = next(iter(DataLoader(ds, batch_size=4, collate_fn=NHWCCollate())))[0]
    loader = DataLoader(ds, batch_size=4, num_workers=1, collate_fn=NHWCCollate(normalize=ImageNormalizer(), threads=2))
    images = next(iter(loader))[0]
    from cltrain.data import normalize

    assert images.dtype == torch.float32 and is_channels_last(images) and torch.equal(images, normalize(plain))


def test_datamodule_on_the_cpu_normalises_in_the_loader_with_the_same_values(root):
    import lightning as L

    from cltrain.data import normalize

    dm = ImageFolderDataModule(root, batch_size=2, num_workers=0, image_size=16, val_resize_size=18, decode_threads=2,
                               dtype=torch.bfloat16)
    dm.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                           enable_progress_bar=False)
    dm.setup("fit")
    images, targets = next(iter(dm.val_dataloader()))
    assert images.dtype == torch.bfloat16 and is_channels_last(images)
    plain = next(iter(DataLoader(dm.val_set, batch_size=2, collate_fn=NHWCCollate())))[0]
    assert torch.equal(images, normalize(plain, dtype=torch.bfloat16))
    assert dm.on_after_batch_transfer((images, targets), 0)[0] is images  # not normalised twice


def test_large_in_process_batches_live_in_their_own_mapping(monkeypatch):
    import gc

    from cltrain.data import collate as collate_module
    from cltrain.data import normalize
    from cltrain.data.normalize import ImageNormalizer

    monkeypatch.setattr(collate_module, "_HUGE_PAGES_FROM", 0)  # every batch through the mapping path
    rng = np.random.default_rng(1)
    samples = [(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8), i) for i in range(3)]
    expected = normalize(NHWCCollate()(samples)[0])
    first = NHWCCollate(normalize=ImageNormalizer(), threads=2)(samples)[0]
    second = NHWCCollate(normalize=ImageNormalizer())(samples)[0]
    gc.collect()  # the collate's own references are gone; the tensors keep their memory
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert first.data_ptr() != second.data_ptr()  # a fresh buffer per batch: a kept batch is never overwritten
    first.add_(1)
    assert torch.equal(second, expected) and is_channels_last(first)


def test_augmentation_of_a_wrapped_transform_is_not_lost_on_threads(root):
    calls = []

    class Wrapper:  # hides the inner transform's augment attribute from the dataset
        takes_paths = True

        def __init__(self):
            self.inner = train_transform(16, augment=lambda hwc: calls.append(1) or hwc * 0)

        def __call__(self, path):
            return self.inner(path)

    ds = ImageFolderDataset(root / "train", Wrapper(), threads=2, index_cache=False)
    out = ds.__getitems__(range(4))
    assert len(calls) == 4 and all(not x.any() for x, _ in out)


def test_outputs_never_alias_the_threads_scratch_buffers(root):
    from cltrain.data import CropParams

    paths = [p for p, _ in ImageFolderDataset(root / "train", eval_transform(16, 18), index_cache=False).samples[:2]]
    t = train_transform(32)
    cases = [(t, CropParams((10, 10, 42, 42))),  # a 32x32 crop: no resize, the decoded pixels themselves
             (t, CropParams((0, 0, 120, 90), flip=True)),
             (eval_transform((90, 120), None), None)]  # the whole image at its own size
    for transform, params in cases:
        first = transform.apply(paths[0], params or transform.make_params(120, 90))
        kept = first.copy()
        transform.apply(paths[1], params or transform.make_params(120, 90))  # reuses this thread's buffers
        np.testing.assert_array_equal(first, kept)


def test_a_seeded_batch_is_the_same_whatever_the_number_of_threads(root):
    # Each sample draws its crop from a seed of its own: a run seeded on a 1-core and on a 16-core
    # machine (decode_threads="auto") trains on the same crops.
    batches = []
    for threads in (1, 2, 3):
        ds = ImageFolderDataset(root / "train", train_transform(32), threads=threads, index_cache=False)
        batches.append(_batch(ds, list(range(len(ds))), seed=5))
    for other in batches[1:]:
        assert all(np.array_equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(batches[0], other))
    ds = ImageFolderDataset(root / "train", train_transform(32), threads=1, index_cache=False)
    assert not all(np.array_equal(a[0], b[0]) for a, b in zip(batches[0], _batch(ds, list(range(len(ds))), seed=6)))
