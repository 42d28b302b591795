"""The base of cltrain's ``TorchFunctionMode``s (the input trace, the check's same randomness): a warning raised by
an op the mode runs names the user's line, not the mode's.

Under a function mode every torch call passes through the mode's ``__torch_function__`` frame, so a warning torch
raises from C++ (``float(loss)`` on a tensor needing grad) or with ``stacklevel=2`` would name that frame
(``cltrain/layout/conv_reach.py``). While a mode is entered, such a warning is raised at the first frame outside
cltrain and torch instead, with that module's filters and once-only registry, so the run's later steps, which run
without the mode, do not show it a second time.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["UserFrameMode"]

_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # cltrain/
_STDLIB = os.path.dirname(os.path.abspath(warnings.__file__))
#: frames passed over on the way to the user's: cltrain's, torch's, and the warnings machinery's (``_py_warnings``)
_PASSED = (_OURS, os.path.dirname(os.path.abspath(torch.__file__)), os.path.join(_STDLIB, "warnings.py"),
           os.path.join(_STDLIB, "_py_warnings.py"))
_modes: set[str] = set()  # the files of the modes' __torch_function__ (a warning there is the user's)
_state = {"depth": 0, "previous": None}  # the modes entered now; the showwarning ``_show`` replaced (never itself)


def _user_frame() -> Any:
    frame = sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PASSED):
        frame = frame.f_back
    return frame


def _show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
          line: str | None = None) -> None:
    previous = _state["previous"] or warnings._showwarning_orig  # type: ignore[attr-defined]
    where = os.path.abspath(filename)
    frame = _user_frame() if _state["depth"] and where in _modes else None
    if frame is None:  # not under a mode (this hook left in place by a catch_warnings): as before
        previous(message, category, filename, lineno, file, line)
        return
    scope = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=scope.get("__name__"), registry=scope.setdefault("__warningregistry__", {}),
                           module_globals=scope)


class UserFrameMode(TorchFunctionMode):
    """A ``TorchFunctionMode`` whose ops' warnings name the user's line (see the module docstring)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _modes.add(os.path.abspath(sys.modules[cls.__module__].__file__))

    def __enter__(self) -> Any:
        if warnings.showwarning is not _show:
            _state["previous"] = warnings.showwarning
            warnings.showwarning = _show
        _state["depth"] += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _state["depth"] = max(0, _state["depth"] - 1)
            if not _state["depth"] and warnings.showwarning is _show:
                warnings.showwarning = _state["previous"] or warnings._showwarning_orig  # type: ignore[attr-defined]
