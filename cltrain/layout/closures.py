"""Functions that hold an original object, made to hold its copy: what makes a deep copy of a module true.

``copy.deepcopy`` copies a module's tensors and submodules but shares its functions: a ``forward`` replaced by a
closure over the original module (``orig = m.forward; m.forward = lambda x: post(orig(x))``), a
``functools.partial`` over it, a wrapper taking the original's method as a default argument
(``def new_forward(self, x, fn=fn)``), or a hook closing over it still runs the original from the copy.

* ``rebound(value, memo)``: ``value`` with every original object it holds in a closure cell, a default, a
  module-level name it reads, a partial's arguments or a bound method's ``self`` replaced by its copy (``memo``:
  ``deepcopy``'s map, original id -> copy), recursively through nested functions; ``value`` itself where it holds
  none. An object that is no copy but holds originals (a callback whose method or closure is a hook on the model,
  holding the module) is replaced by a shallow copy of it whose attributes hold the copies (a callback's
  ``self.module``).
* ``callables_of(module)``: where a module keeps callables (its ``__dict__``, its hooks), for both of the above.
* ``path_to(roots, targets)``: the first path from the callables of ``roots`` to an object in ``targets`` (by id),
  through closures, defaults, partials, bound methods and plain containers: what a copy still reaches of the
  original.
"""

from __future__ import annotations

import copy
import dis
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["callables_of", "path_to", "rebound"]

_LARGE = 256  # a container with more items than this is not searched for originals
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_load_state_dict_pre_hooks")


def callables_of(module: nn.Module) -> Iterator[tuple[str, Any, Any, Any]]:
    """``(label, container, key, value)`` for each callable a module keeps: instance attributes and hooks."""
    for key, value in list(vars(module).items()):
        if callable(value) and not isinstance(value, (nn.Module, type)) and not hasattr(value, "__torch_function__"):
            yield key, vars(module), key, value
    for dict_name in _HOOK_DICTS:
        hooks = getattr(module, dict_name, None)
        if isinstance(hooks, dict):
            for key, value in list(hooks.items()):
                yield f"{dict_name.strip('_')}[{key}]", hooks, key, value


def rebound(value: Any, memo: dict[int, Any], _done: dict[int, Any] | None = None) -> Any:
    """``value`` holding copies (``memo``) where it held originals; see the module docstring."""
    done = {} if _done is None else _done
    if id(value) in memo:
        return memo[id(value)]
    if id(value) in done:
        return done[id(value)]
    if isinstance(value, types.MethodType):
        owner = memo[id(value.__self__)] if id(value.__self__) in memo else _rebound_object(value.__self__, memo, done)
        func = rebound(value.__func__, memo, done)
        return value if owner is value.__self__ and func is value.__func__ else types.MethodType(func, owner)
    if type(value) is functools.partial:  # a subclass may rebuild itself otherwise: left to path_to
        func = rebound(value.func, memo, done)
        args = tuple(rebound(a, memo, done) for a in value.args)
        kwargs = {k: rebound(v, memo, done) for k, v in value.keywords.items()}
        if func is value.func and all(a is b for a, b in zip(args, value.args)) \
                and all(kwargs[k] is v for k, v in value.keywords.items()):
            return value
        return functools.partial(func, *args, **kwargs)
    if isinstance(value, types.FunctionType):
        return _rebound_function(value, memo, done)
    return _rebound_object(value, memo, done)


def _rebound_object(obj: Any, memo: dict[int, Any], done: dict[int, Any], depth: int = 2) -> Any:
    """A shallow copy of ``obj`` whose attributes (and the items of its plain lists, tuples and dicts) that are
    originals, or objects holding originals (``depth`` levels), are their copies; ``obj`` itself where none is."""
    if id(obj) in memo:
        return memo[id(obj)]
    if id(obj) in done:
        return done[id(obj)]
    attrs = getattr(obj, "__dict__", None)
    if depth == 0 or not isinstance(attrs, dict) or isinstance(obj, (nn.Module, torch.Tensor, type, types.ModuleType,
                                                                     types.FunctionType, types.MethodType)):
        return obj
    done[id(obj)] = obj  # a cycle back to it keeps it until it is known to change

    def remapped(value: Any) -> Any:
        if id(value) in memo:
            return memo[id(value)]
        if isinstance(value, (list, tuple, dict)) and len(value) > _LARGE:
            return value  # data, not a holder of the model (path_to names it if it reaches one)
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            items = [remapped(v) for v in value]
            return value if all(a is b for a, b in zip(items, value)) else type(value)(items)
        if type(value) is dict:
            items = {k: remapped(v) for k, v in value.items()}
            return value if all(items[k] is v for k, v in value.items()) else items
        if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
            return rebound(value, memo, done)
        return _rebound_object(value, memo, done, depth - 1)

    changed = {k: new for k, v in list(attrs.items()) if (new := remapped(v)) is not v}
    if not changed:
        return obj
    try:
        clone = copy.copy(obj)
        vars(clone).update(changed)
    except Exception:  # noqa: BLE001 - an object that cannot be copied: path_to names it
        return obj
    done[id(obj)] = clone
    return clone


