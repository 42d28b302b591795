"""What the check compares a tensor by: its norm and a few fixed random projections, which a value moved to
another index changes (a permutation-invariant statistic would not), and the relative difference of two.

Example::

    >>> x = torch.arange(24.0).reshape(2, 3, 2, 2)
    >>> vectors = Vectors()
    >>> def values(t):
    ...     found = signature(t, vectors)
    ...     return [(shape, v) for (shape, _), v in zip(found, numbers([s for _, s in found]))]
    >>> distance(values(x), values(x.contiguous(memory_format=torch.channels_last))) < 1e-6  # the same values, other strides
    True
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["Vectors", "distance", "floats", "noise_scale", "numbers", "project", "projection_loss", "signature"]

_PROJECTIONS = 3
#: The most elements a cached product of a tensor's trailing dims' vectors covers (384 KiB of float32 per shape): a
#: tensor up to this size is one matrix-vector product; a larger one a matrix product against its trailing dims'
#: vectors, then its leading dims'.
_TRAILING_MAX = 1 << 15
#: The most elements a cached product of the leading dims' vectors holds (4 MiB of float32); past both limits a
#: tensor contracts its dims one at a time.
_WEIGHTS_MAX = 1 << 20


class Vectors:
    """Fixed random vectors per (size, dim, device): the same in every run; and per tensor shape, strides and device,
    how ``project`` contracts it (``plan``)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        self._plans: dict[tuple[Any, ...], tuple[list[int], int, torch.Tensor | None, torch.Tensor | None]] = {}

    def get(self, size: int, dim: int, device: torch.device) -> torch.Tensor:
        key = (size, dim, device)
        if key not in self._cache:
            g = torch.Generator().manual_seed(1_000_003 * size + dim)
            self._cache[key] = torch.randn(size, _PROJECTIONS, generator=g, dtype=torch.float32).to(device)
        return self._cache[key]

    def _product(self, x: torch.Tensor, dims: list[int]) -> torch.Tensor:
        """The vectors of ``dims`` multiplied out: ``(prod of their sizes, P)``, row-major over ``dims``."""
        weights = torch.ones(1, _PROJECTIONS, device=x.device, dtype=torch.float32)
        for d in dims:
            v = self.get(x.shape[d], d, x.device)
            weights = (weights[:, None, :] * v[None, :, :]).reshape(-1, _PROJECTIONS)
        return weights

    def plan(self, x: torch.Tensor) -> tuple[list[int], int, torch.Tensor | None, torch.Tensor | None]:
        """``(order, rows, trailing, leading)`` for a tensor of ``x``'s shape and strides: its dims in memory order,
        the stride-1 dim last (size-1 dims first: their stride says nothing); ``x.permute(order)`` seen as ``(rows,
        columns)``, the columns the largest run of trailing dims up to ``_TRAILING_MAX`` elements; their vectors
        multiplied out, ``(P, columns)``; the leading dims' ``(rows, P)`` (``None`` for one row). ``trailing`` is
        ``None`` where the limits leave no such split: ``project`` then contracts one dim at a time."""
        key = (x.shape, x.stride(), x.device)
        found = self._plans.get(key)
        if found is None:
            order = sorted(range(x.dim()), key=lambda d: (x.shape[d] > 1, -x.stride(d), d))
            split, columns = len(order), 1
            while split > 0 and columns * x.shape[order[split - 1]] <= _TRAILING_MAX:
                split -= 1
                columns *= x.shape[order[split]]
            rows = x.numel() // columns if columns else 0
            trailing = leading = None
            if split < len(order) and rows * _PROJECTIONS <= _WEIGHTS_MAX:
                trailing = self._product(x, order[split:]).t().contiguous()
                leading = self._product(x, order[:split]) if rows > 1 else None
            found = self._plans[key] = (order, rows, trailing, leading)
        return found


def project(x: torch.Tensor, vectors: Vectors) -> torch.Tensor:
    """``_PROJECTIONS`` projections of ``x`` (float) on rank-1 random tensors: shape ``(_PROJECTIONS,)``.

    Each is ``sum(x[i, j, ...] * a[i] * b[j] * ...)``; a value moved to another index changes it, a
    permutation-invariant statistic (sum, norm) would not."""
    if x.dim() == 0:
        return x.reshape(1).repeat(_PROJECTIONS)
    # Contract in memory order: in the logical order the product strides through a channels_last tensor's memory
    # (measured in the check's cost: docs/performance.md); one product over the trailing dims, where one op per dim
    # made small tensors cost their Python and large ones a pass over memory per dim.
    order, rows, trailing, leading = vectors.plan(x)
    y = x.permute(order)
    if trailing is not None:
        if leading is None:
            return torch.mv(trailing, y.reshape(-1))
        return ((y.reshape(rows, -1) @ trailing.t()) * leading).sum(0)
    y = y @ vectors.get(x.shape[order[-1]], order[-1], x.device)  # (..., P)
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


def signature(obj: Any, vectors: Vectors, seen: dict[int, tuple[Any, int, Any]] | None = None,
              ) -> list[tuple[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]]]:
    """Per floating tensor: its shape and ``(norm, projections)`` (device tensors: no sync here; ``numbers`` turns
    them into floats).

    ``seen`` caches by tensor (and its version): a module's input is mostly the previous one's output. The torch
    function modes around the step (``cltrain.check.randomness.SameRandomness``, the user's own) do not see these
    ops: they are the check's arithmetic, a dozen small ops per tensor that each mode would add its Python to."""
    out = []
    with torch._C.DisableTorchFunction():
        for t in floats(obj):
            cache = seen if not t.is_inference() else None  # inference tensors have no version counter
            version = t._version if cache is not None else -1
            hit = cache.get(id(t)) if cache is not None else None
            if hit is not None and hit[0]() is t and hit[1] == version:
                out.append((tuple(t.shape), hit[2]))
                continue
            x = t.detach().float()
            sig = (torch.linalg.vector_norm(x), project(x, vectors))
            if cache is not None:
                cache[id(t)] = (weakref.ref(t), version, sig)
            out.append((tuple(t.shape), sig))
    return out


def numbers(signatures: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[float]]:
    """``[norm, projections...]`` of each ``(norm, projections)`` that ``signature`` gave, in one transfer."""
    if not signatures:
        return []
    norms = torch.stack([n for n, _ in signatures]).unsqueeze(1)
    projections = torch.stack([p for _, p in signatures])
    return torch.cat([norms, projections], 1).double().cpu().tolist()


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
    # the signatures are float32 (``signature`` casts): a float64 run is judged at float32's resolution
    return min(64 * max(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps), 2.0**-6)
