"""What a front door lends ``cltrain.session.LayoutSession`` to run the run through: the host.

A host says a line, tells whether this process decides (the only process, or rank 0 of several), hands the deciding
rank's value to every rank, sums a tensor over the ranks, logs metrics (both layouts' step times) to the run's
logger, and names the run's optimizers and the model's copies (an EMA's, SWA's) as they are at the moment the session
asks. ``Host`` is one process or ``torch.distributed``'s default
group (Fabric, plain loops, the Hugging Face Trainer); ``cltrain.lightning_access.LightningHost`` is a Lightning
``Trainer`` and its strategy.

Example::

    >>> optimizer = torch.optim.SGD(torch.nn.Conv2d(3, 8, 3).parameters(), lr=0.1)
    >>> host = Host(optimizers=lambda: [optimizer])
    >>> host.deciding(), host.broadcast("rank 0's"), host.optimizers() == [optimizer]
    (True, "rank 0's", True)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["Host", "Say", "several_ranks", "shown"]

#: ``say(message, warn)``: one line, a warning where ``warn``.
Say = Callable[[str, bool], None]


def shown(logger: logging.Logger) -> logging.Logger:
    """``logger`` (one of cltrain's), whose lines show where the program set up no logging, as Lightning's do:
    Python then shows warnings only, and a door's lines (the check's verdict, the race's decision) are information.
    The ``cltrain`` logger is given a handler that prints each line as it is (and keeps it from the root logger a
    program may set up later); a level set on it is kept. Where the program has a handler, nothing changes."""
    ours = logging.getLogger("cltrain")
    if not logging.getLogger().handlers and not ours.handlers and logger.name.split(".")[0] == "cltrain":
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        ours.addHandler(handler)
        ours.propagate = False
        if ours.level == logging.NOTSET:
            ours.setLevel(logging.INFO)
    return logger


def _logged(message: str, warn: bool) -> None:
    logging.getLogger("cltrain").log(logging.WARNING if warn else logging.INFO, message)


def several_ranks() -> bool:
    """Whether ``torch.distributed``'s default group is initialised with more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Host:
    """One process, or ``torch.distributed``'s default group where one of several ranks is initialised when the
    session asks (rank 0 decides; every rank must then call the session at the same points).

    Args:
        say: ``say(message, warn)`` (default: the ``cltrain`` logger); in a group of several ranks only rank 0 says.
        optimizers: the run's optimizers, whose state takes its parameters' strides whenever these change.
        copies: the model's copies (an EMA's ``AveragedModel``), which join its layout and its fallbacks.
        log: ``log(metrics)`` hands ``{name: value}`` to the run's logger (default: none); only the deciding rank
            logs.
        aliases: tensors outside the model that share a parameter's data and must keep sharing it when the
            parameter changes layout (the layer copies of Lightning's ``ModelPruning``, which its lottery-ticket
            reset writes into the weights with ``.data =``).
    """

    #: whether every rank runs each evaluation (Lightning's loops do; a loop may evaluate on rank 0 alone, where a
    #: check shared by the ranks would wait for the others)
    evaluates_together = False

    def __init__(self, say: Say | None = None, *, optimizers: Callable[[], Iterable[Any]] = tuple,
                 copies: Callable[[], Iterable[nn.Module]] = tuple,
                 log: Callable[[dict[str, float]], Any] | None = None,
                 aliases: Callable[[], Iterable[torch.Tensor]] = tuple) -> None:
        self._say, self._optimizers, self._copies, self._log = say or _logged, optimizers, copies, log
        self._aliases = aliases

    def several(self) -> bool:
        """Whether the run has more than one rank."""
        return several_ranks()

    def grouped(self) -> bool:
        """Whether ``torch.distributed``'s default group is initialised, of any number of ranks: a DDP may hold the
        model then (``torchrun --nproc_per_node=1``, ``Fabric(strategy="ddp", devices=1)``)."""
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    def evaluates_alone(self) -> bool:
        """Whether an evaluation may run on one rank of several alone (``evaluates_together`` not promised): what
        every rank must join (a broadcast, DDP's buckets built again) is not done there."""
        return not self.evaluates_together and self.several()

    def deciding(self) -> bool:
        """Whether this process decides for every rank (checks, times)."""
        return not several_ranks() or torch.distributed.get_rank() == 0

    def say(self, message: str, warn: bool = False) -> None:
        if self.deciding():
            self._say(message, warn)

    def broadcast(self, value: Any) -> Any:
        """The deciding rank's ``value`` on every rank."""
        if not several_ranks():
            return value
        shared = [value]
        torch.distributed.broadcast_object_list(shared, src=0)
        return shared[0]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks (an all-reduce on the backend's device)."""
        import torch.distributed as dist

        if not several_ranks():
            return tensor
        on_gpu = "gloo" not in str(dist.get_backend()) and torch.cuda.is_available()  # NCCL reduces CUDA tensors
        tensor = tensor.to(torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu"))
        dist.all_reduce(tensor)
        return tensor

    def log(self, metrics: dict[str, float]) -> None:
        """``metrics`` to the run's logger, from the deciding rank."""
        if self._log is not None and self.deciding():
            self._log(metrics)

    def optimizers(self) -> list[Any]:
        return list(self._optimizers())

    def copies(self) -> list[nn.Module]:
        return list(self._copies())

    def aliases(self) -> list[torch.Tensor]:
        return list(self._aliases())
