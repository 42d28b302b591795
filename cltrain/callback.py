"""The ``ChannelsLast`` Lightning callback: channels_last training for an existing project, in one line."""

from __future__ import annotations

import copy
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from cltrain.layout import (
    CONV1D_TYPES,
    CONV_TYPES,
    is_channels_last,
    layout_summary,
    to_channels_last,
    to_channels_last_1d,
    to_contiguous,
)
from cltrain.layout.batches import check_inputs, describe_batch, first_image_tensor, image_inputs, restride_batch
from cltrain.layout.conv_reach import ConvReach
from cltrain.layout.stacks import in_input_layout
from cltrain.guardrails import KNOWN_FAULTS, GuardRecord, apply_guardrails, find_hazards
from cltrain.check.budget import DEFAULT_SAMPLES, check_within_budget
from cltrain.check.compare import LayoutCheck
from cltrain.check.lightning_step import apply_to_copy, check_lightning_step
from cltrain.layout.lightning_access import (
    model_copies,
    overrides,
    restride_optimizer_state,
    run_after,
    step_target,
    undo_run_after,
)
from cltrain.check.fallback import Fallback, apply_fallbacks
from cltrain.precision import autocast_dtype, compute_dtype
from cltrain.sharding import not_checked_reason, sharded_line, sharding_of

__all__ = ["ChannelsLast"]

_MODES = ("full", "conv", "off", "auto")


