"""Check one real step in both layouts, find where the user's code assumes NCHW, and choose the fallback.

``check_layout(model, step)`` runs ``step`` (the forward, the step code that consumes the outputs, and
the backward) on an NCHW copy and a channels_last copy of ``model``, with the same RNG state and with
random ops (dropout) drawn in the same logical order in both. Every module's inputs, outputs and output
gradients, the loss and every parameter's gradient are compared as they happen; the first place that
raises only in channels_last, or differs beyond the layouts' own rounding noise, is the finding.
The noise is measured on the same batch: an NCHW run whose every module output, and the gradient
arriving at it, is perturbed by a few units in the last place of its dtype. A finding is then fixed by the smallest ``cltrain.nchw_fallback``
that makes the channels_last copy agree, tried in order (the outputs of the module just before the
faulty code, the module holding it, its parents, the whole model), each verified by running the step
again. The model itself, its gradients, BatchNorm statistics, optimizer and RNG state are not touched.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from cltrain import to_channels_last
    >>> from cltrain.layout_check import check_layout
    >>> class Head(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 6 * 6, 2)
    ...     def forward(self, x):
    ...         return self.fc(self.conv(x).view(x.size(0), -1))
    >>> model = to_channels_last(Head())
    >>> x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    >>> result = check_layout(model, lambda m, layout: m(x.contiguous() if layout == "contiguous" else x).sum())
    >>> result.verdict, [f.kind for f in result.fallbacks]
    ('fallback', ['outputs'])
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import random
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from cltrain.autolayout import to_contiguous
from cltrain.nchw_fallback import Fallback, apply_fallbacks, map_images

__all__ = ["Finding", "LayoutCheck", "check_layout", "projection_loss"]

# A finding differs from the NCHW run by more than RATIO times the measured noise at the same place, by more
# than FLOOR (relative), and by more than JUMP times the difference already in its inputs: a layout fault
# moves values to other places, which is O(1) at once.
RATIO = 10.0
FLOOR = 0.02
JUMP = 3.0
_ATTEMPTS = 8  # fallbacks tried before the whole model stays contiguous
_PROJECTIONS = 3
# Frames in these folders are not the user's code (the finding names the innermost frame outside them).
_LIBRARY_PARTS = (f"{os.sep}torch{os.sep}", f"{os.sep}lightning{os.sep}", f"{os.sep}lightning_fabric{os.sep}",
                  f"{os.sep}pytorch_lightning{os.sep}", f"{os.sep}cltrain{os.sep}", os.path.dirname(contextlib.__file__) + os.sep)


# ---- signatures: a few numbers per tensor that a moved value changes ----------------------------------------


class _Vectors:
    """Fixed random vectors per (size, device): the same in every run."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int, str], torch.Tensor] = {}

    def get(self, size: int, dim: int, device: torch.device) -> torch.Tensor:
        key = (size, dim, str(device))
        if key not in self._cache:
            g = torch.Generator().manual_seed(1_000_003 * size + dim)
            self._cache[key] = torch.randn(size, _PROJECTIONS, generator=g).to(device)
        return self._cache[key]


def _project(x: torch.Tensor, vectors: _Vectors) -> torch.Tensor:
    """``_PROJECTIONS`` projections of ``x`` (float) on rank-1 random tensors: shape ``(_PROJECTIONS,)``.

    Each is ``sum(x[i, j, ...] * a[i] * b[j] * ...)``; a value moved to another index changes it, a
    permutation-invariant statistic (sum, norm) would not."""
    if x.dim() == 0:
        return x.reshape(1).expand(_PROJECTIONS)
    dims = x.dim()
    y = x @ vectors.get(x.shape[-1], dims - 1, x.device)  # (..., P)
    for d in range(dims - 1):
        v = vectors.get(x.shape[d], d, x.device)  # (size, P): contracts the leading dim
        y = (y * v.view(v.shape[0], *([1] * (y.dim() - 2)), _PROJECTIONS)).sum(0)
    return y


