"""Top-k accuracy accumulated on the device with no host sync: the training metric.

torchmetrics' ``MulticlassAccuracy(top_k=k > 1)`` builds a one-hot of the targets
(``F.one_hot``), which on a CPU-type device reads the targets' min and max back
to the host (``.item()``) on every update, and with its default
``validate_args=True`` runs ``torch.unique`` on the targets (a device sync on
CUDA) on every update. ``TopKAccuracy`` is the same micro-averaged
``Prec@k`` of apex main_amp.py (correct predictions over samples) as two running
sums, so a training step never waits for the host; its states reduce across
processes like any torchmetrics ``Metric``. Validation keeps torchmetrics'
``MulticlassAccuracy`` (``validate_args=False``): a test checks both agree.

Example::

    >>> import torch
    >>> metric = TopKAccuracy(top_k=2)
    >>> metric(torch.tensor([[0.1, 0.5, 0.4], [0.9, 0.02, 0.08]]), torch.tensor([2, 1]))
    tensor(0.5000)
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

__all__ = ["TopKAccuracy"]


class TopKAccuracy(Metric):
    """Fraction of samples whose target is among the ``top_k`` highest logits (micro average).

    Args:
        top_k: how many of the highest logits count as a hit (>= 1).

    Raises:
        ValueError: ``top_k`` < 1.
    """

    full_state_update = False
    higher_is_better = True
    is_differentiable = False

    def __init__(self, top_k: int = 1) -> None:
        super().__init__()
        if top_k < 1:
            raise ValueError(f"TopKAccuracy: top_k must be >= 1, got {top_k}")
        self.top_k = top_k
        self.add_state("correct", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Count the hits of a ``(N, C)`` logits batch against ``(N,)`` class indices."""
        k = min(self.top_k, logits.shape[-1])
        hits = (logits.topk(k, dim=-1).indices == targets.unsqueeze(-1)).any(dim=-1)
        self.correct += hits.sum()
        self.total += targets.numel()

    def compute(self) -> torch.Tensor:
        """The accuracy so far (0 before any sample)."""
        return self.correct / self.total.clamp(min=1)
