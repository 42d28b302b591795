"""Copy the next batch to the GPU on a side stream while the current one trains.

Lightning moves a batch to the device when its step starts, on the compute
stream, so the copy waits behind the previous step's kernels and the step waits
for the copy: no overlap. :class:`PrefetchDataLoader` does what apex's
``data_prefetcher`` does instead: when batch i is taken it makes the compute
stream wait for batch i's copy (issued one batch earlier) and starts batch i+1's
copy on a side stream. Lightning then finds the batch on its device already and
its own transfer is a no-op. It is a ``DataLoader`` subclass, so Lightning can
still re-create it with a ``DistributedSampler`` under DDP.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch.utils.data import DataLoader

__all__ = ["PrefetchDataLoader"]


def _cuda_prefetch(batches: Iterator[Any], device: torch.device) -> Iterator[Any]:
    stream = torch.cuda.Stream(device)

    def send(batch: Any) -> Any:
        with torch.cuda.stream(stream):
            return apply_to_collection(batch, torch.Tensor, lambda t: t.to(device, non_blocking=True))

    def take(batch: Any) -> Any:
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(stream)
        # The caching allocator must not reuse these blocks while the compute stream reads them.
        apply_to_collection(batch, torch.Tensor, lambda t: t.record_stream(compute) if t.is_cuda else None)
        return batch

    try:
        ahead = send(next(batches))
    except StopIteration:
        return
    for batch in batches:
        current = take(ahead)
        ahead = send(batch)
        yield current
    yield take(ahead)


class PrefetchDataLoader(DataLoader):
    """A ``DataLoader`` whose batches come out already on ``prefetch_device`` when it is a
    CUDA device (copied on a side stream, one batch ahead); any other value, or no
    CUDA, gives a plain ``DataLoader``. Use it with pinned memory."""

    def __init__(self, *args: Any, prefetch_device: str | torch.device | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefetch_device = prefetch_device

    def __iter__(self) -> Iterator[Any]:
        it = super().__iter__()
        device = None if self.prefetch_device is None else torch.device(self.prefetch_device)
        if device is None or device.type != "cuda" or not torch.cuda.is_available():
            return it
        return _cuda_prefetch(it, device)
