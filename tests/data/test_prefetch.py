"""PrefetchDataLoader off CUDA: a plain DataLoader's batches (the CUDA path is checked in
tests/e2e/test_cuda.py); loading in the main process from a dataset decoding on threads, the next
batch decodes ahead and images are written into the batch, with the batches a plain loader gives.
Real JPEG files, real decode threads, real DataLoaders."""

import hashlib
import inspect
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from cltrain import is_channels_last
from cltrain.data import ImageFolderDataset, NHWCCollate, PrefetchDataLoader, eval_transform, train_transform
from cltrain.data import collate as collate_module
from cltrain.data.image_folder_dataset import BadImageError
from cltrain.data.normalize import ImageNormalizer
from tests.helpers.data_fixtures import write_image_folder


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


# --- loading in the main process: the next batch decoding ahead, images written into the batch ------

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("ahead"), classes=2, train=6, val=1, size=(120, 90))


class _Starts(ImageFolderDataset):
    """The real dataset, counting the batches begun (``start_items``, which ``__getitems__`` calls too)."""

    started = 0

    def start_items(self, indices, collate=None):
        self.started += 1
        return super().start_items(indices, collate)


def _epoch(loader, seed=0, draw=False):
    """One epoch as copies (the consumer keeps nothing of the loader's), seeded; ``draw``: the
    consumer draws random numbers between batches, as a training step does."""
    torch.manual_seed(seed)
    out = []
    for x, y in loader:
        out.append((x.clone(memory_format=torch.preserve_format), y.clone()))
        if draw:
            torch.rand(3)
    return out


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))


@pytest.mark.parametrize("decode_ahead", [True, False])
@pytest.mark.parametrize("normalize", [None, ImageNormalizer()], ids=["uint8", "normalised"])
def test_threads_give_the_batches_of_a_plain_loader_with_the_same_seed(folder, normalize, decode_ahead):
    ds = _Starts(folder / "train", train_transform(32), threads=2, index_cache=False)
    collate = NHWCCollate(normalize=normalize)
    expected = _epoch(DataLoader(ds, batch_size=4, shuffle=True, collate_fn=collate))
    loader = PrefetchDataLoader(ds, batch_size=4, shuffle=True, collate_fn=collate, decode_ahead=decode_ahead)
    got = _epoch(loader)
    assert len(got) == 3 and _same(got, expected)
    for x, _ in got:
        assert is_channels_last(x) and x.dtype == (torch.uint8 if normalize is None else torch.float32)
    ds.started = 0
    next(iter(loader))
    assert ds.started == (2 if decode_ahead else 1)  # the second batch begun before the first is handed out
    assert not _same(_epoch(loader, seed=1), expected)  # the control: the seed decides the crops and the order


def test_seeded_runs_repeat_when_the_consumer_draws_random_numbers(folder):
    ds = ImageFolderDataset(folder / "train", train_transform(32), threads=2, index_cache=False)
    loader = PrefetchDataLoader(ds, batch_size=4, shuffle=True, collate_fn=NHWCCollate())
    first = _epoch(loader, draw=True)
    assert _same(_epoch(loader, draw=True), first)
    assert not _same(_epoch(loader, seed=1, draw=True), first)  # the control: another seed, other batches


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """Small JPEGs for batches of 8 float32 images of 640x640 (39 MB: large enough to be recycled)."""
    root = write_image_folder(tmp_path_factory.mktemp("big"), classes=2, train=16, val=1, size=(48, 36))
    assert 8 * 640 * 640 * 3 * 4 >= collate_module._HUGE_PAGES_FROM
    return root


def _fingerprint(x):
    return hashlib.sha1(x.permute(0, 2, 3, 1).numpy()).hexdigest()  # the NHWC buffer: dense, no copy


@pytest.mark.parametrize("threads,decode_ahead", [(2, True), (2, False), (1, True)])
def test_batches_handed_out_are_never_overwritten(big, threads, decode_ahead):
    ds = ImageFolderDataset(big / "train", train_transform(640), threads=threads, index_cache=False)
    loader = PrefetchDataLoader(ds, batch_size=8, collate_fn=NHWCCollate(normalize=ImageNormalizer()),
                                decode_ahead=decode_ahead)
    kept, when_received = [], []
    for x, _ in loader:
        kept.append(x)
        when_received.append(_fingerprint(x))
    assert len(kept) == 4 and [_fingerprint(x) for x in kept] == when_received
    assert len({x.data_ptr() for x in kept}) == 4
    del kept
    # The control: the same epoch keeping nothing reuses a buffer, so the kept run above proved something.
    pointers = [x.data_ptr() for x, _ in loader]
    assert len(set(pointers)) < len(pointers)


