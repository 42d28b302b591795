"""One step of a model run with every module's tensors summarised as they pass: what
``cltrain.check.compare`` compares between the layouts.

``execute(model, step, layout, rng, vectors)`` runs ``step`` (and the backward of the loss it returns, and
``after_backward``: the hooks, clipping and optimizer step on copies) on ``model`` with hooks on every
module: each module call's inputs and outputs, the gradients arriving at its outputs and inputs, the
result, every parameter's gradient and, with ``updates=True``, every parameter's change are reduced to a
few numbers (a norm and fixed random projections, ``signature``), and where the code was when something
raised is kept.
Random ops draw in the logical order whatever the strides (``SameRandomness``), and the RNG state is
set before and restored after. With ``perturb=True`` every module output, and the gradient arriving at
it, is perturbed by ``noise_scale`` of its dtype: the noise run.

The code after the backward starts from the same gradient values in every run (``GradientTape``): the
reference run keeps each parameter's gradient as its backward leaves it, the others record their own and
then take those values, in their own strides. An update rule that turns a near-zero gradient into a full
step (Adam's first step is about ``lr * sign(g)``) then cannot amplify the backward's rounding, while
code that reads a gradient's memory as NCHW still moves values. Before a copied optimizer steps, its state
tensors take their parameter's strides, as the same run in that layout would have built them.
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode

from cltrain.check.fallback import map_images
from cltrain.check.isolation import ReferenceOutputs

__all__ = ["GradientTape", "Raise", "Recorder", "Run", "SameRandomness", "Vectors", "distance", "execute", "floats",
           "loss_of", "noise_scale", "projection_loss", "rng_state", "set_rng_state", "signature"]

_PROJECTIONS = 3


# ---- signatures: a few numbers per tensor that a moved value changes ----------------------------------------


class Vectors:
    """Fixed random vectors per (size, device): the same in every run."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int, str], torch.Tensor] = {}

    def get(self, size: int, dim: int, device: torch.device) -> torch.Tensor:
        key = (size, dim, str(device))
        if key not in self._cache:
            g = torch.Generator().manual_seed(1_000_003 * size + dim)
            self._cache[key] = torch.randn(size, _PROJECTIONS, generator=g).to(device)
        return self._cache[key]


def project(x: torch.Tensor, vectors: Vectors) -> torch.Tensor:
    """``_PROJECTIONS`` projections of ``x`` (float) on rank-1 random tensors: shape ``(_PROJECTIONS,)``.

    Each is ``sum(x[i, j, ...] * a[i] * b[j] * ...)``; a value moved to another index changes it, a
    permutation-invariant statistic (sum, norm) would not."""
    if x.dim() == 0:
        return x.reshape(1).expand(_PROJECTIONS)
    # Contract in memory order, the stride-1 dim first: in the logical order the first matmul strides through
    # a channels_last tensor's memory (measured in the check's cost: docs/performance.md). Size-1 dims go first:
    # their stride says nothing, and one taken for the stride-1 dim makes the first product as large as x.
    order = sorted(range(x.dim()), key=lambda d: (x.shape[d] > 1, -x.stride(d), d))
    y = x.permute(order) @ vectors.get(x.shape[order[-1]], order[-1], x.device)  # (..., P)
    for d in order[:-1]:
        v = vectors.get(x.shape[d], d, x.device)  # (size, P): contracts the leading dim
        y = (y * v.view(v.shape[0], *([1] * (y.dim() - 2)), _PROJECTIONS)).sum(0)
    return y


def projection_loss(output: Any, vectors: Vectors | None = None) -> torch.Tensor:
    """A scalar whose gradient is dense and layout-independent: the sum of the projections of every
    floating tensor in ``output`` (for checking a model without its own loss)."""
    vectors = vectors or Vectors()
    total = None
    for t in floats(output):
        term = project(t.float(), vectors).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("projection_loss: the model's output holds no floating tensor.")
    return total


def floats(obj: Any) -> list[torch.Tensor]:
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


