"""The ``ChannelsLast`` Lightning callback: channels_last training for an existing project, in one line."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from cltrain.check.budget import DEFAULT_SAMPLES, check_within_budget
from cltrain.check.compare import LayoutCheck
from cltrain.check.lightning_step import STEPS, check_lightning_step
from cltrain.check.resume import run_fingerprint
from cltrain.layout import to_contiguous
from cltrain.layout.batches import check_inputs, first_image_tensor
from cltrain.lightning_access import LightningHost, overrides, overrides_hook, run_after, step_target, undo_run_after
from cltrain.nchw_code import UPSTREAM, guard_pruning, unguard_pruning
from cltrain.options import check_copies, check_flags, check_layout_choice, check_mode, check_positive
from cltrain.precision import autocast_dtype, compute_dtype
from cltrain.session import LayoutSession, SessionResults
from cltrain.sharding import sharding_of

__all__ = ["ChannelsLast"]

_MODES = ("full", "conv", "off")
_FINDERS = {"BatchSizeFinder", "LearningRateFinder"}  # Lightning's tuner callbacks, of either package


class ChannelsLast(SessionResults, Callback):
    r"""Train, validate, test and predict in channels_last (NHWC) memory format, in the faster of the two layouts.

    The model is converted once it is complete (after the LightningModule's ``setup`` or ``configure_model``), before
    the strategy moves it and wraps it in DDP, identically on every rank. The model's inputs are put in its layout in
    every stage (targets and masks keep theirs; ``cltrain.layout.batches`` says which tensors); a (B, T, C, H, W)
    stack of images gets each frame channels_last. The first batch of training and of evaluation is checked in both
    layouts (``verify``); then the first training steps race channels_last against NCHW on the run's own batches
    and keep the faster (``layout="auto"``, ``cltrain.timing.layout_race``), in one line; both step times go to the
    Trainer's loggers. Averaged copies held by other callbacks (``WeightAveraging``, ``EMAWeightAveraging``,
    ``StochasticWeightAveraging``) join the model's layout; whatever moves a parameter's layout later (Lightning's
    ``ModelPruning``, torch's pruning, a hook writing ``.data``) is put back at the next epoch's or validation's end,
    with the optimizer state; the checks' verdicts and the race's decision travel in the checkpoint, and on resume
    the optimizer state is restrided to its parameter's layout. A channels_last model's 4-D/5-D outputs are
    channels_last: flatten them with ``reshape``, not ``view``. Everything runs in ``cltrain.session.LayoutSession``,
    which this callback maps Lightning's hooks onto. The guide: docs/guides/callback.md.

    Under a sharding strategy (``ModelParallelStrategy``, ``FSDPStrategy``, ``DeepSpeedStrategy``) or on a model
    sharded already, the parameters stay contiguous, as the engine requires, and only the inputs are channels_last
    (``cltrain.sharding``; docs/guides/scaling.md); the check, the race and the audit then do not run.

    Args:
        mode: ``"full"`` restrides every 4-D/5-D parameter and buffer; ``"conv"`` only convolution weights; ``"off"``
            does nothing (for sweeps).
        layout: ``"auto"`` races the layouts on the first training steps and keeps the faster (the line says by
            how much); ``"channels_last"`` or ``"contiguous"`` pins one, as a run's line says to pin what it chose
            (two runs pinned alike train bit for bit alike).
        convert_inputs: put the model's inputs in the model's layout. With ``False`` only the model is converted
            (the first convolution then converts the activations, as Composer does).
        inputs: which tensors of a batch are the model's inputs. ``None``: by the batch's shape. A key or field name
            (found at any depth of the batch), an index of a tuple/list batch, or a list of those: every floating
            rank-4/5 tensor under them. ``"all"``: every floating rank-4/5 tensor of the batch, targets included.
        audit: run ``cltrain.audit.audit_model`` on the first training batch and print which ops lose the layout.
        guard: apply ``cltrain.guardrails.apply_guardrails`` after every conversion: the few layers that match a
            known-bad backend kernel get a targeted workaround; one log line names them. ``False`` trains the bare
            kernels.
        verify: on the first batch of training (and of validation, test or predict, whichever comes first) run the
            step in both layouts on copies of the model (``cltrain.check.compare``): where the project's own code
            assumes NCHW and raises or diverges only in channels_last, the smallest part holding that code runs in
            NCHW (or the whole model stays contiguous), and one line names the module, the file and line, and the
            fix. Nothing of the real run changes. ``False`` skips the check.
        check_samples: the check runs on the first ``check_samples`` samples of the batch (``cltrain.check.budget``);
            ``None``: the whole batch.
        copies: copies of the model that should follow its layout besides those other callbacks hold, which are
            found (an EMA kept by your own code): a module, a list, or a function giving them.

    Attributes:
        layout: the layout the model is in now (``"channels_last"`` or ``"contiguous"``); ``None`` before ``setup``
            and with ``mode="off"``.
        decision: the race's ``cltrain.timing.layout_race.LayoutDecision`` for the batches trained on last
            (``None``: not decided yet, or not raced); ``decisions``: one per kind of batch.
        timings: the decision's median seconds per step of each layout, or ``None``.
        guardrails: the ``cltrain.guardrails.GuardRecord`` of each known fault worked around (``record.as_dict()``
            for ``metrics.json``); ``None`` before ``setup``, with ``guard=False`` and with ``mode="off"``.
        layout_checks: the ``cltrain.check.compare.LayoutCheck`` of each first batch checked, by kind (``"train"``,
            ``"eval"``); ``result.as_dict()`` for ``metrics.json``.
        fallbacks: the ``cltrain.check.fallback.Fallback``s the checks applied to the model.
        summary: ``cltrain.layout_summary`` of the model's parameters and buffers once converted.
        sharding: the sharding engine that holds the model's parameters, which then stay contiguous; or ``None``.
        audit_report: with ``audit=True``, the ``cltrain.audit.AuditReport`` of the first training batch.
        session: the ``cltrain.session.LayoutSession`` that runs it all.

    Raises:
        ValueError: an unknown ``mode`` or ``layout``, a non-bool ``convert_inputs``, ``audit``, ``guard`` or
            ``verify``, a ``check_samples`` that is not ``None`` or an int >= 1, an ``inputs`` that is none of its
            forms, ``copies`` that are not modules, or a key or index named in ``inputs`` that a batch lacks (raised
            at that batch).

    Example::

        from lightning.pytorch import Trainer
        from cltrain import ChannelsLast

        trainer = Trainer(callbacks=[ChannelsLast()], precision="bf16-mixed")
        trainer.fit(model, datamodule=dm)
    """

    def __init__(
        self,
        mode: str = "full",
        layout: str = "auto",
        convert_inputs: bool = True,
        audit: bool = False,
        guard: bool = True,
        inputs: str | int | list[str | int] | None = None,
        verify: bool = True,
        check_samples: int | None = DEFAULT_SAMPLES,
        copies: Callable[[], Iterable[nn.Module]] | nn.Module | Sequence[nn.Module] | None = None,
    ) -> None:
        check_mode("ChannelsLast", mode, _MODES)
        check_layout_choice("ChannelsLast", layout)
        check_flags("ChannelsLast", convert_inputs=convert_inputs, audit=audit, guard=guard, verify=verify)
        inputs = check_inputs(inputs, owner="ChannelsLast")
        check_positive("ChannelsLast", "check_samples", check_samples, optional=True)
        self.mode, self.convert_inputs, self.inputs, self.audit = mode, convert_inputs, inputs, audit
        self.guard, self.verify, self.check_samples = guard, verify, check_samples
        self.copies = check_copies("ChannelsLast", copies)
        self.audit_report: Any = None
        self.session = LayoutSession("conv" if mode == "conv" else "full", layout=layout, guard=guard, verify=verify,
                                     inputs=inputs, check_samples=check_samples, convert_inputs=convert_inputs)
        self._audited = False
        self._module: LightningModule | None = None
        self._due: str | None = None  # what ran since the last step that may have moved the parameters
        self._tuning = False  # the model is in NCHW for Lightning's finders (``_start``)

    # ---- the model -----------------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.mode == "off":
            return
        self._module = pl_module
        self.session.host = LightningHost(trainer, pl_module, _say, exclude=self, copies=self.copies)
        self.session.watch_optimizers = not pl_module.automatic_optimization  # the step's own optimizer calls
        self.session.fingerprint = lambda: run_fingerprint(
            pl_module, precision=str(trainer.precision), device=trainer.strategy.root_device.type,
            code=[getattr(type(pl_module), method, None) for method in STEPS.values()])
        if sharding_of(pl_module, trainer.strategy) is not None:
            # configure_model may call fully_shard next, which refuses a model that arrived channels_last.
            to_contiguous(pl_module)
        # LightningModule.setup runs after this hook and configure_model after that; the model
        # is complete only then, and the strategy moves and wraps it right after.
        last = "configure_model" if overrides("configure_model", pl_module) else "setup"
        finders = [type(c).__name__ for c in trainer.callbacks if _FINDERS & {k.__name__ for k in type(c).__mro__}]
        run_after(pl_module, last, lambda: self._start(trainer, pl_module, stage, finders))
        guard_pruning(trainer.callbacks, pl_module, lambda what, aliases: self.session.boundary(
            pl_module, aliases=aliases,
            line=f"ChannelsLast: {what.partition('.')[0]} prunes the weights in NCHW (torch's pruning calls view on "
                 f"channels_last ones: {UPSTREAM}); they and their masks go back to {self.layout} after each of its "
                 "calls, with their optimizer state."))

    def _start(self, trainer: Trainer, pl_module: LightningModule, stage: str, finders: list[str]) -> None:
        self.session.start(pl_module, device=trainer.strategy.root_device, dtype=compute_dtype(trainer.precision),
                           sharding=sharding_of(pl_module, trainer.strategy), owner=f"ChannelsLast(mode={self.mode!r})",
                           training=stage == "fit")
        if finders and stage == "fit" and self.session.layout == "channels_last" and self.sharding is None:
            # Lightning's finders run their trial steps with no callback: no check, no fallback, inputs as they come
            # (a head that views its input raised there); the fit's own steps start in the layout (on_train_start)
            to_contiguous(pl_module)
            self._tuning = True
            _say(f"ChannelsLast: {' and '.join(finders)} {'run' if len(finders) > 1 else 'runs'} trial steps without "
                 "callbacks, so the model takes them in NCHW; it is channels_last from the fit's first step.", False)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        undo_run_after(pl_module)
        if self.mode == "off":
            return
        self.session.end(pl_module)
        unguard_pruning(trainer.callbacks)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.session.close()  # an exception ends the run without teardown: torch's own utilities back
        unguard_pruning(trainer.callbacks)

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

    # ---- batches -------------------------------------------------------------------------------

    def _batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, stage: str,
                     dataloader_idx: int | None = None) -> None:
        if self.mode == "off":
            return
        kind = "train" if stage == "train" else "eval"

        def check() -> LayoutCheck:
            return check_within_budget(
                lambda part: check_lightning_step(trainer, pl_module, part, batch_idx, stage, inputs=self.inputs,
                                                  dataloader_idx=dataloader_idx, convert_inputs=self.convert_inputs),
                batch, self.check_samples, inputs=self.inputs)

        self.session.batch(kind, batch, pl_module, check if self.verify else None)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._due is not None and self.mode != "off":
            self.session.boundary(pl_module, after=self._due)
            self._due = None
        self._batch_start(trainer, pl_module, batch, batch_idx, "train")
        if self.audit and not self._audited and self.mode != "off":
            self._audited = True
            self._run_audit(trainer, pl_module, batch)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if pl_module.automatic_optimization:  # manual optimization may go on with its inputs after a backward (a
            self.session.forward_done()  # GAN's discriminator on the real images): the trace ends at the batch's end

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.mode == "off":
            return
        self.session.batch_end()
        last = batch_idx + 1 == trainer.num_training_batches
        if pl_module.automatic_optimization:  # a step is a cycle of batches ending in an optimizer step
            completed = (batch_idx + 1) % trainer.accumulate_grad_batches == 0  # Lightning steps at the epoch's end
        else:  # manual optimization accumulates as it likes: the step ends at the batch whose optimizer stepped
            completed = self.session.optimizer_stepped()
        if completed or last:  # a cycle the epoch ends before its accumulation is whole is not timed
            self.session.step_end(pl_module, completed=completed)

    # Lightning passes ``dataloader_idx`` to these hooks and to the step only with several data loaders.
    @override
    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int | None = None) -> None:
        self._batch_start(trainer, pl_module, batch, batch_idx, "validation", dataloader_idx)

    @override
    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_end()

    @override
    def on_test_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
                            dataloader_idx: int | None = None) -> None:
        self._batch_start(trainer, pl_module, batch, batch_idx, "test", dataloader_idx)

    @override
    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_end()

    @override
    def on_predict_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
                               dataloader_idx: int | None = None) -> None:
        self._batch_start(trainer, pl_module, batch, batch_idx, "predict", dataloader_idx)

    @override
    def on_predict_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_end()

    def _eval_end(self) -> None:
        if self.mode != "off":
            self.session.batch_end()

    # ---- checkpoints ---------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.session.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Restored after configure_model and before the strategy wraps the model: a decided layout is taken now.
        self.session.load_state_dict(state_dict, model=self._module)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Runs after the optimizer state is restored from a checkpoint: momentum buffers keep the
        # strides they were saved with, which may be another layout than their parameter's.
        if self.mode != "off":
            if self._tuning:  # the finders' trials are over
                self._tuning = False
                self.session.put_back(pl_module)
            self.session.resume()

    # ---- the audit ------------------------------------------------------------------------------

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