def projection_loss(output: Any, vectors: _Vectors | None = None) -> torch.Tensor:
    """A scalar whose gradient is dense and layout-independent: the sum of the projections of every
    floating tensor in ``output`` (for checking a model without its own loss)."""
    vectors = vectors or _Vectors()
    total = None
    for t in _floats(output):
        term = _project(t.float(), vectors).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("projection_loss: the model's output holds no floating tensor.")
    return total


def _floats(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            if o.is_floating_point() and o.layout is torch.strided:
                found.append(o)
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v)
        elif isinstance(o, dict):
            for v in o.values():
                visit(v)

    visit(obj)
    return found


def _signature(obj: Any, vectors: _Vectors, seen: dict[int, tuple[Any, int, torch.Tensor]] | None = None,
               ) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Per floating tensor: its shape and ``[norm, projections...]`` (a device tensor: no sync here).

    ``seen`` caches by tensor (and its version): a module's input is mostly the previous one's output."""
    out = []
    for t in _floats(obj):
        cache = seen if not t.is_inference() else None  # inference tensors have no version counter
        version = t._version if cache is not None else -1
        hit = cache.get(id(t)) if cache is not None else None
        if hit is not None and hit[0]() is t and hit[1] == version:
            out.append((tuple(t.shape), hit[2]))
            continue
        x = t.detach().float()
        sig = torch.cat([torch.linalg.vector_norm(x).reshape(1), _project(x, vectors)])
        if cache is not None:
            cache[id(t)] = (weakref.ref(t), version, sig)
        out.append((tuple(t.shape), sig))
    return out


def _distance(a: list[tuple[tuple[int, ...], list[float]]], b: list[tuple[tuple[int, ...], list[float]]]) -> float:
    """The relative difference of two signatures: the largest over their tensors (inf: not comparable)."""
    if len(a) != len(b):
        return float("inf")
    worst = 0.0
    for (shape_a, sa), (shape_b, sb) in zip(a, b):
        if shape_a != shape_b:
            return float("inf")
        finite_a = all(v == v and abs(v) != float("inf") for v in sa)
        finite_b = all(v == v and abs(v) != float("inf") for v in sb)
        if finite_a != finite_b:
            return float("inf")
        if not finite_a:
            continue
        scale = max(sa[0], sb[0])
        if scale == 0.0:
            continue
        worst = max(worst, max(abs(x - y) for x, y in zip(sa, sb)) / scale)
    return worst


def _noise_scale(dtype: torch.dtype) -> float:
    """The relative perturbation of the noise run: a kernel's rounding differs between layouts by more than
    half a unit in the last place where it sums long runs (a convolution's weight gradient sums N*H*W
    products), so 64 units, and at most 2**-6 for 16-bit dtypes."""
    return min(64 * torch.finfo(dtype).eps, 2.0**-6)


# ---- one run of the step, recorded -----------------------------------------------------------------------------


_RANDOM_OUT = {
    torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout, torch.nn.functional.feature_alpha_dropout,
    torch.dropout, torch.feature_dropout, torch.alpha_dropout, torch.feature_alpha_dropout, torch.bernoulli,
    torch.Tensor.bernoulli, torch.rand_like, torch.randn_like, torch.randint_like,
}
_RANDOM_IN_PLACE = {
    torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.exponential_,
    torch.Tensor.geometric_, torch.Tensor.cauchy_, torch.Tensor.log_normal_, torch.Tensor.random_,
    torch.dropout_, torch.feature_dropout_, torch.alpha_dropout_, torch.feature_alpha_dropout_,
}


class _SameRandomness(TorchFunctionMode):
    """Random ops draw in the logical (NCHW) order whatever the strides, so the same RNG state gives the
    same dropout mask in both layouts (a kernel fills a mask in memory order)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        x = args[0] if args else kwargs.get("input")
        if (func not in _RANDOM_OUT and func not in _RANDOM_IN_PLACE) or not isinstance(x, torch.Tensor) \
                or x.dim() < 2 or x.is_contiguous():
            return func(*args, **kwargs)
        rest = args[1:] if args else ()
        kwargs = {k: v for k, v in kwargs.items() if k != "input"}
        in_place = func in _RANDOM_IN_PLACE or bool(kwargs.get("inplace")) or (len(args) > 3 and args[3] is True)
        if func in _RANDOM_IN_PLACE:
            tmp = x.clone(memory_format=torch.contiguous_format)
            func(tmp, *rest, **kwargs)
            with torch.no_grad() if not x.requires_grad else contextlib.nullcontext():
                return x.copy_(tmp)
        if in_place:
            kwargs["inplace"] = False
            if len(rest) > 2:
                rest = (*rest[:2], False, *rest[3:])
        result = func(x.clone(memory_format=torch.contiguous_format), *rest, **kwargs)
        if in_place:
            return x.copy_(result)
        return torch.empty_like(x, dtype=result.dtype).copy_(result)


