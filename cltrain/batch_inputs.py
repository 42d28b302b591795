"""A batch's model inputs in the model's layout: the one input path of every front door.

``BatchInputs.convert(batch, kind, model, layout)`` finds the model's inputs in a batch (``cltrain.layout.batches``:
targets and masks keep their layout) and puts them in ``layout``, either in place (a Lightning callback or a loop
cannot replace the batch object: the tensors' ``.data`` is swapped and given back when the batch ends, ``restore``) or
into a new structure (a forward pre-hook returns new arguments, the caller's tensors untouched). On the first batch of
each kind it holds the inputs it converted for ``InputTrace``, which follows that forward (``start_trace`` as the
step starts, ``end_trace`` at its backward or end): an input that reaches no convolution in channels_last is left as
it arrives from then on. It says once that batches arrive in another layout, and once that a batch holds no model
input it can find while other tensors look like images.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import torch
from torch import nn

from cltrain.host import Say
from cltrain.layout.batches import (Inputs, describe_batch, first_image_tensor, image_inputs, map_tensors,
                                    restore_batch, restride_batch)
from cltrain.layout import has_convolutions
from cltrain.layout.conv_reach import ConvReach
from cltrain.layout.stacks import channel_dim, in_input_layout, to_input_layout
from cltrain.layout.tensors import is_compiled

__all__ = ["BatchInputs", "InputTrace"]


class InputTrace:
    """Which converted inputs of the first forward of each kind of batch reach a convolution in channels_last.

    ``start(kind, converted, model)`` holds a ``cltrain.layout.conv_reach.ConvReach`` around that forward (not
    around a compiled one: a ``TorchFunctionMode`` would change what Dynamo compiles); ``end()`` leaves it and keeps
    the keys of the inputs no convolution took in channels_last in ``left_as_is[kind]``: converting them is a copy
    that helps nothing, and one line says so, once per input shape.
    """

    def __init__(self, say: Say) -> None:
        self.say = say
        self.left_as_is: dict[str, frozenset[Hashable]] = {}
        self._active: tuple[str, ConvReach, dict[Hashable, torch.Tensor]] | None = None
        self._told: set[str] = set()
        self._conv_free = False  # the model traced has no convolution module

    def traced(self, kind: str) -> bool:
        """Whether the first forward of ``kind`` was traced (or is being traced)."""
        return kind in self.left_as_is

    def start(self, kind: str, converted: dict[Hashable, torch.Tensor], model: nn.Module,
              compiled: bool = False) -> bool:
        """Trace this forward of ``kind``; ``False`` where it is not traced (nothing converted, or compiled: ``model``
        holds compiled code, or ``compiled`` says its call does)."""
        self.left_as_is[kind] = frozenset()
        if not converted or compiled or is_compiled(model):
            return False
        self._conv_free = not has_convolutions(model)
        self._active = (kind, ConvReach(converted), converted)
        self._active[1].__enter__()
        return True

    def end(self, completed: bool = True) -> list[Hashable] | None:
        """Leave the trace; the keys left as they arrive from now on (``None``: nothing was traced or judged)."""
        if self._active is None:
            return None
        kind, reach, converted = self._active
        self._active = None
        reach.__exit__(None, None, None)
        if not completed or reach.convolutions == 0 and not self._conv_free:  # nothing seen to judge by: convert
            return None
        left = sorted(set(converted) - reach.reached, key=str)
        if left:
            self.left_as_is[kind] = frozenset(left)
            shapes = ", ".join(str(tuple(converted[k].shape)) for k in left)
            if shapes not in self._told:
                self._told.add(shapes)
                why = "the model has none" if self._conv_free else \
                    "a convolution gets it only out of that format: copied, sliced, reshaped or permuted first" \
                    if set(left) <= reach.reached_otherwise else \
                    "the model reshapes or permutes it, or other code replaces it, first"
                self.say(f"ChannelsLast: the input {shapes} reaches no convolution in channels_last ({why}), so "
                         "converting it is a copy that helps nothing: it is left as it arrives from now on.", False)
        return left


class BatchInputs:
    """The model's inputs in each batch (see the module docstring); ``inputs`` names them
    (``cltrain.layout.batches``); ``say`` tells the lines."""

    def __init__(self, say: Say, inputs: Inputs = None) -> None:
        self.say, self.inputs = say, inputs
        self.trace = InputTrace(say=say)
        #: the converted inputs' data as the loader made them, given back when the batch ends
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._pending: tuple[str, dict[int, torch.Tensor]] | None = None  # the first batch of a kind, to trace
        self._told = self._looked = False
        self._hint = " cltrain.data's NHWC collate makes this copy unnecessary."
        self._named = "channels_last"  # the memory format the lines name
        #: the model's call runs compiled code (a door's hook that Dynamo traced): its forward is not traced
        self.compiled = False

    def convert(self, batch: Any, kind: str, model: nn.Module, layout: str, *, in_place: bool = True) -> Any:
        """``batch`` with its model inputs in ``layout``: the same object, its tensors restrided in place, or (not
        ``in_place``) a new structure holding new tensors. The first batch of ``kind`` in channels_last is traced
        once its step starts (``start_trace``)."""
        traced = None
        if not self.trace.traced(kind) and layout == "channels_last" and self.inputs != "all":
            traced = {p: t for p, t in image_inputs(batch, self.inputs).items() if not in_input_layout(t, model)}
        skip = self.trace.left_as_is.get(kind, ())
        if in_place:
            converted = restride_batch(batch, layout, inputs=self.inputs, skip=skip, model=model, kept=self.kept)
        else:
            batch, new = _restrided_copy(batch, layout, self.inputs, skip, model)
            converted = len(new)
            if traced is not None:
                traced = {p: new[p] for p in traced if p in new}
        self._look(batch, model)
        if traced is not None:  # traced through this batch's forward, after the check
            self._pending = (kind, traced)
        else:
            self._tell(converted, layout)
        return batch

    def start_trace(self, model: nn.Module, layout: str) -> None:
        """Follow this step's forward, where its batch is the first of its kind."""
        if self._pending is None:
            return
        kind, traced = self._pending
        if layout != "channels_last":  # the model runs in NCHW, and the batch with it
            self._pending = None
            self.trace.start(kind, {}, model)
        elif not self.trace.start(kind, traced, model, self.compiled):  # compiled: convert as before
            self._pending = None
            self._tell(len(traced), layout)

    def end_trace(self, completed: bool = True) -> None:
        """Leave the trace (at the backward, or the batch's end)."""
        if self._pending is None:
            return
        traced = self._pending[1]
        self._pending = None
        left = self.trace.end(completed)
        self._tell(len(traced) - len(left or ()), "channels_last")

    def restore(self) -> None:
        """The loader's tensors as it made them (it may hand the same ones out again)."""
        restore_batch(self.kept)

    def _look(self, batch: Any, model: nn.Module) -> None:
        if self._looked:
            return
        self._looked = True
        if isinstance(batch, Mapping) and "pixel_values" in batch:  # an image processor's CHW floats: no collate of ours
            self._hint = ""
        first = first_image_tensor(batch, self.inputs)
        if first is not None and first.dim() == 5 and channel_dim(first, model) == 2:  # (B, T, C, H, W) stacks
            self._named = "channels_last per frame"
            self._hint = ""
        elif first is not None and first.dim() == 5:  # clips: channels_last_3d, from the clip collate
            self._named = "channels_last_3d"
            self._hint = self._hint and " cltrain.data.video's NDHWCCollate makes this copy unnecessary."
        if first_image_tensor(batch, self.inputs) is None and first_image_tensor(batch, "all") is not None:
            self.say(f"ChannelsLast: no model input found in the batch ({describe_batch(batch)}), so none is converted "
                     "(the first convolution converts the activations). Name it with inputs=KEY or inputs=INDEX (a list "
                     "for several: inputs=[KEY, KEY]).",
                     False)

    def _tell(self, converted: int, layout: str) -> None:
        if converted and not self._told and layout == "channels_last":
            self._told = True
            self.say(f"ChannelsLast: batches arrive in another layout; converting {converted} tensor(s) per batch "
                     f"to {self._named} on the device.{self._hint}", False)


def _restrided_copy(batch: Any, layout: str, inputs: Inputs, skip: Any,
                    model: nn.Module) -> tuple[Any, dict[int, torch.Tensor]]:
    """``batch`` rebuilt with its selected inputs in ``layout`` (new tensors, autograd followed), and the new tensors
    by position; the caller's tensors are untouched."""
    new: dict[int, torch.Tensor] = {}
    by_id: dict[int, torch.Tensor] = {}
    for position, t in image_inputs(batch, inputs).items():
        if position in skip:
            continue
        if layout == "channels_last" and not in_input_layout(t, model):
            changed = to_input_layout(t, model)
        elif layout != "channels_last" and not t.is_contiguous():
            changed = t.contiguous()
        else:
            continue
        new[position] = by_id[id(t)] = changed
    if not new:
        return batch, new
    return map_tensors(batch, lambda t: by_id.get(id(t), t)), new
