"""A batch's model inputs in the model's layout, for an adapter that gets each batch before the step (``ChannelsLast``).

``BatchInputs.convert`` restrides the inputs in place (``cltrain.layout.batches``: targets and masks keep their
layout; the loader's tensors are given back when the batch ends, ``restore``); on the first batch of each stage it
holds the inputs it converted for ``cltrain.session.InputTrace``, which follows that forward (``start_trace`` as the
step starts, ``end_trace`` at its backward or end): an input that reaches no convolution in channels_last is left as
it arrives from then on. It says once that batches arrive in another layout, and once that a batch holds no model
input it can find.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cltrain.layout.batches import (Inputs, describe_batch, first_image_tensor, image_inputs, restore_batch,
                                    restride_batch)
from cltrain.layout.stacks import in_input_layout
from cltrain.session import InputTrace, LayoutSession

__all__ = ["BatchInputs"]


class BatchInputs:
    """The inputs of ``session``'s model in each batch (see the module docstring); ``inputs`` names them
    (``cltrain.layout.batches``)."""

    def __init__(self, session: LayoutSession, inputs: Inputs = None) -> None:
        self.session, self.inputs = session, inputs
        self.trace = InputTrace(say=session.say)
        #: the converted inputs' data as the loader made them, given back when the batch ends
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: tuple[str, dict[int, torch.Tensor]] | None = None  # the first batch of a stage, to trace
        self._told = self._looked = False

    def convert(self, batch: Any, stage: str, model: nn.Module) -> None:
        """Put ``batch``'s model inputs in the session's layout, in place; the first batch of ``stage`` is traced
        once its step starts (``start_trace``)."""
        layout, one_d = self.session.layout, self.session.one_d
        traced = None
        if not self.trace.traced(stage) and layout == "channels_last" and self.inputs != "all" and not one_d:
            traced = {p: t for p, t in image_inputs(batch, self.inputs, one_d).items() if not in_input_layout(t, model)}
        converted = restride_batch(batch, layout, one_d=one_d, inputs=self.inputs,
                                   skip=self.trace.left_as_is.get(stage, ()), model=model, kept=self.kept)
        if not self._looked:
            self._looked = True
            if first_image_tensor(batch, self.inputs) is None and first_image_tensor(batch, "all") is not None:
                self.session.say(
                    f"ChannelsLast: no model input found in the batch ({describe_batch(batch)}), so none is converted "
                    "(the first convolution converts the activations). Name it with inputs=KEY or inputs=INDEX.", False)
        if traced is not None:  # traced through this batch's forward, after the check
            self._pending = (stage, traced)
            return
        self._tell(converted)

    def put_contiguous(self, batch: Any) -> None:
        """The batch's inputs in NCHW (a check kept the whole model contiguous)."""
        restride_batch(batch, "contiguous", one_d=self.session.one_d, inputs=self.inputs, kept=self.kept)

    def start_trace(self, model: nn.Module) -> None:
        """Follow this step's forward, where its batch is the first of its stage."""
        if self._pending is None:
            return
        stage, traced = self._pending
        if self.session.layout != "channels_last":  # the check put the model in NCHW, and the batch with it
            self._pending = None
            self.trace.start(stage, {}, model)
        elif not self.trace.start(stage, traced, model):  # compiled: convert as before
            self._pending = None
            self._tell(len(traced))

    def end_trace(self, completed: bool = True) -> None:
        """Leave the trace (at the backward, or the batch's end)."""
        if self._pending is None:
            return
        traced = self._pending[1]
        self._pending = None
        left = self.trace.end(completed)
        self._tell(len(traced) - len(left or ()))

    def restore(self) -> None:
        """The loader's tensors as it made them (it may hand the same ones out again)."""
        restore_batch(self.kept)

    def _tell(self, converted: int) -> None:
        if converted and not self._told:
            self._told = True
            self.session.say(
                f"ChannelsLast: batches arrive in another layout; converting {converted} tensor(s) per batch "
                f"to {self.session.layout} on the device. cltrain.data's NHWC collate makes this copy unnecessary.",
                False)
