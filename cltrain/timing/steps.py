"""A training step to time, and the one builder of "a step in each layout": the cases every layout timing runs.

``training_step`` makes one step (zero the gradients, the loss under autocast, backward, the optimizer's step)
and returns it as a callable that leaves the loss on the device. ``layout_steps`` makes one per layout from deep
copies of a model, each fed the batch's input in that layout: what ``time_layouts`` and the
benchmarks of ``scripts/`` hand :func:`cltrain.timing.rounds.time_steps`. The given model is never touched.

Example::

    >>> import torch, torchvision
    >>> from cltrain.timing.rounds import time_steps
    >>> from cltrain.timing.steps import layout_steps
    >>> steps = layout_steps(torchvision.models.resnet18(num_classes=10), torch.randn(2, 3, 32, 32))
    >>> sorted(time_steps(steps, rounds=1).per_step())
    ['channels_last', 'contiguous']
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten  # tensors in nested outputs, namedtuples too

from cltrain.guardrails import apply_guardrails
from cltrain.layout import to_channels_last, to_channels_last_1d, to_contiguous
from cltrain.precision import autocast_for

__all__ = ["LAYOUTS", "input_in_layout", "layout_steps", "model_in_layout", "scalar_loss", "training_step"]

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


def input_in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` in ``layout``: a contiguous copy, or channels_last (4-D), channels_last_3d (5-D) or channels-last
    1-D strides (3-D)."""
    if layout == "contiguous":
        return x.clone(memory_format=torch.contiguous_format)
    return to_channels_last_1d(x) if x.dim() == 3 else to_channels_last(x)


def training_step(model: nn.Module, loss: Callable[[], torch.Tensor], *,
                  optimizer: torch.optim.Optimizer | None = None, autocast_dtype: torch.dtype | None = None,
                  device: torch.device | str = "cpu") -> Callable[[], torch.Tensor]:
    """One training step of ``model`` as a callable: gradients zeroed (set to ``None``), ``loss()`` under
    ``torch.autocast`` in ``autocast_dtype`` on ``device`` (none when ``None``), backward, ``optimizer``'s step
    (none when ``None``). It returns the loss, detached and left on the device (no host sync)."""
    def step() -> torch.Tensor:
        (optimizer or model).zero_grad(set_to_none=True)
        with autocast_for(device, autocast_dtype):
            value = loss()
        value.backward()
        if optimizer is not None:
            optimizer.step()
        return value.detach()

    return step


def layout_steps(model: nn.Module, inputs: torch.Tensor, *, targets: Any = None,
                 loss: Callable[[Any, Any], torch.Tensor] | None = None,
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
                 autocast_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 guardrails: bool = False, layouts: Iterable[str] = LAYOUTS) -> dict[str, Callable[[], torch.Tensor]]:
    """A :func:`training_step` per layout, each on its own deep copy of ``model`` fed ``inputs`` in that layout.

    Args:
        model: the model as it will be trained (not modified; each copy keeps its train/eval mode).
        inputs: the batch's input, 4-D ``(N, C, H, W)``, 5-D ``(N, C, D, H, W)``, or 3-D ``(N, C, L)`` for a 1-D
            model: its ``"channels_last"`` is then channels-last 1-D strides for the input and the
            Conv1d/ConvTranspose1d weights.
        targets: passed to ``loss`` beside the output.
        loss: ``loss(output, targets)``; default :func:`scalar_loss` of the output.
        optimizer: builds each copy's optimizer from its parameters; ``None``: no optimizer step.
        autocast_dtype: the step under ``torch.autocast`` in this dtype, or ``None``.
        device: where the copies and inputs go; default the model's device.
        guardrails: apply :func:`cltrain.guardrails.apply_guardrails` to each copy for its layout, as
            ``ChannelsLast`` does to the model it trains.
        layouts: the layouts, in the order the first round times them.
    """
    if device is None:
        device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    score = loss or (lambda output, _: scalar_loss(output))
    steps = {}
    for layout in layouts:
        copy_ = model_in_layout(model, layout, device, conv1d=inputs.dim() == 3)
        if guardrails:
            apply_guardrails(copy_, device=device, dtype=autocast_dtype or dtype, layout=layout)
        x = input_in_layout(inputs.to(device), layout)
        steps[layout] = training_step(copy_, lambda m=copy_, x=x: score(m(x), targets),
                                      optimizer=optimizer(copy_.parameters()) if optimizer else None,
                                      autocast_dtype=autocast_dtype, device=device)
    return steps