def _rebound_function(fn: types.FunctionType, memo: dict[int, Any], done: dict[int, Any]) -> types.FunctionType:
    cells = fn.__closure__ or ()
    contents = [_cell_value(c) for c in cells]
    done[id(fn)] = fn  # a function that holds itself (recursion) keeps itself until it is known to change
    new_contents = [rebound(v, memo, done) if v is not _EMPTY else v for v in contents]
    defaults = tuple(rebound(d, memo, done) for d in fn.__defaults__ or ())
    kwdefaults = {k: rebound(v, memo, done) for k, v in (fn.__kwdefaults__ or {}).items()}
    wrapped = getattr(fn, "__wrapped__", None)
    new_wrapped = rebound(wrapped, memo, done) if wrapped is not None else None
    scope, (read, writes) = fn.__globals__, _globals_used(fn.__code__)
    # a function that writes a module-level name keeps the module's own (a copy of them would hide its writes)
    names = {} if writes else {name: rebound(scope[name], memo, done) for name in read if name in scope}
    names = {name: value for name, value in names.items() if value is not scope[name]}
    unchanged = (all(a is b for a, b in zip(new_contents, contents))
                 and all(a is b for a, b in zip(defaults, fn.__defaults__ or ()))
                 and all(kwdefaults[k] is v for k, v in (fn.__kwdefaults__ or {}).items())
                 and new_wrapped is wrapped and not names)
    if unchanged:
        return fn
    new_cells = tuple(types.CellType() for _ in cells)
    # a module-level name that holds an original (``orig = m.forward`` in a script or a notebook): its copy, in one
    # copy of the module's globals per model copy (``memo``), shared by every function of that module rebound for it
    space = scope
    if names:
        key: Any = ("globals", id(scope))
        space = memo.get(key)
        if space is None:
            space = memo[key] = dict(scope)
        space.update(names)
    copy_ = types.FunctionType(fn.__code__, space, fn.__name__, defaults or None, new_cells or None)
    if names:  # a function that calls itself by its module-level name calls its copy
        space.update({name: copy_ for name in read if scope.get(name) is fn})
    done[id(fn)] = copy_
    for cell, value in zip(new_cells, new_contents):  # filled after: a cell may hold the function itself
        if value is not _EMPTY:
            cell.cell_contents = copy_ if value is fn else value
    copy_.__kwdefaults__ = kwdefaults or None
    copy_.__dict__.update(fn.__dict__)
    if new_wrapped is not None:
        copy_.__wrapped__ = new_wrapped
    copy_.__qualname__, copy_.__module__, copy_.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return copy_


_EMPTY = object()


def _globals_used(code: types.CodeType) -> tuple[set[str], bool]:
    """The module-level names ``code`` reads (its own and its nested functions': a lambda inside it), and whether
    it writes one (``global x; x = ...``)."""
    read, writes = set(), False
    for instruction in dis.get_instructions(code):
        if instruction.opname == "LOAD_GLOBAL":
            read.add(instruction.argval)
        writes = writes or instruction.opname in ("STORE_GLOBAL", "DELETE_GLOBAL")
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner, inner_writes = _globals_used(const)
            read, writes = read | inner, writes or inner_writes
    return read, writes


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name not yet bound)
        return _EMPTY


def path_to(roots: list[tuple[str, nn.Module]], targets: set[int], depth: int = 6) -> str | None:
    """The first path (``"encoder.forward -> closure 'fn' -> ..."``) from the callables of the named modules
    ``roots`` to an object whose id is in ``targets``, or ``None``."""
    for name, module in roots:
        for label, _, _, value in callables_of(module):
            found = _search(value, targets, depth, set())
            if found is not None:
                return " -> ".join([f"{name}.{label}" if name else label, *found])
    return None


def _children(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, types.MethodType):
        yield "its self", value.__self__
        yield "its function", value.__func__
    elif isinstance(value, functools.partial):
        yield "the partial's function", value.func
        for i, a in enumerate(value.args):
            yield f"the partial's argument {i}", a
        for k, v in value.keywords.items():
            yield f"the partial's argument {k!r}", v
    elif isinstance(value, types.FunctionType):
        for name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
            yield f"{value.__qualname__}'s closure {name!r}", _cell_value(cell)
        for i, d in enumerate(value.__defaults__ or ()):
            yield f"{value.__qualname__}'s default {i}", d
        for k, d in (value.__kwdefaults__ or {}).items():
            yield f"{value.__qualname__}'s default {k!r}", d
        if getattr(value, "__wrapped__", None) is not None:
            yield "the function it wraps", value.__wrapped__
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(value):
            yield f"item {i}", v
    elif isinstance(value, dict):
        for k, v in value.items():
            yield f"item {k!r}", v


def _search(value: Any, targets: set[int], depth: int, seen: set[int]) -> list[str] | None:
    if id(value) in targets:
        return []
    if depth == 0 or id(value) in seen or isinstance(value, nn.Module):
        return None  # a module that is not a target is the copy's own: its callables are searched as roots
    seen.add(id(value))
    for label, child in _children(value):
        if id(child) in targets:
            return [label]
        found = _search(child, targets, depth - 1, seen)
        if found is not None:
            return [label, *found]
    return None
