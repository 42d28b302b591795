"""What a class's constructor takes, and whether a value fits a type hint: for ``trainer.*`` keys beyond the schema
and the keys of a ``callbacks`` or ``logger`` entry.

Any argument of Lightning's ``Trainer`` (or of ``trainer._target_``) passes through under ``trainer.*``
by its own name (``+trainer.detect_anomaly=true``); ``cltrain.app.config.check`` asks
``constructor_arguments`` whether it exists and ``fits_hint`` whether its value has the argument's type.
``unknown_argument`` names a key an entry's class does not take (``callbacks.early_stopping.patiense``), with the
closest it does, whether the key was typed or added with ``+``.

Example::

    >>> fits_hint(3, int | None), fits_hint("3", int | None)
    (True, False)
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import types
import typing
from functools import cache
from typing import Any, Union

from omegaconf import ListConfig

from cltrain.app.config.errors import ConfigError

__all__ = ["constructor_arguments", "fits_hint", "unknown_argument"]

_NONE = type(None)
_UNIONS = (Union, types.UnionType)  # Optional[X] and X | None


def _parameters(target: str | None) -> tuple[type | None, dict[str, inspect.Parameter]]:
    """The class at dotted path ``target`` and its constructor's parameters; ``(None, {})`` if it does not import."""
    if not isinstance(target, str):
        return None, {}
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        return cls, dict(inspect.signature(cls).parameters)
    except (ImportError, AttributeError, ValueError, TypeError):
        return None, {}


@cache
def constructor_arguments(target: str | None) -> dict[str, Any]:
    """Constructor argument -> type hint of the class at dotted path ``target``; empty if it does not import."""
    cls, params = _parameters(target)
    if cls is None:
        return {}
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - unresolvable annotations: names only
        hints = {}
    return {p: hints.get(p, Any) for p in params if p not in ("self", "args", "kwargs")}


def unknown_argument(key: str, value: Any, target: Any) -> ConfigError | None:
    """The error for ``key`` (``callbacks.early_stopping.patiense``) in an entry that builds ``target``, where the
    class takes no keyword of that name: the closest it takes, and all of them. ``None`` where the class takes it, takes
    any keyword (``**kwargs``) or does not import (building it says why)."""
    parent, _, name = key.rpartition(".")
    cls, params = _parameters(target)
    if cls is None or name.startswith("_") or name in params \
            or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    names = sorted(n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY))
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    reason = f"not an argument of {cls.__name__}" + (f"; did you mean {parent}.{close[0]}?" if close else "")
    return ConfigError(key, value, reason, ", ".join(names))


def fits_hint(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the simple type ``hint`` (bool, int, float, str, None, Literal, Optional,
    Union, list of those); a hint it cannot judge (a class, a timedelta) lets anything through."""
    origin = typing.get_origin(hint)
    if origin in _UNIONS:
        return any(fits_hint(value, a) for a in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin is list:
        item = typing.get_args(hint)[0] if typing.get_args(hint) else Any
        return isinstance(value, (list, ListConfig)) and all(fits_hint(v, item) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is _NONE:
        return value is None
    return True  # a class, a timedelta, a mapping: Lightning checks it
