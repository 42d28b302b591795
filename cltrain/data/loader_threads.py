"""Load the samples of a batch on several threads of one process.

libjpeg-turbo (simplejpeg, the region decoder) and torch's resize release the GIL, so
a batch's images decode in parallel in one process: two cores need no second
process, no pickling and no shared-memory hand-over. A Dataset with ``__getitems__``
(which the DataLoader calls with a batch's indices) hands them to ``load_batch``.

Random crops stay reproducible: the calling thread draws one seed per sample from the
torch RNG (so ``seed_everything`` and the DataLoader's per-worker seeding decide them),
and each sample's transform draws from a generator seeded with it
(``sample_generator``). Augmentations that draw from the global RNG
(``HWCAugment``) run afterwards in the calling thread, in
sample order. The threads run torch on one intra-op thread each, set as each thread's own
OpenMP team size: ``torch.set_num_threads`` there would also set the process's default, which a
thread that has not yet run a parallel kernel takes up (the main thread's training step among
them, on one core).

Example::

    >>> from cltrain.data import ImageFolderDataset, train_transform, make_demo_dataset
    >>> ds = ImageFolderDataset(make_demo_dataset("/tmp/cltrain-demo") / "train", train_transform(224), threads=2)
    >>> [img.shape for img, _ in ds.__getitems__([0, 1])]
    [(224, 224, 3), (224, 224, 3)]
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from cltrain.data.resume_state import SeededIndex

__all__ = ["augment_deferred", "load_batch", "one_thread", "run_each", "sample_generator", "loading_plan", "scratch_tensor",
           "start_batch", "thread_scratch", "usable_cores"]

_LOCAL = threading.local()
_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def sample_generator() -> torch.Generator | None:
    """The generator this thread's current sample draws from (``None``: the global torch RNG)."""
    return getattr(_LOCAL, "generator", None)


def augment_deferred() -> bool:
    """Whether this thread's transform should leave its augmentation to the calling thread."""
    return getattr(_LOCAL, "defer_augment", False)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's per-image kernels in this block on one intra-op thread (this thread's setting only).

    One image's work is too small to split: on a busy machine each small parallel region
    waits for a descheduled OpenMP thread (docs/performance.md). Images are loaded in
    parallel instead (``load_batch``, DataLoader workers).
    """
    threads = torch.get_num_threads()  # this thread's OpenMP team size (made from the process's default at its first call)
    if threads == 1 or not _openmp():
        yield
        return
    _set_openmp_threads(1)
    try:
        yield
    finally:
        _set_openmp_threads(threads)


_OPENMP: list[Any] | None = None
_OPENMP_LOCK = threading.Lock()


def _openmp() -> list[Any]:
    """The OpenMP runtimes loaded in this process (threadpoolctl's controllers; torch's kernels use one)."""
    global _OPENMP
    if _OPENMP is not None:  # per image: no lock once found
        return _OPENMP
    with _OPENMP_LOCK:
        if _OPENMP is None:
            from threadpoolctl import ThreadpoolController

            _OPENMP = list(ThreadpoolController().select(user_api="openmp").lib_controllers)
        return _OPENMP


def _set_openmp_threads(threads: int) -> None:
    """This thread's OpenMP team size, and no other thread's: ``torch.set_num_threads`` also sets the process's
    default, which every thread that has not yet run a parallel kernel takes up at its first (a decode thread's 1
    became the main thread's, and a run trained on one core)."""
    torch.get_num_threads()  # torch sets a thread's team size from its default at the thread's first call: before ours
    for runtime in _openmp():
        runtime.set_num_threads(threads)


def _init_thread() -> None:
    _set_openmp_threads(1)  # without an OpenMP runtime (torch's own thread pool), the pool's threads keep its size


_SCRATCH = threading.local()


def thread_scratch(name: str, nbytes: int) -> np.ndarray:
    """This thread's reusable 1-D uint8 buffer ``name`` of at least ``nbytes``.

    Each image's decoded pixels, their dense copy and (for a normalised batch) the resized image go here, not into new arrays: a new
    multi-megabyte array is a fresh mapping, faulted in page by page, and threads of one
    process doing that serialise on the kernel's memory-map lock (docs/performance.md)."""
    return _scratch(name, nbytes)[0]


def scratch_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``thread_scratch(name, ...)`` as a dense uint8 tensor of ``shape`` (one strided view of the buffer: no
    numpy slice and ``from_numpy`` per image, each a few microseconds under the GIL)."""
    strides, nbytes = [], 1
    for size in reversed(shape):
        strides.append(nbytes)
        nbytes *= size
    return _scratch(name, nbytes)[1].as_strided(shape, strides[::-1])


def _scratch(name: str, nbytes: int) -> tuple[np.ndarray, torch.Tensor]:
    found = getattr(_SCRATCH, name, None)
    if found is None or found[0].size < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), np.uint8)
        found = (buf, torch.from_numpy(buf))
        setattr(_SCRATCH, name, found)
    return found


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, as ``taskset`` or a container sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def loading_plan(num_workers: int | None = None, cores: int | None = None) -> tuple[int, int]:
    """``(num_workers, decode_threads)`` for ``"auto"``: the fastest measured split of ``cores``
    (default: ``usable_cores()``) between DataLoader worker processes and decode threads; with
    ``num_workers`` given, the threads each of those processes gets.

    Up to 4 cores, one process decodes on a thread per core (2 cores: 1.28x the images per second
    of 2 worker processes for the float batch, 1.13x for uint8; docs/performance.md). Above that,
    a worker process per 4 cores with 4 threads each: the Python share of each image's work holds
    the GIL, so one process's threads stop adding throughput well before 16 (not measured: the
    machine behind these figures has 2 cores)."""
    cores = usable_cores() if cores is None else max(1, cores)
    if num_workers is None:
        num_workers = 0 if cores <= _CORES_PER_PROCESS else cores // _CORES_PER_PROCESS
    return num_workers, max(1, min(_CORES_PER_PROCESS, cores // max(1, num_workers)))


_CORES_PER_PROCESS = 4


def _pool(threads: int) -> ThreadPoolExecutor:
    # More decode threads than cores only add switching: on 2 cores, 3 and 4 threads loaded 3 % fewer
    # images per second than 2 (docs/performance.md), so the pool has at most as many threads as cores.
    threads = min(threads, usable_cores())
    key = (os.getpid(), threads)  # a forked DataLoader worker has no threads of its parent: it makes its own
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(threads, thread_name_prefix="cltrain-decode", initializer=_init_thread)
    return pool


class _Failed:
    """A sample whose load raised ``error`` in a thread."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _seeded(load: Callable[[int], Any], index: int, seed: int, catch: type[BaseException], defer: bool) -> Any:
    # one generator per thread, seeded anew for each sample: ``manual_seed`` resets its whole state (a fresh
    # generator's draws), half the cost of making one
    generator = getattr(_LOCAL, "own", None)
    if generator is None:
        generator = _LOCAL.own = torch.Generator()
    _LOCAL.generator, _LOCAL.defer_augment = generator.manual_seed(seed), defer
    try:
        return load(index)
    except catch as err:
        return _Failed(err)
    finally:
        _LOCAL.generator, _LOCAL.defer_augment = None, False


