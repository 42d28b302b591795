"""What the check compares a tensor by: its norm and a few fixed random projections, which a value moved to
another index changes (a permutation-invariant statistic would not), and the relative difference of two.

Example::

    >>> x = torch.arange(24.0).reshape(2, 3, 2, 2)
    >>> vectors = Vectors()
    >>> a = signature(x, vectors)
    >>> b = signature(x.contiguous(memory_format=torch.channels_last), vectors)  # the same values, other strides
    >>> distance([(s, v.tolist()) for s, v in a], [(s, v.tolist()) for s, v in b]) < 1e-6
    True
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["Vectors", "distance", "floats", "noise_scale", "project", "projection_loss", "signature"]

_PROJECTIONS = 3


class Vectors:
    """Fixed random vectors per (size, device): the same in every run."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int, str], torch.Tensor] = {}

    def get(self, size: int, dim: int, device: torch.device) -> torch.Tensor:
        key = (size, dim, str(device))
        if key not in self._cache:
            g = torch.Generator().manual_seed(1_000_003 * size + dim)
            self._cache[key] = torch.randn(size, _PROJECTIONS, generator=g).to(device)
        return self._cache[key]


def project(x: torch.Tensor, vectors: Vectors) -> torch.Tensor:
    """``_PROJECTIONS`` projections of ``x`` (float) on rank-1 random tensors: shape ``(_PROJECTIONS,)``.

    Each is ``sum(x[i, j, ...] * a[i] * b[j] * ...)``; a value moved to another index changes it, a
    permutation-invariant statistic (sum, norm) would not."""
    if x.dim() == 0:
        return x.reshape(1).expand(_PROJECTIONS)
    # Contract in memory order, the stride-1 dim first: in the logical order the first matmul strides through
    # a channels_last tensor's memory (measured in the check's cost: docs/performance.md). Size-1 dims go first:
    # their stride says nothing, and one taken for the stride-1 dim makes the first product as large as x.
    order = sorted(range(x.dim()), key=lambda d: (x.shape[d] > 1, -x.stride(d), d))
    y = x.permute(order) @ vectors.get(x.shape[order[-1]], order[-1], x.device)  # (..., P)
    for d in order[:-1]:
        v = vectors.get(x.shape[d], d, x.device)  # (size, P): contracts the leading dim
        y = (y * v.view(v.shape[0], *([1] * (y.dim() - 2)), _PROJECTIONS)).sum(0)
    return y


def projection_loss(output: Any, vectors: Vectors | None = None) -> torch.Tensor:
    """A scalar whose gradient is dense and layout-independent: the sum of the projections of every
    floating tensor in ``output`` (for checking a model without its own loss)."""
    vectors = vectors or Vectors()
    total = None
    for t in floats(output):
        term = project(t.float(), vectors).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("projection_loss: the model's output holds no floating tensor.")
    return total


def floats(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            if o.is_floating_point() and o.layout is torch.strided:
                found.append(o)
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v)
        elif isinstance(o, dict):
            for v in o.values():
                visit(v)

    visit(obj)
    return found


def signature(obj: Any, vectors: Vectors, seen: dict[int, tuple[Any, int, torch.Tensor]] | None = None,
               ) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Per floating tensor: its shape and ``[norm, projections...]`` (a device tensor: no sync here).

    ``seen`` caches by tensor (and its version): a module's input is mostly the previous one's output."""
    out = []
    for t in floats(obj):
        cache = seen if not t.is_inference() else None  # inference tensors have no version counter
        version = t._version if cache is not None else -1
        hit = cache.get(id(t)) if cache is not None else None
        if hit is not None and hit[0]() is t and hit[1] == version:
            out.append((tuple(t.shape), hit[2]))
            continue
        x = t.detach().float()
        sig = torch.cat([torch.linalg.vector_norm(x).reshape(1), project(x, vectors)])
        if cache is not None:
            cache[id(t)] = (weakref.ref(t), version, sig)
        out.append((tuple(t.shape), sig))
    return out


def distance(a: list[tuple[tuple[int, ...], list[float]]], b: list[tuple[tuple[int, ...], list[float]]]) -> float:
    """The relative difference of two signatures: the largest over their tensors (inf: not comparable)."""
    if len(a) != len(b):
        return float("inf")
    worst = 0.0
    for (shape_a, sa), (shape_b, sb) in zip(a, b):
        if shape_a != shape_b:
            return float("inf")
        finite_a = all(v == v and abs(v) != float("inf") for v in sa)
        finite_b = all(v == v and abs(v) != float("inf") for v in sb)
        if finite_a != finite_b:
            return float("inf")
        if not finite_a:
            continue
        scale = max(sa[0], sb[0])
        if scale == 0.0:
            continue
        worst = max(worst, max(abs(x - y) for x, y in zip(sa, sb)) / scale)
    return worst


def noise_scale(dtype: torch.dtype) -> float:
    """The relative perturbation of the noise run: a kernel's rounding differs between layouts by more than
    half a unit in the last place where it sums long runs (a convolution's weight gradient sums N*H*W
    products), so 64 units, and at most 2**-6 for 16-bit dtypes."""
    return min(64 * torch.finfo(dtype).eps, 2.0**-6)