@dataclass
class _Raise:
    error: BaseException
    phase: str  # "forward", "backward" or "step"
    context: tuple[str | None, str | None]  # (the module whose code ran, the module completed just before)
    position: int  # how many events had happened


@dataclass
class _Run:
    keys: list[tuple] = field(default_factory=list)
    signatures: dict[tuple, Any] = field(default_factory=dict)
    contexts: dict[tuple, tuple[str | None, str | None]] = field(default_factory=dict)
    raised: _Raise | None = None
    seconds: float = 0.0


class _Recorder:
    """Hooks on every module of one copy: signatures of inputs, outputs and output gradients, and where
    the code was when something raised."""

    def __init__(self, model: nn.Module, vectors: _Vectors, perturb: bool) -> None:
        self.run = _Run()
        self.vectors = vectors
        self.seen: dict[int, tuple[Any, int, torch.Tensor]] = {}
        self.stack: list[list[Any]] = []  # [name, call key, last child completed]
        self.last_top: str | None = None
        self.backward_open: list[str] = []
        self.calls: dict[str, int] = {}
        self.handles: list[Any] = []
        self.factors: dict[tuple, torch.Tensor] = {}
        self.perturb = perturb
        for name, module in model.named_modules():
            if perturb:
                self.handles.append(module.register_forward_hook(self._perturb))
            self.handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(name), with_kwargs=True, always_call=True))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def record(self, key: tuple, obj: Any, context: tuple[str | None, str | None]) -> None:
        if key in self.run.signatures:
            return
        self.run.keys.append(key)
        self.run.signatures[key] = _signature(obj, self.vectors, self.seen)
        self.run.contexts[key] = context

    def _noisy(self, t: torch.Tensor) -> torch.Tensor:
        key = (tuple(t.shape), t.dtype, str(t.device))
        factor = self.factors.get(key)
        if factor is None:  # one random sign pattern per shape: the perturbation is one multiply
            g = torch.Generator().manual_seed(len(self.factors))
            signs = torch.randint(0, 2, t.shape, generator=g).to(torch.float32) * 2 - 1
            factor = self.factors[key] = (1 + signs * _noise_scale(t.dtype)).to(t.device, t.dtype)
        return t * factor

    def _perturb(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Forward hook of the noise run: every output, and later the gradient arriving at it, perturbed."""
        if not _floats(output):
            return None
        output = map_images(output, self._noisy, ranks=None)
        if torch.is_grad_enabled():
            for t in _floats(output):
                if t.requires_grad:
                    t.register_hook(self._noisy)
        return output

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            k = self.calls.get(name, 0)
            self.calls[name] = k + 1
            call = f"{name}#{k}"
            context = (self.stack[-1][0], self.stack[-1][2]) if self.stack else (None, self.last_top)
            self.record(("forward-in", call), (args, kwargs), context)
            self.stack.append([name, call, None])
            if torch.is_grad_enabled():
                for i, t in enumerate(_floats((args, kwargs))):
                    if t.requires_grad:
                        t.register_hook(self._grad(("grad-in", call, i), name, closes=True))

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self.stack:
                return
            frame = self.stack.pop()
            if sys.exc_info()[0] is not None:
                if self.run.raised is None:
                    self.run.raised = _Raise(sys.exc_info()[1], "forward", (frame[0], frame[2]), len(self.run.keys))
                return
            self.record(("forward-out", frame[1]), output, (frame[0], frame[2]))
            if self.stack:
                self.stack[-1][2] = frame[0]
            else:
                self.last_top = frame[0]
            if torch.is_grad_enabled():
                for i, t in enumerate(_floats(output)):
                    if t.requires_grad:
                        t.register_hook(self._grad(("grad-out", frame[1], i), name, closes=False))

        return hook

    def _grad(self, key: tuple, name: str, closes: bool) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            context = (self.backward_open[-1] if self.backward_open else None, None)
            self.record(key, grad, context)
            if closes:
                if name in self.backward_open:
                    self.backward_open.remove(name)
            else:
                self.backward_open.append(name)

        return hook


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


def _loss_of(result: Any) -> torch.Tensor | None:
    if isinstance(result, torch.Tensor):
        return result if result.dim() == 0 and result.requires_grad else None
    if isinstance(result, dict) and isinstance(result.get("loss"), torch.Tensor):
        return _loss_of(result["loss"])
    return None


def _execute(model: nn.Module, step: Callable[[nn.Module, str], Any], layout: str, rng: dict[str, Any],
             vectors: _Vectors, perturb: bool = False) -> _Run:
    for param in model.parameters():
        param.grad = None
    recorder = _Recorder(model, vectors, perturb)
    run = recorder.run
    propagated = False
    start = time.perf_counter()
    _set_rng_state(rng)
    phase = "step"
    try:
        with _SameRandomness():
            result = step(model, layout)
            loss = _loss_of(result)
            recorder.record(("result",), loss if loss is not None else result, (None, recorder.last_top))
            if loss is not None:
                phase = "backward"
                loss.backward()
                phase = "step"
                for pname, param in model.named_parameters():
                    owner = pname.rpartition(".")[0]
                    recorder.record(("param", pname), param.grad, (owner, None))
    except Exception as error:  # noqa: BLE001 - the user's code raising is a result
        propagated = True
        if run.raised is None or run.raised.error is not error:
            context = (recorder.backward_open[-1] if recorder.backward_open else None, None) if phase == "backward" \
                else (None, recorder.last_top)
            run.raised = _Raise(error, phase, context, len(run.keys))
        elif run.raised.phase == "forward" and phase == "backward":
            run.raised.phase = "backward"
    finally:
        recorder.close()
        _set_rng_state(rng)
    if not propagated:
        run.raised = None  # raised inside a module and caught by the user's own code
    run.seconds = time.perf_counter() - start
    # One transfer of all the numbers, after the run.
    keys = list(run.signatures)
    flat = [s for key in keys for _, s in run.signatures[key]]
    values = torch.stack(flat).double().cpu().tolist() if flat else []
    it = iter(values)
    for key in keys:
        run.signatures[key] = [(shape, next(it)) for shape, _ in run.signatures[key]]
    for pname, param in model.named_parameters():
        param.grad = None
    return run


# ---- findings and the result ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """The first place the channels_last run differs from the NCHW run.

    Attributes:
        kind: ``"raised"`` (only in channels_last) or ``"diverged"`` (beyond the layouts' rounding noise).
        phase: ``"forward"``, ``"backward"`` or ``"step"`` (the step code around the model).
        module: the qualified name of the module whose code it is in (``None``: the step code).
        where: ``file:line`` of the user's code, when it can be known.
        detail: the exception (type and first line), or the relative difference and the noise.
    """

    kind: str
    phase: str
    module: str | None
    where: str | None
    detail: str

    def fix(self) -> str:
        """What to change in the user's code, in a few words."""
        if "view size is not compatible" in self.detail or ".view(" in self.detail:
            return "use torch.flatten(x, 1) or .reshape(...) instead of .view(...) there"
        if self.kind == "raised" and "contiguous" in self.detail.lower():
            return "call .contiguous() on the tensor before that op"
        if self.kind == "diverged":
            return ("that code reads memory as if it were NCHW (as_strided, data_ptr, an extension op): call "
                    ".contiguous() on its input first")
        return "make that code layout-agnostic (.reshape instead of .view, .contiguous() before raw-memory ops)"

    def as_dict(self) -> dict[str, Any]:
        """Plain types, for ``metrics.json``."""
        return {"kind": self.kind, "phase": self.phase, "module": self.module, "where": self.where,
                "detail": self.detail, "fix": self.fix()}


@dataclass(frozen=True)
class LayoutCheck:
    """What ``check_layout`` found and chose.

    Attributes:
        verdict: ``"passed"`` (the same in both layouts), ``"fallback"`` (parts run in NCHW: ``fallbacks``),
            ``"contiguous"`` (the whole model should stay NCHW) or ``"not checked"`` (``reason`` says why).
        findings: each fault found, in the order found.
        fallbacks: the ``Fallback``s that make the channels_last step agree with NCHW.
        reason: for ``"not checked"``, why.
        seconds: the check's wall time.
        worst: the largest relative difference seen between the layouts where they agreed, and the noise there.
        timings: where the fault could not be isolated inside the model (the step code, the model's own
            forward), seconds per step of the channels_last model with its fallback and of the contiguous
            model, ``{"channels_last": s, "contiguous": s}``: the faster was kept.
    """

    verdict: str
    findings: tuple[Finding, ...] = ()
    fallbacks: tuple[Fallback, ...] = ()
    reason: str | None = None
    seconds: float = 0.0
    worst: tuple[float, float] | None = None
    timings: dict[str, float] | None = None

    def line(self) -> str:
        """One log line: what was found, where, what was done and how to fix it."""
        if self.verdict == "passed":
            return f"layout check passed: the first batch computes the same in channels_last as in NCHW ({self.seconds:.1f} s)"
        if self.verdict == "not checked":
            return f"layout check skipped: {self.reason}"
        parts = []
        for finding in self.findings:
            where = f" at {finding.where}" if finding.where else ""
            module = ("the step code" if finding.module is None else
                      f"`{finding.module}`" if finding.module else "the model's own forward")
            parts.append(f"{module} {finding.kind} in channels_last only ({finding.phase}{where}: {finding.detail}); "
                         f"fix: {finding.fix()}")
        done = "; ".join(f.describe() for f in self.fallbacks)
        if self.timings:
            done += (f" (measured {1e3 * self.timings['channels_last']:.0f} ms/step channels_last with the fallback, "
                     f"{1e3 * self.timings['contiguous']:.0f} ms/step contiguous)")
        return f"layout check: {' | '.join(parts)} -> {done} ({self.seconds:.1f} s)"

    def as_dict(self) -> dict[str, Any]:
        """Plain types, for ``metrics.json``."""
        return {"verdict": self.verdict, "findings": [f.as_dict() for f in self.findings],
                "fallbacks": [f.as_dict() for f in self.fallbacks], "reason": self.reason,
                "seconds": round(self.seconds, 3), "timings": self.timings}


def _user_frame(error: BaseException) -> str | None:
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        if not any(part in frame.filename for part in _LIBRARY_PARTS) and not frame.filename.startswith("<"):
            return f"{frame.filename}:{frame.lineno}"
    return None


def _source_of(model: nn.Module, name: str | None, step_owner: Any) -> str | None:
    target = dict(model.named_modules()).get(name) if name is not None else step_owner
    if target is None:
        return None
    try:
        method = getattr(type(target), "forward" if name is not None else "training_step", None) or type(target)
        return f"{inspect.getsourcefile(method)}:{inspect.getsourcelines(method)[1]}"
    except (TypeError, OSError):
        return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160]}" if text else type(error).__name__


