"""The copies the layout check runs on: true copies of a model (eager, methods, closures and hooks bound to the
copy: ``eager_copy``) and of its optimizers, and how user code knows it is running on one.

``is_check_copy(module)`` is ``True`` for a model the check made, and ``checking()`` while the check runs:
code with side effects outside the model (writing files, counting steps, a global registry) can skip them::

    from cltrain.check import checking

    def training_step(self, batch, batch_idx):
        loss = ...
        if not checking():
            self.samples_seen += len(batch[0])
        return loss
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from cltrain.layout.closures import callables_of, rebound
from cltrain.layout.optimizer_state import user_step_hooks
from cltrain.layout.tensors import is_materialized

__all__ = ["ELEMENTWISE_OPTIMIZERS", "checking", "copy_optimizer", "copy_schedulers", "eager_copy", "elementwise",
           "float32_tensors", "half_dtype", "in_float32", "is_check_copy", "mark_copy", "rebind_methods", "running",
           "shared_note"]

_MARK = "_cltrain_check_copy"

#: torch's optimizers whose update of a parameter is elementwise in its gradient and state (fused, foreach or
#: per tensor): the same values in any layout, so re-running them on the check's copies tells nothing.
#: LBFGS (which flattens gradients with ``view``) and every subclass or other optimizer are run.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
    torch.optim.ASGD,
)
_depth = 0


def checking() -> bool:
    """``True`` while the first-batch layout check runs the step on its copies."""
    return _depth > 0


def is_check_copy(module: Any) -> bool:
    """``True`` for a module (or LightningModule) that the layout check copied to run the step on."""
    return bool(getattr(module, _MARK, False))


@contextlib.contextmanager
def running() -> Iterator[None]:
    """``checking()`` is ``True`` inside."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def mark_copy(model: nn.Module) -> nn.Module:
    """Mark every module of ``model`` as a check copy (``is_check_copy``); returns ``model``."""
    for module in model.modules():
        module.__dict__[_MARK] = True
    return model


