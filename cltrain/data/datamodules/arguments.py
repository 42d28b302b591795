"""A DataModule's arguments from its settings groups: its signature, and its call bound to the groups.

``signature_of(groups)`` is ``(self, root, <every field of the groups>)``, what ``inspect``, ``help`` and
LightningCLI read (``BatchDataModule`` gives each subclass the signature of its ``settings``);
``bind_settings`` makes each group of a call's arguments (or takes it whole, ``augmentation=Augmentation(...)``),
so a bad value is one line naming the DataModule.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import re
import typing
from collections.abc import Sequence
from typing import Any

from cltrain.data import source_settings
from cltrain.data.augment_group import Augmentation

__all__ = ["POSITIONAL", "WHOLE", "bind_settings", "default_of", "signature_of"]

#: The groups a DataModule also takes whole, by their key (``augmentation=Augmentation(...)``).
WHOLE: tuple[type, ...] = (Augmentation,)
#: The arguments after ``root`` that may also be given by position (``ImageFolderDataModule(root, 32)``).
POSITIONAL = ("batch_size", "num_workers", "persistent_workers", "pin_memory")


def default_of(group: type, name: str) -> Any:
    """The default of field ``name`` of ``group`` (``inspect.Parameter.empty`` when it has none)."""
    f = next(f for f in dataclasses.fields(group) if f.name == name)
    return inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default


def signature_of(groups: Sequence[type]) -> inspect.Signature:
    """``(self, root, <every field of groups>)``: a DataModule's signature, as ``inspect``, ``help`` and
    LightningCLI read it. ``POSITIONAL`` fields may also be given by position; a group of ``WHOLE`` is
    also taken whole, by its key, before its fields."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD), P("root", P.POSITIONAL_OR_KEYWORD, annotation=str | os.PathLike)]
    for group in groups:
        hints = typing.get_type_hints(group)
        if group in WHOLE:
            params.append(P(group.key, P.KEYWORD_ONLY, default=None, annotation=group | None))
        for f in dataclasses.fields(group):
            kind = P.POSITIONAL_OR_KEYWORD if f.name in POSITIONAL else P.KEYWORD_ONLY
            params.append(P(f.name, kind, default=default_of(group, f.name), annotation=hints[f.name]))
    return inspect.Signature(params)


def _instead(owner: str, message: str, signature: inspect.Signature) -> str:
    """For an argument ``owner`` does not take: the one of its own that is spelled nearly so, or the DataModules that
    take it (a settings group's first line names them)."""
    name = re.search(r"unexpected keyword argument '(\w+)'", message)
    if name is None:
        return ""
    takers = [taker for group in vars(source_settings).values()
              if isinstance(group, type) and dataclasses.is_dataclass(group)
              and name[1] in {f.name for f in dataclasses.fields(group)}
              for taker in re.findall(r"``(\w+Module)``", (group.__doc__ or "").split("\n\n")[0])]
    if takers:
        return f": an option of {', '.join(dict.fromkeys(takers))}, not of {owner}"
    close = difflib.get_close_matches(name[1], [p for p in signature.parameters if p not in ("self", "root")], n=1)
    return f"; did you mean {close[0]}?" if close else ""


def _differs(value: Any, default: Any) -> bool:
    if isinstance(value, Sequence) and not isinstance(value, str) and isinstance(default, Sequence):
        return tuple(value) != tuple(default)
    return value != default


def bind_settings(owner: str, groups: Sequence[type], args: tuple, kwargs: dict[str, Any]
                  ) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """``(root, values, made)`` of a DataModule's call: every argument by name (defaults filled in) and each
    group made from its fields (by its ``key``), or taken whole.

    Raises:
        TypeError: an argument it does not take, or a group of the wrong type (one line naming ``owner``).
        ValueError: a bad value, or a group given whole and by some of its fields too (one line naming ``owner``).
    """
    signature = signature_of(groups)
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError as err:  # Python's message: name the class called, and what it takes instead
        raise TypeError(f"{owner}: {err}{_instead(owner, str(err), signature)}") from None
    bound.apply_defaults()
    values = dict(bound.arguments)
    values.pop("self")
    root = values.pop("root")
    made: dict[str, Any] = {}
    for group in groups:
        names = [f.name for f in dataclasses.fields(group)]
        whole = values.pop(group.key, None) if group in WHOLE else None
        if whole is not None:
            if not isinstance(whole, group):
                raise TypeError(f"{owner}: {group.key}={whole!r} must be a cltrain.data.{group.__name__}.")
            changed = sorted(n for n in names if _differs(values[n], default_of(group, n)))
            if changed:
                raise ValueError(f"{owner}: pass {', '.join(changed)} inside {group.key}={group.__name__}(...), "
                                 f"or leave {group.key} out; not both.")
            made[group.key] = whole
        else:
            try:
                made[group.key] = group(**{n: values[n] for n in names})
            except ValueError as err:  # "<Group>: name=value ...": the DataModule's name instead
                raise ValueError(f"{owner}: {re.sub(r'^[A-Z][A-Za-z]*: ', '', str(err))}") from None
        values.update({n: getattr(made[group.key], n) for n in names})
    return root, values, made
