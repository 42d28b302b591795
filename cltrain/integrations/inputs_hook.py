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

On the first training call (the model in train mode, gradients on) and the first evaluation call, the hook
checks that batch (``cltrain.check.plain_step``, through its ``cltrain.session.LayoutSession``): the model's
forward, and the loss it computes from ``labels``, in both layouts on copies of the model, in float32 outside the
loop's autocast. Where the model's
code assumes NCHW, that part is put in NCHW (one log line names it and the fix); nothing of the real run
changes. In a distributed run, rank 0 checks its batch and every rank applies what it chose (a model with
``SyncBatchNorm`` is not checked: its copies would wait for the other ranks).

Example::

    >>> import torch
    >>> from cltrain.integrations.inputs_hook import ChannelsLastInputs
    >>> model = torch.nn.Conv2d(3, 8, 3)
    >>> hook = ChannelsLastInputs(verify=False).attach(model)
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
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from cltrain.layout.stacks import to_input_layout
from cltrain.options import check_flags
from cltrain.host import Host
from cltrain.session import InputTrace, LayoutSession

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
    if not isinstance(names, Sequence) or not names or not all(isinstance(n, str) and n for n in names):
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


def _images(value: Any) -> list[torch.Tensor]:
    return [value] if _is_image(value) else [v for v in value if _is_image(v)] if isinstance(value, (list, tuple)) \
        else []


def _call(model: nn.Module, batch: tuple[tuple[Any, ...], tuple[Any, ...], dict[str, Any]]) -> Any:
    first, rest, kwargs = batch
    return model(*first, *rest, **kwargs)


