"""A forward pre-hook that puts a model's image arguments in channels_last and checks its first batches.

Loops that call the model themselves (the Hugging Face ``Trainer`` calls ``model(**inputs)``, an Accelerate
loop ``model(x)``) give a plug-in no way to change the batch: the hook changes what the model receives
instead. It converts the first positional argument and the keyword arguments it names (``pixel_values``
by default), when they are floating 4-D/5-D tensors (or lists of them), and nothing else: ``labels``,
masks and boxes keep the layout the collator made. A (B, T, C, H, W) stack of frames or images gets each frame
channels_last (``cltrain.layout.stacks``). The conversion returns new tensors (the caller's batch is not
modified) and runs outside ``torch.compile``'s graph, so a compiled model sees a stable layout. The first
training and the first evaluation forward are traced (not a compiled one): an argument that reaches no
convolution in channels_last is left as it arrives from then on (``left_as_is``), and one line says so.

The hook is a front door of ``cltrain.session.LayoutSession``, which runs the rest: on the first training call (the
model in train mode, gradients on) and the first evaluation call, the check of that batch (``cltrain.check.plain_step``:
the model's forward, and the loss it computes from ``labels``, in both layouts on copies of the model, in float32
outside the loop's autocast; where the model's code assumes NCHW, that part is put in NCHW and one line names it and
the fix); the race of the layouts on the first training steps (a step ends where the next training call starts, or
where the door says, ``session.step_end``: the Hugging Face callback does at each optimizer step's end). In a
distributed run, rank 0 checks its batch and times, and every rank applies what it chose.

Example::

    >>> import torch
    >>> from cltrain.integrations.inputs_hook import ChannelsLastInputs
    >>> model = torch.nn.Conv2d(3, 8, 3)
    >>> hook = ChannelsLastInputs(verify=False, layout="channels_last").attach(model)
    >>> seen = []
    >>> _ = model.register_forward_hook(lambda m, args, out: seen.append(args[0].is_contiguous()))
    >>> _ = model(torch.randn(2, 3, 8, 8))
    >>> seen
    [False]
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from cltrain.check.result import LayoutCheck
from cltrain.devices import device_of
from cltrain.host import Host, shown
from cltrain.layout import has_convolutions
from cltrain.layout.batches import first_image_list, map_tensors
from cltrain.layout.stacks import to_input_layout
from cltrain.options import check_flags, check_layout_choice
from cltrain.session import LayoutSession

__all__ = ["IMAGE_ARGUMENTS", "ChannelsLastInputs", "argument_names"]

#: The forward arguments holding images in Hugging Face vision models (timm models wrapped by
#: ``TimmWrapperForImageClassification`` included).
IMAGE_ARGUMENTS: tuple[str, ...] = ("pixel_values", "pixel_values_videos")

_state = threading.local()  # `checking`: the hook is running the layout check; every hook stands aside


def argument_names(value: str | Sequence[str], where: str) -> tuple[str, ...]:
    """``value`` (a forward argument's name or a list of names) as a tuple.

    Raises:
        ValueError: ``value`` is neither; the message starts with ``where`` (``"Owner(argument=...)"``).
    """
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, Sequence) or not names or not all(isinstance(n, str) and n for n in names) \
            or "all" in names:  # the loop door's 'all' (every tensor of a batch): here a forward argument's name
        raise ValueError(f"{where}: expected the name of the model's image argument (e.g. 'pixel_values') or a list "
                         "of names.")
    return tuple(names)


def _is_image(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() in (4, 5)


def _holds_image(value: Any) -> bool:
    return _is_image(value) or isinstance(value, (list, tuple)) and any(_is_image(v) for v in value)


def _to_channels_last(value: Any, model: nn.Module) -> Any:
    if _is_image(value):
        return to_input_layout(value, model)
    if isinstance(value, (list, tuple)) and any(_is_image(v) for v in value):
        return type(value)(_to_channels_last(v, model) for v in value)
    return value


def _call(model: nn.Module, batch: tuple[tuple[Any, ...], tuple[Any, ...], dict[str, Any]]) -> Any:
    first, rest, kwargs = batch
    # accelerate.prepare under mixed precision makes ``forward`` an autocast-wrapped method, which the check's deepcopy
    # binds to the copy (its float32 run would compute in bfloat16): the copy runs the forward it had before prepare
    original = model.__dict__.get("_original_forward") if "forward" in model.__dict__ else None
    if original is None:
        return model(*first, *rest, **kwargs)
    wrapped, model.forward = model.forward, original
    try:
        return model(*first, *rest, **kwargs)
    finally:
        model.forward = wrapped


class ChannelsLastInputs:
    """Put a model's image arguments in its layout on every call, and run its first batches through the session.

    Args:
        names: the keyword arguments holding images (``"pixel_values"``, or what the model's forward calls
            them); a name or a list of names.
        positional: also convert the first positional argument (``model(x)``).
        verify: run the layout check (``cltrain.check.plain_step``) on the first training and evaluation batch.
        autocast_dtype: the loop's autocast dtype (``torch.bfloat16``, ``torch.float16``, ``None``); the check
            uses it only where the step cannot run in float32.
        logger: where the lines go (default: this module's logger).
        layout: for a hook attached without a session: ``"auto"`` (race the layouts), ``"channels_last"`` or
            ``"contiguous"``.
        steps: ``"forward"``: a training step ends where the next training call starts (a hand-written loop; where
            the session watches the loop's optimizers, the next call after one of them stepped: under gradient
            accumulation the calls up to the optimizer's step are one step); ``"door"``: the door ends each step
            itself (``session.step_end``).

    Attributes:
        layout: the layout the model runs in now (``"channels_last"`` or ``"contiguous"``).
        layout_checks: the ``LayoutCheck`` of the first batch of each kind, ``"train"`` and ``"eval"``.
        optimizers: optimizers whose state follows every change of a parameter's layout.
        left_as_is: the arguments (``0`` for the first positional one, or names) left as they arrive because the
            traced forward took them to no convolution in channels_last.
        session: the ``cltrain.session.LayoutSession`` the hook runs through.

    Raises:
        ValueError: ``names`` is not a name or a list of names, or ``positional`` / ``verify`` is not a bool.

    Example::

        hook = ChannelsLastInputs(names=["pixel_values"]).attach(model)
        model(pixel_values=batch)            # the model gets a channels_last copy; the first call is checked
        hook.layout_checks["train"].line()
    """

    def __init__(
        self,
        names: str | Sequence[str] = IMAGE_ARGUMENTS,
        *,
        positional: bool = True,
        verify: bool = True,
        autocast_dtype: torch.dtype | None = None,
        logger: logging.Logger | None = None,
        layout: str = "auto",
        steps: str = "forward",
    ) -> None:
        names = argument_names(names, f"ChannelsLastInputs(names={names!r})")
        check_flags("ChannelsLastInputs", positional=positional, verify=verify)
        check_layout_choice("ChannelsLastInputs", layout)
        self.names, self.positional, self.verify, self.steps = names, positional, verify, steps
        self.autocast_dtype = autocast_dtype
        self.log = logger or logging.getLogger(__name__)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.model: nn.Module | None = None
        self.session = LayoutSession(layout=layout, verify=verify, host=self.host())
        self._handles: list[RemovableHandle] = []
        self._keys: dict[int, str | int] = {}
        self._hinted = False
        self._last: str | None = None
        self.pending: list[Callable[[], None]] = []  # run at the model's next call (a checkpoint's state to restore)

    def _say(self, message: str, warn: bool) -> None:
        shown(self.log).log(logging.WARNING if warn else logging.INFO, message)

    def host(self, **kwargs: Any) -> Host:
        """The host this hook lends its session: its logger, its ``optimizers``."""
        return Host(self._say, optimizers=lambda: self.optimizers, **kwargs)

    @property
    def layout(self) -> str:
        """The layout the model runs in now."""
        return self.session.layout or "channels_last"

    @property
    def layout_checks(self) -> dict[str, Any]:
        """The ``LayoutCheck`` of the first batch of each kind, ``"train"`` and ``"eval"``."""
        return self.session.layout_checks

    @property
    def left_as_is(self) -> set[str | int]:
        """The arguments (``0``: the first positional one, or names) left as they arrive: the traced forward took
        them to no convolution in channels_last."""
        left = self.session.inputs.trace.left_as_is.values()
        return {self._keys[p] for positions in left for p in positions if p in self._keys}

    def attach(self, model: nn.Module, session: LayoutSession | None = None) -> ChannelsLastInputs:
        """Register the hook on ``model`` (first among its pre-hooks), leaving the model it was on before and any
        other ``ChannelsLastInputs`` on ``model``; ``session``: the door's ``LayoutSession`` that converted it
        (default: this hook's own, which converts ``model`` now)."""
        self.detach()
        other = ChannelsLastInputs.of(model)
        if other is not None:
            other.detach()
        self.model = model
        if session is not None:
            self.session = session
        elif self.session.layout is None:
            self.session.start(model, dtype=self.autocast_dtype)
        self._handles = [model.register_forward_pre_hook(self, with_kwargs=True, prepend=True),
                         model.register_forward_hook(self._forward_done, always_call=True)]
        return self

    def detach(self) -> None:
        """Remove the hook from its model."""
        for handle in self._handles:
            handle.remove()
        self._handles, self.model = [], None

    @staticmethod
    def of(model: nn.Module) -> ChannelsLastInputs | None:
        """The ``ChannelsLastInputs`` attached to ``model``, or ``None``."""
        return next((h for h in model._forward_pre_hooks.values() if isinstance(h, ChannelsLastInputs)), None)

    def __deepcopy__(self, memo: dict[int, Any]) -> ChannelsLastInputs:
        # A copy of the model (the check's, an EMA's) shares the hook: its inputs are converted, never checked.
        return self

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Dynamo traces this far where the model was compiled after the hook was attached (``accelerator.prepare``
        # with a ``dynamo_backend``, ``torch.compile`` after it): its forward is then not traced (the trace's
        # function mode made Dynamo compile it as ~50 graphs, and again after); the rest runs eagerly
        return self._before_forward(module, args, kwargs, torch.compiler.is_compiling())

    @torch.compiler.disable
    def _before_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                        compiled: bool) -> Any:
        if getattr(_state, "checking", False) or self.session.layout is None:
            return None
        self.session.inputs.compiled = compiled
        if module is self.model:
            self.run_pending()
        if module is not self.model:  # a copy: its inputs in the layout, nothing else
            if self.layout != "channels_last" or not self.session.convert_inputs:
                return None
            first = (_to_channels_last(args[0], module), *args[1:]) if self.positional and args else args
            return first, {k: _to_channels_last(v, module) if k in self.names else v for k, v in kwargs.items()}
        kind = "train" if module.training and torch.is_grad_enabled() else "eval"
        if self.steps == "forward":  # a hand-written loop: its calls are all the events there are
            # the previous training step ended where this call starts (its optimizer step done, evaluation or not);
            # a cycle that an evaluation ends before its optimizer step is not timed; evaluation calls that follow
            # evaluation calls end nothing (nor count as batches without an optimizer step). An evaluation may run on
            # one rank alone (`if accelerator.is_main_process:`): what every rank must join (the race's judgement, DDP's
            # buckets built again) waits for the next training step there
            alone = self.session.host.evaluates_alone()
            if kind == "train" or self._last == "train":
                stepped = self.session.optimizer_stepped()
                if kind == "eval" or stepped:
                    self.session.step_end(module, completed=stepped, judge=kind == "train" or not alone)
            if kind == "eval" and self._last == "train" and not alone:
                self.session.boundary(module, after="before an evaluation")
        self._last = kind
        if not self._hinted:
            self._hinted = True
            self._hint(args, kwargs)
        found = self._found(args, kwargs)
        arguments = {("args[0]" if k == 0 else k): (args[0] if k == 0 else kwargs[k]) for k in found}
        if not found and self.positional and args and first_image_list(args[:1]) is not None:
            arguments = {"args[0]": args[0]}  # a detector's list of 3-D images: nothing to convert; the race times it
        self._keys = {p: k for p, k in enumerate(k for k in found for _ in _image_count(arguments, k))}
        check = (lambda: self._check(module, args, kwargs, kind, found)) if self.verify else None
        self.session.inputs.inputs = tuple(arguments) or None
        new = self.session.batch(kind, arguments, module, check, in_place=False)
        if new is arguments:
            return None
        new_args = (new["args[0]"], *args[1:]) if "args[0]" in new else args
        return new_args, {**kwargs, **{k: v for k, v in new.items() if k != "args[0]"}}

    def run_pending(self) -> None:
        """Run what waits for the model's next call, in order, once."""
        while self.pending:
            self.pending.pop(0)()

    def _forward_done(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if module is self.model:
            self.session.batch_end(restore=False, completed=sys.exc_info()[0] is None)

    def _found(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str | int]:
        """What the hook converts in this call: ``0`` for the first positional argument, and names."""
        first: list[str | int] = [0] if self.positional and args and _holds_image(args[0]) else []
        return first + [k for k in self.names if k in kwargs and _holds_image(kwargs[k])]

    def _hint(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._found(args, kwargs):
            return
        others = [k for k, v in kwargs.items() if _is_image(v)]
        if others:
            self.session.unnamed_images = True
            rgb = [k for k in others if kwargs[k].shape[1] == 3]  # a mask or a depth map has one channel
            named = (rgb or others)[0] if len(rgb or others) == 1 else rgb or others
            self.log.info(
                "ChannelsLast: the model's forward got no image argument named %s; %s look like images: name the "
                "images among them with inputs=%r to convert them (a mask or a target stays as the collator built "
                "it; the first convolution converts the activations meanwhile).",
                list(self.names), others, named,
            )

    def _check(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], kind: str,
               found: list[str | int]) -> LayoutCheck:
        """The door's step runner: the model's forward (and its loss) on this call's arguments, in both layouts."""
        from cltrain.check.plain_step import check_plain_step

        if not found and not (has_convolutions(module) and _holds_pixels((args, kwargs))):
            return LayoutCheck("not checked", reason="the model's forward got no image argument to check")
        # no 4-D/5-D image argument (a detector's list of 3-D images, images under another name): the forward is
        # checked on its arguments as they come, which its convolutions read in either layout (a text-only call,
        # pixel_values=None, is not: no convolution would run, and "passed" would say nothing)
        grad = torch.enable_grad() if kind == "train" else torch.no_grad()
        _state.checking = True
        try:  # positional: the first argument alone; the check restrides only what `found` names
            with torch.autocast(device_of(module).type, enabled=False), grad:  # float32: the loop's autocast is outside
                return check_plain_step(module, (args[:1], args[1:], kwargs), _call, inputs=found or None,
                                        autocast_dtype=self.autocast_dtype, samples=self.session.check_samples,
                                        convert_inputs=self.session.convert_inputs and bool(found))
        finally:
            _state.checking = False


def _holds_pixels(value: Any) -> bool:
    """Whether ``value`` (a call's arguments) holds a floating tensor of 3 to 5 dimensions, at any depth."""
    found: list[bool] = []
    map_tensors(value, lambda t: found.append(t.is_floating_point() and t.dim() in (3, 4, 5)))
    return any(found)


def _image_count(arguments: dict[str, Any], key: str | int) -> list[torch.Tensor]:
    value = arguments["args[0]" if key == 0 else key]
    return [value] if _is_image(value) else [v for v in value if _is_image(v)]
