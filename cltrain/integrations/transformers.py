"""``ChannelsLastCallback``: channels_last training for a Hugging Face ``Trainer``, in one line."""

from __future__ import annotations

import logging as std_logging
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import ExportableState
    from transformers.utils import logging
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("cltrain.integrations.transformers needs transformers: pip install 'cltrain[hf]'.") from error

from cltrain.integrations.inputs_hook import IMAGE_ARGUMENTS, ChannelsLastInputs, argument_names
from cltrain.check.resume import run_fingerprint
from cltrain.layout import is_channels_last
from cltrain.check.budget import DEFAULT_SAMPLES
from cltrain.options import check_copies, check_flags, check_layout_choice, check_mode, check_positive
from cltrain.session import LayoutSession, SessionResults
from cltrain.sharding import sharding_of

__all__ = ["ChannelsLastCallback"]

# The Trainer's own logger: its `log_level` / `log_level_replica` apply where the user set one.
logger = logging.get_logger("transformers.trainer")


def _logger_for(args: TrainingArguments) -> Any:
    """Where the door's lines go: the Trainer's logger where the user set its level (``log_level``, or transformers'
    verbosity at info); at the default (``"passive"``, transformers' warning level) cltrain's own, which shows the
    lines as every other door does (``cltrain.host.shown``)."""
    if getattr(args, "log_level", "passive") != "passive" or logger.isEnabledFor(std_logging.INFO):
        return logger
    return std_logging.getLogger(__name__)


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


