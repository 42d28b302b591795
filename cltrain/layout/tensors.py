"""Layout helpers: put tensors and modules in channels_last, and tell whether they are.

The rules, and why:

* Rank decides the format: 4-D -> ``torch.channels_last``, 5-D ->
  ``torch.channels_last_3d``, every other rank is left alone. Plain
  ``module.to(memory_format=torch.channels_last)`` raises on a model that also
  holds 5-D weights (pytorch#77821); choosing per tensor does not.
* Convert with ``Tensor.to(memory_format=...)``, never ``.contiguous(...)``:
  on an ambiguous shape (C == 1, or H == W == 1) ``contiguous`` sees the
  tensor as already channels_last and returns it unchanged with NCHW strides,
  while ``to`` restrides it.
* Modules are converted in place through ``param.data``, so the ``Parameter``
  objects an optimizer (or DDP) may already hold stay the same objects.

Example::

    >>> import torch, torchvision
    >>> from cltrain import to_channels_last, is_channels_last, layout_summary
    >>> model = to_channels_last(torchvision.models.resnet18())
    >>> layout_summary(model)["channels_last"]
    20
    >>> x = to_channels_last(torch.randn(2, 1, 8, 8))   # grayscale: ambiguous shape
    >>> is_channels_last(x), x.stride()
    (True, (64, 1, 8, 1))
"""

from __future__ import annotations

import sys

from collections import Counter
from typing import Literal, TypeVar, overload

import torch
from torch import nn

__all__ = [
    "compiled_frames",
    "is_compiled",
    "is_materialized",
    "CONV1D_TYPES",
    "CONV_TYPES",
    "has_convolutions",
    "MODES",
    "is_channels_last",
    "is_channels_last_1d",
    "layout_of",
    "layout_summary",
    "memory_format_for",
    "nchw",
    "to_channels_last",
    "to_channels_last_1d",
    "to_contiguous",
]

Mode = Literal["full", "conv"]
MODES: tuple[str, ...] = ("full", "conv")

#: The layers whose weights ``mode="conv"`` converts.
CONV_TYPES: tuple[type[nn.Module], ...] = (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)

def has_convolutions(model: nn.Module) -> bool:
    """Whether ``model`` holds a layer of ``CONV_TYPES`` (a lazy one too): without one, channels_last speeds nothing up."""
    return any(isinstance(m, CONV_TYPES) for m in model.modules())


#: The layers whose weights ``to_channels_last_1d`` converts.
CONV1D_TYPES: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.ConvTranspose1d)

M = TypeVar("M", bound=nn.Module)


def has_nchw_strides(t: torch.Tensor) -> bool:
    """Whether ``t`` has canonical row-major (NCHW) strides, those of a fresh contiguous tensor: a channels_last 1x1
    or depthwise kernel (``(O, I, 1, 1)``, ``(O, 1, kH, kW)``) is ``is_contiguous()`` to torch and has not."""
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= max(size, 1)
    return t.stride() == tuple(reversed(expected))


def nchw(t: torch.Tensor) -> torch.Tensor:
    """``t`` in canonical row-major (NCHW) strides: a copy unless it already has them.

    ``contiguous()`` keeps channels_last strides on size-1 dims (C == 1, a 1x1 kernel), which a kernel
    or code reading raw memory still sees as channels_last; canonical strides leave nothing to chance."""
    return t if has_nchw_strides(t) else t.clone(memory_format=torch.contiguous_format)


def memory_format_for(tensor: torch.Tensor) -> torch.memory_format | None:
    """The channels-last format for ``tensor``'s rank: 4 -> ``channels_last``,
    5 -> ``channels_last_3d``, anything else -> ``None`` (no such format exists;
    stock PyTorch has no channels-last 1-D, pytorch#66681)."""
    if tensor.dim() == 4:
        return torch.channels_last
    if tensor.dim() == 5:
        return torch.channels_last_3d
    return None


