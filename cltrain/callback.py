"""The ``ChannelsLast`` Lightning callback: channels_last training for an existing project, in one line."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from cltrain.check.budget import DEFAULT_SAMPLES, check_within_budget
from cltrain.check.compare import LayoutCheck
from cltrain.check.fallback import Fallback
from cltrain.check.lightning_step import check_lightning_step
from cltrain.check.resume import restored_check, run_fingerprint, saved_check
from cltrain.guardrails import GuardRecord
from cltrain.layout import MODES, to_contiguous
from cltrain.batch_inputs import BatchInputs
from cltrain.layout.batches import check_inputs, first_image_tensor
from cltrain.host import Host
from cltrain.lightning_access import LightningHost, overrides, overrides_hook, run_after, step_target, undo_run_after
from cltrain.nchw_code import UPSTREAM, flat_parameters, guard_pruning, unguard_pruning
from cltrain.options import check_flags, check_mode, check_positive
from cltrain.precision import autocast_dtype, compute_dtype
from cltrain.session import LayoutSession
from cltrain.sharding import sharding_of

__all__ = ["ChannelsLast"]

_MODES = (*MODES, "off", "auto")


class ChannelsLast(Callback):
    r"""Train, validate, test and predict in channels_last (NHWC) memory format.

    The model is converted once it is complete (after the LightningModule's ``setup`` or
    ``configure_model``), before the strategy moves it and wraps it in DDP, identically on every
    rank. In every stage the model's inputs are restrided in place in
    ``on_{train,validation,test,predict}_batch_start`` (``cltrain.layout.batches`` says which
    tensors); targets and masks keep their layout, and a tensor already channels_last is not
    copied; a (B, T, C, H, W) stack of images gets each frame channels_last (``cltrain.layout.stacks``). At each
    stage's first batch the model's forward is traced: an input whose converted layout reaches no convolution
    (the model makes it contiguous first) is left as it arrives from then on, and one line says so. Averaged
    copies held by other callbacks (``WeightAveraging``, ``EMAWeightAveraging``,
    ``StochasticWeightAveraging``) join the model's layout, and on resume the optimizer state is
    restrided to its parameter's layout. A channels_last model's 4-D/5-D outputs are
    channels_last: flatten them with ``reshape``, not ``view``. The guide:
    docs/guides/callback.md.

    Under a sharding strategy (``ModelParallelStrategy``, whose ``configure_model`` calls ``fully_shard``;
    ``FSDPStrategy``; ``DeepSpeedStrategy``) or on a model sharded already, the parameters stay contiguous, as the
    engine requires, and only the inputs are channels_last: the convolutions still run NHWC kernels
    (``cltrain.sharding``; docs/guides/scaling.md). The first-batch check and the audit then do not run (a sharded
    model cannot be copied; the line says how to check instead), and ``mode="auto"`` is not timed.

    Args:
        mode: ``"full"`` restrides every 4-D/5-D parameter and buffer; ``"conv"`` only
            convolution weights; ``"auto"`` times a few steps in both layouts on a synthetic batch
            of ``input_shape`` (on rank zero, decision broadcast) and keeps the faster; ``"off"``
            does nothing (for sweeps).
        convert_inputs: put the model's inputs in the model's layout. With
            ``False`` only the model is converted (the first convolution then
            converts the activations, as Composer does).
        inputs: which tensors of a batch are the model's inputs. ``None``: by
            the batch's shape, as above. A key or field name (found at any
            depth of the batch), an index of a tuple/list batch, or a list of
            those: every floating rank-4/5 tensor under them. ``"all"``: every
            floating rank-4/5 tensor of the batch, targets included.
        audit: run ``cltrain.audit.audit_model`` on the first training batch and
            print which ops lose the layout (rank zero).
        input_shape: ``(N, C, H, W)`` or ``(N, C, D, H, W)`` for ``mode="auto"``;
            when ``None`` it is read from the DataModule's ``input_shape``. A rank-3
            ``(N, C, L)`` shape times a 1-D model with channels-last 1-D strides
            (``cltrain.layout.to_channels_last_1d``) against NCL; if that wins, the
            Conv1d/ConvTranspose1d weights and every rank-3 floating batch tensor get
            those strides. ``"full"``/``"conv"`` never touch rank-3 tensors.
        auto_steps: timed steps per layout in ``mode="auto"``.
        guard: apply ``cltrain.guardrails.apply_guardrails`` once the model is converted: the
            few layers that match a known-bad backend kernel (``cltrain.guardrails.KNOWN_FAULTS``:
            crashes or silently wrong gradients on this device) get a targeted workaround, the rest of
            the model keeps its layout; one log line names them. ``False`` trains the bare kernels.
        verify: on the first batch of training (and of validation, test or predict, whichever comes
            first) run the step in both layouts on copies of the model (``cltrain.check.compare``): where
            the project's own code assumes NCHW (a ``view`` that merges C with H and W, an op reading raw
            memory, a custom backward doing either) and raises or diverges only in channels_last, the
            smallest part holding that code runs in NCHW (or the whole model stays contiguous), and one
            line names the module, the file and line, and the fix. Nothing of the real run changes
            (weights, gradients, BatchNorm statistics, optimizer and RNG state, logged values).
            ``False`` skips the check.
        check_samples: the check runs on the first ``check_samples`` samples of the batch (every batch tensor
            whose leading dim is the batch size is cut; both layouts see the same samples), so it costs a few
            samples' steps and little memory; the whole batch where the step raises on the part without
            channels_last too (code written for the batch size). ``None``: the whole batch. An out-of-memory
            error inside the check is retried on fewer samples, then reported as not checked: never a verdict
            (``cltrain.check.budget``).
        auto_timeout: ``mode="auto"`` times the layouts in a child process
            (``cltrain.timing.probe.probe_layout``), which a native crash cannot take the run down
            with (a model the child cannot load, from a script without a main guard, ``python -c`` or a
            notebook, is timed in this process with the guardrails, and the log line says so); this is
            how long it may go without progress (seconds) before it counts as a hang.

    Attributes:
        layout: ``"channels_last"`` (the channels-last format of each tensor's rank) or
            ``"contiguous"`` (what ``mode="auto"`` keeps when NCHW times faster; a model that
            arrived channels_last is then put back in NCHW); ``None`` before ``setup`` and always
            with ``mode="off"``.
        timings: with ``mode="auto"``, the median seconds per timed step of each layout,
            ``{"channels_last": s, "contiguous": s}`` (the same on every rank); else ``None``, also
            when the timing failed.
        auto_failure: with ``mode="auto"``, one line saying why the timing gave no result (the probe
            crashed, raised or hung while timing); the layout is then
            ``"contiguous"``. ``None`` otherwise.
        guardrails: the ``cltrain.guardrails.GuardRecord`` of each known fault worked around in
            the model (``record.as_dict()`` for ``metrics.json``); ``[]`` when none matched, ``None``
            before ``setup``, with ``guard=False`` and with ``mode="off"``.
        layout_checks: the ``cltrain.check.compare.LayoutCheck`` of each first batch checked, by kind
            (``"train"``, ``"eval"``); ``result.as_dict()`` for ``metrics.json``.
        fallbacks: the ``cltrain.check.fallback.Fallback``s the checks applied to the model.
        summary: ``cltrain.layout_summary`` of the model's parameters and buffers
            once converted.
        sharding: the sharding engine (``"FSDP2"``, ``"FSDP"``, ``"DeepSpeed"``, ``"DTensor"``) that holds the
            model's parameters, which then stay contiguous; ``None`` when none does.
        audit_report: with ``audit=True``, the ``cltrain.audit.AuditReport`` of the
            first training batch.
        batch_inputs: the ``cltrain.batch_inputs.BatchInputs`` that converts each batch's model inputs
            (``batch_inputs.trace.left_as_is``: the inputs left as they arrive, by stage).

    Raises:
        ValueError: an unknown ``mode``, a non-bool ``convert_inputs``, ``guard`` or ``verify``, a ``check_samples``
            that is not ``None`` or an int >= 1, an ``inputs``
            that is none of its forms, an ``input_shape`` that is not rank 3, 4 or 5, a non-positive
            ``auto_timeout``, ``mode="auto"`` with no shape to time (raised in ``setup``), or a key or
            index named in ``inputs`` that a batch lacks (raised at that batch).

    Example::

        from lightning.pytorch import Trainer
        from cltrain import ChannelsLast

        trainer = Trainer(callbacks=[ChannelsLast()], precision="bf16-mixed")
        trainer.fit(model, datamodule=dm)
    """

    def __init__(
        self,
        mode: str = "full",
        convert_inputs: bool = True,
        audit: bool = False,
        input_shape: tuple[int, ...] | None = None,
        auto_steps: int = 3,
        guard: bool = True,
        auto_timeout: float = 300.0,
        inputs: str | int | list[str | int] | None = None,
        verify: bool = True,
        check_samples: int | None = DEFAULT_SAMPLES,
    ) -> None:
        check_mode("ChannelsLast", mode, _MODES)
        check_flags("ChannelsLast", convert_inputs=convert_inputs, audit=audit)
        inputs = check_inputs(inputs, owner="ChannelsLast")
        if input_shape is not None and (
            len(input_shape) not in (3, 4, 5) or not all(isinstance(s, int) and s > 0 for s in input_shape)
        ):
            raise ValueError(
                f"ChannelsLast(input_shape={input_shape!r}): expected (N, C, H, W), (N, C, D, H, W) or, for a 1-D "
                "model, (N, C, L) positive ints."
            )
        check_positive("ChannelsLast", "auto_steps", auto_steps)
        check_flags("ChannelsLast", guard=guard, verify=verify)
        check_positive("ChannelsLast", "check_samples", check_samples, optional=True)
        check_positive("ChannelsLast", "auto_timeout", auto_timeout, whole=False)
        self.mode = mode
        self.convert_inputs = convert_inputs
        self.inputs = inputs
        self.audit = audit
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.auto_steps = auto_steps
        self.guard = guard
        self.verify = verify
        self.check_samples = check_samples
        self.auto_timeout = float(auto_timeout)
        self.audit_report: Any = None
        self.session = LayoutSession("conv" if mode == "conv" else "full", guard=guard, host=Host(_say))
        self.batch_inputs = BatchInputs(self.session, inputs)
        self._audited = False
        self._flat: Any = None  # flat_parameters(), held from setup to teardown
        self._due: str | None = None  # what ran since the last step that may have moved the parameters
        self._restored: dict[str, Any] | None = None  # the checks of the checkpoint resumed from
        self._fingerprint: str | None = None
        self._expecting = False

    @property
    def layout(self) -> str | None:
        """``"channels_last"`` or ``"contiguous"``; ``None`` before ``setup`` and with ``mode="off"``."""
        return self.session.layout

    @property
    def timings(self) -> dict[str, float] | None:
        """With ``mode="auto"``, the median seconds per timed step of each layout (``None`` where the timing failed)."""
        return self.session.probe.timings if self.session.probe is not None else None

    @property
    def auto_failure(self) -> str | None:
        """With ``mode="auto"``, why the timing gave no result; else ``None``."""
        return self.session.probe.failure if self.session.probe is not None else None

    @property
    def guardrails(self) -> list[GuardRecord] | None:
        """The ``GuardRecord`` of each known fault worked around (``None`` before ``setup``, with ``guard=False``)."""
        return self.session.guardrails

    @property
    def layout_checks(self) -> dict[str, LayoutCheck]:
        """The ``LayoutCheck`` of each first batch checked, by kind (``"train"``, ``"eval"``)."""
        return self.session.layout_checks

    @property
    def fallbacks(self) -> list[Fallback]:
        """The ``Fallback``s the checks applied to the model."""
        return self.session.fallbacks

    @property
    def summary(self) -> dict[str, int] | None:
        """``cltrain.layout_summary`` of the model's parameters and buffers once converted."""
        return self.session.summary

    @property
    def sharding(self) -> str | None:
        """The engine holding the model's parameters (which then stay contiguous), or ``None``."""
        return self.session.sharding

    # ---- model conversion ----------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.mode == "off":
            return
        self.session.host = LightningHost(trainer, pl_module, _say, exclude=self)
        if self.mode == "auto" and self.layout is None and self._shape(trainer) is None:
            raise ValueError(
                "ChannelsLast(mode='auto') needs the shape of a training batch to time: pass "
                "input_shape=(N, C, H, W), or use a DataModule with an `input_shape` attribute."
            )
        if sharding_of(pl_module, trainer.strategy) is not None:
            # configure_model may call fully_shard next, which refuses a model that arrived channels_last.
            to_contiguous(pl_module)
        # LightningModule.setup runs after this hook and configure_model after that; the model
        # is complete only then, and the strategy moves and wraps it right after.
        last = "configure_model" if overrides("configure_model", pl_module) else "setup"
        run_after(pl_module, last, lambda: self._convert_model(trainer, pl_module))
        self._flat = flat_parameters()
        self._flat.__enter__()
        guard_pruning(trainer.callbacks, pl_module, lambda what, aliases: self.session.keep(
            pl_module, aliases=aliases,
            line=f"ChannelsLast: {what.partition('.')[0]} prunes the weights in NCHW (torch's pruning calls view on "
                 f"channels_last ones: {UPSTREAM}); they and their masks go back to {self.layout} after each of its "
                 "calls, with their optimizer state."))

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        undo_run_after(pl_module)
        if self.mode == "off":
            return
        self.session.keep(pl_module, after="by the end of the run")
        unguard_pruning(trainer.callbacks)
        if self._flat is not None:
            self._flat.__exit__(None, None, None)
            self._flat = None

    # ---- the layout for the whole run: put back after whatever may have moved it, never every step ------------

    def _keep_due(self, trainer: Trainer, hook: str, when: str) -> None:
        ran = [type(c).__name__ for c in trainer.callbacks if c is not self and overrides_hook(c, hook)]
        self._due = f"{when}{' (' + ', '.join(ran) + ' ran then)' if ran else ''}"

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._keep_due(trainer, "on_train_epoch_end", f"after epoch {trainer.current_epoch}'s end")

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._keep_due(trainer, "on_validation_end", f"after validation at step {trainer.global_step}")

    def _convert_model(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device, dtype = trainer.strategy.root_device, compute_dtype(trainer.precision)
        sharding = sharding_of(pl_module, trainer.strategy)
        if self.mode == "auto" and self.layout is None and not sharding:  # a sharded model cannot be copied to time
            self.session.choose(step_target(pl_module), self._shape(trainer), steps=self.auto_steps, device=device,
                                autocast_dtype=autocast_dtype(trainer.precision), timeout=self.auto_timeout,
                                owner="ChannelsLast(mode='auto')")
        untimed = " (not timed: a sharded model cannot be copied)" if self.mode == "auto" and sharding else ""
        self.session.convert(pl_module, device=device, dtype=dtype, sharding=sharding,
                             owner=f"ChannelsLast(mode={self.mode!r}){untimed}", inputs=self.convert_inputs)

    def _shape(self, trainer: Trainer) -> tuple[int, ...] | None:
        if self.input_shape is not None:
            return self.input_shape
        shape = getattr(trainer.datamodule, "input_shape", None)
        return tuple(shape) if shape is not None else None

    # ---- batches -------------------------------------------------------------------------------

    def _convert_batch(self, batch: Any, stage: str, pl_module: LightningModule) -> None:
        if self.mode != "off" and self.convert_inputs and self.layout is not None:
            self.batch_inputs.convert(batch, stage, pl_module)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._due is not None:
            self.session.keep(pl_module, after=self._due)
            self._due = None
        self._convert_batch(batch, "train", pl_module)
        self._check_first_batch(trainer, pl_module, batch, batch_idx, "train")
        if not self._expecting and self.mode != "off":
            self._expecting = True
            self.session.expect(pl_module)
        if self.audit and not self._audited:
            self._audited = True
            self._run_audit(trainer, pl_module, batch)
        self.batch_inputs.start_trace(pl_module)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self.batch_inputs.end_trace()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._batch_end()

    # Lightning passes ``dataloader_idx`` to these hooks and to the step only with several data loaders.
    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
        dataloader_idx: int | None = None,
    ) -> None:
        self._batch_start(trainer, pl_module, batch, batch_idx, "validation", dataloader_idx)

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_end()

    @override
    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
        dataloader_idx: int | None = None,
    ) -> None:
        self._batch_start(trainer, pl_module, batch, batch_idx, "test", dataloader_idx)

    @override
    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_end()

    @override
    def on_predict_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
        dataloader_idx: int | None = None,
    ) -> None:
        self._batch_start(trainer, pl_module, batch, batch_idx, "predict", dataloader_idx)

    @override
    def on_predict_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        self._batch_end()

    def _batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, stage: str,
                     dataloader_idx: int | None) -> None:
        self._convert_batch(batch, stage, pl_module)
        self._check_first_batch(trainer, pl_module, batch, batch_idx, stage, dataloader_idx)
        self.batch_inputs.start_trace(pl_module)

    def _batch_end(self) -> None:
        self.batch_inputs.end_trace()
        self.batch_inputs.restore()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.batch_inputs.end_trace(completed=False)
        self.batch_inputs.restore()
        unguard_pruning(trainer.callbacks)
        if self._flat is not None:  # an exception ends the run without teardown: torch's own utilities back
            self._flat.__exit__(None, None, None)
            self._flat = None

    # ---- the first-batch layout check ------------------------------------------------------------

    def _check_first_batch(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
                           stage: str, dataloader_idx: int | None = None) -> None:
        kind = "train" if stage == "train" else "eval"
        if not self.verify or self.mode == "off" or self.layout != "channels_last" or kind in self.layout_checks:
            return

        saved = (self._restored or {}).get("layout_checks", {}).get(kind)
        same = saved is not None and self._restored.get("fingerprint") == run_fingerprint(trainer, pl_module)

        def run() -> LayoutCheck:
            if same:  # the verdict of the checkpoint's run, for the same model and step: not paid again
                return restored_check(saved)
            result = check_within_budget(
                lambda part: check_lightning_step(trainer, pl_module, part, batch_idx, stage, inputs=self.inputs,
                                                  one_d=self.session.one_d, dataloader_idx=dataloader_idx),
                batch, self.check_samples, inputs=self.inputs)
            changed = "checked again: the model, its step or the precision changed since the checkpoint"
            return dataclasses.replace(result, notes=(*result.notes, changed)) if saved is not None else result

        self._fingerprint = run_fingerprint(trainer, pl_module)
        if self.session.check(kind, pl_module, run).verdict == "contiguous":
            self.batch_inputs.put_contiguous(batch)

    # ---- resume and audit ----------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        if not self.layout_checks:
            return {}
        return {"layout_checks": {k: saved_check(r) for k, r in self.layout_checks.items()},
                "fingerprint": self._fingerprint}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict or None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Runs after the optimizer state is restored from a checkpoint: momentum buffers keep the
        # strides they were saved with, which may be another layout than their parameter's.
        if self.mode != "off":
            self.session.resume()

    def _run_audit(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
        from cltrain.audit import audit_model

        if self.sharding is not None:
            rank_zero_warn(f"ChannelsLast(audit=True): not audited, the model is sharded by {self.sharding}, which "
                           "cannot be copied; audit the unsharded model: cltrain.audit_model(model, batch_input).")
            return
        example = first_image_tensor(batch, self.inputs)
        if example is None:
            rank_zero_warn("ChannelsLast(audit=True): the first training batch holds no 4-D/5-D float tensor to audit.")
            return
        target = step_target(pl_module)
        # A copy: the real module may be wrapped by DDP, whose gradient hooks must not see this backward.
        self.audit_report = audit_model(
            copy.deepcopy(target), example.detach(), autocast_dtype=autocast_dtype(trainer.precision)
        )
        rank_zero_info(f"ChannelsLast layout audit of {type(target).__name__}:\n{self.audit_report.format_table()}")



def _say(message: str, warn: bool) -> None:
    (rank_zero_warn if warn else rank_zero_info)(message)
