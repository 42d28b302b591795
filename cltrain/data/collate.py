"""Collate HWC uint8 images straight into one NHWC buffer; hand out its NCHW view.

The batch is ``torch.empty((N, H, W, C), uint8)`` filled image by image with a
plain copy (each image is already HWC, so nothing is transposed), and returned
as ``buffer.permute(0, 3, 1, 2)``: shape (N, C, H, W) with channels_last
strides, for C == 1 and N == 1 as well (``permute`` of a dense NHWC buffer gives
the canonical strides). Tensors coming back from DataLoader worker processes
keep their strides, and so does ``pin_memory``.

Example::

    >>> import numpy as np, torch
    >>> images, targets = nhwc_collate([(np.zeros((32, 32, 3), np.uint8), 1), (np.ones((32, 32, 3), np.uint8), 0)])
    >>> images.shape, images.is_contiguous(memory_format=torch.channels_last), targets.dtype
    (torch.Size([2, 3, 32, 32]), True, torch.int64)
"""

from __future__ import annotations

import math
import mmap
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import default_collate

from cltrain.data.loader_threads import run_each, scratch_tensor
from cltrain.data.normalize import ImageNormalizer
from cltrain.layout.batches import map_tensors

__all__ = ["BatchSlot", "NHWCCollate", "as_hwc", "nhwc_collate"]


class BatchSlot:
    """Image ``index`` of ``buffer`` (an NHWC batch ``NHWCCollate.new_batch`` made), written in place
    by ``NHWCCollate.write``: a sample holding these for all of a batch's images is collated without a copy."""

    __slots__ = ("buffer", "index")

    def __init__(self, buffer: torch.Tensor, index: int) -> None:
        self.buffer, self.index = buffer, index

    def image(self) -> torch.Tensor:
        """The slot's pixels: HWC of the buffer's dtype."""
        return self.buffer[self.index]


def as_hwc(image: Any, index: int) -> np.ndarray | torch.Tensor:
    """``image`` (PIL image, HWC array or tensor) as an HWC array or tensor; ``index`` names it in errors."""
    if isinstance(image, Image.Image):
        image = np.asarray(image)
    if isinstance(image, np.ndarray):
        arr = image
    elif isinstance(image, torch.Tensor):
        arr = image
        if arr.dim() == 3 and arr.shape[0] in (1, 3) and arr.shape[-1] not in (1, 3, 4):
            raise TypeError(f"nhwc_collate: image {index} is a tensor of shape {tuple(arr.shape)}, which looks CHW; "
                            "give HWC images (the transforms of cltrain.data do).")
    else:
        raise TypeError(f"nhwc_collate: image {index} is a {type(image).__name__}; expected a numpy array, "
                        "a PIL image or a torch tensor (HWC uint8).")
    if arr.dtype != (torch.uint8 if isinstance(arr, torch.Tensor) else np.uint8):
        raise TypeError(f"nhwc_collate: image {index} has dtype {arr.dtype}; expected uint8 (HWC).")
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3:
        raise TypeError(f"nhwc_collate: image {index} has shape {tuple(arr.shape)}; expected (H, W) or (H, W, C).")
    return arr


# glibc's largest mmap threshold: above it every allocation is a fresh mapping, faulted in page by page
# (below it, freed batches are reused from the heap: a uint8 batch filled no faster in huge pages)
_HUGE_PAGES_FROM = 32 << 20