class ChannelsLastCallback(SessionResults, TrainerCallback, ExportableState):
    r"""Train, evaluate and predict a ``transformers.Trainer``'s model in channels_last (NHWC), in the faster layout.

    A front door of ``cltrain.session.LayoutSession``, which runs everything; at each of the Trainer's events:

    * ``on_init_end`` (the end of ``Trainer.__init__``: before the optimizer, DDP/FSDP wrapping and
      ``torch_compile``): converts the model in place (the channels-last format of each 4-D/5-D parameter and
      buffer) and applies ``cltrain.guardrails`` for the device and the ``bf16``/``fp16`` autocast dtype; attaches
      a forward pre-hook (``cltrain.integrations.inputs_hook.ChannelsLastInputs``) that gives the model its image
      arguments (``pixel_values``) in its layout, in training, ``evaluate`` and ``predict``, without a change to
      the collator; ``labels`` and masks keep their layout.
    * ``on_train_begin``: a model built by ``model_init`` inside ``train()`` is converted the same way (in place:
      the optimizer, made just before, keeps its parameters); a checkpoint resumed by ``resume_from_checkpoint``
      brings the check's verdict and the race's decision back (no second check, no second race) and its optimizer
      state takes its parameters' strides.
    * the first training forward and the first evaluation forward: the layout check (``cltrain.check.plain_step``)
      runs the model's forward, and the loss it computes from ``labels``, in both layouts on copies; where the
      model's code assumes NCHW, that part runs in NCHW and one log line names it.
    * ``on_step_end``: the optimizer step's time, while the layouts race on the first steps; the faster is kept in
      one line, and both step times go to ``state.log_history`` (``trainer_state.json``).
    * ``on_epoch_end``: whatever moved a parameter's layout (a pruning, a hook writing ``.data``) is put back.
    * a save (``save_steps``, ``save_model``): the model's state dict holds contiguous tensors, which safetensors
      requires (for a model that is not a ``PreTrainedModel`` too); the verdicts and decisions go into
      ``trainer_state.json`` (this callback is ``ExportableState``).

    Under FSDP (``fsdp_config={"version": 2}``) or DeepSpeed, which need a GPU in Accelerate, the weights stay
    contiguous, as the engine requires, and only the image arguments are channels_last (``cltrain.sharding``;
    docs/guides/scaling.md); the check and the race do not run on a sharded model.

    Its lines go through the Trainer's logger where its level is set (``log_level``), else they show as every door's do;
    it never changes ``TrainerControl``.

    Args:
        mode: ``"full"`` restrides every 4-D/5-D parameter and buffer; ``"conv"`` only convolution weights.
        inputs: the model's forward arguments holding images, a name or a list (default ``pixel_values`` and
            ``pixel_values_videos``); the first positional argument is converted too.
        convert_inputs: put those arguments in the model's layout; ``False``: only the model is converted (its first
            convolution converts the activations) and the arguments stay as the collator built them.
        guard: apply ``cltrain.guardrails.apply_guardrails`` (workarounds for known-bad kernels on this device).
        verify: run the layout check on the first training and evaluation batch.
        layout: ``"auto"`` races channels_last against NCHW on the first training steps and keeps the faster;
            ``"channels_last"`` or ``"contiguous"`` pins one.
        copies: the model's copies that should follow its layout (an EMA's ``AveragedModel`` that a callback of
            yours updates): a module, a list, or a function giving them, asked at each change of layout.
        check_samples: the check runs on this many samples of the batch (``cltrain.check.budget``); ``None``: the
            whole batch.

    Attributes:
        inputs_hook: the ``ChannelsLastInputs`` on the model.
        session: the ``cltrain.session.LayoutSession``; its results are this callback's attributes too
            (``cltrain.session.SessionResults``: ``layout``, ``decision``, ``layout_checks``, ``guardrails``, ...).

    Raises:
        ValueError: an unknown ``mode`` or ``layout``, an ``inputs`` that is not a name or a list of names, a
            non-bool ``convert_inputs``, ``guard`` or ``verify``, ``copies`` that are not modules, a ``check_samples``
            that is not ``None`` or an int >= 1; in ``on_train_begin``, a model rebuilt by ``model_init`` in a
            distributed run (DDP/FSDP wrapped it before any callback could convert it).

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
        convert_inputs: bool = True,
        guard: bool = True,
        verify: bool = True,
        layout: str = "auto",
        copies: Callable[[], Iterable[nn.Module]] | nn.Module | Sequence[nn.Module] | None = None,
        check_samples: int | None = DEFAULT_SAMPLES,
    ) -> None:
        check_mode("ChannelsLastCallback", mode)
        names = argument_names(inputs, f"ChannelsLastCallback(inputs={inputs!r})")
        check_flags("ChannelsLastCallback", convert_inputs=convert_inputs, guard=guard, verify=verify)
        check_layout_choice("ChannelsLastCallback", layout)
        self.mode, self.names, self.guard, self.verify, self.choice = mode, names, guard, verify, layout
        self.convert_inputs = convert_inputs
        self.copies = check_copies("ChannelsLastCallback", copies)
        check_positive("ChannelsLastCallback", "check_samples", check_samples, optional=True)
        self.check_samples = check_samples
        self.inputs_hook = ChannelsLastInputs(names, verify=verify, logger=logger, steps="door")
        self.session = self._session()
        self.saved: dict[str, Any] | None = None  # the session's state, as a checkpoint's trainer_state.json holds it
        self._state: TrainerState | None = None
        self._contiguous_save: Any = None
        self._init_seen = False  # on_init_end ran: the callback was given to Trainer(callbacks=...), not add_callback
        self._told_late = False  # an evaluation or prediction before train() that the hook never saw was said

    def _session(self) -> LayoutSession:
        host = self.inputs_hook.host(copies=self.copies, log=lambda metrics: self._log(metrics))
        return LayoutSession(self.mode, layout=self.choice, guard=self.guard, verify=self.verify, host=host,
                             check_samples=self.check_samples, convert_inputs=self.convert_inputs)

    def _log(self, metrics: dict[str, float]) -> None:
        if self._state is not None:
            self._state.log_history.append({**metrics, "step": self._state.global_step})

    def state(self) -> dict[str, Any]:
        """What ``trainer_state.json`` keeps (``ExportableState``): the arguments, and the session's state."""
        return {"args": {"mode": self.mode, "inputs": list(self.names), "convert_inputs": self.convert_inputs,
                         "guard": self.guard, "verify": self.verify, "layout": self.choice,
                         "check_samples": self.check_samples},
                "attributes": {"saved": self.session.state_dict(), "rebuilt": True}}  # set on a rebuilt one alone

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    model: nn.Module | None = None, **kwargs: Any) -> None:
        self.inputs_hook.log = _logger_for(args)
        self._init_seen = True
        if model is not None:
            self._convert(model, args)
            self._arm(model)  # a save_model before train()

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                       **kwargs: Any) -> None:
        self._state = state
        self.inputs_hook.log = _logger_for(args)
        self._unarm()
        if getattr(self, "rebuilt", False) and not getattr(self, "_told_rebuilt", False):
            self._told_rebuilt = True
            self.session.say(
                "ChannelsLastCallback: restore_callback_states_from_checkpoint=True replaced the callback given to "
                f"this Trainer by one made from the checkpoint's options (layout={self.choice!r}, mode={self.mode!r}; "
                "copies at their default: none); leave it False: the callback restores its own state "
                "from the checkpoint.", True)
        if model is None:
            return
        if model is not self.inputs_hook.model:  # built by model_init inside train(), or a restored callback
            sharding = sharding_of(model, _accelerator_state())
            late = not self._init_seen and not getattr(self, "rebuilt", False)  # not a callback restored from a state
            if args.world_size > 1 and not (_convs_channels_last(model) or sharding) and late:
                raise ValueError(
                    "ChannelsLastCallback: added after Trainer.__init__ (trainer.add_callback), too late to convert "
                    "the model before DDP/FSDP wrapped it; give it to Trainer(callbacks=[ChannelsLastCallback()])."
                )
            if args.world_size > 1 and not (_convs_channels_last(model) or sharding):
                raise ValueError(
                    "ChannelsLastCallback: Trainer(model_init=...) built the model after DDP/FSDP wrapped it, too late "
                    "to convert; in distributed runs return cltrain.loops.convert_model(model) from model_init."
                )
            self._convert(model, args)
        if optimizer is not None:
            self.inputs_hook.optimizers = [optimizer]
        # a fresh train()'s state holds the callbacks' own state() (a search's earlier trial), not a checkpoint's
        saved = self.saved or (_saved_in(state) if state.global_step > 0 else None)
        if saved:  # resumed: the verdicts and decisions of the checkpoint
            self.session.load_state_dict(saved, model=model)
        # A checkpoint written without this callback: the Trainer's next save looks its entry up (KeyError else)
        state.stateful_callbacks.setdefault(type(self).__name__, self.state())
        self.session.resume()  # a resumed state keeps the strides it was saved with

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    model: nn.Module | None = None, **kwargs: Any) -> None:
        if model is not None:
            self.session.step_end(model)
            self._arm(model)  # a save may follow at once: asked already, or by a callback after this one (a stop)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     model: nn.Module | None = None, **kwargs: Any) -> None:
        if model is not None:
            self.session.boundary(model, after=f"after epoch {state.epoch:g}")
            self._arm(model)  # as at a step's end

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    model: nn.Module | None = None, **kwargs: Any) -> None:
        self._not_attached("evaluate")
        if model is not None:  # a callback after this one may ask for a save (should_save), which follows at once
            self._arm(model)

    def on_predict(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                   metrics: Any = None, **kwargs: Any) -> None:
        self._not_attached("predict")

    def _not_attached(self, what: str) -> None:
        """An evaluation or prediction the hook never saw: the callback was added after ``Trainer.__init__``."""
        if self.inputs_hook.model is None and not self._init_seen and not self._told_late:
            self._told_late = True
            self.session.say(f"ChannelsLastCallback: added after Trainer.__init__ (trainer.add_callback), so this "
                             f"{what}() ran in NCHW, unconverted and unchecked; the model is converted at train(). "
                             "Give it to Trainer(callbacks=[ChannelsLastCallback()]) to convert it from the start.",
                             True)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self._unarm()  # an evaluation no save followed

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self._unarm()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     model: nn.Module | None = None, **kwargs: Any) -> None:
        if model is not None:
            self.session.end(model)
            self._arm(model)  # trainer.save_model() usually follows

    def _arm(self, model: nn.Module) -> None:
        """The model's next state dicts hold contiguous tensors (safetensors refuses others), until the save ends."""
        if self._contiguous_save is None:
            self._contiguous_save = model.register_state_dict_post_hook(_contiguous_tensors)

    def _unarm(self) -> None:
        if self._contiguous_save is not None:
            self._contiguous_save.remove()
            self._contiguous_save = None

    def _convert(self, model: nn.Module, args: TrainingArguments) -> None:
        dtype = _compute_dtype(args)
        self.inputs_hook.autocast_dtype = dtype
        session = self.session
        session.fingerprint = lambda: run_fingerprint(model, precision=str(dtype), device=args.device.type)
        # Accelerate shards it in `prepare`; FSDP2 refuses channels_last parameters
        session.start(model, device=args.device, dtype=dtype, sharding=sharding_of(model, _accelerator_state()),
                      owner=f"ChannelsLastCallback(mode={self.mode!r})", compiles=bool(getattr(args, "torch_compile", False)))
        self.inputs_hook.attach(model, session)


def _contiguous_tensors(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """A state dict's channels_last tensors as contiguous copies (its parameters themselves, ``keep_vars``, kept), where
    the Trainer's save takes it: a state dict anyone else takes meanwhile (an EMA swap, a restore of the best weights
    by a callback after this one) holds the model's own tensors, so a write through it reaches the model."""
    if not _in_trainer_save():
        return
    for key, value in state_dict.items():
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and not value.is_contiguous():
            state_dict[key] = value.contiguous()


def _in_trainer_save() -> bool:
    """Whether a ``Trainer`` save (``save_model``, ``_save``: ``safetensors`` there refuses channels_last) is on the
    stack: the Trainer offers no event before its save."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in ("save_model", "_save") and frame.f_globals.get("__name__") == "transformers.trainer":
            return True
        frame = frame.f_back
    return False


def _saved_in(state: TrainerState) -> dict[str, Any] | None:
    """The session's state a resumed checkpoint's ``trainer_state.json`` holds for this callback."""
    entry = (state.stateful_callbacks or {}).get("ChannelsLastCallback")
    entry = entry[0] if isinstance(entry, list) and entry else entry
    return (entry or {}).get("attributes", {}).get("saved") if isinstance(entry, dict) else None