@pytest.fixture()
def with_bad(tmp_path):
    root = write_image_folder(tmp_path / "d", classes=2, train=2, val=1, size=(64, 48))
    bad = root / "train" / "c0" / "0_001.jpg"  # sample 1 of c0/0_000, c0/0_001, c1/1_000, c1/1_001
    bad.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    return root, bad


@pytest.mark.parametrize("threads", [2, 1])
def test_a_bad_file_is_skipped_and_logged_or_named_in_the_error(with_bad, threads):
    root, bad = with_bad
    log = root / "skipped.tsv"
    transform = eval_transform(24, 28)
    ds = ImageFolderDataset(root / "train", transform, bad_files="skip", skip_log=log, threads=threads, index_cache=False)
    loader = PrefetchDataLoader(ds, batch_size=4, collate_fn=NHWCCollate())
    (x, y), = list(loader)
    assert y.tolist() == [0, 1, 1, 1] and is_channels_last(x)  # the next readable sample in its place
    expected = [transform(p) for p in (ds.samples[0][0], ds.samples[2][0], ds.samples[2][0], ds.samples[3][0])]
    assert all(np.array_equal(x[k].permute(1, 2, 0).numpy(), img) for k, img in enumerate(expected))
    assert str(bad) in log.read_text()
    ds = ImageFolderDataset(root / "train", transform, threads=threads, index_cache=False)
    with pytest.raises(BadImageError, match="0_001.jpg"):
        list(PrefetchDataLoader(ds, batch_size=4, collate_fn=NHWCCollate()))


def test_another_collate_gets_the_samples_decoded_on_threads(folder):
    seen = []

    def stack(samples):  # HWC arrays to an NHWC tensor: no NHWCCollate, no batch slots
        seen.append(type(samples[0][0]))
        return torch.stack([torch.from_numpy(img) for img, _ in samples]), torch.tensor([t for _, t in samples])

    ds = _Starts(folder / "train", eval_transform(24, 28), threads=2, index_cache=False)
    got = _epoch(PrefetchDataLoader(ds, batch_size=4, collate_fn=stack))
    assert ds.started == 3 and seen == [np.ndarray] * 3
    assert _same(got, _epoch(DataLoader(ds, batch_size=4, collate_fn=stack)))
    assert got[0][0].shape == (4, 24, 24, 3)


def test_an_epoch_abandoned_midway_leaves_the_next_one_whole(folder):
    ds = ImageFolderDataset(folder / "train", eval_transform(24, 28), threads=2, index_cache=False)
    loader = PrefetchDataLoader(ds, batch_size=4, collate_fn=NHWCCollate(normalize=ImageNormalizer()))
    expected = _epoch(DataLoader(ds, batch_size=4, collate_fn=NHWCCollate(normalize=ImageNormalizer())))
    for _ in loader:
        break  # the second batch is decoding when the loop leaves
    got = _epoch(loader)
    assert [len(y) for _, y in got] == [4, 4, 4] and _same(got, expected)


@pytest.mark.parametrize("threads", [2, 1])
def test_an_epoch_under_inference_mode_then_a_training_epoch(big, threads):
    # Lightning validates under torch.inference_mode: buffers and scratch images made there are reused
    # (and written by the decode threads, which are not in inference mode) in the next training epoch.
    ds = ImageFolderDataset(big / "train", train_transform(640), threads=threads, index_cache=False)
    loader = PrefetchDataLoader(ds, batch_size=8, collate_fn=NHWCCollate(normalize=ImageNormalizer()))
    with torch.inference_mode():
        assert len([x for x, _ in loader]) == 2 * 2
    torch.manual_seed(0)
    trained = [_fingerprint(x) for x, _ in loader]
    torch.manual_seed(0)
    plain = DataLoader(ds, batch_size=8, collate_fn=NHWCCollate(normalize=ImageNormalizer()))
    assert trained == [_fingerprint(x) for x, _ in plain]


class _WithPaths(ImageFolderDataset):
    """A user's subclass in the common style: the sample also carries its file path."""

    def __getitem__(self, index):
        image, target = super().__getitem__(index)
        return image, target, self.samples[index][0]


