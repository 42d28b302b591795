"""Pick the faster memory layout for a model by timing it: what ``ChannelsLast(mode="auto")`` runs.

Whether channels_last pays depends on the model, the dtype and the device
(pytorch#50549, #50036): depthwise-heavy or non-convolutional models can lose
on CPU, big convolutional ones usually win. So instead of guessing,
``time_layouts`` runs a few forward+backward steps of *copies* of the real
model on a synthetic batch of the real input shape, once in each layout,
interleaved so that a machine getting busier or quieter drifts both equally,
and reports the median seconds per step. ``choose_layout`` keeps the
faster one. The given model is never touched (weights, grads, BatchNorm
statistics and layout stay as they were).

Example::

    >>> import torchvision
    >>> from cltrain.timing.layouts import choose_layout
    >>> layout, seconds = choose_layout(torchvision.models.resnet18(), (8, 3, 64, 64), steps=2)
    >>> layout in ("channels_last", "contiguous"), sorted(seconds)
    (True, ['channels_last', 'contiguous'])
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten  # tensors in nested outputs, namedtuples too

from cltrain.guardrails import apply_guardrails
from cltrain.layout import to_channels_last, to_channels_last_1d, to_contiguous
from cltrain.precision import autocast_for

__all__ = ["LAYOUTS", "choose_layout", "model_in_layout", "scalar_loss", "synchronize", "time_layouts", "timed"]

log = logging.getLogger(__name__)

#: The two layouts compared, in the order timed in the first round.
LAYOUTS: tuple[str, str] = ("contiguous", "channels_last")


def _mean(t: torch.Tensor) -> torch.Tensor:
    if t.dim() < 3:
        return t.mean()
    # `mean`'s backward divides an expanded scalar, which comes out NCHW whatever `t` is; a
    # weighted sum's backward takes the layout of the weights, which `full_like` gives `t`'s.
    return (t * torch.full_like(t, 1.0 / t.numel())).sum()


def scalar_loss(output: Any) -> torch.Tensor:
    """A scalar to call ``backward`` on, from whatever a model returned: the sum of the means
    (as float32) of every floating tensor that requires grad in a tensor, tuple, list,
    namedtuple or dict output. A mean keeps the gradients O(1) whatever the batch size;
    float32 keeps an fp16/bf16 reduction from overflowing. The gradient of a 4-D/5-D
    output has that output's layout, so a dense-prediction model's last layer is timed
    and audited as training with a real loss would run it.

    Raises:
        ValueError: the output holds no floating tensor that requires grad.
    """
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    terms = [_mean(t.float()) for t in tensors if t.is_floating_point() and t.requires_grad]
    if not terms:
        raise ValueError(f"scalar_loss: the model output ({type(output).__name__}) holds no floating tensor that requires grad.")
    return torch.stack(terms).sum() if len(terms) > 1 else terms[0]


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels on ``device`` (CUDA), so a wall-clock timer measures the work."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_of(model: nn.Module) -> torch.device:
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return torch.device("cpu")


def model_in_layout(
    model: nn.Module, layout: str, device: torch.device | str | None = None, *, conv1d: bool = False
) -> nn.Module:
    """A deep copy of ``model`` (on ``device`` if given) with every 4-D/5-D parameter and
    buffer in ``layout`` (``"channels_last"`` or ``"contiguous"``) and no gradients. With
    ``conv1d=True``, ``"channels_last"`` also gives Conv1d/ConvTranspose1d weights
    channels-last 1-D strides (``cltrain.layout.to_channels_last_1d``).

    Raises:
        ValueError: ``layout`` is not one of ``LAYOUTS``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"model_in_layout: layout={layout!r} is not one of {LAYOUTS}.")
    clone = copy.deepcopy(model)
    if device is not None:
        clone.to(device)
    for param in clone.parameters():
        param.grad = None
    if layout == "contiguous":
        return to_contiguous(clone)
    to_channels_last(clone)
    return to_channels_last_1d(clone) if conv1d else clone