def _canonical_strides(shape: torch.Size, memory_format: torch.memory_format | None) -> tuple[int, ...]:
    # The strides `torch.empty(shape, memory_format=...)` (and so `.to(memory_format=...)`)
    # gives: channels innermost, then the spatial dims right to left, batch outermost.
    # `None` is channels-last 1-D for (N, C, L), which has no torch.memory_format.
    order = {torch.channels_last: (1, 3, 2, 0), torch.channels_last_3d: (1, 4, 3, 2, 0), None: (1, 2, 0)}[memory_format]
    strides = [0] * len(shape)
    step = 1
    for d in order:
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def is_channels_last(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is dense channels-last for its rank (4-D or 5-D).

    PyTorch's ``is_contiguous(memory_format=...)`` ignores the strides of
    size-1 dims, so an N1HW (grayscale) or NC11 (pooled) tensor counts as
    *both* NCHW and channels_last there, whatever it really is. This predicate
    is stricter and answers like this:

    * the tensor must be dense in channels-last order (``is_contiguous``);
    * and the strides of its size-1 channel and spatial dims must be the ones
      ``tensor.to(memory_format=...)`` gives, which are what the convolution
      kernels read (``suggest_memory_format``). So a freshly made contiguous
      ``(N, 1, H, W)`` tensor is **not** channels_last, while the same tensor
      after ``to_channels_last`` is.
    * The batch stride is not compared when N == 1 (no kernel reads it), so a
      single image ``unsqueeze(0)``-ed from an HWC array counts.
    * When C == H == W (== D) == 1 both layouts have the very same strides; the
      answer is then ``True`` (and ``is_contiguous()`` is ``True`` as well).

    Tensors of other ranks, and non-strided (sparse, ...) tensors, are ``False``.
    """
    fmt = memory_format_for(tensor)
    if fmt is None or tensor.layout is not torch.strided:
        return False
    if not tensor.is_contiguous(memory_format=fmt):
        return False
    expected = _canonical_strides(tensor.shape, fmt)
    return all(
        stride == want
        for d, (size, stride, want) in enumerate(zip(tensor.shape, tensor.stride(), expected))
        if d != 0 and size == 1
    )


def layout_of(tensor: torch.Tensor) -> str:
    """One word for ``tensor``'s layout: ``"channels_last"``, ``"channels_last_3d"``,
    ``"contiguous"`` (dense NCHW/NCDHW), ``"strided"`` (neither: a slice, an
    expanded view, ...), ``"channels_last_1d"`` for a rank-3 tensor that ``is_channels_last_1d``
    accepts (unless C == L == 1, where both layouts coincide), or ``"rank<N>"`` for
    other ranks and other rank-3 tensors."""
    fmt = memory_format_for(tensor)
    if fmt is None:
        if tensor.dim() == 3 and tensor.shape[1] * tensor.shape[2] > 1 and is_channels_last_1d(tensor):
            return "channels_last_1d"
        return f"rank{tensor.dim()}"
    if is_channels_last(tensor):
        return "channels_last" if fmt is torch.channels_last else "channels_last_3d"
    if tensor.is_contiguous():
        return "contiguous"
    return "strided"


def _restride(tensor: torch.Tensor) -> torch.Tensor:
    fmt = memory_format_for(tensor)
    if fmt is None or tensor.layout is not torch.strided or is_channels_last(tensor):
        return tensor
    out = tensor.to(memory_format=fmt)
    if not is_channels_last(out):
        # `to` trusts suggest_memory_format, which can call an odd-strided size-1
        # view "already channels_last"; empty_like gives the canonical strides.
        out = torch.empty_like(tensor, memory_format=fmt).copy_(tensor)
    return out


def is_materialized(tensor: torch.Tensor) -> bool:
    """``False`` for a lazy module's parameter or buffer before its first forward (it has no shape yet)."""
    return not isinstance(tensor, nn.parameter.UninitializedTensorMixin)


def _convert_in_place(tensor: torch.Tensor | None) -> bool:
    if tensor is None or not is_materialized(tensor) or memory_format_for(tensor) is None:
        return False
    new = _restride(tensor.data)
    changed = new is not tensor.data
    if changed:
        tensor.data = new
    grad = tensor.grad if isinstance(tensor, nn.Parameter) else None
    if grad is not None:
        new_grad = _restride(grad)
        if new_grad is not grad:
            tensor.grad = new_grad
    return changed


def _convert_module(module: M, mode: str) -> M:
    if mode not in MODES:
        raise ValueError(f"to_channels_last: mode={mode!r} is not one of {MODES}.")
    for sub in module.modules():
        if mode == "conv":
            if isinstance(sub, CONV_TYPES):
                _convert_in_place(sub.weight)
            continue
        for param in sub.parameters(recurse=False):
            _convert_in_place(param)
        for buf in sub.buffers(recurse=False):
            _convert_in_place(buf)
    return module


@overload
def to_channels_last(obj: torch.Tensor, mode: Mode = "full") -> torch.Tensor: ...
@overload
def to_channels_last(obj: M, mode: Mode = "full") -> M: ...


def to_channels_last(obj, mode="full"):
    """Put a tensor or a module in the channels-last format of each tensor's rank.

    Args:
        obj: a ``torch.Tensor`` or an ``nn.Module``.
        mode: for modules only. ``"full"`` restrides every 4-D parameter and
            buffer to ``channels_last`` and every 5-D one to
            ``channels_last_3d``; ``"conv"`` restrides only the weights of
            Conv2d/Conv3d/ConvTranspose2d/ConvTranspose3d (what
            ``torch.nn.utils.convert_conv2d_weight_memory_format`` and its 3-D
            sibling do, both at once). Other ranks are never touched. Existing
            gradients are restrided with their parameter.

    Returns:
        For a module: the same module, converted in place. For a tensor: a
        4-D/5-D tensor in channels-last strides (``to`` semantics, so C == 1
        and H == W == 1 shapes really get them), the tensor itself when it is
        already channels-last (no copy), and any other rank unchanged.

    Raises:
        ValueError: ``mode`` is not ``"full"`` or ``"conv"``.
        TypeError: ``obj`` is neither a tensor nor a module.

    Example::

        >>> model = to_channels_last(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv3d(8, 8, 1)))
        >>> model[1].weight.is_contiguous(memory_format=torch.channels_last_3d)
        True
    """
    if isinstance(obj, torch.Tensor):
        return _restride(obj)
    if isinstance(obj, nn.Module):
        return _convert_module(obj, mode)
    raise TypeError(f"to_channels_last expects a torch.Tensor or an nn.Module, got {type(obj).__name__}.")


def layout_summary(module: nn.Module, buffers: bool = False) -> dict[str, int]:
    """Count ``module``'s parameters (and buffers, if asked) by layout.

    Keys are the words of ``layout_of`` (``"channels_last"``,
    ``"channels_last_3d"``, ``"contiguous"``, ``"strided"``, ``"rank1"``, ...)
    plus ``"uninitialized"`` for lazy parameters; only keys with a count appear.
    Shared parameters are counted once.

    Example::

        >>> layout_summary(torch.nn.Conv2d(3, 8, 3))
        {'contiguous': 1, 'rank1': 1}
    """
    counts: Counter[str] = Counter()
    tensors = list(module.parameters())
    if buffers:
        tensors += [b for b in module.buffers() if b is not None]
    for t in tensors:
        counts["uninitialized" if not is_materialized(t) else layout_of(t)] += 1
    return dict(sorted(counts.items()))


# ---- channels-last 1-D ----------------------------------------------------------------------------
# Stock PyTorch has no channels-last format for rank 3 (pytorch#66681), but (N, C, L) strides
# (C*L, 1, C) can be expressed, and Conv1d (which runs as a 2-D convolution on (N, C, 1, L))
# then picks its NHWC kernels. Intel's XPU extension calls these `to_channels_last_1d` /
# `is_contiguous_channels_last_1d`. On stock PyTorch it is usually slower (docs/guides/callback.md);
# `ChannelsLast(mode="auto")` with a rank-3 input_shape times it before using it.


def is_channels_last_1d(tensor: torch.Tensor) -> bool:
    """Whether a rank-3 ``(N, C, L)`` tensor has channels-last 1-D strides ``(C*L, 1, C)``.

    The same rules as ``is_channels_last``: dense in that order, and the strides of
    size-1 channel/length dims must be the canonical ones (the batch stride is not compared
    when N == 1). A plain contiguous ``(N, 1, L)`` or ``(N, C, 1)`` tensor is therefore
    **not** channels-last 1-D, and when C == L == 1 both layouts coincide and the answer is
    ``True``. Other ranks and non-strided tensors are ``False``.
    """
    if tensor.dim() != 3 or tensor.layout is not torch.strided:
        return False
    expected = _canonical_strides(tensor.shape, None)
    return all(
        stride == want
        for d, (size, stride, want) in enumerate(zip(tensor.shape, tensor.stride(), expected))
        if size != 1 or d != 0
    )


def _restride_1d(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() != 3 or tensor.layout is not torch.strided or is_channels_last_1d(tensor):
        return tensor
    # `transpose(1, 2).contiguous()` is a no-op on the ambiguous shapes (C == 1 or L == 1):
    # write into canonical strides instead. `copy_` is differentiable, so gradients flow.
    out = torch.empty_strided(
        tensor.shape, _canonical_strides(tensor.shape, None), dtype=tensor.dtype, device=tensor.device
    )
    return out.copy_(tensor)


@overload
def to_channels_last_1d(obj: torch.Tensor) -> torch.Tensor: ...
@overload
def to_channels_last_1d(obj: M) -> M: ...


def to_channels_last_1d(obj):
    """Give an ``(N, C, L)`` tensor, or a module's Conv1d/ConvTranspose1d weights, channels-last
    1-D strides ``(C*L, 1, C)`` (the layout Intel's ``to_channels_last_1d`` makes).

    Args:
        obj: a rank-3 tensor (other ranks are returned unchanged), or an ``nn.Module``
            whose ``CONV1D_TYPES`` weights are restrided in place (through ``.data``,
            gradients too, so optimizer-held ``Parameter`` objects stay the same).

    Returns:
        The tensor restrided (a copy that autograd follows; the tensor itself when already
        channels-last 1-D), or the same module.

    Raises:
        TypeError: ``obj`` is neither a tensor nor a module.

    Example::

        >>> x = to_channels_last_1d(torch.randn(2, 4, 10))
        >>> x.stride(), is_channels_last_1d(x)
        ((40, 1, 4), True)
    """
    if isinstance(obj, torch.Tensor):
        return _restride_1d(obj)
    if isinstance(obj, nn.Module):
        for sub in obj.modules():
            if isinstance(sub, CONV1D_TYPES) and is_materialized(sub.weight):
                sub.weight.data = _restride_1d(sub.weight.data)
                if sub.weight.grad is not None:
                    sub.weight.grad = _restride_1d(sub.weight.grad)
        return obj
    raise TypeError(f"to_channels_last_1d expects a torch.Tensor or an nn.Module, got {type(obj).__name__}.")


def to_contiguous(module: nn.Module) -> nn.Module:
    """Put every 4-D/5-D parameter and buffer of ``module`` back in NCHW/NCDHW strides, and
    channels-last 1-D rank-3 ones back in NCL, in place (through ``.data``, so the
    ``Parameter`` objects stay the same); returns ``module``."""
    # `contiguous()` keeps channels_last strides on size-1 dims (a 1x1 conv weight), which
    # the kernels would still read as channels_last; cloning gives canonical NCHW strides.
    for tensor in [*module.parameters(), *module.buffers()]:
        if not is_materialized(tensor):  # a lazy module's, made NCHW by its first forward
            continue
        four_or_five_d = memory_format_for(tensor) is not None and layout_of(tensor) != "contiguous"
        one_d = is_channels_last_1d(tensor) and not tensor.is_contiguous()
        if four_or_five_d or one_d:
            tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)
    return module


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or a module in it runs compiled code: a ``torch.compile`` wrapper (``OptimizedModule``),
    ``module.compile()``, or a LightningModule that Lightning unwrapped from one (``_compiler_ctx``)."""
    optimized = sys.modules["torch._dynamo"].eval_frame.OptimizedModule if "torch._dynamo" in sys.modules else ()
    return any(isinstance(m, optimized) or getattr(m, "_compiled_call_impl", None) is not None
               or getattr(m, "_compiler_ctx", None) is not None for m in module.modules())


def compiled_frames() -> int:
    """How many frames ``torch.compile`` has compiled in this process (dynamo's own count; 0 where dynamo was never
    loaded): compiled code that ran between two readings differs."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils.counters["frames"]["ok"] if utils is not None else 0