class ChannelsLastInputs:
    """Put a model's image arguments in channels_last on every call, and check its first batches.

    Args:
        names: the keyword arguments holding images (``"pixel_values"``, or what the model's forward calls
            them); a name or a list of names.
        positional: also convert the first positional argument (``model(x)``).
        verify: run the layout check (``cltrain.check.plain_step``) on the first training and evaluation batch.
        autocast_dtype: the loop's autocast dtype (``torch.bfloat16``, ``torch.float16``, ``None``); the check
            uses it only where the step cannot run in float32.
        logger: where the check's result and hints go (default: this module's logger).

    Attributes:
        layout: ``"channels_last"``, or ``"contiguous"`` once a check put the whole model in NCHW (the hook
            then stops converting).
        layout_checks: the ``LayoutCheck`` of the first batch of each kind, ``"train"`` and ``"eval"``.
        optimizers: optimizers whose state is restrided to its parameters' strides when a check changes them.
        left_as_is: the arguments (``0`` for the first positional one, or names) left as they arrive because the
            traced forward took them to no convolution in channels_last.

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
    ) -> None:
        names = argument_names(names, f"ChannelsLastInputs(names={names!r})")
        check_flags("ChannelsLastInputs", positional=positional, verify=verify)
        self.names = names
        self.positional = positional
        self.verify = verify
        self.autocast_dtype = autocast_dtype
        self.log = logger or logging.getLogger(__name__)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.model: nn.Module | None = None
        self.session = LayoutSession(host=self._host())
        self._trace = InputTrace(say=self._say)
        self._handles: list[RemovableHandle] = []
        self._hinted = False

    def _say(self, message: str, warn: bool) -> None:
        self.log.log(logging.WARNING if warn else logging.INFO, message)

    def _host(self) -> Host:
        return Host(self._say, optimizers=lambda: self.optimizers)

    @property
    def layout(self) -> str:
        """``"channels_last"``, or ``"contiguous"`` once a check put the whole model in NCHW."""
        return self.session.layout or "channels_last"

    @property
    def layout_checks(self) -> dict[str, Any]:
        """The ``LayoutCheck`` of the first batch of each kind, ``"train"`` and ``"eval"``."""
        return self.session.layout_checks

    @property
    def left_as_is(self) -> set[str | int]:
        """The arguments (``0``: the first positional one, or names) left as they arrive: the traced forward took
        them to no convolution in channels_last."""
        return {key for keys in self._trace.left_as_is.values() for key, _ in keys}

    def attach(self, model: nn.Module, session: LayoutSession | None = None) -> ChannelsLastInputs:
        """Register the hook on ``model`` (first among its pre-hooks), leaving the model it was on before;
        ``session``: the ``LayoutSession`` that converted it (default: one for the model as it is)."""
        self.detach()
        self.model = model
        self.session = session or LayoutSession.of(model, dtype=self.autocast_dtype, host=self._host())
        self._handles = [model.register_forward_pre_hook(self, with_kwargs=True, prepend=True),
                         model.register_forward_hook(self._end_trace, always_call=True)]
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

    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if getattr(_state, "checking", False) or self.layout != "channels_last":
            return None
        left = self.left_as_is
        convert = self.positional and args and 0 not in left
        new_args = (_to_channels_last(args[0], module), *args[1:]) if convert else args
        new_kwargs = {k: _to_channels_last(v, module) if k in self.names and k not in left else v
                      for k, v in kwargs.items()}
        if module is self.model:
            if not self._hinted:
                self._hinted = True
                self._hint(args, kwargs)
            kind = "train" if module.training and torch.is_grad_enabled() else "eval"
            if self.verify and kind not in self.layout_checks:
                self._check(module, args, kwargs, kind)
                if self.layout != "channels_last":  # the whole model stays NCHW: so do its inputs
                    return None
            if not self._trace.traced(kind):
                self._start_trace(kind, module, args, kwargs, new_args, new_kwargs)
        return new_args, new_kwargs

    def _start_trace(self, kind: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     new_args: tuple[Any, ...], new_kwargs: dict[str, Any]) -> None:
        """Trace this forward (``cltrain.session.InputTrace``): each converted input that reaches no convolution in
        its layout is left as it arrives from then on (a stack the model makes contiguous first)."""
        converted: dict[Any, torch.Tensor] = {}
        left = self.left_as_is
        pairs = [(0, args[0], new_args[0])] if self.positional and args and 0 not in left else []
        pairs += [(k, kwargs[k], new_kwargs[k]) for k in self.names if k in kwargs and k not in left]
        for key, old, new in pairs:
            for i, (a, b) in enumerate(zip(_images(old), _images(new))):
                if a is not b:
                    converted[(key, i)] = b
        self._trace.start(kind, converted, module)

    def _end_trace(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._trace.end(completed=sys.exc_info()[0] is None)

    def _found(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str | int]:
        """What the hook converts in this call: ``0`` for the first positional argument, and names."""
        first: list[str | int] = [0] if self.positional and args and _holds_image(args[0]) else []
        return first + [k for k in self.names if k in kwargs and _holds_image(kwargs[k])]

    def _hint(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._found(args, kwargs):
            return
        others = [k for k, v in kwargs.items() if _is_image(v)]
        if others:
            self.log.info(
                "ChannelsLast: the model's forward got no image argument named %s; %s look like images: name them "
                "with inputs=%r to convert them (the first convolution converts the activations meanwhile).",
                list(self.names), others, others,
            )

    def _check(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], kind: str) -> None:
        from cltrain.check import LayoutCheck
        from cltrain.check.plain_step import check_plain_step

        found = self._found(args, kwargs)

        def run() -> LayoutCheck:  # on rank 0; every rank applies what it chose
            if not found:
                return LayoutCheck("not checked", reason="the model's forward got no image argument to check")
            device = next((t.device for t in [*module.parameters(), *module.buffers()]), torch.device("cpu"))
            grad = torch.enable_grad() if kind == "train" else torch.no_grad()
            _state.checking = True
            try:  # positional: the first argument alone; the check restrides only what `inputs` names
                with torch.autocast(device.type, enabled=False), grad:  # float32: the loop's autocast is outside
                    return check_plain_step(module, (args[:1], args[1:], kwargs), _call, inputs=found,
                                            autocast_dtype=self.autocast_dtype)
            finally:
                _state.checking = False

        self.session.check(kind, module, run)