def _empty_batch(shape: tuple[int, ...], pin_memory: bool, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    # A buffer made under inference mode (Lightning's validation loop) is an inference tensor, which the
    # decode threads (not in inference mode) or a later training batch could not write into.
    with torch.inference_mode(False):
        return _new_batch(shape, pin_memory, dtype)


def _new_batch(shape: tuple[int, ...], pin_memory: bool, dtype: torch.dtype) -> torch.Tensor:
    """The batch buffer; in a DataLoader worker, in shared memory as ``default_collate`` does, so
    the batch reaches the main process without being copied into shared memory once more; else a
    fresh anonymous mapping with transparent huge pages asked for (where the kernel allows them)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.utils.data.get_worker_info() is not None:
        storage = torch.UntypedStorage._new_shared(nbytes)
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)
    if pin_memory or nbytes < _HUGE_PAGES_FROM or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
    # A batch nobody holds any more is reused; else a fresh mapping with transparent huge pages (a
    # page fault per 2 MiB, not per 4 KiB). Filling a float32 batch of 64 224x224 images: 32 ms in
    # a new torch.empty, 6.8 ms in a new huge-page mapping, 3.0 ms in a reused one (docs/performance.md).
    key = (shape, dtype)
    free = _RECYCLED.get(key, [])
    for batch, alone in free:
        if _uses(batch) == alone and sys.getrefcount(batch) <= 3:  # the list, this loop and the call
            return batch
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    batch = torch.frombuffer(buffer, dtype=dtype).view(shape)
    if len(free) < _RECYCLE and hasattr(torch._C, "_storage_Use_Count"):
        _RECYCLED[key] = [*free, (batch, _uses(batch))]
    return batch


#: Large batch buffers of this process kept for reuse, per (shape, dtype): at most this many each
#: (a training loop holds one or two batches at a time; the loader decodes one ahead).
_RECYCLE = 4
_RECYCLED: dict[tuple, list[torch.Tensor]] = {}


def _uses(batch: torch.Tensor) -> int:
    """How many tensors (views included) hold ``batch``'s memory: a kept batch is free again when this
    is back to its count when it was made and no one else holds the tensor itself."""
    return torch._C._storage_Use_Count(batch.untyped_storage()._cdata)


def _pin(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t if t.is_pinned() else t.pin_memory())


class NHWCCollate:
    """``collate_fn`` for a DataLoader of ``(image, target, ...)`` or ``{"image": ..., ...}`` samples.

    The images go into one NHWC buffer; every other field is collated by
    ``default_collate``, as a plain DataLoader would: int targets become int64, float
    targets float64 (1.7 stays 1.7), tensors and arrays are stacked, strings listed.

    In a DataLoader worker the buffer is allocated in shared memory (as ``default_collate``
    allocates its stacked tensors), so it crosses to the main process without a copy.

    Args:
        pin_memory: allocate the batch in pinned memory (for CUDA copies with
            ``non_blocking=True``); the other fields are pinned too. Pinning is per
            process: with ``num_workers > 0`` use the DataLoader's own ``pin_memory=True``
            instead, which pins in the main process and keeps the strides.
        image_key: the key of the image in dict samples.
        normalize: an ``ImageNormalizer``: the batch comes out
            normalised (float32/bfloat16/float16, channels_last), each image written into the
            buffer as it is converted (the DataModules then skip their own normalisation);
            ``None``: uint8.
        threads: images copied (and normalised) on this many threads
            (``cltrain.data.loader_threads``).

    Returns (from a call):
        ``(images, targets, ...)`` for sequence samples, a dict for dict samples: images
        ``(N, C, H, W)`` uint8 with channels_last strides (a view of an ``(N, H, W, C)``
        buffer).

    Raises:
        ValueError: an empty batch, or images of different shapes (the message names
            both shapes and their positions).
        TypeError: an image that is not HWC uint8 (numpy array, PIL image or tensor), or a
            sample that is neither a sequence nor a dict with ``image_key``.
    """

    def __init__(self, pin_memory: bool = False, image_key: str = "image", normalize: ImageNormalizer | None = None,
                 threads: int = 1) -> None:
        self.pin_memory = bool(pin_memory)
        self.image_key = image_key
        self.normalize, self.threads = normalize, threads

    def new_batch(self, n: int, shape: tuple[int, int, int]) -> torch.Tensor:
        """An empty NHWC batch of ``n`` images of ``shape`` = (H, W, C), of this collate's dtype,
        for ``write`` to fill (in a DataLoader worker, in shared memory)."""
        return _empty_batch((n, *shape), self.pin_memory, torch.uint8 if self.normalize is None else self.normalize.dtype)

    def write(self, buffer: torch.Tensor, index: int,
              make: Callable[[torch.Tensor], np.ndarray | torch.Tensor]) -> BatchSlot:
        """Image ``index`` of ``buffer``: ``make(dest)`` writes (or returns) it as HWC uint8, ``dest``
        being the slot itself for a uint8 batch, or a per-thread scratch image that is normalised
        into the slot at once; safe to call from several threads for different slots."""
        slot = buffer[index]
        if self.normalize is None:
            dest = slot
        else:  # this thread's scratch image: normalised into the slot at once, while in the CPU cache
            dest = scratch_tensor("normalise", tuple(slot.shape))
        image = make(dest)
        if self.normalize is not None:
            self.normalize(image if image is dest else torch.as_tensor(as_hwc(image, index)), slot)
        elif image is not slot:
            slot.copy_(torch.as_tensor(as_hwc(image, index)))
        return BatchSlot(buffer, index)

    def images(self, images: Sequence[Any]) -> torch.Tensor:
        """Only the images: ``(N, C, H, W)`` channels_last uint8 (or normalised)."""
        if len(images) == 0:
            raise ValueError("nhwc_collate: the batch is empty.")
        first = images[0]
        if isinstance(first, BatchSlot):
            buffer = first.buffer
            if len(images) == buffer.shape[0] and all(isinstance(s, BatchSlot) and s.buffer is buffer and s.index == i
                                                      for i, s in enumerate(images)):
                return buffer.permute(0, 3, 1, 2)  # written in place: nothing to copy
        images = [s.image() if isinstance(s, BatchSlot) else s for s in images]
        arrays = [as_hwc(img, i) for i, img in enumerate(images)]
        shape = tuple(arrays[0].shape)
        for i, img in enumerate(arrays):
            if tuple(img.shape) != shape:
                raise ValueError(f"nhwc_collate: image {i} has shape (H, W, C) = {tuple(img.shape)} but image 0 has {shape}; "
                                 "all images of a batch must be the same size (resize or crop them in the transform).")
        dtype = torch.uint8 if self.normalize is None else self.normalize.dtype
        buffer = _empty_batch((len(arrays), *shape), self.pin_memory, dtype)
        if self.normalize is not None:
            run_each(lambda i: self.normalize(torch.as_tensor(arrays[i]), buffer[i]), range(len(arrays)), self.threads)
            return buffer.permute(0, 3, 1, 2)
        view = buffer.numpy()
        for i, img in enumerate(arrays):
            if isinstance(img, torch.Tensor):
                buffer[i].copy_(img)
            else:
                view[i] = img
        return buffer.permute(0, 3, 1, 2)

    def __call__(self, batch: Sequence[Any]) -> Any:
        if len(batch) == 0:
            raise ValueError("nhwc_collate: the batch is empty.")
        first = batch[0]
        if isinstance(first, Mapping):
            if self.image_key not in first:
                raise TypeError(f"nhwc_collate: dict samples need the key {self.image_key!r} (image_key); "
                                f"sample 0 has {sorted(first)}.")
            rest = default_collate([{k: v for k, v in s.items() if k != self.image_key} for s in batch])
            out = {self.image_key: self.images([s[self.image_key] for s in batch])}
            out.update(self._pinned(rest))
            return type(first)(out) if type(first) is not dict else out
        if not isinstance(first, Sequence) or isinstance(first, (str, bytes)) or len(first) < 1:
            raise TypeError(f"nhwc_collate: sample 0 is a {type(first).__name__}; expected (image, target, ...) "
                            f"or a dict with {self.image_key!r}.")
        images = self.images([s[0] for s in batch])
        if len(first) == 1:
            return (images,)
        rest = self._pinned(default_collate([tuple(s[1:]) for s in batch]))
        return (images, *rest)

    def _pinned(self, obj: Any) -> Any:
        return _pin(obj) if self.pin_memory else obj

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pin_memory={self.pin_memory}, normalize={self.normalize!r}, threads={self.threads})"


def nhwc_collate(batch: Sequence[Any]) -> Any:
    """``NHWCCollate`` without pinning, as a function."""
    return NHWCCollate()(batch)