class ChannelsLast(Callback):
    r"""Train, validate, test and predict in channels_last (NHWC) memory format.

    The model is converted once it is complete (after the LightningModule's ``setup`` or
    ``configure_model``), before the strategy moves it and wraps it in DDP, identically on every
    rank. In every stage the model's inputs are restrided in place in
    ``on_{train,validation,test,predict}_batch_start`` (``cltrain.layout.batches`` says which
    tensors); targets and masks keep their layout, and a tensor already channels_last is not
    copied; a (B, T, C, H, W) stack of images gets each frame channels_last (``cltrain.layout.stacks``). At each
    stage's first batch the model's forward is traced: an input whose converted layout reaches no convolution
    (the model makes it contiguous first) is left as it arrives from then on, and one line says so. Averaged copies held by other callbacks (``WeightAveraging``, ``EMAWeightAveraging``,
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
        if mode not in _MODES:
            raise ValueError(f"ChannelsLast(mode={mode!r}): expected one of {_MODES}.")
        if not isinstance(convert_inputs, bool):
            raise ValueError(f"ChannelsLast(convert_inputs={convert_inputs!r}): expected True or False.")
        if not isinstance(audit, bool):
            raise ValueError(f"ChannelsLast(audit={audit!r}): expected True or False.")
        inputs = check_inputs(inputs, owner="ChannelsLast")
        if input_shape is not None and (
            len(input_shape) not in (3, 4, 5) or not all(isinstance(s, int) and s > 0 for s in input_shape)
        ):
            raise ValueError(
                f"ChannelsLast(input_shape={input_shape!r}): expected (N, C, H, W), (N, C, D, H, W) or, for a 1-D "
                "model, (N, C, L) positive ints."
            )
        if not isinstance(auto_steps, int) or auto_steps < 1:
            raise ValueError(f"ChannelsLast(auto_steps={auto_steps!r}): expected an int >= 1.")
        if not isinstance(guard, bool):
            raise ValueError(f"ChannelsLast(guard={guard!r}): expected True or False.")
        if not isinstance(verify, bool):
            raise ValueError(f"ChannelsLast(verify={verify!r}): expected True or False.")
        if check_samples is not None and (not isinstance(check_samples, int) or isinstance(check_samples, bool)
                                          or check_samples < 1):
            raise ValueError(f"ChannelsLast(check_samples={check_samples!r}): expected None or an int >= 1.")
        if not isinstance(auto_timeout, (int, float)) or auto_timeout <= 0:
            raise ValueError(f"ChannelsLast(auto_timeout={auto_timeout!r}): expected seconds > 0.")
        self.mode = mode
        self.convert_inputs = convert_inputs
        self.inputs = inputs
        self.audit = audit
        self.input_shape = tuple(input_shape) if input_shape is not None else None
        self.auto_steps = auto_steps
        self.guard = guard
        self.verify = verify
        self.check_samples = check_samples
        self.layout_checks: dict[str, LayoutCheck] = {}
        self.fallbacks: list[Fallback] = []
        self.auto_timeout = float(auto_timeout)
        self.layout: str | None = None
        self.timings: dict[str, float] | None = None
        self.auto_failure: str | None = None
        self.guardrails: list[GuardRecord] | None = None
        self._device: torch.device | None = None
        self._dtype: torch.dtype | None = None
        self.summary: dict[str, int] | None = None
        self.sharding: str | None = None
        self.audit_report: Any = None
        self._one_d = False  # auto timed a rank-3 shape: channels-last 1-D for Conv1d and rank-3 batches
        self._audited = False
        self._told_inputs = False
        self._checked_inputs = False
        self._warned_no_conv = False
        self._left_as_is: dict[str, frozenset[int]] = {}  # per stage: input positions no convolution needs converted
        self._reach: tuple[str, ConvReach, dict[int, torch.Tensor]] | None = None  # the first batch being traced
        self._told_left: set[str] = set()

    # ---- model conversion ----------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.mode == "off":
            return
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

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        undo_run_after(pl_module)

    def _put_in_layout(self, module: nn.Module, hazards: dict[str, list[str]] | None = None) -> list[GuardRecord]:
        if self.sharding is not None:
            if sharding_of(module) is None:  # FSDP and DeepSpeed wrap it later, and flatten it contiguous
                to_contiguous(module)
        elif self.layout == "channels_last":
            to_channels_last(module, mode="conv" if self.mode == "conv" else "full")
            if self._one_d:
                to_channels_last_1d(module)
        else:  # auto kept NCHW: make that true even for a model that arrived channels_last
            to_contiguous(module)
        if not self.guard:
            return []
        # After every conversion: converting again would undo a guarded weight's layout.
        return apply_guardrails(module, device=self._device, dtype=self._dtype, layout=self.layout, hazards=hazards)

    def _convert_copies(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Averaging callbacks deep-copy the module in their own `setup`, before this callback
        # converts it (whatever the callback order); every EMA update and validation swap
        # would then copy across layouts. Their copies join the model's layout here.
        if self.layout is None or self.sharding is not None:
            return
        for copy_ in model_copies(trainer, pl_module, exclude=self):
            self._put_in_layout(copy_)

    def _hazards_on_every_rank(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, list[str]]:
        """The modules any rank finds hazardous (the oneDNN ISA may differ between machines): every
        rank guards the same modules, so parameter layouts, and DDP's buckets, agree."""
        local = find_hazards(pl_module, device=self._device, dtype=self._dtype, layout=self.layout)
        if trainer.world_size == 1:
            return local
        names = [name for name, _ in pl_module.named_modules()]
        index = {name: j for j, name in enumerate(names)}
        flags = torch.zeros(len(KNOWN_FAULTS), len(names), device=self._device)
        for i, fault in enumerate(KNOWN_FAULTS):
            for name in local.get(fault.key, ()):
                flags[i, index[name]] = 1
        flags = trainer.strategy.reduce(flags, reduce_op="sum").cpu()
        union = {fault.key: [names[j] for j in flags[i].nonzero().flatten().tolist()]
                 for i, fault in enumerate(KNOWN_FAULTS)}
        return {key: found for key, found in union.items() if found}

    def _convert_model(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._device = trainer.strategy.root_device
        self._dtype = compute_dtype(trainer.precision)
        self.sharding = sharding_of(pl_module, trainer.strategy)
        if self.layout is None:  # a sharded model cannot be copied to time it
            self.layout = "channels_last" if self.mode != "auto" or self.sharding else self._choose(trainer, pl_module)
        hazards = self._hazards_on_every_rank(trainer, pl_module) if self.guard else None
        records = self._put_in_layout(pl_module, hazards)
        if self.guard:
            self.guardrails = records
        apply_fallbacks(pl_module, self.fallbacks)  # a later fit: conversion restrided their weights
        self._convert_copies(trainer, pl_module)
        self.summary = layout_summary(pl_module, buffers=True)
        convs = CONV_TYPES + CONV1D_TYPES if self._one_d else CONV_TYPES
        if not self._warned_no_conv and not any(isinstance(m, convs) for m in pl_module.modules()):
            self._warned_no_conv = True
            rank_zero_warn(
                f"ChannelsLast: {type(pl_module).__name__} has no Conv2d/Conv3d/ConvTranspose layer, so "
                "channels_last has nothing to speed up; remove the callback or keep it for the layout checks."
            )
        counts = ", ".join(f"{n} {k}" for k, n in self.summary.items())
        if self.sharding is not None:
            untimed = " (not timed: a sharded model cannot be copied)" if self.mode == "auto" else ""
            (rank_zero_info if self.convert_inputs else rank_zero_warn)(
                f"ChannelsLast(mode={self.mode!r}){untimed}: {sharded_line(self.sharding, self.convert_inputs)}")
        else:
            rank_zero_info(
                f"ChannelsLast(mode={self.mode!r}): model layout is {self.layout}; parameters and buffers: {counts}."
            )
        if records:
            rank_zero_info("ChannelsLast: worked around known kernel faults: " + "; ".join(r.line() for r in records))

    def _shape(self, trainer: Trainer) -> tuple[int, ...] | None:
        if self.input_shape is not None:
            return self.input_shape
        shape = getattr(trainer.datamodule, "input_shape", None)
        return tuple(shape) if shape is not None else None

    def _choose(self, trainer: Trainer, pl_module: LightningModule) -> str:
        from cltrain.timing.probe import probe_layout

        decision: list[Any] = [None, None, None]
        self._one_d = len(self._shape(trainer)) == 3
        if trainer.is_global_zero:
            # In a child process: a native crash in either layout's kernels must not end the run.
            result = probe_layout(
                step_target(pl_module),
                self._shape(trainer),
                steps=self.auto_steps,
                device=self._device,
                autocast_dtype=autocast_dtype(trainer.precision),
                guardrails=self.guard,
                timeout=self.auto_timeout,
            )
            decision = [result.layout, result.timings, result.failure, result.method]
        # Every rank must take the same layout or DDP's buckets disagree between ranks.
        layout, self.timings, self.auto_failure, method = trainer.strategy.broadcast(decision, src=0)
        if self.auto_failure is not None:
            rank_zero_warn(f"ChannelsLast(mode='auto'): {self.auto_failure}; keeping contiguous.")
            return layout
        per_img = ", ".join(f"{k} {v * 1e3:.1f} ms/step" for k, v in sorted(self.timings.items()))
        rank_zero_info(f"ChannelsLast(mode='auto'), timed {method}: {per_img} -> keeping {layout}.")
        return layout

    # ---- batches -------------------------------------------------------------------------------

    def _convert_batch(self, batch: Any, stage: str, pl_module: LightningModule) -> None:
        if self.mode == "off" or not self.convert_inputs or self.layout is None:
            return
        traced = None
        if self._traces_inputs(stage):
            traced = {p: t for p, t in image_inputs(batch, self.inputs, self._one_d).items()
                      if not in_input_layout(t, pl_module)}
        converted = restride_batch(batch, self.layout, one_d=self._one_d, inputs=self.inputs,
                                   skip=self._left_as_is.get(stage, ()), model=pl_module)
        if not self._checked_inputs:
            self._checked_inputs = True
            if first_image_tensor(batch, self.inputs) is None and first_image_tensor(batch, "all") is not None:
                rank_zero_info(
                    f"ChannelsLast: no model input found in the batch ({describe_batch(batch)}), so none is converted "
                    "(the first convolution converts the activations). Name it with inputs=KEY or inputs=INDEX."
                )
        if traced is not None:
            self._left_as_is[stage] = frozenset()
            if traced:
                # Traced through this batch's forward (after the check): `_end_trace` keeps or stops each conversion.
                self._reach = (stage, ConvReach(traced), traced)
                return
        self._tell_converting(converted)

    def _traces_inputs(self, stage: str) -> bool:
        return (stage not in self._left_as_is and self.layout == "channels_last" and self.inputs != "all"
                and not self._one_d)

    def _tell_converting(self, converted: int) -> None:
        if converted and not self._told_inputs:
            self._told_inputs = True
            rank_zero_info(
                f"ChannelsLast: batches arrive in another layout; converting {converted} tensor(s) per batch "
                f"to {self.layout} on the device. cltrain.data's NHWC collate makes this copy unnecessary."
            )

    def _start_trace(self, pl_module: LightningModule) -> None:
        if self._reach is None:
            return
        compiled = getattr(pl_module, "_compiler_ctx", None) is not None or any(
            type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None
            for m in pl_module.modules())
        if self.layout != "channels_last" or compiled:
            # The check put the model in NCHW; or the step is compiled, and a TorchFunctionMode would change what
            # Dynamo compiles: convert as before.
            self._tell_converting(len(self._reach[2]) if self.layout == "channels_last" else 0)
            self._reach = None
            return
        self._reach[1].__enter__()

    def _end_trace(self, completed: bool = True) -> None:
        """Leave the forward's trace; with ``completed``, stop converting the inputs that no convolution took
        in channels_last."""
        if self._reach is None:
            return
        stage, reach, traced = self._reach
        self._reach = None
        reach.__exit__(None, None, None)
        if not completed or reach.convolutions == 0:  # nothing seen to judge by: keep converting
            self._tell_converting(len(traced))
            return
        left = sorted(set(traced) - reach.reached)
        if left:
            self._left_as_is[stage] = frozenset(left)
            shapes = ", ".join(str(tuple(traced[p].shape)) for p in left)
            if shapes not in self._told_left:  # once per run, not once per stage
                self._told_left.add(shapes)
                rank_zero_info(
                    f"ChannelsLast: the input {shapes} reaches no convolution in {self.layout} (the model reshapes "
                    "or permutes it, or other code replaces it, first), so converting it is a copy that helps nothing: "
                    "it is left as it arrives from now on."
                )
        self._tell_converting(len(traced) - len(left))

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._convert_batch(batch, "train", pl_module)
        self._check_first_batch(trainer, pl_module, batch, batch_idx, "train")
        if self.audit and not self._audited:
            self._audited = True
            self._run_audit(trainer, pl_module, batch)
        self._start_trace(pl_module)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._end_trace()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._end_trace()

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._convert_batch(batch, "validation", pl_module)
        self._check_first_batch(trainer, pl_module, batch, batch_idx, "validation")
        self._start_trace(pl_module)

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._end_trace()

    @override
    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._convert_batch(batch, "test", pl_module)
        self._check_first_batch(trainer, pl_module, batch, batch_idx, "test")
        self._start_trace(pl_module)

    @override
    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self._end_trace()

    @override
    def on_predict_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._convert_batch(batch, "predict", pl_module)
        self._check_first_batch(trainer, pl_module, batch, batch_idx, "predict")
        self._start_trace(pl_module)

    @override
    def on_predict_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        self._end_trace()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._end_trace(completed=False)

    # ---- the first-batch layout check ------------------------------------------------------------

    def _check_first_batch(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
                           stage: str) -> None:
        kind = "train" if stage == "train" else "eval"
        if not self.verify or self.mode == "off" or self.layout != "channels_last" or kind in self.layout_checks:
            return
        result = None
        if self.sharding is not None:  # a sharded model cannot be copied; every rank knows why
            result = LayoutCheck("not checked", reason=not_checked_reason(self.sharding))
        elif trainer.is_global_zero:
            try:
                result = check_within_budget(
                    lambda part: check_lightning_step(trainer, pl_module, part, batch_idx, stage, inputs=self.inputs,
                                                      one_d=self._one_d),
                    batch, self.check_samples, inputs=self.inputs)
            except Exception as error:  # noqa: BLE001 - the check failing must not end the run
                result = LayoutCheck("not checked", reason=f"the check itself failed ({type(error).__name__}: {error})")
        # Every rank applies the same fallbacks, or DDP's parameter layouts disagree between ranks.
        result = trainer.strategy.broadcast(result, src=0)
        self.layout_checks[kind] = result
        if result.verdict == "fallback":
            self.fallbacks += [f for f in result.fallbacks if f not in self.fallbacks]
            apply_fallbacks(pl_module, self.fallbacks)
            for copy_ in model_copies(trainer, pl_module, exclude=self):
                apply_to_copy(copy_, self.fallbacks)
            restride_optimizer_state(trainer.optimizers)
        elif result.verdict == "contiguous":
            self.layout = "contiguous"
            records = self._put_in_layout(pl_module)
            if self.guard:
                self.guardrails = records
            self._convert_copies(trainer, pl_module)
            restride_optimizer_state(trainer.optimizers)
            restride_batch(batch, "contiguous", one_d=self._one_d, inputs=self.inputs)
        if result.verdict in ("fallback", "contiguous"):
            rank_zero_warn(f"ChannelsLast {result.line()}")
        else:
            rank_zero_info(f"ChannelsLast {result.line()}")

    # ---- resume and audit ----------------------------------------------------------------------

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Runs after the optimizer state is restored from a checkpoint: momentum buffers keep the
        # strides they were saved with, which may be another layout than their parameter's.
        if self.mode == "off" or self.sharding is not None:  # the engine owns the optimizer state's layout
            return
        self._convert_copies(trainer, pl_module)  # copies made later than setup (on_fit_start)
        restride_optimizer_state(trainer.optimizers)

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

