"""What a class's constructor takes, and whether a value fits a type hint: for ``trainer.*`` keys beyond the schema.

Any argument of Lightning's ``Trainer`` (or of ``trainer._target_``) passes through under ``trainer.*``
by its own name (``+trainer.detect_anomaly=true``); ``cltrain.app.config.check`` asks
``constructor_arguments`` whether it exists and ``fits_hint`` whether its value has the argument's type.

Example::

    >>> fits_hint(3, int | None), fits_hint("3", int | None)
    (True, False)
"""

from __future__ import annotations

import importlib
import inspect
import types
import typing
from functools import cache
from typing import Any, Union

from omegaconf import ListConfig

__all__ = ["constructor_arguments", "fits_hint"]

_NONE = type(None)
_UNIONS = (Union, types.UnionType)  # Optional[X] and X | None


@cache
def constructor_arguments(target: str | None) -> dict[str, Any]:
    """Constructor argument -> type hint of the class at dotted path ``target``; empty if it does not import."""
    if target is None:
        return {}
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        params = inspect.signature(cls).parameters
    except (ImportError, AttributeError, ValueError, TypeError):
        return {}
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - unresolvable annotations: names only
        hints = {}
    return {p: hints.get(p, Any) for p in params if p not in ("self", "args", "kwargs")}


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