def signature(obj: Any, vectors: Vectors, seen: dict[int, tuple[Any, int, torch.Tensor]] | None = None,
               ) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Per floating tensor: its shape and ``[norm, projections...]`` (a device tensor: no sync here).

    ``seen`` caches by tensor (and its version): a module's input is mostly the previous one's output."""
    out = []
    for t in floats(obj):
        cache = seen if not t.is_inference() else None  # inference tensors have no version counter
        version = t._version if cache is not None else -1
        hit = cache.get(id(t)) if cache is not None else None
        if hit is not None and hit[0]() is t and hit[1] == version:
            out.append((tuple(t.shape), hit[2]))
            continue
        x = t.detach().float()
        sig = torch.cat([torch.linalg.vector_norm(x).reshape(1), project(x, vectors)])
        if cache is not None:
            cache[id(t)] = (weakref.ref(t), version, sig)
        out.append((tuple(t.shape), sig))
    return out


def distance(a: list[tuple[tuple[int, ...], list[float]]], b: list[tuple[tuple[int, ...], list[float]]]) -> float:
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


def noise_scale(dtype: torch.dtype) -> float:
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


class SameRandomness(TorchFunctionMode):
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
class Raise:
    error: BaseException
    phase: str  # "forward", "backward", "step" or "update" (after the backward: hooks, clipping, optimizer)
    context: tuple[str | None, str | None]  # (the module whose code ran, the module completed just before)
    position: int  # how many events had happened


@dataclass
class Run:
    keys: list[tuple] = field(default_factory=list)
    signatures: dict[tuple, Any] = field(default_factory=dict)
    contexts: dict[tuple, tuple[str | None, str | None]] = field(default_factory=dict)
    raised: Raise | None = None
    seconds: float = 0.0


class Recorder:
    """Hooks on every module of one copy: signatures of inputs, outputs and output gradients, and where
    the code was when something raised."""

    def __init__(self, model: nn.Module, vectors: Vectors, perturb: bool,
                 outputs: ReferenceOutputs | None = None) -> None:
        self.run = Run()
        self.outputs = outputs
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
            # prepend: the input as the caller passed it, before a guardrail's own pre-hook copies it (the guarded
            # layer and its guard are one unit; the copy's gradient would be that branch's share only)
            self.handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True, prepend=True))
            self.handles.append(module.register_forward_hook(self._post(name), with_kwargs=True, always_call=True))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()

    def record(self, key: tuple, obj: Any, context: tuple[str | None, str | None]) -> None:
        if key in self.run.signatures:
            return
        self.run.keys.append(key)
        self.run.signatures[key] = signature(obj, self.vectors, self.seen)
        self.run.contexts[key] = context

    def _noisy(self, t: torch.Tensor) -> torch.Tensor:
        key = (tuple(t.shape), t.dtype, str(t.device))
        factor = self.factors.get(key)
        if factor is None:  # one random sign pattern per shape: the perturbation is one multiply
            g = torch.Generator().manual_seed(len(self.factors))
            signs = torch.randint(0, 2, t.shape, generator=g).to(torch.float32) * 2 - 1
            factor = self.factors[key] = (1 + signs * noise_scale(t.dtype)).to(t.device, t.dtype)
        return t * factor

    def _perturb(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Forward hook of the noise run: every output, and later the gradient arriving at it, perturbed."""
        if not floats(output):
            return None
        output = map_images(output, self._noisy, ranks=None)
        if torch.is_grad_enabled():
            for t in floats(output):
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
                for i, t in enumerate(floats((args, kwargs))):
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
                    self.run.raised = Raise(sys.exc_info()[1], "forward", (frame[0], frame[2]), len(self.run.keys))
                return
            self.record(("forward-out", frame[1]), output, (frame[0], frame[2]))
            # recorded first: a module's own difference is seen; what follows computes from the reference's values
            handed = self.outputs.pass_on(frame[1], output) if self.outputs is not None else output
            if self.stack:
                self.stack[-1][2] = frame[0]
            else:
                self.last_top = frame[0]
            if torch.is_grad_enabled():
                for i, t in enumerate(floats(handed)):
                    if t.requires_grad:
                        t.register_hook(self._grad(("grad-out", frame[1], i), name, closes=False))
            return None if handed is output else handed

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


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


def loss_of(result: Any) -> torch.Tensor | None:
    if isinstance(result, torch.Tensor):
        return result if result.dim() == 0 and result.requires_grad else None
    if isinstance(result, dict) and isinstance(result.get("loss"), torch.Tensor):
        return loss_of(result["loss"])
    return None


