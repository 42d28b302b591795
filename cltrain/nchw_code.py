"""Torch code that assumes NCHW strides on a parameter, and the workaround for each (pytorch#96743).

The kernels' faults are ``cltrain.guardrails``'; these are Python utilities that call ``view`` on a weight, which
raises ``view size is not compatible with input tensor's size and stride`` on a channels_last one:

* ``torch.nn.utils.parameters_to_vector`` (``param.view(-1)``) and ``vector_to_parameters`` (``view_as``, which
  would also leave the parameter in NCHW): ``flat_parameters()`` puts versions in place that read a channels_last
  parameter in its logical order (the vector is the one an NCHW model gives) and write it back in its own strides,
  and hand every other parameter to torch's own code. A module that bound torch's own functions by name before the
  run (``from torch.nn.utils import parameters_to_vector`` at its top) gets these for the run too, and one line names
  it (``bound_by_name``).
* ``torch.nn.utils.prune``: ``l1_unstructured``'s ``view(-1)`` and ``random_unstructured``'s ``rand_like`` (which draws
  in memory order, another mask than an NCHW model's): ``pruning_in_logical_order()`` computes their masks on the
  weight's NCHW values, so a channels_last weight gets the mask an NCHW model gets, in the weight's own layout;
  global pruning goes through ``parameters_to_vector``. ``in_nchw(model)`` runs pruning code on NCHW weights and the
  caller puts the layout back after it (``LayoutSession.boundary``): what ``ChannelsLast`` does around Lightning's
  ``ModelPruning``, whose lottery-ticket reset writes weights from copies taken before the conversion.

``torch_utilities()`` holds all of these for a run (every front door's session does, from ``start`` to ``end``).
``python -m scripts.repro.prune_channels_last`` shows both faults on torch as installed.

Example::

    >>> import torch
    >>> conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    >>> with torch_utilities():
    ...     vector = torch.nn.utils.parameters_to_vector(conv.parameters())
    ...     torch.nn.utils.vector_to_parameters(vector * 2, conv.parameters())
    ...     _ = torch.nn.utils.prune.l1_unstructured(conv, "weight", amount=0.5)
    >>> vector.shape, conv.weight.is_contiguous(memory_format=torch.channels_last)
    (torch.Size([112]), True)
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.utils as utils
import torch.nn.utils.convert_parameters as convert
import torch.nn.utils.prune as prune
from torch import nn

from cltrain.layout.tensors import has_nchw_strides, is_channels_last, nchw, to_channels_last

__all__ = ["aliases_follow", "bound_by_name", "flat_parameters", "guard_pruning", "in_nchw", "pruning_aliases",
           "pruning_in_logical_order", "relayout", "torch_utilities", "unguard_pruning"]

UPSTREAM = "pytorch#96743"
_original = (convert.parameters_to_vector, convert.vector_to_parameters)
# A token per hold: a hold given back late (a session the collector finds during another run) ends only itself. The
# collector runs such a session's finalizer at any allocation, also on a thread inside one of the sections below: the
# lock is reentrant, and each section ends by making what is installed match the holds (``_sync``).
_lock = threading.RLock()
_holders: set[object] = set()
_told = False


def _breaks_view(t: torch.Tensor) -> bool:
    return t.dim() >= 2 and not t.is_contiguous()


def _own_strides(t: torch.Tensor) -> bool:
    """Strides a ``view_as`` would lose (a channels_last 1x1 or depthwise kernel's too, contiguous to torch)."""
    return t.dim() >= 2 and not has_nchw_strides(t)


def _tell() -> None:
    global _told
    if not _told:
        _told = True
        logging.getLogger("cltrain").info(
            "ChannelsLast: torch.nn.utils.parameters_to_vector / vector_to_parameters read and wrote channels_last "
            f"parameters in their logical order and kept their strides ({UPSTREAM}: torch's own call view on them).")


def parameters_to_vector(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """torch's ``parameters_to_vector``, reading a non-contiguous parameter in its logical order."""
    parameters = list(parameters)
    if not any(map(_breaks_view, parameters)):
        return _original[0](parameters)
    _tell()
    device = None
    vec = []
    for param in parameters:
        device = convert._check_param_device(param, device)
        vec.append(param.reshape(-1))
    return torch.cat(vec)


def vector_to_parameters(vec: torch.Tensor, parameters: Iterable[torch.Tensor]) -> None:
    """torch's ``vector_to_parameters``, a parameter with strides of its own (``_own_strides``) written back in them."""
    parameters = list(parameters)
    if not any(map(_own_strides, parameters)):
        return _original[1](vec, parameters)
    if not isinstance(vec, torch.Tensor):
        raise TypeError(f"expected torch.Tensor, but got: {torch.typename(vec)}")
    _tell()
    device, pointer = None, 0
    for param in parameters:
        device = convert._check_param_device(param, device)
        part = vec[pointer:pointer + param.numel()].view_as(param)
        param.data = part.data if not _own_strides(param) else torch.empty_like(param).copy_(part)
        pointer += param.numel()
    return None


@contextlib.contextmanager
def flat_parameters() -> Iterator[None]:
    """``torch.nn.utils.parameters_to_vector`` / ``vector_to_parameters`` that take channels_last parameters,
    inside (nested and concurrent holders share one install; torch's own are back when the last leaves)."""
    with _hold(_holders):
        yield


@contextlib.contextmanager
def _hold(holders: set[object]) -> Iterator[None]:
    token = object()
    with _lock:
        holders.add(token)
        _sync()
    try:
        yield
    finally:
        with _lock:
            holders.discard(token)
            _sync()


def _sync() -> None:
    """Under the lock: ours where a hold asks for them, else torch's (again, where a finalizer changed the holds
    meanwhile)."""
    while True:
        held = bool(_holders), bool(_pruning_holders)
        flat = (parameters_to_vector, vector_to_parameters) if held[0] else _original
        for where in (utils, convert):
            where.parameters_to_vector, where.vector_to_parameters = flat
        for cls in _MASKED:
            cls.compute_mask = _logical[cls] if held[1] else _compute_mask[cls]
        if held == (bool(_holders), bool(_pruning_holders)):
            return


@contextlib.contextmanager
def aliases_follow(model: nn.Module, aliases: Iterable[torch.Tensor]) -> Iterator[None]:
    """Inside, ``model``'s parameters and buffers may change layout (``.data =``); each tensor of ``aliases`` that
    shared one's data before shares its new data after (``relayout`` does the same for one tensor)."""
    aliases = list(aliases)
    own = [*model.parameters(), *model.buffers()]
    pairs = [(a, t) for a in aliases for t in own if a is not t and a.shape == t.shape and a.stride() == t.stride()
             and a.data_ptr() == t.data_ptr()] if aliases else []
    yield
    for alias, t in pairs:
        alias.data = t.data


def relayout(t: torch.Tensor, memory_format: torch.memory_format, aliases: Iterable[torch.Tensor] = ()) -> None:
    """``t``'s data in ``memory_format`` (canonical strides, size-1 dims included), in place, and every tensor of
    ``aliases`` that shares its data shares the new data too (a copy written with ``.data =`` that training then
    updates through the weight stays so)."""
    new = nchw(t.data) if memory_format == torch.contiguous_format else to_channels_last(t.data)
    for alias in aliases:
        if alias is not t and alias.shape == t.shape and alias.stride() == t.stride() \
                and alias.data_ptr() == t.data_ptr():
            alias.data = new
    t.data = new


_MASKED = (prune.L1Unstructured, prune.RandomUnstructured)  # their compute_mask views (or draws over) the tensor
_compute_mask = {cls: cls.compute_mask for cls in _MASKED}
_pruning_holders: set[object] = set()  # as _holders


def _in_logical_order(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def compute_mask(self: Any, t: torch.Tensor, default_mask: torch.Tensor) -> torch.Tensor:
        if t.dim() < 2 or t.is_contiguous():
            return original(self, t, default_mask)
        mask = original(self, nchw(t), nchw(default_mask))  # the mask an NCHW model gets
        return to_channels_last(mask) if is_channels_last(t) else mask

    compute_mask.__doc__ = original.__doc__
    return compute_mask


_logical = {cls: _in_logical_order(_compute_mask[cls]) for cls in _MASKED}


@contextlib.contextmanager
def pruning_in_logical_order() -> Iterator[None]:
    """``torch.nn.utils.prune``'s ``L1Unstructured`` and ``RandomUnstructured`` masks computed on a channels_last
    weight's NCHW values (the mask an NCHW model gets, in the weight's layout), inside (shared by nested holders)."""
    with _hold(_pruning_holders):
        yield


#: ``(id(module), attr)`` -> ``(module, torch's function, holds)``: what ``bound_by_name`` rebound, shared by every
#: hold (a module rebound by one run stays so while another holds it, as ``_holders``).
_rebound: dict[tuple[int, str], tuple[Any, Any, set[object]]] = {}


def _unbind(token: object | None) -> None:
    """Give back the hold ``token`` of ``bound_by_name`` (``None``: every hold): a module none holds any more gets
    torch's function back, where it still has ours."""
    with _lock:
        for key, (module, original, holders) in list(_rebound.items()):
            if token is None:
                holders.clear()
            holders.discard(token)
            if not holders and _rebound.pop(key, None) is not None:
                if vars(module).get(key[1]) in (parameters_to_vector, vector_to_parameters):
                    setattr(module, key[1], original)


@contextlib.contextmanager
def bound_by_name(say: Callable[[str, bool], None] | None = None) -> Iterator[list[str]]:
    """Inside, a module outside torch that bound torch's ``parameters_to_vector`` / ``vector_to_parameters`` by name
    (``from torch.nn.utils import parameters_to_vector`` at its top, before the run) calls ``flat_parameters``'
    versions; ``say`` names those modules in one line. Yields their names."""
    ours = {id(_original[0]): parameters_to_vector, id(_original[1]): vector_to_parameters}
    token, rebound = object(), set()
    with _lock:
        for _, _, holders in list(_rebound.values()):  # first: a late finalizer cannot undo these from here on
            holders.add(token)
        for name, module in list(sys.modules.items()):  # then what is torch's (what such a finalizer gave back too)
            if module is None or name.split(".")[0] in ("torch", "cltrain"):
                continue
            try:
                items = list(vars(module).items())
            except TypeError:
                continue
            for attr, value in items:
                if id(value) in ours and value in _original:
                    setattr(module, attr, ours[id(value)])
                    _rebound.setdefault((id(module), attr), (module, value, set()))[2].add(token)
                    rebound.add(module.__name__)
    names = sorted(rebound)  # said by the hold that rebound them (another run's holds leave them rebound)
    if names and say is not None:
        say(f"ChannelsLast: {', '.join(names)} bound torch.nn.utils.parameters_to_vector or vector_to_parameters by "
            f"name; during the run they read and write channels_last parameters in their logical order ({UPSTREAM}).",
            False)
    say = None  # held no longer than needed: it may hold the run that holds this context
    try:
        yield names
    finally:
        _unbind(token)


@contextlib.contextmanager
def torch_utilities(say: Callable[[str, bool], None] | None = None) -> Iterator[None]:
    """Every fix of this module held at once: ``flat_parameters``, ``pruning_in_logical_order`` and
    ``bound_by_name`` (``say`` names the modules it rebinds)."""
    with flat_parameters(), pruning_in_logical_order(), bound_by_name(say):
        say = None  # as in bound_by_name
        yield


def in_nchw(model: nn.Module, aliases: Iterable[torch.Tensor] = ()) -> None:
    """Every 4-D/5-D parameter and buffer of ``model`` in NCHW (contiguous), in place (``aliases`` as in
    ``relayout``): what torch's pruning assumes. Put the layout back afterwards with ``LayoutSession.keep``."""
    aliases = list(aliases)
    for t in [*model.parameters(), *model.buffers()]:
        if t.dim() in (4, 5) and not t.is_contiguous():
            relayout(t, torch.contiguous_format, aliases)


def pruning_aliases(callbacks: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors of the layer copies ``ModelPruning`` keeps for its lottery-ticket reset: the reset writes them
    into the weights with ``.data =``, so they share data with the weights from then on, and training updates
    both; a change of layout keeps that sharing (``relayout``), or the next reset would start elsewhere."""
    found: list[torch.Tensor] = []
    for callback in callbacks:
        layers = getattr(callback, "_original_layers", None) if is_pruning_callback(callback) else None
        for ref in (layers or {}).values():
            copy_ = ref.get("data") if isinstance(ref, dict) else None
            if isinstance(copy_, nn.Module):
                found += [*copy_.parameters(), *copy_.buffers()]
    return found


#: ModelPruning's methods that call torch's pruning or write weights from copies taken before the conversion.
PRUNING_METHODS = ("apply_pruning", "apply_lottery_ticket_hypothesis", "make_pruning_permanent")


def is_pruning_callback(callback: Any) -> bool:
    """Lightning's ``ModelPruning`` (either package) or a subclass, told by class name."""
    return any(c.__name__ == "ModelPruning" for c in type(callback).__mro__)


def guard_pruning(callbacks: Iterable[Any], model: nn.Module,
                  keep: Callable[[str, list[torch.Tensor]], Any]) -> list[Any]:
    """Run the pruning methods of every ``ModelPruning`` among ``callbacks`` on ``model`` in NCHW (``in_nchw``)
    and call ``keep(what_ran, aliases)`` after each, which puts the layout back (``aliases``: ``pruning_aliases``);
    returns the callbacks wrapped (for ``unguard_pruning``). The wrappers are set on the instances: the class and other instances are untouched."""
    wrapped = []
    for callback in callbacks:
        if not is_pruning_callback(callback) or "_cltrain_unguarded" in vars(callback):
            continue
        callback._cltrain_unguarded = {name: vars(callback).get(name) for name in PRUNING_METHODS}
        for name in PRUNING_METHODS:
            setattr(callback, name, _in_nchw(getattr(callback, name), callback, model, keep,
                                             f"{type(callback).__name__}.{name}"))
        wrapped.append(callback)
    return wrapped


def _in_nchw(method: Callable, callback: Any, model: nn.Module, keep: Callable[[str, list[torch.Tensor]], Any],
             what: str) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        in_nchw(model, pruning_aliases([callback]))
        try:
            return method(*args, **kwargs)
        finally:
            keep(what, pruning_aliases([callback]))
    return run


def unguard_pruning(callbacks: Iterable[Any]) -> None:
    """Undo ``guard_pruning`` on ``callbacks``."""
    for callback in callbacks:
        saved = vars(callback).pop("_cltrain_unguarded", None)
        for name, method in (saved or {}).items():
            if method is None:
                vars(callback).pop(name, None)
            else:
                setattr(callback, name, method)
