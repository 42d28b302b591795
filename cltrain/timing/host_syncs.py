"""The host syncs of a piece of code: ATen ops that copy a device value to the host and so drain the GPU queue.

``.item()``, ``float(t)`` and ``bool(t)`` all reach ``_local_scalar_dense``; a data-dependent shape (``nonzero``,
``unique``, ``masked_select``) needs the value too. Counted on the CPU, they are the syncs a CUDA run would wait on.

Example::

    >>> import torch
    >>> with SyncOps() as mode:
    ...     _ = torch.ones(2).sum().item()
    >>> dict(mode.counts["setup"])
    {'_local_scalar_dense': 1}
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SYNC_OPS", "SyncOps"]

#: ATen ops that copy a device value to the host (or need its value to decide a shape): each one
#: drains the GPU queue. ``.item()``/``float(t)``/``bool(t)`` all reach ``_local_scalar_dense``.
SYNC_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select",
                      "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive"})


class SyncOps(TorchDispatchMode):
    """Counts :data:`SYNC_OPS` by ``phase`` (any key the caller sets, ``"setup"`` at first)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase: Any = "setup"
        self.counts: dict[Any, Counter] = defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.counts[self.phase][name] += 1
        return func(*args, **(kwargs or {}))
