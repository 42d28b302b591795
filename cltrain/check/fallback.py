"""Run one part of a channels_last model in NCHW: the fallbacks ``cltrain.check.compare`` chooses.

A fallback is a ``Fallback(kind, module)``:

* ``"outputs"``: the module's 4-D/5-D outputs are handed on in NCHW strides (a copy), so the code that
  consumes them (the parent's ``forward`` or the step's loss) sees the layout it assumes;
* ``"module"``: the module runs in NCHW: its inputs and its own parameters and buffers in NCHW strides,
  and the gradients arriving at its outputs too (a custom backward sees NCHW); the rest of the
  model keeps its layout;
* ``"weights"``: the 4-D/5-D parameters of the module and its submodules stay in NCHW strides, so their
  gradients and optimizer state do too (for an optimizer, gradient hook or clipping code that flattens or
  reads a gradient as NCHW); inputs and activations keep channels_last, where the speed is;
* ``"model"``: the whole model stays contiguous (the caller changes the model's layout; nothing here).

A model holding compiled code has its compiled graphs dropped (``torch._dynamo.reset()``) when a
fallback is applied: hooks added after compilation are not traced otherwise.

The hooks are module-level functions, so a model with fallbacks still deep-copies and pickles;
``state_dict`` keys and values are unchanged.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cltrain.layout import nchw, to_contiguous
from cltrain.layout.tensors import is_compiled

__all__ = ["Fallback", "apply_fallbacks", "map_images"]

_KINDS = ("outputs", "module", "weights", "model")


def _is_image(t: Any, ranks: tuple[int, ...] | None) -> bool:
    return (isinstance(t, torch.Tensor) and (ranks is None or t.dim() in ranks) and t.is_floating_point()
            and t.layout is torch.strided)


def map_images(obj: Any, fn: Any, ranks: tuple[int, ...] | None = (4, 5)) -> Any:
    """``obj`` with ``fn`` applied to every floating tensor of a rank in ``ranks`` (``None``: any) in it,
    through tuples, named tuples, lists and dicts."""
    if _is_image(obj, ranks):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_images(v, fn, ranks) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_images(v, fn, ranks) for v in obj)
    if isinstance(obj, dict):
        try:
            return type(obj)((k, map_images(v, fn, ranks)) for k, v in obj.items())
        except TypeError:
            return {k: map_images(v, fn, ranks) for k, v in obj.items()}
    return obj


def _nchw_grad(t: torch.Tensor) -> torch.Tensor:
    if t.requires_grad:
        t.register_hook(nchw)
    return t


def _outputs_nchw(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """Forward hook: the module's image outputs in NCHW strides."""
    return map_images(output, nchw)


def _inputs_nchw(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Forward pre-hook: the module's image inputs (positional and keyword) in NCHW strides."""
    return map_images(args, nchw), map_images(kwargs, nchw)


def _output_grads_nchw(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    """Forward hook: the gradients that will arrive at the module's image outputs, in NCHW strides."""
    map_images(output, _nchw_grad)


@dataclass(frozen=True)
class Fallback:
    """One part of the model that runs in NCHW.

    Attributes:
        kind: ``"outputs"`` (the module's outputs handed on in NCHW), ``"module"`` (the module runs in
            NCHW), ``"weights"`` (the module's 4-D/5-D parameters stay NCHW) or ``"model"`` (the whole
            model stays contiguous).
        module: the module's qualified name (``""``: the model itself).
        group: the class name when the same fallback was applied to every instance of a class (for the log
            line; not part of equality).
    """

    kind: str
    module: str
    group: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Fallback(kind={self.kind!r}): expected one of {_KINDS}.")

    def describe(self) -> str:
        """What it does, in a few words."""
        name = f"`{self.module}`" if self.module else "the model"
        if self.kind == "outputs":
            return f"the outputs of {name} are handed on in NCHW"
        if self.kind == "module":
            return f"{name} runs in NCHW"
        if self.kind == "weights":
            return f"the weights of {name} stay NCHW (activations channels_last)"
        return "the whole model stays contiguous (NCHW)"

    def as_dict(self) -> dict[str, str]:
        """Plain types, for ``metrics.json``."""
        return {"kind": self.kind, "module": self.module, **({"group": self.group} if self.group else {})}


def _register_once(module: nn.Module, kind: str, hook: Any, **options: Any) -> None:
    hooks = module._forward_pre_hooks if kind == "pre" else module._forward_hooks
    if any(h is hook for h in hooks.values()):
        return
    if kind == "pre":
        module.register_forward_pre_hook(hook, **options)
    else:
        module.register_forward_hook(hook, **options)


def apply_fallbacks(model: nn.Module, fallbacks: list[Fallback]) -> None:
    """Apply the ``"outputs"`` and ``"module"`` fallbacks to ``model``'s modules, in place (idempotent).

    A ``"model"`` fallback is the caller's to apply (it changes the model's layout, and the batches').

    Raises:
        KeyError: a fallback names a module that ``model`` does not have.
    """
    modules = dict(model.named_modules())
    for fallback in fallbacks:
        if fallback.kind == "model":
            continue
        if fallback.module not in modules:
            raise KeyError(f"apply_fallbacks: {type(model).__name__} has no module named {fallback.module!r}.")
        module = modules[fallback.module]
        if fallback.kind == "outputs":
            _register_once(module, "post", _outputs_nchw)
        elif fallback.kind == "weights":
            for param in module.parameters():
                if param.dim() in (4, 5) and param.stride() != nchw(param).stride():
                    param.data = nchw(param.data)
        else:
            to_contiguous(module)
            _register_once(module, "pre", _inputs_nchw, with_kwargs=True)
            _register_once(module, "post", _output_grads_nchw)
    if any(f.kind != "model" for f in fallbacks) and is_compiled(model):
        sys.modules["torch._dynamo"].reset()
