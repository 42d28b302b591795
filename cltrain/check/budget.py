"""What the first-batch layout check runs on: a slice of the batch, and an out-of-memory error that is never a verdict.

``check_within_budget(run, batch, samples=4)`` calls ``run(part) -> LayoutCheck`` (the check on one batch) on
``part``, the first ``samples`` samples of ``batch``: every tensor whose leading dim is the batch size (the size of
the model's first image input, or the length of a detector's list of 3-D images) is cut to its first ``samples``
rows, and every list or tuple below the batch that is as long to its first ``samples`` elements (a detector's
images and targets, per-sample names); other tensors and objects are passed as they are. Both layouts see the
same part, so the comparison stays exact, and the check's activations are ``samples`` rows instead of the whole
batch's. Where the step raised on the part without channels_last too (code written
for the whole batch, ``x.view(BATCH, -1)``, per-sample data the cut left long), the whole batch is checked;
not where it raised at what the check's copy cannot reach (``trainer.strategy``). An out-of-memory error (CUDA
or host) inside the check frees what it held and the check runs again on half as many samples (down to
``MIN_SAMPLES``), then gives ``"not checked"`` with the reason: never a finding, so never a fallback.

Example::

    >>> import torch
    >>> from cltrain.check.compare import LayoutCheck
    >>> seen = []
    >>> def run(part):
    ...     seen.append(part[0].shape[0])
    ...     return LayoutCheck("passed")
    >>> batch = (torch.randn(32, 3, 8, 8), torch.randint(0, 5, (32,)))
    >>> check_within_budget(run, batch, samples=4).verdict, seen
    ('passed', [4])
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from cltrain.check import LayoutCheck
from cltrain.check.result import COPY_LIMIT
from cltrain.layout.batches import Inputs, first_image_list, first_image_tensor, map_tensors

__all__ = ["DEFAULT_SAMPLES", "MIN_SAMPLES", "check_within_budget", "free_memory", "is_out_of_memory", "slice_batch"]

#: Samples of the first batch the check runs on by default.
DEFAULT_SAMPLES = 4
#: The fewest samples an out-of-memory retry goes down to (BatchNorm in training needs two).
MIN_SAMPLES = 2
_OOM_TEXT = ("out of memory", "outofmemoryerror", "memoryerror", "can't allocate memory", "failed to allocate")


def is_out_of_memory(error: BaseException | str) -> bool:
    """Whether ``error`` (an exception, or its message as a ``LayoutCheck`` reports it) is an allocation failure:
    ``torch.OutOfMemoryError``, ``MemoryError``, a CUDA or host allocator's ``RuntimeError``."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return any(part in text.lower() for part in _OOM_TEXT)


def free_memory() -> None:
    """Collect what a failed run left and give the CUDA caching allocator's free blocks back."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def slice_batch(batch: Any, samples: int, size: int) -> Any:
    """``batch`` rebuilt with every list or tuple below it (not ``batch`` itself) of ``size`` elements cut to its first
    ``samples``, each element whole (a detector's 3-D image, whose leading dim is its channels, a target's boxes), and
    every other tensor whose leading dim is ``size`` cut to its first ``samples`` rows (views)."""
    whole: set[int] = set()

    def samples_of(values: list[Any]) -> list[Any]:
        if len(values) != size:
            return values
        map_tensors(values, lambda t: whole.add(id(t)))
        return values[:samples]

    return map_tensors(batch, lambda t: t[:samples] if id(t) not in whole and t.dim() >= 1 and t.shape[0] == size
                       else t, items=samples_of)


def batch_size(batch: Any, inputs: Inputs = None) -> int | None:
    """How many samples ``batch`` holds: the leading dim of its first image tensor, else the length of its first
    list of 3-D images; ``None`` where it holds neither."""
    image = first_image_tensor(batch, inputs)
    if image is not None:
        return int(image.shape[0]) if image.dim() > 0 else None
    images = first_image_list(batch)
    return len(images) if images is not None else None


def _oom_in(result: LayoutCheck) -> str | None:
    """The out-of-memory message a check's result carries (as its reason or as a finding), or ``None``."""
    texts = [result.reason or ""] + [f.detail for f in result.findings if f.kind == "raised"]
    return next((t for t in texts if t and is_out_of_memory(t)), None)


def _whole_batch_may_help(result: LayoutCheck) -> bool:
    """The step raised on the part's NCHW copy (the model may have been checked alone), and not at something the
    check's copy cannot reach (a collective, ...): code that may be written for the whole batch."""
    if result.step_raised is None:
        return False
    return COPY_LIMIT not in (result.step_raised + (result.reason or "" if result.verdict == "not checked" else ""))


def check_within_budget(run: Callable[[Any], LayoutCheck], batch: Any, samples: int | None = DEFAULT_SAMPLES, *,
                        inputs: Inputs = None) -> LayoutCheck:
    """``run(part)`` on the first ``samples`` samples of ``batch`` (see the module docstring).

    Args:
        run: the check on one batch, ``run(part) -> LayoutCheck``.
        batch: the batch as the step gets it.
        samples: how many samples to check; ``None``: the whole batch.
        inputs: which tensors are the model's inputs (``cltrain.layout.batches``): the first one's leading dim
            is the batch size.

    Returns:
        ``run``'s ``LayoutCheck``, or ``"not checked"`` with the reason where memory ran out at every size tried.
    """
    size = batch_size(batch, inputs)
    n = size if size is None or samples is None else min(samples, size)
    whole_needed = ""  # why the whole batch is checked after a part was
    while True:
        part = batch if n == size else slice_batch(batch, n, size)
        oom = None
        try:
            result = run(part)
            oom = _oom_in(result)
        except Exception as error:  # noqa: BLE001 - only an allocation failure is handled here
            if not is_out_of_memory(error):
                raise
            oom = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160] if str(error).strip() else ''}"
            del error
        del part
        if oom is not None:
            free_memory()  # only before a retry: a full collection costs a step's worth on a large heap
            if n is not None and n > MIN_SAMPLES and not whole_needed:
                n = max(MIN_SAMPLES, n // 2)
                continue
            at = f"{n} samples" if n is not None else "the whole batch"
            reason = f"out of memory at {at} ({oom}){whole_needed}; the run goes on unchecked in channels_last"
            return LayoutCheck("not checked", reason=reason)
        if _whole_batch_may_help(result) and n is not None and size is not None and n < size:
            whole_needed = f" (on {n} of {size} samples: {result.reason})"
            n = size
            continue
        return result
