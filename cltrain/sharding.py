"""Which sharding engine holds a model, and the layout its parameters keep under it.

FSDP2 (``torch.distributed.fsdp.fully_shard``) refuses channels_last parameters and all-gathers contiguous
ones for each forward; FSDP1 and DeepSpeed flatten parameters (or their gradients) into contiguous buffers.
A convolution runs its NHWC kernel when its input *or* its weight is channels_last, so under every sharding
engine cltrain keeps the weights contiguous (NCHW) and puts only the inputs, and so the activations, in
channels_last: ResNet-50 keeps 1.93x of the 1.94x channels_last speed-up on an H200 (docs/performance.md).

``sharding_of(model, engine)`` names the engine from the model (``FSDPModule`` modules, DTensor, FSDP1 or
DeepSpeed parameters) or from what will shard it (a Lightning or Fabric strategy, an ``accelerate.Accelerator``
or its state); ``sharded_line`` is the one log line that says what is where; ``not_checked_reason`` says why the
first-batch check does not run on a sharded model, and how to check instead. The guide: docs/guides/scaling.md.

Example::

    >>> import torch
    >>> sharding_of(torch.nn.Conv2d(3, 8, 3)) is None
    True
    >>> engine, layouts = sharded_line("FSDP2").split(": ")
    >>> engine
    'FSDP2 shards the parameters, which it keeps contiguous'
    >>> layouts
    'the weights stay NCHW, the inputs and activations are channels_last (the convolutions run NHWC kernels).'
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ENGINES", "not_checked_reason", "sharded_line", "sharding_of"]

#: Each engine ``sharding_of`` names, and what it does to the parameters' layout.
ENGINES: dict[str, str] = {
    "FSDP2": "FSDP2 shards the parameters, which it keeps contiguous",
    "FSDP": "FSDP flattens the parameters into contiguous shards",
    "DeepSpeed": "DeepSpeed flattens the parameters (or their gradients) into contiguous buffers",
    "DTensor": "the parameters are DTensors, which the sharding keeps contiguous",
}

#: Lightning's and Fabric's strategies that shard (class names: ``pytorch_lightning``'s count too).
_STRATEGIES = {"ModelParallelStrategy": "FSDP2", "FSDPStrategy": "FSDP", "DeepSpeedStrategy": "DeepSpeed"}

# How the check is run instead, in the reason a sharded model's check gives.
_CHECK_INSTEAD = ("check the unsharded model in one process instead: cltrain.loops.verify_layout("
               "convert_model(model, sharded=True), batch, step) before fully_shard (docs/guides/scaling.md)")


def _model_engine(model: nn.Module) -> str | None:
    if not torch.distributed.is_available():  # no engine can have sharded it
        return None
    from torch.distributed.fsdp import FSDPModule

    modules = list(model.modules())
    if any(isinstance(m, FSDPModule) for m in modules):
        return "FSDP2"
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in modules):
        return "FSDP"
    params = list(model.parameters())
    if any(type(p).__name__ == "FlatParameter" for p in params):
        return "FSDP"
    if any(hasattr(p, "ds_id") for p in params):  # a ZeRO-3 partitioned parameter
        return "DeepSpeed"
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in params):
        return "DTensor"
    return None


def _engine_of(engine: Any) -> str | None:
    for cls in type(engine).__mro__:
        if cls.__name__ in _STRATEGIES:
            return _STRATEGIES[cls.__name__]
    # accelerate's Accelerator and AcceleratorState: what they wrap with (FSDP needs a GPU; on the CPU they use DDP).
    kind = getattr(getattr(engine, "distributed_type", None), "value", None)
    if kind == "FSDP":
        plugin = getattr(engine, "fsdp_plugin", None) or getattr(getattr(engine, "state", None), "fsdp_plugin", None)
        return "FSDP2" if getattr(plugin, "fsdp_version", 1) == 2 else "FSDP"
    if kind == "DEEPSPEED":
        return "DeepSpeed"
    return None


def sharding_of(model: nn.Module | None = None, engine: Any = None) -> str | None:
    """The sharding engine that holds ``model``'s parameters, or will: a key of ``ENGINES``, or ``None``.

    Args:
        model: the model; sharded when a module is an ``FSDPModule`` (``fully_shard``), an FSDP1 wrapper, or a
            parameter is a ``FlatParameter``, a DeepSpeed ZeRO-3 parameter or a ``DTensor``.
        engine: what will wrap it: a Lightning or Fabric strategy (``ModelParallelStrategy`` -> ``"FSDP2"``,
            ``FSDPStrategy`` -> ``"FSDP"``, ``DeepSpeedStrategy``), an ``accelerate.Accelerator`` or
            ``AcceleratorState`` (its ``distributed_type`` and FSDP plugin's version), or ``None``.

    Returns:
        The model's own engine when it is sharded already, else the one ``engine`` will use, else ``None``.
    """
    found = _model_engine(model) if model is not None else None
    return found or (_engine_of(engine) if engine is not None else None)


def sharded_line(engine: str | None, inputs: bool = True) -> str:
    """What is where under ``engine`` (``None``: an engine not named yet), in one line.

    Args:
        engine: a key of ``ENGINES``, or ``None``.
        inputs: whether the model's inputs are put in channels_last (``False``: nothing runs in NHWC).
    """
    why = ENGINES.get(engine or "", "sharding keeps the parameters contiguous")
    if not inputs:
        return (f"{why}: the weights stay NCHW and the inputs are not converted, so no convolution runs an NHWC "
                "kernel; convert the inputs (convert_inputs=True) for the channels_last speed-up.")
    return (f"{why}: the weights stay NCHW, the inputs and activations are channels_last (the convolutions run NHWC "
            "kernels).")


def not_checked_reason(engine: str) -> str:
    """The first-batch check's ``not checked`` reason for a model ``engine`` has sharded."""
    by = f"by {engine}" if engine else "(sharded=True)"
    return f"the model is sharded {by}, which cannot be copied for the check; {_CHECK_INSTEAD}"
