"""Where a fault found by ``cltrain.check.compare`` is: the user's file and line, the fallbacks to try for it,
smallest first, and the same fallback for every instance of the faulty module's class."""

from __future__ import annotations

import functools
import inspect
import os
import site
import sys
import sysconfig
import traceback
from typing import Any

from torch import nn

from cltrain.check.fallback import Fallback

__all__ = ["candidates", "class_wide", "first_line", "method_source", "place", "source_of", "user_frame"]

_PASS_THROUGH = ("__torch_function__", "__torch_dispatch__")
_FRAMEWORKS = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities", "cltrain")


@functools.lru_cache(maxsize=1)
def _install_roots() -> tuple[str, ...]:
    """The folders packages are installed into (site-packages of this interpreter and the user's), deepest first."""
    roots = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    roots |= set(getattr(site, "getsitepackages", lambda: [])())
    if site.ENABLE_USER_SITE:
        roots.add(site.getusersitepackages())
    return tuple(sorted({os.path.realpath(r) + os.sep for r in roots}, key=len, reverse=True))


def _framework_dirs() -> tuple[str, ...]:
    """Where torch, Lightning and cltrain really are (imported modules' folders), and the standard library."""
    dirs = [os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep]
    for name in _FRAMEWORKS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(os.path.realpath(os.path.dirname(module.__file__)) + os.sep)
    return tuple(dirs)


def place(filename: str, line: int) -> tuple[str, str | None]:
    """``(file:line as shown, the installed package it is in or None)``: a file in an installed package is shown
    from the package's folder (``lightly/models/batchnorm.py:62``), one under the working directory relative to it,
    any other in full. Installed means under this interpreter's site-packages, never a folder's name."""
    path = os.path.realpath(filename)
    for root in _install_roots():
        if path.startswith(root):
            rest = path[len(root):]
            return f"{rest}:{line}", rest.split(os.sep)[0].removesuffix(".py")
    cwd = os.path.realpath(os.getcwd()) + os.sep
    return f"{path[len(cwd):] if path.startswith(cwd) else path}:{line}", None


def user_frame(error: BaseException) -> tuple[str, str | None] | None:
    """``place`` of the innermost frame of ``error``'s traceback outside torch, Lightning, cltrain and the standard
    library (by where those packages really are), and outside an installed tensor subclass's ``__torch_function__``
    (the pass-through of every op on a ``torchvision.tv_tensors.Image``), or ``None``."""
    frameworks = _framework_dirs()
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.filename.startswith("<"):
            continue
        where, package = place(frame.filename, frame.lineno or 0)
        if package in _FRAMEWORKS or package is None and os.path.realpath(frame.filename).startswith(frameworks):
            continue
        if package is not None and frame.name in _PASS_THROUGH:  # an installed tensor subclass's pass-through
            continue
        return where, package
    return None


def source_of(model: nn.Module, name: str | None, step_owner: Any) -> tuple[str, str | None] | None:
    """``place`` of module ``name``'s ``forward`` (``None``: ``step_owner``'s ``training_step``); where that is in an
    installed package and the module has code of the user's own (a ``forward`` set on the instance, a forward or
    backward hook registered on it), that code's: a fault there is the user's to fix, not the package's."""
    target = dict(model.named_modules()).get(name) if name is not None else step_owner
    if target is None:
        return None
    found = method_source(target, "forward" if name is not None else "training_step")
    if name is not None and found is not None and found[1] is not None:
        own_forward = [vars(target)["forward"]] if callable(vars(target).get("forward")) else []
        hooks = [*own_forward, *target._forward_pre_hooks.values(), *target._forward_hooks.values(),
                 *target._backward_pre_hooks.values(), *target._backward_hooks.values()]
        own = [at for at in map(_hook_place, hooks) if at is not None and at[1] is None]
        found = own[0] if own else found
    return found


def _hook_place(hook: Any) -> tuple[str, str | None] | None:
    """``place`` of a hook's code (a function, a ``functools.partial``, a method or a callable object), ``None``
    for cltrain's, torch's or Lightning's own or one without source."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    code = hook if inspect.isfunction(hook) or inspect.ismethod(hook) else getattr(type(hook), "__call__", None)
    try:
        code = inspect.unwrap(code)
        filename = inspect.getsourcefile(code)
        if filename is None or os.path.realpath(filename).startswith(_framework_dirs()):
            return None
        return place(filename, inspect.getsourcelines(code)[1])
    except (TypeError, OSError, ValueError):
        return None


def method_source(obj: Any, method: str) -> tuple[str, str | None] | None:
    """``place`` of where ``type(obj).<method>`` (or the class) is defined."""
    try:
        code = getattr(type(obj), method, None) or type(obj)
        code = inspect.unwrap(code)
        return place(inspect.getsourcefile(code), inspect.getsourcelines(code)[1])
    except (TypeError, OSError, ValueError):
        return None


def first_line(error: BaseException) -> str:
    """The exception's type and the first line of its message (at most 160 characters)."""
    text = [line for line in str(error).strip().splitlines() if line.strip()]
    if text and text[0].startswith("The following operation failed in the TorchScript interpreter"):
        text = [text[-1].split(": ", 1)[-1]]  # TorchScript puts its own traceback first and the error last
    if not text:
        return type(error).__name__
    line = text[0].strip()
    if len(line) > 160:  # at a word boundary, with an ellipsis: not "this may b"
        line = line[:159].rsplit(" ", 1)[0].rstrip(" ;,.(") + "…"
    return f"{type(error).__name__}: {line}"


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
