"""Pick the faster memory layout for a model by timing copies of it, before training (a run decides on its own
steps instead: ``cltrain.timing.layout_race``).

Whether channels_last pays depends on the model, the dtype and the device
(pytorch#50549, #50036): depthwise-heavy or non-convolutional models can lose
on CPU, big convolutional ones usually win. So instead of guessing,
``time_layouts`` runs a few forward+backward steps of *copies* of the real
model on a synthetic batch of the real input shape, once in each layout,
interleaved so that a machine getting busier or quieter drifts both equally
(``cltrain.timing.steps.layout_steps`` builds the steps, ``cltrain.timing.rounds.time_steps``
times them), and reports the median seconds per step. ``choose_layout`` keeps the
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

import logging
from typing import Any

import torch
from torch import nn

from cltrain.timing.rounds import time_steps
from cltrain.timing.steps import layout_steps

__all__ = ["choose_layout", "time_layouts"]

log = logging.getLogger(__name__)


def time_layouts(
    model: nn.Module,
    input_shape: tuple[int, ...],
    *,
    steps: int = 3,
    warmup: int = 1,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
    guardrails: bool = False,
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
    if device is None:
        device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    batch = torch.randn(shape, device=device, dtype=dtype)
    cases = layout_steps(model, batch, device=device, autocast_dtype=autocast_dtype, guardrails=guardrails)
    # one step per round, the layouts alternating which goes first
    per_step = time_steps(cases, rounds=steps, warmup=warmup, sync=device).per_step()
    return {layout: per_step[layout].median for layout in ("channels_last", "contiguous")}


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