def _upstream(key: tuple, z: dict[tuple, float], previous: float, index: dict[str, Any]) -> float:
    """The largest difference already present in what ``key``'s value is computed from: a module's
    inputs for its outputs; the gradients arriving at its outputs (and its inputs) for its input and
    parameter gradients; otherwise the event just before."""
    kind = key[0]
    if kind == "forward-out":
        return z.get(("forward-in", key[1]), 0.0)
    if kind == "grad-in":
        calls = [key[1]]
    elif kind == "param":
        calls = index["calls"].get(key[1].rpartition(".")[0], [])
    else:
        return previous
    found = [z.get(("forward-in", c), 0.0) for c in calls]
    found += [z.get(k, 0.0) for c in calls for k in index["grad-out"].get(c, ())]
    return max(found, default=previous)


def _compare(ref: _Run, noise: _Run | None, run: _Run, floor: float) -> tuple[int, tuple, float, float] | None:
    """The first event (position, key, difference, noise) where ``run`` differs from ``ref``, or ``None``.

    An event differs when its difference is above ``floor``, above ``RATIO`` times the noise there, and above
    ``JUMP`` times the difference already in what it is computed from (an ill-conditioned gradient grows
    step by step; a layout fault appears at once)."""
    z = {key: _distance(ref.signatures[key], run.signatures[key]) for key in ref.keys if key in run.signatures}
    index: dict[str, Any] = {"calls": {}, "grad-out": {}}
    for key in ref.keys:
        if key[0] == "forward-in":
            index["calls"].setdefault(key[1].rpartition("#")[0], []).append(key[1])
        elif key[0] == "grad-out":
            index["grad-out"].setdefault(key[1], []).append(key)
    previous = 0.0
    for position, key in enumerate(ref.keys):
        if key not in z:
            continue
        here = z[key]
        bar = max(floor, JUMP * _upstream(key, z, previous, index))
        previous = here
        if here <= bar:
            continue
        if noise is None:
            return position, key, here, float("nan")  # the caller measures the noise and asks again
        z_noise = _distance(ref.signatures[key], noise.signatures[key]) if key in noise.signatures else float("inf")
        if here > max(RATIO * z_noise, bar):
            return position, key, here, z_noise
    return None