def load_batch(load: Callable[[int], Any], indices: Sequence[int], threads: int,
               augment: Callable[[Any], Any] | None = None, retry: type[BaseException] = Exception,
               fallback: Callable[[int], Any] | None = None) -> list[Any]:
    """``[load(i) for i in indices]``, computed on ``threads`` threads.

    Args:
        load: index -> ``(image, target, ...)``; called in the threads.
        indices: the batch's sample indices.
        threads: threads of the pool (one pool per process and count, kept for reuse).
        augment: applied to each sample's image (its first field) in the calling thread, in order.
        retry: exceptions of ``load`` that send the sample to ``fallback`` in the calling thread
            (a bad-file policy there picks its replacement); others are raised.
        fallback: index -> sample for those; ``None`` re-raises.

    Returns:
        The samples, in the order of ``indices``.
    """
    return start_batch(load, indices, threads, augment, retry, fallback)()


def start_batch(load: Callable[[int], Any], indices: Sequence[int], threads: int,
                augment: Callable[[Any], Any] | None = None, retry: type[BaseException] = Exception,
                fallback: Callable[[int], Any] | None = None) -> Callable[[], list[Any]]:
    """``load_batch`` begun: the samples are loading on the pool's threads when this returns (with one
    thread, or one usable core, they are loaded here, before it returns); calling the result waits for
    them (and runs ``augment`` and ``fallback`` in the calling thread). The random seeds are drawn
    here, one per sample, so batches started one after another draw in that order and a seeded run
    gives the same samples whatever the number of threads."""
    seeded = bool(indices) and all(isinstance(i, SeededIndex) for i in indices)
    if seeded:  # a ResumableSampler's (or a stream's): the same in any worker
        seeds = [i.seed for i in indices]
    else:
        seeds = torch.randint(0, 2**62, (len(indices),)).tolist()  # from the global RNG: reproducible per worker seed
    defer = augment is not None  # a transform whose augmentation the caller cannot see applies it itself
    samples: list[Any] = [None] * len(indices)
    # One task per thread, each taking the next sample until none is left (``next`` on a builtin
    # iterator is atomic under the GIL): a task per sample cost ~20 us of the GIL each (a Future,
    # the queue's locks), time in which the other decode threads wait.
    todo = iter(enumerate(zip(indices, seeds)))

    def drain() -> None:
        for k, (i, seed) in todo:
            samples[k] = _seeded(load, i, seed, retry, defer)

    threads = min(threads, usable_cores(), len(indices))
    if threads <= 1:
        with one_thread():
            drain()
        tasks = []
    else:
        pool = _pool(threads)
        tasks = [pool.submit(drain) for _ in range(threads)]

    def finish() -> list[Any]:
        for task in tasks:
            task.result()
        out = []
        for index, seed, sample in zip(indices, seeds, samples):
            if isinstance(sample, _Failed):
                if fallback is None:
                    raise sample.error
                sample = _seeded(fallback, index, seed, (), False)  # its replacement draws from the sample's seed too
            elif augment is not None:
                sample = (_augmented(augment, sample[0], seed if seeded else None), *sample[1:])
            out.append(sample)
        return out

    return finish


def _augmented(augment: Callable[[Any], Any], image: Any, seed: int | None) -> Any:
    """``augment(image)``: from the global RNG in order, or with a sample's own seed from that seed (the same
    whichever worker or place in the epoch draws it: an exact resume), the global RNG left as it was."""
    if seed is None:
        return augment(image)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed ^ 0x5EED)
        return augment(image)


def run_each(fn: Callable[[Any], None], items: Sequence[Any], threads: int) -> None:
    """``fn(item)`` for every item, on ``threads`` threads of the pool (in this thread when 1)."""
    if threads <= 1 or len(items) <= 1:
        with one_thread():
            for item in items:
                fn(item)
        return
    # One task per thread over a contiguous run of items: a task per item costs a GIL hand-over each.
    step = -(-len(items) // threads)
    chunks = [items[k:k + step] for k in range(0, len(items), step)]
    for future in [_pool(threads).submit(_each, fn, chunk) for chunk in chunks]:
        future.result()


def _each(fn: Callable[[Any], None], items: Sequence[Any]) -> None:
    for item in items:
        fn(item)
