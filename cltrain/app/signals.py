"""SIGTERM and SIGINT end a run cleanly: the latest state saved, exit status 143 / 130.

``SignalStop`` handles SIGINT and SIGTERM for the whole of ``train()``, chained with Lightning's own SIGTERM handler.
Outside ``fit`` a signal raises ``RunInterrupted`` at once. Inside ``fit`` the first signal stops the run after the
current batch, through Lightning's ``on_exception`` hooks, where ``KeepOnException`` writes ``last.ckpt``:

* after a batch whose optimizer stepped: with gradient accumulation, the batch that ends the accumulation (a
  half-accumulated gradient is in no checkpoint);
* after an epoch's last batch, at the epoch's end, once its validation (if due) is whole (stopped before, a resumed
  run would never validate that epoch, or finish its validation; stopped at the next epoch's start, Lightning has
  begun that epoch and a resumed run skips most of it), unless the run ends with that epoch anyway (an
  ``EarlyStopping`` deciding there is asked first: ``_AfterMonitors``);
* after a validation in the middle of an epoch (``val_check_interval``), due after the batch or under way when the
  signal came, once it is whole (cut, a resumed run goes on with the next batch and never finishes it), or where it
  falls inside an accumulation, after the batch that ends it;
* not at all where the fit has trained all it was to (``trained_out``): it ends as it would have;
* by Lightning's own stop (either signal sets its flag, under several ranks on every rank at the same batch), which
  comes after the batch's metrics reach the loggers.

A second signal stops the run at once, in the middle of a step, and ``last.ckpt`` stays the latest whole state written
before; so does a first signal after the training loop has waited ``DATA_GRACE`` seconds for a batch that does not
come (a read that stalls). While that file is written (``holding``), further signals wait for it: a signal raised
inside ``torch.save`` would leave no file and a traceback. SIGUSR1 (SLURM's requeue) is never touched.

A signal the main thread cannot take (it waits inside C++: a rendezvous for a rank that never comes, a collective
with a rank that is gone, where a Python handler runs only when the call returns) ends the process after
``STUCK_GRACE`` seconds with one line (exit 128 + the signal's number), as it would end without a handler: a thread
watches the signals arrive (``signal.set_wakeup_fd``) and the handler taking them.

Under several ranks a signal may reach one rank, or each rank at its own moment (Ctrl+C reaches every process of the
terminal's group). Each rank notes it, and at each of the points above the ranks agree
(``agreed``: a reduction of one integer over a CPU process group, so the device is not waited on), so every rank
stops at the same batch and meets the others in the checkpoint's collectives. Stopped at different points, a rank's
checkpoint barrier met another rank's next collective: a gloo error and a traceback, or both ranks waiting for ever.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, Checkpoint
from typing_extensions import override

__all__ = ["RunInterrupted", "SignalStop", "lost_peer"]

HANDLED = (signal.SIGINT, signal.SIGTERM)
#: Seconds a signal may wait for the main thread's handler before the process ends without it.
STUCK_GRACE = 60.0
#: Seconds a first signal waits for a batch that does not come (a data read that stalls) before the run stops at once.
DATA_GRACE = 20.0


class RunInterrupted(BaseException):
    """The run was stopped by ``signum`` (a BaseException: nothing on the way catches it as an error)."""

    def __init__(self, signum: int, at_once: bool = False) -> None:
        self.signum = signum
        #: a second signal stopped the run in the middle of a step: its state is not one to save
        self.at_once = at_once
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class SignalStop(Callback):
    """Stop the run on SIGINT / SIGTERM with the latest state saved; see the module docstring.

    Use as a context manager around the whole run, and as a Trainer callback.

    Example::

        stop = SignalStop()
        with stop:
            trainer = Trainer(callbacks=[stop, OnExceptionCheckpoint("ckpts", "last")])
            with stop.deferred():
                trainer.fit(model)
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._defer = False
        self._holding = False
        self._stepped = False
        self._world_size = 1
        self._group: Any = None  # the CPU process group the ranks agree over; None: the default one, or one process
        self._previous: dict[int, Any] = {}
        self._taken = 0  # signals the handler has taken (the watchdog compares them with those that arrived)
        self._watch: tuple[int, int, int] | None = None  # the wakeup pipe's ends and the wakeup fd before it
        self._fetching: float | None = None  # since when the training loop waits for its next batch
        self._children: list[Any] = []  # the ranks this process launched (Lightning's launcher)

    # --- the handler ----------------------------------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._taken += 1
        again = self.signum == signum
        self.signum = self.signum or signum  # the first (torchrun sends SIGTERM after the terminal's SIGINT)
        if self._holding:  # the latest state is being written: the stop goes on once it is
            print(f"cltrain: {signal.Signals(signum).name}: last.ckpt is being written; the run stops once it is.",
                  file=sys.stderr, flush=True)
            return
        if not self._defer or again:
            raise RunInterrupted(signum, at_once=self._defer and again)
        # inside fit: stop at the end of the current batch (a single process's Lightning also sees SIGTERM itself)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """While active (``KeepOnException``'s save), a signal is noted and does not raise."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    def __enter__(self) -> SignalStop:
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                self._previous[signum] = signal.signal(signum, self._handle)
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._watch = (read, write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
            threading.Thread(target=self._watchdog, args=(read,), daemon=True, name="cltrain-signals").start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        if self._watch is not None:
            read, write, before = self._watch
            self._watch = None
            signal.set_wakeup_fd(before)
            os.close(write)  # the watchdog reads the end of the pipe and leaves

    def _watchdog(self, read: int) -> None:
        """Each handled signal that arrives (a byte on the wakeup pipe) must reach the handler within ``STUCK_GRACE``
        seconds; one that does not (the main thread waits inside C++) ends the process, as the signal would without
        a handler."""
        arrived = 0
        try:
            while data := os.read(read, 64):
                for signum in data:
                    if signum not in HANDLED:
                        continue
                    arrived += 1
                    deadline = time.monotonic() + STUCK_GRACE
                    while self._taken < arrived and time.monotonic() < deadline:
                        time.sleep(0.1)
                    if self._taken < arrived:
                        print(f"cltrain: {signal.Signals(signum).name}: the run waits inside a call that Python "
                              f"cannot interrupt (a rendezvous or a collective with a rank that is not there); "
                              f"stopped after {STUCK_GRACE:.0f} s.", file=sys.stderr, flush=True)
                        self._end_children()
                        os._exit(128 + signum)
                    if arrived == 1 and self._defer:
                        self._await_batch(signum)
        finally:
            os.close(read)

    def _end_children(self) -> None:
        """The ranks this process launched, killed (as Lightning's launcher ends them after Ctrl+C): this process stops
        at once, where they cannot agree with it, and a rank waiting for a stalled read, which no signal may have
        reached (a ``kill`` of the launching process alone), would wait on, orphaned."""
        for proc in self._children:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.kill()

    def _await_batch(self, signum: int) -> None:
        """A first signal, taken while the training loop waits for its next batch (a read from a store that stalls
        for minutes): after ``DATA_GRACE`` seconds of that wait, the signal again, which stops the run at once (no
        batch is in the middle: ``last.ckpt`` stays the latest whole state), within a preemption's notice."""
        since = time.monotonic()
        while self._watch is not None and self.signum == signum and self._defer:
            fetching = self._fetching
            if fetching is not None and not self._holding and time.monotonic() - max(fetching, since) > DATA_GRACE:
                print(f"cltrain: {signal.Signals(signum).name}: the next batch has not come in {DATA_GRACE:.0f} s (a "
                      "data read that stalls); stopping now.", file=sys.stderr, flush=True)
                self._end_children()
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.1)

    def deferred(self) -> _Deferred:
        """While the returned context is active (``trainer.fit``), a first signal waits for the batch end."""
        return _Deferred(self)

    # --- the callback ---------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not any(isinstance(c, _AfterMonitors) and c.stop is self for c in trainer.callbacks):
            trainer.callbacks.append(_AfterMonitors(self))
        self._world_size = trainer.world_size if dist.is_available() and dist.is_initialized() else 1
        if self._world_size == 1:
            return
        self._children = list(getattr(getattr(trainer.strategy, "launcher", None), "procs", None) or [])
        connector = getattr(trainer, "_signal_connector", None)
        if hasattr(connector, "_sigterm_notifier_fn"):  # registered after this hook
            connector._sigterm_notifier_fn = _ignore  # the ranks agree at the batch's end (``agreed``)
        if dist.get_backend() == "gloo":
            self._group = None
        elif getattr(self._group, "made_for", None) is not dist.group.WORLD:  # NCCL: the flag stays on the CPU
            self._group = dist.new_group(backend="gloo")
            self._group.made_for = dist.group.WORLD

    def agreed(self, trainer: pl.Trainer) -> int | None:
        """The signal the run stops for: this rank's; under several ranks the one any rank noted, the same on every
        rank (every rank calls this at the same point)."""
        if self._world_size == 1 or not dist.is_initialized():
            return self.signum
        flag = torch.tensor([self.signum or 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        self.signum = self.signum or int(flag) or None
        return int(flag) or None

    def stopped_by_peer(self, exception: BaseException) -> bool:
        """A lost peer once a signal was noted: a rank that a second signal stopped in the middle of a step left this
        one's collective without it. Its state is the middle of a step too."""
        return self.signum is not None and self._world_size > 1 and lost_peer(exception)

    def _check(self, trainer: pl.Trainer) -> None:
        signum = self.agreed(trainer)
        if signum is not None:
            raise RunInterrupted(signum)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._stepped, self._fetching = False, None

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._stepped = True

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._fetching = time.monotonic()  # the next batch is fetched from here (or the validation begins)
        signum = self.agreed(trainer)
        if signum is None:
            return
        stepped = self._stepped or trainer.accumulate_grad_batches == 1  # not in the middle of an accumulation
        if stepped and not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch and not trained_out(trainer):
            # Lightning's own stop, once this batch is logged (and validated, where it is due): every rank, this batch
            if not _lightning_stop(trainer, True):
                raise RunInterrupted(signum)
            return
        # Later: at the end of the accumulation, or after the epoch's last batch at the epoch's end, its validation
        # whole (stopped before the last batch counts as done, a resumed run skipped that validation); or the fit
        # ends here, trained out (``max_steps``), as it would have.
        # Lightning would stop a single process at this batch's end on SIGTERM: it waits too.
        _lightning_stop(trainer, False)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        # no stop here: a signal noted since the last epoch's end stops the run at this epoch's first batch end
        self._fetching = time.monotonic()

    def epoch_end(self, trainer: pl.Trainer) -> None:
        """The stop at an epoch's end, after the callbacks that monitor a metric (``_AfterMonitors``): an early stop
        decided there ends the run as it would have."""
        signum = self.agreed(trainer)
        if signum is None:
            return
        if _ends_here(trainer):  # a run ending with this epoch ends as it would have (a flag set in a validation
            _lightning_stop(trainer, False)  # in the middle of it, or by Lightning's own handler, left unset)
            return
        if not _lightning_stop(trainer, True):  # Lightning's own stop, once the epoch counts as done (every rank)
            raise RunInterrupted(signum)

    @override
    def on_validation_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._fetching = None  # a validation's batches: their reads and steps are not the training loop's wait

    @override
    def on_validation_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._fetching = time.monotonic()
        if trainer.sanity_checking or not _fitting(trainer) or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return  # the epoch's validation: the stop comes at the epoch's end
        if not self._stepped and trainer.accumulate_grad_batches > 1:
            return  # a validation inside an accumulation: the stop comes at its end (``on_train_batch_end``)
        signum = self.agreed(trainer)  # in the middle of the epoch: the stop after its batch, the validation whole
        if signum is None:
            return
        if _ends_here(trainer):  # an early stop decided in this validation, or max_steps: the fit ends as it would
            _lightning_stop(trainer, False)
        elif not _lightning_stop(trainer, True):
            raise RunInterrupted(signum)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.sanity_checking or not _fitting(trainer):
            self._check(trainer)
            return
        # a validation of the fit: whole, then the stop (cut, a resumed run never finished it: a checkpoint or early
        # stop monitoring its metric went without); Lightning's own stop would cut it too
        if self.agreed(trainer) is not None:
            _lightning_stop(trainer, False)


class _AfterMonitors(Checkpoint):
    """``SignalStop``'s decision at an epoch's end, made after ``EarlyStopping`` decides there (at the train epoch's
    end, Lightning's default without validation): Lightning calls the callbacks that monitor a metric after all
    others, and a ``Checkpoint`` last of them. Decided before, a signal in the epoch an early stop ends saved an
    interrupted run, and the resumed one trained on past the stop. Saves nothing."""

    def __init__(self, stop: SignalStop) -> None:
        self.stop = stop

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self.stop.epoch_end(trainer)


def _fitting(trainer: pl.Trainer) -> bool:
    """Inside ``trainer.fit`` (its validations too), not ``trainer.validate``."""
    return trainer.state.fn == "fit"


def _lightning_stop(trainer: pl.Trainer, on: bool) -> bool:
    """Set Lightning's own SIGTERM stop (it stops the fit at the next batch or epoch end it checks); ``False`` where
    this Lightning has none."""
    connector = getattr(trainer, "_signal_connector", None)
    if not hasattr(connector, "received_sigterm"):
        return False
    connector.received_sigterm = on
    return True


def _ends_here(trainer: pl.Trainer) -> bool:
    """The fit ends after this epoch anyway: its limits reached (``trained_out``) or a stop asked for (as Lightning's
    fit loop judges it; the epoch is counted as processed before ``on_train_epoch_end``)."""
    return bool(trainer.should_stop) or trained_out(trainer)


def trained_out(trainer: pl.Trainer) -> bool:
    """The fit has trained all it was to: ``max_epochs`` epochs or ``max_steps`` steps."""
    loop = trainer.fit_loop
    counts = ((loop.epoch_progress.current.processed, loop.max_epochs), (trainer.global_step, loop.max_steps))
    return any(limit not in (None, -1) and count >= limit for count, limit in counts)


class _Deferred:
    def __init__(self, stop: SignalStop) -> None:
        self.stop = stop

    def __enter__(self) -> None:
        self.stop._defer = True

    def __exit__(self, *exc: Any) -> None:
        self.stop._defer = False


def _ignore(signum: int, frame: FrameType | None) -> None:
    """Lightning's SIGTERM handler under several ranks, replaced: it broadcast from inside the signal handler, meeting
    whatever collective the interrupted rank was about to run, and passed the signal on to the ranks it started, which
    the terminal's or the scheduler's signal had often reached already (a second signal: a stop at once)."""


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a collective's error for a rank that is gone (gloo's closed connection): the rank that
    stopped says why; this one's traceback would only point at DDP's broadcast."""
    text = str(err)
    return isinstance(err, getattr(dist, "DistNetworkError", ())) or isinstance(err, RuntimeError) and (
        "Connection closed by peer" in text or "Connection reset by peer" in text)


def peer_exit_status(trainer: pl.Trainer, wait: float = 3.0) -> int | None:
    """The exit status to take from the ranks this process launched (Lightning's launcher starts a node's other ranks
    as its children), once ``lost_peer``: 2 where one ended with the app's own 2 (a config or data error), so the
    command's status says what the failing rank said whichever rank read the bad file; ``None`` otherwise. Waits at
    most ``wait`` seconds for them (they end within it; Lightning's observer kills this process a few seconds later)."""
    import subprocess

    procs = getattr(getattr(trainer.strategy, "launcher", None), "procs", None) or []
    deadline = time.monotonic() + wait
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    return 2 if any(proc.returncode == 2 for proc in procs) else None