def _candidates(context: tuple[str | None, str | None]) -> list[Fallback]:
    """The fallbacks to try for a fault in ``context``'s code, smallest first."""
    module, before = context
    found: list[Fallback] = []
    if before is not None:
        found.append(Fallback("outputs", before))
    name = module
    while name is not None and name != "":
        found.append(Fallback("module", name))
        name = name.rpartition(".")[0] if "." in name else None
    found.append(Fallback("model", ""))
    return found


def check_layout(
    model: nn.Module,
    step: Callable[[nn.Module, str], Any],
    *,
    step_owner: Any = None,
    copy_model: Callable[[nn.Module], nn.Module] = copy.deepcopy,
    floor: float = FLOOR,
    time_fallbacks: bool = True,
) -> LayoutCheck:
    """Run ``step`` in both layouts on copies of ``model`` and choose the NCHW fallbacks its code needs.

    Args:
        model: the model as it will train, already channels_last (not changed: the runs use copies).
        step: ``step(model_copy, layout) -> result`` runs one step's forward and step code on the copy and
            returns the loss (a scalar tensor, or a dict with ``"loss"``; its backward is run here) or, for a
            forward-only check, the outputs. ``layout`` is ``"contiguous"`` or ``"channels_last"``: the step
            puts the model's inputs in it.
        step_owner: the object whose method is the step code (a LightningModule), to name its file.
        copy_model: makes each copy (``cltrain.model_access.detached_copy`` for a LightningModule).
        floor: the smallest relative difference that counts as a finding.
        time_fallbacks: where the fault is not isolated inside the model, time the fallback against the
            whole model contiguous and keep the faster; ``False`` keeps the fallback (a model already
            wrapped by DDP, whose gradient buckets keep the parameters' layout).

    Returns:
        A ``LayoutCheck``.
    """
    start = time.perf_counter()
    vectors = _Vectors()
    rng = _rng_state()
    ref_model = to_contiguous(copy_model(model))
    ref = _execute(ref_model, step, "contiguous", rng, vectors)
    if ref.raised is not None:
        reason = f"the step raised without channels_last too ({_first_line(ref.raised.error)})"
        return LayoutCheck("not checked", reason=reason, seconds=time.perf_counter() - start)
    top_level = {key[1].rpartition("#")[0] for key in ref.keys if key[0] == "forward-out"
                 and ref.contexts[key][0] is None}  # modules the step code calls directly
    noise: _Run | None = None
    fallbacks: list[Fallback] = []
    findings: list[Finding] = []
    pending: list[Fallback] = []
    last_position = -1
    worst: tuple[float, float] | None = None
    for _ in range(_ATTEMPTS):
        trial = copy_model(model)
        apply_fallbacks(trial, fallbacks)
        run = _execute(trial, step, "channels_last", rng, vectors)
        del trial
        first = _compare(ref, noise, run, floor)
        if first is not None and noise is None:
            noise = _execute(ref_model, step, "contiguous", rng, vectors, perturb=True)
            first = _compare(ref, noise, run, floor)
        if run.raised is not None and (first is None or run.raised.position <= first[0]):
            position, context = run.raised.position, run.raised.context
            where = _user_frame(run.raised.error)
            phase = "step" if run.raised.phase == "forward" and context[0] is None else run.raised.phase
            finding = Finding("raised", phase, context[0], where, _first_line(run.raised.error))
        elif first is not None:
            position, key, z, z_noise = first
            context = run.contexts[key]
            phase = {"forward-in": "forward", "forward-out": "forward", "grad-in": "backward",
                     "grad-out": "backward", "param": "backward"}.get(key[0], "step")
            finding = Finding("diverged", phase if context[0] is not None else "step", context[0],
                              _source_of(model, context[0], step_owner),
                              f"{z:.2g} relative difference at {key[0]} of {key[1] if len(key) > 1 else 'the result'}, "
                              f"noise {z_noise:.2g}")
        else:
            worst = _worst(ref, noise, run)
            if not fallbacks:
                return LayoutCheck("passed", seconds=time.perf_counter() - start, worst=worst)
            timings = None
            if time_fallbacks and any(f.module == "" or f.module in top_level for f in fallbacks):
                # Not isolated inside the model: keep whichever of the two costs less.
                trial = copy_model(model)
                apply_fallbacks(trial, fallbacks)
                timings = {"channels_last": _time_step(trial, step, "channels_last", rng),
                           "contiguous": _time_step(ref_model, step, "contiguous", rng)}
                if timings["contiguous"] < timings["channels_last"]:
                    return LayoutCheck("contiguous", tuple(findings), (Fallback("model", ""),),
                                       seconds=time.perf_counter() - start, worst=worst, timings=timings)
            return LayoutCheck("fallback", tuple(findings), tuple(fallbacks), seconds=time.perf_counter() - start,
                               worst=worst, timings=timings)
        if position > last_position:  # a new fault (or the first): its own candidates
            findings.append(finding)
            pending = [c for c in _candidates(context) if c not in fallbacks]
            last_position = position
        elif fallbacks:  # the last fallback did not move the fault: try the next candidate instead
            fallbacks.pop()
        if not pending:
            break
        choice = pending.pop(0)
        if choice.kind == "model":
            break
        fallbacks.append(choice)
    return LayoutCheck("contiguous", tuple(findings), (Fallback("model", ""),), seconds=time.perf_counter() - start)


def _time_step(model: nn.Module, step: Callable[[nn.Module, str], Any], layout: str, rng: dict[str, Any],
               repeats: int = 2) -> float:
    """The faster of ``repeats`` timed runs of the step and its backward (seconds)."""
    best = float("inf")
    for _ in range(repeats):
        _set_rng_state(rng)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with _SameRandomness():
            loss = _loss_of(step(model, layout))
            if loss is not None:
                loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
        for param in model.parameters():
            param.grad = None
    _set_rng_state(rng)
    return best


def _worst(ref: _Run, noise: _Run | None, run: _Run) -> tuple[float, float]:
    worst, at = 0.0, None
    for key in ref.keys:
        if key in run.signatures:
            z = _distance(ref.signatures[key], run.signatures[key])
            if z > worst:
                worst, at = z, key
    z_noise = _distance(ref.signatures[at], noise.signatures[at]) if noise is not None and at in noise.signatures \
        else float("nan")
    return worst, z_noise
