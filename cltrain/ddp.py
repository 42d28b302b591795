"""DistributedDataParallel after a parameter changes layout: its gradient buckets built again.

DDP copies each gradient into a view of its bucket made with the strides the parameter had when the buckets were
built (at the wrap, then once after the first iteration). A parameter restrided since (channels_last to NCHW or back:
the race's switch, a check's verdict, a pruning put back) gets the ranks' averaged gradient permuted, the values of
one layout in the places of the other, and torch only warns ("not an error"): ``scripts/repro/ddp_restrided_grads.py``.

``rebuild_buckets`` has every DDP that holds the model build its buckets again, with the strides the parameters have
then, so the very next step's gradients are right. Where DDP rebuilds its buckets itself (``find_unused_parameters``
off, or a static graph): the reducer's own reset (what ``DistributedDataParallel._update_process_group`` does to force a
rebuild) with every parameter queued for it (what a static graph does after its first iteration), rebuilt at once.
Where it never does (``find_unused_parameters=True``, no static graph: the Hugging Face ``Trainer``'s
default): a new reducer, built as DDP builds one when unpickled (``__setstate__``), its communication hooks registered
again. Private DDP methods both: ``blocker`` names a torch without them. Every rank must call it at the same step.
"""

from __future__ import annotations

import gc

from torch import nn

__all__ = ["blocker", "rebuild_buckets", "wrappers"]

_RESET = ("_reset_state", "_push_all_rebuilt_params", "_rebuild_buckets")
_NEW = ("_build_params_for_reducer", "_ddp_init_helper", "_build_debug_param_to_name_mapping", "_comm_hooks",
        "mixed_precision")


def wrappers(model: nn.Module) -> list[nn.parallel.DistributedDataParallel]:
    """The ``DistributedDataParallel`` modules holding ``model``'s parameters, however the door wrapped it (a
    Lightning strategy, Fabric, Accelerate, the Hugging Face ``Trainer``, a user's own). Garbage is collected first: a
    DDP left unreachable (an earlier fit's) may still be uncollected on one rank and not on another, and each DDP
    found is rebuilt with a collective. A collection and one walk over the objects Python tracks (0.41-0.43 s for half
    a million on a 2-core EPYC): the session asks under several ranks only, at its start and its first change of
    layout."""
    first = next(model.parameters(), None)
    if first is None:
        return []
    gc.collect()
    # type(), not isinstance: isinstance reads an object's __class__, which torch's deprecated
    # torch.distributed.reduce_op answers with a FutureWarning on every rank
    return [o for o in gc.get_objects() if issubclass(type(o), nn.parallel.DistributedDataParallel)
            and any(p is first for p in o.module.parameters())]


def blocker(ddps: list[nn.parallel.DistributedDataParallel]) -> str | None:
    """Why the buckets of ``ddps`` cannot be built again (a parameter restrided under them would get wrong
    gradients for the rest of the run); ``None``: they can."""
    for ddp in ddps:
        if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params", False):
            return "DDP reduces these gradients outside its reducer (compiled or delayed all-reduce)"
        reducer = getattr(ddp, "reducer", None)
        needs = (_RESET, reducer) if _rebuilds_itself(ddp) else (_NEW, ddp)
        if reducer is None or not all(hasattr(needs[1], name) for name in needs[0]):
            return "this torch's DDP cannot build its gradient buckets again"
    return None


def rebuild_buckets(ddps: list[nn.parallel.DistributedDataParallel]) -> str | None:
    """Have ``ddps`` build their gradient buckets again now, with the parameters' strides now (between steps, or
    inside DDP's forward before its backward); ``None`` where done, else why not (``blocker``), and nothing changed.
    Building them calls every rank (the bucket order is rank 0's)."""
    reason = blocker(ddps)
    if reason is not None:
        return reason
    for ddp in ddps:
        if _rebuilds_itself(ddp):
            ddp.reducer._reset_state()
            ddp.reducer._push_all_rebuilt_params()
            ddp.reducer._rebuild_buckets()  # now: a door's forward hook switches inside DDP's forward, after it
            ddp._has_rebuilt_buckets = True  # would have rebuilt them, and the backward would push them again
        else:
            _new_reducer(ddp)
    return None


def _rebuilds_itself(ddp: nn.parallel.DistributedDataParallel) -> bool:
    return not ddp.find_unused_parameters or bool(getattr(ddp, "static_graph", False))


def _new_reducer(ddp: nn.parallel.DistributedDataParallel) -> None:
    """A new reducer for ``ddp`` (no static graph), as ``DistributedDataParallel.__setstate__`` builds one; the old
    one, freed, removes its autograd hooks."""
    import torch.distributed as dist

    params, sparse = ddp._build_params_for_reducer()
    ddp._ddp_init_helper(params, sparse, ddp._build_debug_param_to_name_mapping(params), False)
    for hook, state in ddp._comm_hooks:
        dist._register_comm_hook(ddp.reducer, state, hook)
    if ddp.mixed_precision is not None:
        ddp.reducer._set_mixed_precision_param_dtype(ddp.mixed_precision.param_dtype)
