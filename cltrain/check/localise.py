"""Where a fault found by ``cltrain.check.compare`` is: the user's file and line, the fallbacks to try for it,
smallest first, and the same fallback for every instance of the faulty module's class."""

from __future__ import annotations

import contextlib
import inspect
import os
import traceback
from typing import Any

from torch import nn

from cltrain.check.fallback import Fallback

__all__ = ["candidates", "class_wide", "first_line", "method_source", "source_of", "user_frame"]

# Frames in these folders are not the user's code (the finding names the innermost frame outside them).
_LIBRARY_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}lightning{os.sep}", f"{os.sep}lightning_fabric{os.sep}",
                  f"{os.sep}pytorch_lightning{os.sep}", f"{os.sep}cltrain{os.sep}",
                  os.path.dirname(contextlib.__file__) + os.sep)


def user_frame(error: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``error``'s traceback outside torch, Lightning and cltrain."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        if not any(part in frame.filename for part in _LIBRARY_PARTS) and not frame.filename.startswith("<"):
            return f"{frame.filename}:{frame.lineno}"
    return None


def source_of(model: nn.Module, name: str | None, step_owner: Any) -> str | None:
    """``file:line`` of module ``name``'s ``forward`` (``None``: ``step_owner``'s ``training_step``)."""
    target = dict(model.named_modules()).get(name) if name is not None else step_owner
    if target is None:
        return None
    return method_source(target, "forward" if name is not None else "training_step")


def method_source(obj: Any, method: str) -> str | None:
    """``file:line`` where ``type(obj).<method>`` (or the class) is defined."""
    try:
        code = getattr(type(obj), method, None) or type(obj)
        code = inspect.unwrap(code)
        return f"{inspect.getsourcefile(code)}:{inspect.getsourcelines(code)[1]}"
    except (TypeError, OSError, ValueError):
        return None


def first_line(error: BaseException) -> str:
    """The exception's type and the first line of its message (at most 160 characters)."""
    text = [line for line in str(error).strip().splitlines() if line.strip()]
    if text and text[0].startswith("The following operation failed in the TorchScript interpreter"):
        text = [text[-1].split(": ", 1)[-1]]  # TorchScript puts its own traceback first and the error last
    return f"{type(error).__name__}: {text[0].strip()[:160]}" if text else type(error).__name__


def candidates(context: tuple[str | None, str | None], phase: str) -> list[Fallback]:
    """The fallbacks to try for a fault in ``context``'s code, smallest first.

    After the backward (an optimizer, clipping or a gradient hook reading every gradient alike) the
    weights stay NCHW and the activations channels_last: one run instead of one per layer."""
    module, before = context
    found: list[Fallback] = []
    if phase != "update":
        if before is not None:
            found.append(Fallback("outputs", before))
        name = module
        while name is not None and name != "":
            found.append(Fallback("module", name))
            name = name.rpartition(".")[0] if "." in name else None
    if phase in ("update", "backward"):
        found.append(Fallback("weights", ""))
    found.append(Fallback("model", ""))
    return found


def _owner(fallback: Fallback, faulty: str) -> tuple[str, str] | None:
    """``(the faulty module, the fallback's path relative to it)`` when the fallback is inside it."""
    if fallback.module == faulty:
        return faulty, ""
    if fallback.module.startswith(faulty + "."):
        return faulty, fallback.module[len(faulty):]
    return None


def class_wide(model: nn.Module, fallback: Fallback, faulty: str | None) -> list[Fallback]:
    """The same fallback for every other instance of the faulty module's class (a class defined outside
    torch), at the same place inside each; ``[]`` when there is none."""
    if not faulty or fallback.kind not in ("outputs", "module"):
        return []
    relative = _owner(fallback, faulty)
    modules = dict(model.named_modules())
    cls = type(modules.get(faulty))
    if relative is None or cls.__module__.startswith("torch."):
        return []
    others = []
    for name, module in modules.items():
        if type(module) is cls and name != faulty and f"{name}{relative[1]}" in modules:
            others.append(Fallback(fallback.kind, f"{name}{relative[1]}", group=cls.__name__))
    return others
