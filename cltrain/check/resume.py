"""The first-batch check's verdict carried in a checkpoint: a resumed run with the same model, step and precision
applies it without paying the check again; anything else is checked again.

What decides "the same" (``run_fingerprint``): the LightningModule's class, every parameter's name, shape and dtype,
the code of the module's ``forward`` and step methods (their bytecode and constants, so an edit to the step shows),
the Trainer's precision, the device type and torch's version. A checkpoint written before this carried nothing,
and its run is checked as a new one.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from cltrain.check.fallback import Fallback
from cltrain.check.result import LayoutCheck

__all__ = ["restored_check", "run_fingerprint", "saved_check"]

_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")
RESTORED = "the verdict of the checkpoint resumed from (the same model, step and precision)"


def _code(obj: Any) -> str:
    code = getattr(getattr(obj, "__func__", obj), "__code__", None)
    if code is None:
        return ""
    consts = [c for c in code.co_consts if not hasattr(c, "co_code")]
    return code.co_code.hex() + repr(consts) + "".join(_code_of(c) for c in code.co_consts if hasattr(c, "co_code"))


def _code_of(code: Any) -> str:
    return code.co_code.hex() + repr([c for c in code.co_consts if not hasattr(c, "co_code")])


def run_fingerprint(trainer: Any, pl_module: torch.nn.Module) -> str:
    """A digest of what the check's verdict depends on (the module docstring)."""
    parts = [type(pl_module).__module__, type(pl_module).__qualname__, str(trainer.precision),
             trainer.strategy.root_device.type, torch.__version__]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in pl_module.named_parameters()]
    parts += [_code(getattr(type(pl_module), m, None)) for m in _METHODS]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def saved_check(check: LayoutCheck) -> dict[str, Any]:
    """What a checkpoint keeps of ``check``: the verdict, the fallbacks, the reason and the notes."""
    return {"verdict": check.verdict, "reason": check.reason, "notes": list(check.notes),
            "fallbacks": [[f.kind, f.module, f.group] for f in check.fallbacks]}


def restored_check(saved: dict[str, Any]) -> LayoutCheck:
    """The ``LayoutCheck`` ``saved_check`` kept, its line saying where it came from."""
    return LayoutCheck(saved["verdict"], fallbacks=tuple(Fallback(*f) for f in saved.get("fallbacks", ())),
                       reason=saved.get("reason"), notes=(*saved.get("notes", ()), RESTORED))