class GradientTape:
    """Each parameter's gradient after each backward of the reference run (``recording``), given to the
    same parameter at the same point of every later run."""

    def __init__(self) -> None:
        self.grads: dict[tuple[str, int], torch.Tensor] = {}
        self.recording = True

    def hooks(self, model: nn.Module, recorder: Recorder) -> list[Any]:
        """Post-accumulate-grad hooks on ``model``'s parameters: record the gradient, then keep or take the tape's."""
        fires: dict[str, int] = {}

        def hook_for(name: str) -> Callable[[torch.Tensor], None]:
            def hook(param: torch.Tensor) -> None:
                k = fires[name] = fires.get(name, -1) + 1
                recorder.record(("param", name), param.grad, (name.rpartition(".")[0], None))
                if param.grad is None:
                    return
                if self.recording:
                    self.grads[(name, k)] = param.grad.detach().clone()
                    return
                ref = self.grads.get((name, k))
                if ref is not None and ref.shape == param.grad.shape:
                    with torch.no_grad():
                        param.grad.copy_(ref)  # the reference's values in this run's strides

            return hook

        return [p.register_post_accumulate_grad_hook(hook_for(n)) for n, p in model.named_parameters()
                if p.requires_grad]


def _state_in_param_strides(model: nn.Module) -> Any:
    """A global optimizer pre-step hook: an optimizer of ``model``'s parameters gets each state tensor of a
    parameter's shape in that parameter's strides (a fused or foreach kernel requires it; the copy's
    parameters may have changed layout since the state was copied)."""
    own = {id(p) for p in model.parameters()}

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p) if id(p) in own else None
                for key, value in (state or {}).items():
                    if isinstance(value, torch.Tensor) and value.shape == p.shape and value.stride() != p.stride() \
                            and p.is_contiguous(memory_format=_format_of(p)):
                        state[key] = torch.empty_like(p, dtype=value.dtype, device=value.device).copy_(value)

    return register_optimizer_step_pre_hook(hook)


def _format_of(t: torch.Tensor) -> torch.memory_format:
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def execute(model: nn.Module, step: Callable[[nn.Module, str], Any], layout: str, rng: dict[str, Any],
            vectors: Vectors, perturb: bool = False, after_backward: Callable[[nn.Module], Any] | None = None,
            updates: bool = False, tape: GradientTape | None = None, outputs: ReferenceOutputs | None = None) -> Run:
    """One recorded run of ``step`` on ``model`` (see the module docstring); ``after_backward(model)`` runs
    after the loss's backward; ``updates`` records each parameter's change over the whole run; ``tape``
    records the gradients (while ``tape.recording``) or gives its values to this run's parameters; ``outputs``
    keeps every module call's outputs (while ``outputs.recording``) or hands on its values in their place
    (``cltrain.check.isolation``)."""
    for param in model.parameters():
        param.grad = None
    before = {name: p.detach().clone() for name, p in model.named_parameters()} if updates else {}
    recorder = Recorder(model, vectors, perturb, outputs)
    run = recorder.run
    handles = tape.hooks(model, recorder) if tape is not None else []
    handles.append(_state_in_param_strides(model))
    propagated = False
    start = time.perf_counter()
    set_rng_state(rng)
    phase = "step"
    try:
        with SameRandomness():
            result = step(model, layout)
            loss = loss_of(result)
            recorder.record(("result",), loss if loss is not None else result, (None, recorder.last_top))
            if loss is not None:
                phase = "backward"
                loss.backward()
                phase = "step"
                for pname, param in model.named_parameters():
                    owner = pname.rpartition(".")[0]
                    recorder.record(("param", pname), param.grad, (owner, None))
                if after_backward is not None:
                    phase = "update"
                    after_backward(model)
                    phase = "step"
            with torch.no_grad():
                for pname, param in model.named_parameters():
                    if pname in before:
                        recorder.record(("update", pname), param.detach() - before[pname],
                                        (pname.rpartition(".")[0], None))
    except Exception as error:  # noqa: BLE001 - the user's code raising is a result
        propagated = True
        if run.raised is None or run.raised.error is not error:
            context = (recorder.backward_open[-1] if recorder.backward_open else None, None) if phase == "backward" \
                else (None, None) if phase == "update" else (None, recorder.last_top)
            run.raised = Raise(error, phase, context, len(run.keys))
        elif run.raised.phase == "forward" and phase == "backward":
            run.raised.phase = "backward"
    finally:
        recorder.close()
        for handle in handles:
            handle.remove()
        set_rng_state(rng)
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
