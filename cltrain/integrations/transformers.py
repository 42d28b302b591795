"""``ChannelsLastCallback``: channels_last training for a Hugging Face ``Trainer``, in one line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.utils import logging
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("cltrain.integrations.transformers needs transformers: pip install 'cltrain[hf]'.") from error

from cltrain.integrations.inputs_hook import IMAGE_ARGUMENTS, ChannelsLastInputs, argument_names
from cltrain.layout import is_channels_last
from cltrain.options import check_flags, check_mode
from cltrain.host import Host
from cltrain.session import LayoutSession
from cltrain.sharding import sharding_of

__all__ = ["ChannelsLastCallback"]

# The Trainer's own logger: its `log_level` / `log_level_replica` apply (info on the main process only by default).
logger = logging.get_logger("transformers.trainer")


def _compute_dtype(args: TrainingArguments) -> torch.dtype | None:
    """The dtype the Trainer's autocast computes convolutions in."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None


def _accelerator_state() -> Any:
    """Accelerate's shared state once the Trainer has made its ``Accelerator`` (FSDP or DeepSpeed is decided there)."""
    from accelerate.state import AcceleratorState, is_initialized

    return AcceleratorState() if is_initialized() else None


def _convs_channels_last(model: nn.Module) -> bool:
    weights = [m.weight for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    return bool(weights) and all(is_channels_last(w) for w in weights)


class ChannelsLastCallback(TrainerCallback):
    r"""Train, evaluate and predict a ``transformers.Trainer``'s model in channels_last (NHWC).

    What it does at each event:

    * ``on_init_end`` (the end of ``Trainer.__init__``: before the optimizer, DDP/FSDP wrapping and
      ``torch_compile``): converts the model in place (the channels-last format of each 4-D/5-D parameter and
      buffer) and applies ``cltrain.guardrails`` for the device and the ``bf16``/``fp16`` autocast dtype; attaches
      a forward pre-hook (``cltrain.integrations.inputs_hook.ChannelsLastInputs``) that gives the model its image
      arguments (``pixel_values``) in channels_last, in training, ``evaluate`` and ``predict``, without a change to
      the collator; ``labels`` and masks keep their layout.
    * ``on_train_begin``: a model built by ``model_init`` inside ``train()`` is converted the same way (in place:
      the optimizer, made just before, keeps its parameters; ``torch_compile`` has not traced yet); a checkpoint
      loaded by ``resume_from_checkpoint`` keeps the layout, and its optimizer state is given its parameters'
      strides.
    * the first training forward and the first evaluation forward: the layout check (``cltrain.check.plain_step``)
      runs the model's forward, and the loss it computes from ``labels``, in both layouts on copies; where the model's
      code assumes NCHW, that part runs in NCHW and one log line names it. The run itself is not changed.

    Under FSDP (``fsdp_config={"version": 2}``) or DeepSpeed, which need a GPU in Accelerate, the weights stay
    contiguous, as the engine requires, and only the image arguments are channels_last: the convolutions still
    run NHWC kernels (``cltrain.sharding``; docs/guides/scaling.md). A model sharded before its first batch is not
    checked (it cannot be copied); the line says how to check it instead.

    It logs through the Trainer's logger (``transformers.utils.logging``) and never changes ``TrainerControl``.
    Checkpoints (``save_pretrained``) hold ordinary tensors: they load into a model without this callback.

    Args:
        mode: ``"full"`` restrides every 4-D/5-D parameter and buffer; ``"conv"`` only convolution weights.
        inputs: the model's forward arguments holding images, a name or a list (default ``pixel_values`` and
            ``pixel_values_videos``); the first positional argument is converted too.
        guard: apply ``cltrain.guardrails.apply_guardrails`` (workarounds for known-bad kernels on this device).
        verify: run the layout check on the first training and evaluation batch.

    Attributes:
        inputs_hook: the ``ChannelsLastInputs`` on the model (its ``layout_checks``: the checks' results).
        guardrails: the ``GuardRecord`` of each known kernel fault worked around (``[]``: none).
        sharding: the engine that shards the model (``"FSDP2"``, ``"FSDP"``, ``"DeepSpeed"``), whose weights then
            stay contiguous; ``None`` when none does.
        summary: ``cltrain.layout_summary`` of the model's parameters and buffers once converted.

    Raises:
        ValueError: an unknown ``mode``, an ``inputs`` that is not a name or a list of names, a non-bool
            ``guard`` or ``verify``; in ``on_train_begin``, a model rebuilt by ``model_init`` in a distributed run
            (DDP/FSDP wrapped it before any callback could convert it).

    Example::

        from transformers import Trainer, TrainingArguments
        from cltrain.integrations.transformers import ChannelsLastCallback

        trainer = Trainer(model=model, args=TrainingArguments("out", bf16=True), train_dataset=train,
                          callbacks=[ChannelsLastCallback()])
        trainer.train()
    """

    def __init__(
        self,
        mode: str = "full",
        inputs: str | Sequence[str] = IMAGE_ARGUMENTS,
        guard: bool = True,
        verify: bool = True,
    ) -> None:
        check_mode("ChannelsLastCallback", mode)
        names = argument_names(inputs, f"ChannelsLastCallback(inputs={inputs!r})")
        check_flags("ChannelsLastCallback", guard=guard, verify=verify)
        self.mode = mode
        self.guard = guard
        self.inputs_hook = ChannelsLastInputs(names, verify=verify, logger=logger)

    @property
    def guardrails(self) -> list[Any] | None:
        """The ``GuardRecord`` of each known kernel fault worked around (``[]``: none)."""
        return self.inputs_hook.session.guardrails

    @property
    def sharding(self) -> str | None:
        """The engine that shards the model, whose weights then stay contiguous; ``None`` when none does."""
        return self.inputs_hook.session.sharding

    @property
    def summary(self) -> dict[str, int] | None:
        """``cltrain.layout_summary`` of the model's parameters and buffers once converted."""
        return self.inputs_hook.session.summary

    @property
    def layout_checks(self) -> dict[str, Any]:
        """The ``LayoutCheck`` of the first batch of each kind checked, ``"train"`` and ``"eval"``."""
        return self.inputs_hook.layout_checks

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    model: nn.Module | None = None, **kwargs: Any) -> None:
        if model is not None:
            self._convert(model, args)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                       **kwargs: Any) -> None:
        if model is None:
            return
        if model is not self.inputs_hook.model:  # built by model_init inside train(), after on_init_end
            sharding = sharding_of(model, _accelerator_state())
            if args.world_size == 1:
                self._convert(model, args)
            elif _convs_channels_last(model) or sharding:  # converted by the user's model_init, or sharded
                session = LayoutSession.of(model, dtype=_compute_dtype(args), guard=self.guard, host=self._host(),
                                           sharding=sharding)
                self._attach(model, args, session)
                session.report_conversion(f"ChannelsLastCallback(mode={self.mode!r})", model)
            else:
                raise ValueError(
                    "ChannelsLastCallback: Trainer(model_init=...) built the model after DDP/FSDP wrapped it, too late "
                    "to convert; in distributed runs return cltrain.loops.convert_model(model) from model_init."
                )
        if optimizer is not None:
            self.inputs_hook.optimizers = [optimizer]
            self.inputs_hook.session.resume()  # a resumed state keeps the strides it was saved with

    def _host(self) -> Host:
        return Host(_say, optimizers=lambda: self.inputs_hook.optimizers)

    def _convert(self, model: nn.Module, args: TrainingArguments) -> None:
        session = LayoutSession(self.mode, guard=self.guard, host=self._host())
        # Accelerate shards it in `prepare`; FSDP2 refuses channels_last parameters
        session.convert(model, device=args.device, dtype=_compute_dtype(args),
                        sharding=sharding_of(model, _accelerator_state()),
                        owner=f"ChannelsLastCallback(mode={self.mode!r})")
        self._attach(model, args, session)

    def _attach(self, model: nn.Module, args: TrainingArguments, session: LayoutSession) -> None:
        self.inputs_hook.autocast_dtype = _compute_dtype(args)
        self.inputs_hook.attach(model, session)


def _say(message: str, warn: bool) -> None:
    (logger.warning if warn else logger.info)(message)
