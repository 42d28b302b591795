"""One step of a model run with every module's tensors summarised as they pass: what
``cltrain.check.compare`` compares between the layouts.

``execute(model, step, layout, rng, vectors)`` runs ``step`` (and the backward of the loss it returns, and
``after_backward``: the hooks, clipping and optimizer step on copies) on ``model`` with hooks on every
module: each module call's inputs and outputs, the gradients arriving at its outputs and inputs, the
result, every parameter's gradient and, with ``updates=True``, every parameter's change are reduced to a
few numbers (``cltrain.check.signature``), each under its ``Event`` (``cltrain.check.events``), and where
the code was when something raised is kept. Random ops draw in the logical order whatever the strides
(``cltrain.check.randomness``), and the RNG state is set before and restored after. With ``perturb=True``
every module output, and the gradient arriving at it, is perturbed by ``noise_scale`` of its dtype: the
noise run. A ``GradientTape`` (``cltrain.check.gradient_tape``) gives every run the reference's gradients;
before a copied optimizer steps, its state tensors take their parameter's strides
(``cltrain.layout.optimizer_state``), as the same run in that layout would have built them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cltrain.check.events import Event
from cltrain.check.fallback import map_images
from cltrain.check.gradient_tape import GradientTape
from cltrain.check.isolation import ReferenceOutputs
from cltrain.check.randomness import same_randomness, set_rng_state
from cltrain.check.signature import Vectors, floats, noise_scale, numbers, signature
from cltrain.layout.optimizer_state import state_in_param_strides

__all__ = ["Raise", "Recorder", "Run", "execute", "loss_of"]


@dataclass
class Raise:
    error: BaseException
    phase: str  # "forward", "backward", "step" or "update" (after the backward: hooks, clipping, optimizer)
    context: tuple[str | None, str | None]  # (the module whose code ran, the module completed just before)
    position: int  # how many events had happened


@dataclass
class Run:
    keys: list[Event] = field(default_factory=list)
    signatures: dict[Event, Any] = field(default_factory=dict)
    contexts: dict[Event, tuple[str | None, str | None]] = field(default_factory=dict)
    raised: Raise | None = None
    seconds: float = 0.0
    only: set[Event] | None = None  # the events this run was asked to measure (None: every event)


class _Measured(Exception):
    """Raised by a run asked for some events only, once it has measured them all: the rest is not run."""


class Recorder:
    """Hooks on every module of one copy: signatures of inputs, outputs and output gradients, and where
    the code was when something raised."""

    def __init__(self, model: nn.Module, vectors: Vectors, perturb: bool,
                 outputs: ReferenceOutputs | None = None, only: set[Event] | None = None) -> None:
        self.run = Run(only=None if only is None else set(only))
        self.remaining = None if only is None else set(only)
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
        """Remove every hook, the tensors' too: a tensor that autograd holds (a graph that an exception's traceback
        keeps) would keep the recorder, and through it the copies, past any garbage collection."""
        for handle in self.handles:
            handle.remove()

    def record(self, key: Event, obj: Any, context: tuple[str | None, str | None]) -> None:
        if key in self.run.signatures or self.remaining is not None and key not in self.remaining:
            return
        self.run.keys.append(key)
        self.run.signatures[key] = signature(obj, self.vectors, self.seen)
        self.run.contexts[key] = context
        if self.remaining is not None:
            self.remaining.discard(key)
            if not self.remaining:
                raise _Measured

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
                    self.handles.append(t.register_hook(self._noisy))
        return output

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            k = self.calls.get(name, 0)
            self.calls[name] = k + 1
            call = f"{name}#{k}"
            context = (self.stack[-1][0], self.stack[-1][2]) if self.stack else (None, self.last_top)
            self.record(Event("forward-in", call), (args, kwargs), context)
            self.stack.append([name, call, None])
            if torch.is_grad_enabled():
                for i, t in enumerate(floats((args, kwargs))):
                    if t.requires_grad:
                        self.handles.append(t.register_hook(self._grad(Event("grad-in", call, i), name, closes=True)))

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
            self.record(Event("forward-out", frame[1]), output, (frame[0], frame[2]))
            # recorded first: a module's own difference is seen; what follows computes from the reference's values
            handed = self.outputs.pass_on(frame[1], output) if self.outputs is not None else output
            if self.stack:
                self.stack[-1][2] = frame[0]
            else:
                self.last_top = frame[0]
            if torch.is_grad_enabled():
                for i, t in enumerate(floats(handed)):
                    if t.requires_grad:
                        self.handles.append(
                            t.register_hook(self._grad(Event("grad-out", frame[1], i), name, closes=False)))
            return None if handed is output else handed

        return hook

    def _grad(self, key: Event, name: str, closes: bool) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            context = (self.backward_open[-1] if self.backward_open else None, None)
            self.record(key, grad, context)
            if closes:
                if name in self.backward_open:
                    self.backward_open.remove(name)
            else:
                self.backward_open.append(name)

        return hook


def loss_of(result: Any) -> torch.Tensor | None:
    if isinstance(result, torch.Tensor):
        return result if result.dim() == 0 and result.requires_grad else None
    if isinstance(result, dict) and isinstance(result.get("loss"), torch.Tensor):
        return loss_of(result["loss"])
    return None


def execute(model: nn.Module, step: Callable[[nn.Module, str], Any], layout: str, rng: dict[str, Any],
            vectors: Vectors, perturb: bool = False, after_backward: Callable[[nn.Module], Any] | None = None,
            updates: bool = False, tape: GradientTape | None = None, outputs: ReferenceOutputs | None = None,
            only: set[Event] | None = None) -> Run:
    """One recorded run of ``step`` on ``model`` (see the module docstring); ``after_backward(model)`` runs
    after the loss's backward; ``updates`` records each parameter's change over the whole run; ``tape``
    records the gradients (while ``tape.recording``) or gives its values to this run's parameters; ``outputs``
    keeps every module call's outputs (while ``outputs.recording``) or hands on its values in their place
    (``cltrain.check.isolation``); ``only`` measures those events alone and stops the run once it has them all."""
    for param in model.parameters():
        param.grad = None
    before = {name: p.detach().clone() for name, p in model.named_parameters()} if updates else {}
    recorder = Recorder(model, vectors, perturb, outputs, only)
    run = recorder.run
    handles = tape.hooks(model, recorder) if tape is not None else []
    handles.append(state_in_param_strides(model.parameters()))
    propagated = False
    start = time.perf_counter()
    set_rng_state(rng)
    phase = "step"
    try:
        with same_randomness():
            result = step(model, layout)
            loss = loss_of(result)
            recorder.record(Event("result"), loss if loss is not None else result, (None, recorder.last_top))
            if loss is not None:
                phase = "backward"
                loss.backward()
                phase = "step"
                for pname, param in model.named_parameters():
                    key = Event("param", pname)
                    recorder.record(key, param.grad, (key.module, None))
                if after_backward is not None:
                    phase = "update"
                    after_backward(model)
                    phase = "step"
            with torch.no_grad():
                for pname, param in model.named_parameters():
                    if pname in before:
                        key = Event("update", pname)
                        recorder.record(key, param.detach() - before[pname], (key.module, None))
    except _Measured:
        pass
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
    it = iter(numbers([s for key in keys for _, s in run.signatures[key]]))
    for key in keys:
        run.signatures[key] = [(shape, next(it)) for shape, _ in run.signatures[key]]
    for pname, param in model.named_parameters():
        param.grad = None
    return run