def _input_in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "contiguous":
        return x.clone(memory_format=torch.contiguous_format)
    return to_channels_last_1d(x) if x.dim() == 3 else to_channels_last(x)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    """Wall seconds of ``fn()``, the device synchronised before and after (so queued kernels count)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def time_layouts(
    model: nn.Module,
    input_shape: tuple[int, ...],
    *,
    steps: int = 3,
    warmup: int = 1,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
    guardrails: bool = False,
    on_step: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Median seconds per forward+backward step of ``model`` in each layout.

    Two deep copies of the model are timed (one per layout) on one synthetic
    ``torch.randn(input_shape)`` batch, loss ``scalar_loss`` of the output.
    After ``warmup`` untimed steps per layout, ``steps`` rounds time one step of
    each layout, alternating which goes first. The model keeps its train/eval
    mode in the copies; the model itself is not modified.

    Args:
        model: the model to time, as it will be trained.
        input_shape: the batch shape, 4-D ``(N, C, H, W)``, 5-D ``(N, C, D, H, W)``, or 3-D
            ``(N, C, L)`` for a 1-D model: its ``"channels_last"`` is then channels-last 1-D
            strides for the input and the Conv1d/ConvTranspose1d weights (usually slower on
            stock PyTorch, which is why it is timed, not assumed).
        steps: timed steps per layout (the median is reported).
        warmup: untimed steps per layout first (allocator, kernel selection, caches).
        device: where to time; default the model's device.
        autocast_dtype: time under ``torch.autocast`` in this dtype (bf16 on CPU,
            fp16 on CUDA, as in training), or ``None`` for the model's own dtype.
        guardrails: apply ``cltrain.guardrails.apply_guardrails`` to each copy for its
            layout, as ``ChannelsLast`` does to the model it trains.
        on_step: called with the layout's name before every step (warm-up ones too): progress
            for a caller watching from another process (``cltrain.timing.probe.probe_layout``).

    Returns:
        ``{"channels_last": seconds, "contiguous": seconds}``.

    Raises:
        ValueError: ``input_shape`` is not 3-D, 4-D or 5-D, or ``steps < 1`` or ``warmup < 0``.
    """
    shape = tuple(int(s) for s in input_shape)
    if len(shape) not in (3, 4, 5):
        raise ValueError(f"time_layouts: input_shape must be 3-D, 4-D or 5-D, got {input_shape!r}.")
    if steps < 1 or warmup < 0:
        raise ValueError(f"time_layouts: need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}.")
    device = torch.device(device) if device is not None else _device_of(model)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    batch = torch.randn(shape, device=device, dtype=dtype)
    models = {layout: model_in_layout(model, layout, device, conv1d=len(shape) == 3) for layout in LAYOUTS}
    if guardrails:
        for layout, copy_ in models.items():
            apply_guardrails(copy_, device=device, dtype=autocast_dtype or dtype, layout=layout)
    inputs = {layout: _input_in_layout(batch, layout) for layout in LAYOUTS}

    def step(layout: str) -> None:
        if on_step is not None:
            on_step(layout)
        m = models[layout]
        m.zero_grad(set_to_none=True)
        with autocast_for(device, autocast_dtype):
            out = m(inputs[layout])
        scalar_loss(out).backward()

    for layout in LAYOUTS:
        for _ in range(warmup):
            step(layout)
    samples: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for i in range(steps):
        for layout in LAYOUTS if i % 2 == 0 else LAYOUTS[::-1]:
            samples[layout].append(timed(lambda: step(layout), device))
    return {layout: statistics.median(samples[layout]) for layout in ("channels_last", "contiguous")}


def choose_layout(model: nn.Module, input_shape: tuple[int, ...], **kwargs: Any) -> tuple[str, dict[str, float]]:
    """The faster layout for ``model`` on ``input_shape``, by ``time_layouts``.

    Keyword arguments go to ``time_layouts``. Logs both timings and the
    decision on the ``cltrain.timing.layouts`` logger.

    Returns:
        ``("channels_last" | "contiguous", {"channels_last": s, "contiguous": s})``;
        a tie goes to ``channels_last``.
    """
    seconds = time_layouts(model, input_shape, **kwargs)
    layout = "channels_last" if seconds["channels_last"] <= seconds["contiguous"] else "contiguous"
    log.info(
        "auto layout for %s on %s: channels_last %.1f ms/step, contiguous %.1f ms/step -> %s",
        type(model).__name__, tuple(input_shape), 1e3 * seconds["channels_last"], 1e3 * seconds["contiguous"], layout,
    )
    return layout, seconds