def copy_optimizer(optimizer: torch.optim.Optimizer, memo: dict[int, Any]) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` and its state whose parameters are the copies ``memo`` maps them to (``memo``:
    the one ``eager_copy`` filled); the original, its state and step count are not touched.

    Raises:
        TypeError: the optimizer can be neither deep-copied nor rebuilt from its ``defaults``.
    """
    own = dict(memo)
    try:  # every attribute of a custom optimizer, not only what Optimizer.__getstate__ keeps
        clone = object.__new__(type(optimizer))
        clone.__dict__.update(copy.deepcopy(vars(optimizer), own))
    except Exception:  # noqa: BLE001 - rebuild from the public constructor instead
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [memo[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
        # only what the constructor takes: torch's AdamW keeps `decoupled_weight_decay` in its defaults, not its
        # arguments
        accepted = inspect.signature(type(optimizer).__init__).parameters
        anything = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
        defaults = {k: v for k, v in optimizer.defaults.items() if anything or k in accepted}
        try:
            clone = type(optimizer)(groups, **defaults)
            clone.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        except Exception as error:  # noqa: BLE001
            raise TypeError(f"{type(optimizer).__name__} cannot be copied ({type(error).__name__}: {error})") from None
    if any(memo.get(id(p)) is not q for g, h in zip(optimizer.param_groups, clone.param_groups)
           for p, q in zip(g["params"], h["params"])):
        raise TypeError(f"{type(optimizer).__name__}'s copy does not hold the copied parameters")
    rebind_methods(clone, own, drop_class_wrappers=True)  # an LR scheduler's patched `step`
    return clone


_HALF = (torch.float16, torch.bfloat16)


def half_dtype(model: nn.Module) -> torch.dtype | None:
    """The 16-bit float ``model`` computes in where its weights are cast (``model.to(torch.bfloat16)``, Lightning's
    and Fabric's ``"bf16-true"``), else ``None``. Its rounding noise (2**-8 per op in bfloat16) would hide an O(1)
    layout fault where a gradient cancels (through BatchNorm), so the check runs its copies in float32 first."""
    return next((p.dtype for p in model.parameters() if is_materialized(p) and p.dtype in _HALF), None)


def in_float32(clone: nn.Module, optimizers: list[torch.optim.Optimizer] = ()) -> nn.Module:
    """A check's copy and its optimizers' copies computing in float32: their 16-bit floating parameters, buffers and
    optimizer state cast, in place (the ``Parameter`` objects kept, so the optimizers still hold them)."""
    clone._apply(lambda t: t.float() if t.dtype in _HALF else t)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dtype in _HALF:
                    state[key] = value.float()
    return clone


def float32_tensors(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 where it holds 16-bit floats (a batch's images for ``in_float32``'s copies)."""
    return t.float() if t.dtype in _HALF else t


def copy_schedulers(configs: list[Any], memo: dict[int, Any]) -> list[Any]:
    """Copies of Lightning's ``LRSchedulerConfig``s, each holding a copy of its scheduler bound to the copied
    optimizer (``memo`` maps each optimizer to its copy); a scheduler that cannot be copied gets a stand-in
    whose ``step`` does nothing (a scheduler steps after the update the check compares)."""
    import dataclasses

    copies = []
    for config in configs:
        scheduler: Any = _InertScheduler()
        if id(getattr(config.scheduler, "optimizer", None)) in memo:
            try:
                scheduler = copy.deepcopy(config.scheduler, dict(memo))
            except Exception:  # noqa: BLE001 - the stand-in instead
                pass
        copies.append(dataclasses.replace(config, scheduler=scheduler))
    return copies


class _InertScheduler:
    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return []


def elementwise(optimizers: list[Any]) -> bool:
    """Whether every optimizer (or ``LightningOptimizer``'s) is one of ``ELEMENTWISE_OPTIMIZERS`` itself, whose step
    runs no step hooks of the user's (per-filter clipping in a pre-step hook reads the gradients' memory)."""
    return all(type(getattr(o, "optimizer", o)) in ELEMENTWISE_OPTIMIZERS and not user_step_hooks(o)
               for o in optimizers)


class _Eager(nn.Module):
    """Stands in a copy for a ``torch.compile``d child: runs the module it wraps eagerly, under the same name."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._orig_mod(*args, **kwargs)


def rebind_methods(obj: Any, memo: dict[int, Any], drop_class_wrappers: bool = False) -> None:
    """Instance attributes of ``obj`` that wrap a method bound to an original object (``memo``: original id ->
    copy): the method bound to its copy instead, unwrapped (a ``torch.compile`` wrapper around a step method
    runs eagerly on the copy). ``drop_class_wrappers``: also drop a wrapper around the class's own function
    (an LR scheduler's on an optimizer's ``step`` calls the original optimizer)."""
    for name, value in list(vars(obj).items()):
        if not callable(value) or isinstance(value, (nn.Module, torch.Tensor, type)):
            continue
        if isinstance(value, types.MethodType) and value.__self__ is obj:
            # deepcopy bound it to the copy already (accelerate's forward wrappers); its defaults may hold originals
            vars(obj)[name] = rebound(value, memo)
            continue
        try:
            inner = inspect.unwrap(value)
        except ValueError:
            continue
        if _compiled(value) and isinstance(inner, types.MethodType) and id(inner.__self__) in memo:
            vars(obj)[name] = types.MethodType(inner.__func__, memo[id(inner.__self__)])
        elif drop_class_wrappers and inner is not value and _unwrapped(getattr(type(obj), name, None)) is inner:
            del vars(obj)[name]
        else:  # a user's wrapper or closure over the original: the same code, holding the copy
            vars(obj)[name] = rebound(value, memo)


def _compiled(fn: Any) -> bool:
    """Whether ``fn`` or a function it wraps is a ``torch.compile`` wrapper."""
    for _ in range(16):
        if fn is None:
            return False
        if hasattr(fn, "_torchdynamo_orig_callable"):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _unwrapped(fn: Any) -> Any:
    try:
        return inspect.unwrap(fn) if fn is not None else None
    except ValueError:
        return None


#: The attributes of each model that its copies share, by name (``shared_note``): found at its first copy, given to
#: every later one (the objects held here: their ids stay theirs).
_shared: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()
_MODULE_STATE = frozenset(vars(nn.Module()))  # a module's own parameters, buffers, children and hooks


def eager_copy(model: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """A deep copy of ``model`` that runs eagerly and only on itself: methods bound as instance attributes
    (Lightning's rebinding of a compiled module's steps) are bound to the copy, ``module.compile()`` is
    undone and a ``torch.compile``d model or child runs its module eagerly (module names unchanged); closures,
    partials, default arguments and hooks that hold the original (a wrapped ``forward``) hold the copy
    (``cltrain.layout.closures``); parameter gradient hooks are copied, likewise. An attribute ``deepcopy`` refuses
    (an open file, a ``SummaryWriter``'s lock) is shared with the copy, or what it refuses inside an attribute that
    holds the model, and ``shared_note`` names it."""
    memo = {} if memo is None else memo
    _computed_tensors(model, memo)
    trial = {**memo, **{id(v): v for v in _shared.get(model, {}).values()}}
    try:
        clone = copy.deepcopy(model, trial)
    except TypeError:  # "cannot pickle '_io.TextIOWrapper' object": the model could not be checked at all
        shared = _share_uncopyable(model, memo)
        if not shared:
            raise
        _shared[model] = shared
        trial = {**memo, **{id(v): v for v in shared.values()}}
        clone = copy.deepcopy(model, trial)
    # deepcopy keeps what it copied alive in a list under the id of the memo it was given: moved under memo's own
    # (under the trial dict's id, gone with it, an object made later at its address, as an optimizer's __dict__
    # that Python makes on first use, was "copied" as that list)
    kept = trial.pop(id(trial), [])
    memo.update(trial)
    memo.setdefault(id(memo), []).extend(kept)
    originals = dict(model.named_parameters())
    for name, param in clone.named_parameters():
        _copy_grad_hooks(originals.get(name), param, memo)
    for parent in list(clone.modules()):
        rebind_methods(parent, memo)
        for label, container, key, value in callables_of(parent):
            if not label.isidentifier():  # its hooks (its attributes are rebound above)
                container[key] = rebound(value, memo)
        if getattr(parent, "_compiled_call_impl", None) is not None:
            parent._compiled_call_impl = None
        if getattr(parent, "_compiler_ctx", None) is not None:
            parent._compiler_ctx = None
        for child_name, child in list(parent.named_children()):
            if isinstance(child, _compiled_types()):
                setattr(parent, child_name, _Eager(child._orig_mod))
    if isinstance(clone, _compiled_types()):  # a model compiled before a door saw it: its copy runs eagerly too
        clone = memo[id(model)] = _Eager(clone._orig_mod)
    return clone


def _share_uncopyable(model: nn.Module, memo: dict[int, Any]) -> dict[str, Any]:
    """The objects in ``model``'s modules' attributes that ``deepcopy`` refuses (shared by the copy), by name: an
    attribute, or where the attribute holds the model (a helper with a back-reference and a lock), the refused
    objects inside it, so that the attribute is copied around them and its back-reference holds the copy. Never one
    that holds the model (a copy's step would run the real one through it)."""
    shared: dict[str, Any] = {}
    real = {id(m) for m in model.modules()} | {id(t) for t in (*model.parameters(), *model.buffers())}
    for path, module in model.named_modules():
        state = module.__getstate__()  # what deepcopy copies (a LightningModule's leaves its trainer out)
        for name, value in (state if isinstance(state, dict) else vars(module)).items():
            if name in _MODULE_STATE or isinstance(value, (nn.Module, torch.Tensor)) or id(value) in memo:
                continue
            _share_refused(value, f"self.{path + '.' if path else ''}{name}", memo, real, shared, 3)
    return shared


def _share_refused(value: Any, label: str, memo: dict[int, Any], real: set[int], shared: dict[str, Any],
                   depth: int) -> None:
    """Add ``value`` to ``shared`` where ``deepcopy`` refuses it and it holds none of ``real``; where it holds some,
    the refused objects among its attributes and items, ``depth`` levels down (never a trial copy of the model: a
    large one on a device would need its memory twice)."""
    if _reaches(value, real, 4, set()):
        if depth and not isinstance(value, (nn.Module, torch.Tensor)):
            for key, item in _children(value):
                _share_refused(item, f"{label}{key}", memo, real, shared, depth - 1)
        return
    try:
        copy.deepcopy(value, {**memo, **{id(v): v for v in shared.values()}})
    except TypeError:
        shared[f"{label} ({type(value).__name__})"] = value


def _children(value: Any) -> list[tuple[str, Any]]:
    """``value``'s attributes and items, each with the suffix that names it (``.lock``, ``['log']``, ``[0]``)."""
    if isinstance(value, dict):
        return [(f"[{k!r}]", v) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    return [(f".{k}", v) for k, v in vars(value).items()] if hasattr(value, "__dict__") else []


def _reaches(value: Any, targets: set[int], depth: int, seen: set[int]) -> bool:
    """Whether ``value``'s attributes and items hold an object whose id is in ``targets``, ``depth`` levels down."""
    if id(value) in targets:
        return True
    if not depth or id(value) in seen or isinstance(value, (str, bytes, int, float, torch.Tensor)):
        return False
    seen.add(id(value))
    items = [v for _, v in _children(value)] if not isinstance(value, (set, frozenset)) else value
    return any(_reaches(item, targets, depth - 1, seen) for item in items)


def shared_note(model: nn.Module) -> str | None:
    """The check line's note on what ``model``'s copies share with it (``eager_copy``), or ``None``: two names and
    how many more, to fit the line."""
    names = _shared.get(model)
    if not names:
        return None
    named = ", ".join(list(names)[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
    return f"shared with the copies: {named}"  # what deepcopy refuses: the guide says why


def _computed_tensors(model: nn.Module, memo: dict[int, Any]) -> None:
    """The tensors a module holds as plain attributes that are not leaves, copied as leaves: those a forward
    pre-hook computes again before every forward (``torch.nn.utils.prune``'s ``weight`` from ``weight_orig`` and
    ``weight_mask``; the old-style ``weight_norm`` and ``spectral_norm``'s, as lightly's DINO head holds them).
    ``deepcopy`` refuses a tensor that is not a leaf (pytorch#103001), and such a model could not be checked. Those in
    the plain lists, tuples and dicts it holds too (a forward hook keeping activations for a feature loss)."""
    def visit(value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) not in memo and not value.is_leaf:
                memo[id(value)] = value.detach().clone(memory_format=torch.preserve_format)
        elif depth and type(value) in (list, tuple, dict):
            for item in (value.values() if type(value) is dict else value):
                visit(item, depth - 1)

    for module in model.modules():
        for value in vars(module).values():
            visit(value, 3)


def _compiled_types() -> tuple[type, ...]:
    return (torch._dynamo.eval_frame.OptimizedModule,) if "torch._dynamo" in sys.modules else ()


def _copy_grad_hooks(original: torch.Tensor | None, param: torch.Tensor, memo: dict[int, Any]) -> None:
    if original is None:
        return
    for hook in (getattr(original, "_backward_hooks", None) or {}).values():
        param.register_hook(rebound(hook, memo))
    for hook in (getattr(original, "_post_accumulate_grad_hooks", None) or {}).values():
        param.register_post_accumulate_grad_hook(rebound(hook, memo))
