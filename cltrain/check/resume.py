"""The first-batch check's verdict carried in a checkpoint: a resumed run with the same model, step and precision
applies it without paying the check again; anything else is checked again.

What decides "the same" (``run_fingerprint``): the model's class, every parameter's name, shape and dtype, the code of
the model's ``forward`` and of the step code the front door names (a LightningModule's step methods, a loop's
``step`` function: their bytecode and constants, so an edit to the step shows), the precision, the device type and
torch's version. A checkpoint that carries nothing is checked as a new run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

from cltrain.check.fallback import Fallback
from cltrain.check.result import LayoutCheck

__all__ = ["RESTORED", "restored_check", "run_fingerprint", "saved_check"]

RESTORED = "the verdict of the checkpoint resumed from (the same model, step and precision)"


def _code(obj: Any) -> str:
    code = getattr(getattr(obj, "__func__", obj), "__code__", None)
    if code is None:
        return ""
    consts = [c for c in code.co_consts if not hasattr(c, "co_code")]
    return code.co_code.hex() + repr(consts) + "".join(_code_of(c) for c in code.co_consts if hasattr(c, "co_code"))


def _code_of(code: Any) -> str:
    return code.co_code.hex() + repr([c for c in code.co_consts if not hasattr(c, "co_code")])


def run_fingerprint(model: torch.nn.Module, *, precision: str, device: str, code: Iterable[Any] = ()) -> str:
    """A digest of what the check's verdict depends on (the module docstring): ``model``, the ``precision`` it trains
    in, the ``device`` type, and the step ``code`` (functions or methods) around it."""
    parts = [type(model).__module__, type(model).__qualname__, str(precision), str(device), torch.__version__]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters()]
    parts += [_code(getattr(type(model), "forward", None))] + [_code(c) for c in code]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def saved_check(check: LayoutCheck) -> dict[str, Any]:
    """What a checkpoint keeps of ``check``: the verdict, the fallbacks, the reason and the notes."""
    return {"verdict": check.verdict, "reason": check.reason, "notes": list(check.notes),
            "fallbacks": [[f.kind, f.module, f.group] for f in check.fallbacks]}


def restored_check(saved: dict[str, Any]) -> LayoutCheck:
    """The ``LayoutCheck`` ``saved_check`` kept, its line saying where it came from."""
    return LayoutCheck(saved["verdict"], fallbacks=tuple(Fallback(*f) for f in saved.get("fallbacks", ())),
                       reason=saved.get("reason"),  # said once, however many resumes the verdict went through
                       notes=(*(n for n in saved.get("notes", ()) if n != RESTORED), RESTORED))