class _OwnLoad(ImageFolderDataset):
    """A user's subclass that overrides load (without the loader's out= argument)."""

    def load(self, index):
        image, target = super().load(index)
        return image, target + 100


@pytest.mark.parametrize("threads", [1, 2])
def test_a_users_dataset_subclass_keeps_its_own_getitem_and_load(folder, threads):
    collate = NHWCCollate()
    paths = _WithPaths(folder / "train", train_transform(32), threads=threads, index_cache=False)
    images, targets, names = next(iter(PrefetchDataLoader(paths, batch_size=4, collate_fn=collate)))
    assert list(names) == [paths.samples[i][0] for i in range(4)] and images.shape == (4, 3, 32, 32)
    own = _OwnLoad(folder / "train", train_transform(32), threads=threads, index_cache=False)
    _, targets = next(iter(PrefetchDataLoader(own, batch_size=4, collate_fn=collate)))
    assert targets.tolist() == [own.samples[i][1] + 100 for i in range(4)]


_SIGNALLED_WORKERS = """
import os, signal, sys, time, torch
from cltrain.data import PrefetchDataLoader
class Numbers(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, i): time.sleep(0.01); return torch.tensor([i])
loader = PrefetchDataLoader(Numbers(), batch_size=4, num_workers=2, persistent_workers=True)
seen = []
for i, batch in enumerate(loader):
    seen += batch.flatten().tolist()
    if i == 2:  # the scheduler's SIGTERM to the whole process group reaches the workers too, and a second one
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
            for worker in loader._iterator._workers:
                os.kill(worker.pid, signum)
            time.sleep(0.3)
print(sorted(seen) == list(range(64)), flush=True)
for i, batch in enumerate(loader):  # the persistent workers, alive at exit, with an iterator left half read
    if i == 1:
        break
"""


_ABANDONED_WORKER = """
import gc, time, torch
from cltrain.data import PrefetchDataLoader
class Slow(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, i): time.sleep(600 if i >= 8 else 0); return torch.tensor([i])
iterator = iter(PrefetchDataLoader(Slow(), batch_size=4, num_workers=1))
next(iterator)
del iterator  # its shutdown's SIGTERM is let pass by the worker, busy in a sample
gc.collect()
print("exiting", flush=True)
"""


@pytest.mark.parametrize("script,said", [("signalled", "True"), ("abandoned", "exiting")])
def test_workers_outlast_sigterms_and_sigints_and_end_at_exit(tmp_path: Path, script: str, said: str) -> None:
    # "signalled": a SIGTERM to the process group killed the workers, and the main process raised "DataLoader worker
    # ... is killed by signal: Terminated" from its SIGCHLD handler wherever it was (inside a checkpoint's
    # torch.save), while the run was stopping at the batch's end; a second one, while the run wrote its checkpoint.
    # Workers that let signals pass must still end at exit: a persistent loader's, left alive, and ("abandoned") one
    # busy in a sample when its iterator was collected made multiprocessing's exit handler, whose SIGTERM they let
    # pass, wait for ever (the loader benchmark's child under gpu_check, in a full test run).
    path = tmp_path / f"{script}.py"
    path.write_text(_SIGNALLED_WORKERS if script == "signalled" else _ABANDONED_WORKER)
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == said, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert time.monotonic() - started < 60


def test_a_dropped_datamodule_s_persistent_workers_end_with_it(tmp_path: Path) -> None:
    # the loader held its DataModule (for the epoch's progress), which holds the loader: only the garbage collector
    # freed them, after closing the workers' queues, and dropping them took 20 s and left the workers running
    import gc
    import weakref

    from cltrain.data import ImageFolderDataModule

    root = write_image_folder(tmp_path / "images", classes=2, train=8, val=2, size=(24, 20))
    dm = ImageFolderDataModule(root, batch_size=4, num_workers=2, persistent_workers=True, image_size=16)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert sum(len(batch[1]) for batch in loader) == 16
    workers, held = list(loader._iterator._workers), weakref.ref(loader)
    started = time.monotonic()
    gc.disable()
    try:
        del dm, loader
        assert held() is None  # freed as it is dropped, its iterator's shutdown with it
    finally:
        gc.enable()
    assert time.monotonic() - started < 10 and not any(w.is_alive() for w in workers)
