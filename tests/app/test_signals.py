"""Real signals sent to a real ``train.py`` process: exit 143 / 130, last.ckpt, metrics.json marked
interrupted, one line with the resume command; the resume continues at the exact step."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.helpers import warm


REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow




def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    return env


def run_until_signalled(args: list[str], signum: int, wait_for: str, timeout: float = 240,
                        group: bool = False) -> tuple[int, str]:
    """Start train.py, wait for a line containing ``wait_for``, send ``signum`` (``group``: to its process group, as
    Ctrl+C in a terminal); (exit status, output)."""
    proc = warm.Popen([sys.executable, str(REPO / "train.py"), *args], stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True, cwd=REPO, env=_env(), start_new_session=group)
    lines, deadline = [], time.monotonic() + timeout
    try:
        for line in proc.stdout:
            lines.append(line)
            if wait_for in line:
                os.killpg(proc.pid, signum) if group else proc.send_signal(signum)
                break
            assert time.monotonic() < deadline, "".join(lines[-30:])
        else:
            pytest.fail("train.py ended before the signal: " + "".join(lines[-30:]))
        lines += proc.stdout.readlines()
        return proc.wait(timeout=120), "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()


def _args(demo_args: list[str], run_dir: Path, epochs: int = 50) -> list[str]:
    # EMA and two workers: their state and their randomness must survive the stop too. ResNet-18, not the tests'
    # smaller SMOKE model: its 0.2 s steps leave the signal, sent on a progress line, time to land mid-epoch. The
    # layout pinned: two fresh runs are equal bit for bit only in one layout (the race decides from timings).
    return ["experiment=smoke", *demo_args, "device=cpu", "amp=false", f"trainer.max_epochs={epochs}",
            "channels_last_layout=channels_last",
            "ema.enabled=true", "data.num_workers=2", "trainer.enable_progress_bar=false", "print_freq=1",
            f"hydra.run.dir='{run_dir}'"]


def _final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    live = {f"live.{k}": v for k, v in ckpt.get("current_model_state", {}).items()}  # under EMA, beside its average
    return {**ckpt["state_dict"], **live}


def test_sigterm_saves_last_state_and_the_printed_command_resumes_at_that_step(demo_args: list[str],
                                                                             tmp_path: Path) -> None:
    run_dir = tmp_path / "run ü (1)"  # the printed command quotes its ckpt_path for Hydra and for the shell
    status, out = run_until_signalled(_args(demo_args, run_dir, epochs=2), signal.SIGTERM, "Epoch: [1][2/")
    assert status == 143, out[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "interrupted" and metrics["last_checkpoint"] == str(run_dir / "checkpoints" / "last.ckpt")
    step = torch.load(metrics["last_checkpoint"], map_location="cpu", weights_only=True)["global_step"]
    assert step == metrics["global_step"] and 4 < step < 8  # mid epoch 1, not the epoch-0 checkpoint
    resume = [line for line in out.splitlines() if "resume with:" in line]
    assert len(resume) == 1 and "interrupted by SIGTERM" in resume[0], out[-3000:]
    assert "Traceback" not in out and "`weights_only` was not set" not in out  # a save's default, read as a load's

    # The printed command, as a user would paste it (finishing epoch 1 this time).
    command = shlex.split(resume[0].split("resume with: ", 1)[1])
    assert command[:2] == ["python", str(REPO / "train.py")] or command[1].endswith("train.py")
    command = [a.replace("trainer.max_epochs=50", "trainer.max_epochs=2") for a in command[2:]]
    command = [a for a in command if not a.startswith("hydra.run.dir=")] + [f"hydra.run.dir={tmp_path / 'resumed'}"]
    done = warm.run([sys.executable, str(REPO / "train.py"), *command], capture_output=True, text=True,
                    cwd=REPO, env=_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    resumed = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    assert resumed["status"] == "completed" and resumed["global_step"] == 8
    assert "not resumable" not in done.stdout + done.stderr
    # bit for bit where the run that was never stopped ends (the same samples, augmentation, EMA, RNG)
    whole = warm.run([sys.executable, str(REPO / "train.py"), *_args(demo_args, tmp_path / "whole", epochs=2)],
                     capture_output=True, text=True, cwd=REPO, env=_env(), timeout=300)
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-2000:]
    a, b = _final_state(tmp_path / "whole"), _final_state(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [r for r in csv.DictReader(open(tmp_path / "resumed" / "csv" / "metrics.csv")) if r.get("train/loss")]
    assert min(int(r["step"]) for r in rows) == step  # the first step trained is the one after the checkpoint


def test_sigint_exits_130_with_last_checkpoint(demo_args: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    status, out = run_until_signalled(_args(demo_args, run_dir), signal.SIGINT, "Epoch: [0][2/")
    assert status == 130, out[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "interrupted"
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    assert step == metrics["global_step"] >= 2
    assert sum("resume with:" in line for line in out.splitlines()) == 1 and "interrupted by SIGINT" in out
    assert "Traceback" not in out



def test_a_second_signal_that_stops_a_step_in_the_middle_writes_no_checkpoint(tmp_path: Path) -> None:
    from cltrain.app.on_exception import KeepOnException
    from cltrain.app.signals import RunInterrupted

    # stopped in the middle of a step (of the optimizer's update, perhaps): that state is not saved
    KeepOnException(tmp_path).on_exception(None, None, RunInterrupted(signal.SIGTERM, at_once=True))
    assert not list(tmp_path.iterdir())


class _Signalling:
    """A LightningModule that sends this process ``signum`` at the start of training step ``at`` (or of the
    validation step ``validating_at``, an (epoch, batch) pair) and, with ``during_save``, once more while its checkpoint
    is being saved."""

    def __new__(cls, at: int, signum: int = signal.SIGTERM, during_save: bool = False,
                validating_at: tuple[int, int] | None = None):
        import lightning.pytorch as pl

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.layer, self.steps, self.validated, self.trained = torch.nn.Linear(2, 1), 0, set(), []
                self.validation_batches = []

            def training_step(self, batch, batch_idx):
                if batch_idx == at:
                    os.kill(os.getpid(), signum)
                self.steps += 1
                self.trained.append((self.current_epoch, batch_idx))
                loss = self.layer(batch[0]).sum()
                self.log("loss", loss)
                return loss

            def validation_step(self, batch, batch_idx):
                if (self.current_epoch, batch_idx) == validating_at and len(self.validation_batches) % 2 == 0:
                    os.kill(os.getpid(), signum)  # (the first of the epoch's two validations)
                self.validated.add(self.current_epoch)
                self.validation_batches.append((self.current_epoch, batch_idx))

            def on_save_checkpoint(self, checkpoint) -> None:
                if during_save:
                    os.kill(os.getpid(), signum)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        return Module()


def _fit_stopped(module, tmp_path: Path, holding: bool = True, resume: bool = False, stops: bool = True,
                 before: tuple = (), **trainer_args):
    """``module`` trained under ``SignalStop`` with ``KeepOnException``, as the app runs them (with a validation each
    epoch); the exception, or ``None`` where the run ended (``resume``: from ``last.ckpt``)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from cltrain.app.on_exception import KeepOnException
    from cltrain.app.signals import RunInterrupted, SignalStop

    stop = SignalStop()
    keep = KeepOnException(tmp_path, **({"holding": stop.holding} if holding else {}))
    trainer = pl.Trainer(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, callbacks=[keep, *before, stop],
                         **{"max_epochs": 1, "logger": False, **trainer_args})
    data = DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=2)
    with stop, stop.deferred():
        try:
            trainer.fit(module, data, DataLoader(TensorDataset(torch.randn(2, 2))),
                        ckpt_path=tmp_path / "last.ckpt" if resume else None)
        except (RunInterrupted, SIGTERMException) as stopped:  # the app's stops (Lightning's stops a single process)
            return trainer, stopped
    assert resume or not stops, "the run was not stopped"
    return trainer, None


def test_a_stop_in_the_middle_of_an_accumulation_waits_for_its_optimizer_step(tmp_path: Path) -> None:
    # SIGTERM during the third batch of 2-batch accumulations: the run stops after the fourth, which steps
    module = _Signalling(at=2)
    trainer, stopped = _fit_stopped(module, tmp_path, accumulate_grad_batches=2)
    assert module.steps == 4 and trainer.global_step == 2 and not getattr(stopped, "at_once", False)
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 2


def test_a_validation_inside_an_accumulation_leaves_the_stop_to_its_optimizer_step(tmp_path: Path) -> None:
    # SIGTERM during the third batch, which a validation follows (val_check_interval=3) in the middle of a 2-batch
    # accumulation: the stop after that validation saved a half-accumulated gradient's step
    module = _Signalling(at=2)
    trainer, stopped = _fit_stopped(module, tmp_path, accumulate_grad_batches=2, val_check_interval=3)
    assert stopped is not None and module.steps == 4 and trainer.global_step == 2


def test_a_signal_in_the_epoch_an_early_stop_at_the_train_epochs_end_ends_lets_the_run_end(tmp_path: Path) -> None:
    # EarlyStopping checking at the train epoch's end runs after every other callback there: the stop was set before
    # it decided, the run saved as interrupted, and the resumed run trained on past the early stop
    from lightning.pytorch.callbacks import EarlyStopping

    early = EarlyStopping(monitor="loss", stopping_threshold=1e9, check_on_train_epoch_end=True)
    module = _Signalling(at=7)  # the epoch's last batch
    trainer, stopped = _fit_stopped(module, tmp_path, stops=False, max_epochs=3, before=(early,))
    assert stopped is None and module.steps == 8 and early.stopped_epoch == 0


@pytest.mark.parametrize("holding", [True, False], ids=["held", "control"])
def test_a_second_signal_while_last_ckpt_is_written_waits_for_it(tmp_path: Path, holding: bool, capfd) -> None:
    module = _Signalling(at=1, during_save=True)
    trainer, stopped = _fit_stopped(module, tmp_path, holding=holding)
    if not holding:  # the control: the signal raised inside the save, and no file was written
        assert stopped.at_once and not (tmp_path / "last.ckpt").exists()
        return
    assert not getattr(stopped, "at_once", False) and module.steps == 2
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 2
    assert "last.ckpt is being written; the run stops once it is" in capfd.readouterr().err


def test_a_stop_at_an_epochs_last_batch_leaves_that_epochs_validation_to_no_one(tmp_path: Path) -> None:
    # SIGTERM during the last batch of epoch 0: epoch 0 is validated before the stop, or by the resumed run
    stopped_module, resumed_module = _Signalling(at=7), _Signalling(at=-1)
    trainer, stopped = _fit_stopped(stopped_module, tmp_path, max_epochs=2)
    assert stopped is not None and stopped_module.steps == 8
    _fit_stopped(resumed_module, tmp_path, resume=True, max_epochs=2)
    assert stopped_module.validated | resumed_module.validated == {0, 1}
    # epoch 0's validation whole before the stop: a cut one was not finished by the resumed run
    assert stopped_module.validation_batches == [(0, 0), (0, 1)] and resumed_module.trained[0] == (1, 0)


@pytest.mark.parametrize("signalled", ["step", "validation"])
def test_a_stop_at_a_validation_in_the_middle_of_an_epoch_waits_for_it_whole(tmp_path: Path, signalled: str) -> None:
    # SIGTERM during the batch that the validation after batch 3 follows, or during that validation: cut, its
    # metric went to no checkpoint (a resumed run goes on with batch 4)
    at = {"step": {"at": 3}, "validation": {"at": -1, "validating_at": (0, 0)}}[signalled]
    stopped_module, resumed_module = _Signalling(**at), _Signalling(at=-1)
    trainer, stopped = _fit_stopped(stopped_module, tmp_path, max_epochs=1, val_check_interval=4)
    assert stopped is not None and stopped_module.trained == [(0, i) for i in range(4)]
    assert stopped_module.validation_batches == [(0, 0), (0, 1)]
    _fit_stopped(resumed_module, tmp_path, resume=True, max_epochs=1, val_check_interval=4)
    assert resumed_module.trained == [(0, i) for i in range(4, 8)] and resumed_module.validation_batches == [(0, 0),
                                                                                                          (0, 1)]


@pytest.mark.parametrize("end", ["max_steps", "early-stop"])
def test_a_signal_in_a_validation_the_fit_ends_with_lets_it_end_as_it_would(tmp_path: Path, end: str) -> None:
    # the validation after batch 3 ends the fit (max_steps, or a stop decided in it, as EarlyStopping's): the stop set
    # for after that validation raised instead, and the app said "interrupted" of a run with nothing left to train
    import lightning.pytorch as pl

    class StopsHere(pl.Callback):
        def on_validation_end(self, trainer, pl_module):
            trainer.should_stop = True

    module = _Signalling(at=-1, validating_at=(0, 0))
    limit = {"max_steps": 4} if end == "max_steps" else {"before": (StopsHere(),)}
    trainer, stopped = _fit_stopped(module, tmp_path, stops=False, max_epochs=2, val_check_interval=4, **limit)
    assert stopped is None and module.trained == [(0, i) for i in range(4)]
    assert module.validation_batches == [(0, 0), (0, 1)]


@pytest.mark.parametrize("validation", [{"limit_val_batches": 0}, {"check_val_every_n_epoch": 2}],
                         ids=["no-validation", "not-this-epoch"])
def test_a_stop_at_an_epochs_last_batch_without_its_validation_resumes_with_the_next_epoch_whole(
        tmp_path: Path, validation: dict) -> None:
    # stopped at the next epoch's start, Lightning had begun that epoch: a resumed run took it as done (24 -> 21 steps)
    stopped_module, resumed_module = _Signalling(at=7), _Signalling(at=-1)
    trainer, stopped = _fit_stopped(stopped_module, tmp_path, max_epochs=3, **validation)
    assert stopped is not None and stopped_module.trained == [(0, i) for i in range(8)]
    _fit_stopped(resumed_module, tmp_path, resume=True, max_epochs=3, **validation)
    assert resumed_module.trained == [(e, i) for e in (1, 2) for i in range(8)]


@pytest.mark.parametrize("limit", [{"max_epochs": 1}, {"max_steps": 6, "max_epochs": 3}], ids=["epochs", "steps"])
def test_a_signal_in_the_last_step_lets_the_run_end_as_it_would(tmp_path: Path, limit: dict) -> None:
    # stopped at that epoch's end, its last.ckpt held every step: a resume line with nothing left to train
    module = _Signalling(at=limit.get("max_steps", 8) - 1)
    trainer, stopped = _fit_stopped(module, tmp_path, stops=False, limit_val_batches=0, **limit)
    assert stopped is None and module.steps == limit.get("max_steps", 8)


def _signalled_at_the_last_step(demo_args: list[str], tmp_path: Path, *overrides: str, steps: int = 4,
                                limit: str = "max_steps") -> Any:
    """train.py's ``train`` with SIGTERM as its step ``steps`` starts (the last under ``max_steps``; the demo's epoch
    has four steps): its metrics, or its ``SystemExit``."""
    from cltrain.app.cli import compose_config
    from cltrain.app.train import train
    from tests.helpers import SMOKE

    cfg = compose_config([*SMOKE, *demo_args, "device=cpu", f"run_dir={tmp_path / 'run'}", "amp=false",
                          "trainer.enable_progress_bar=false", f"trainer.{limit}={steps}",
                          "+callbacks.stop._target_=tests.helpers.signals.SignalAtStep",
                          f"+callbacks.stop.step={steps - 1}", *overrides])
    try:
        return train(cfg)
    except SystemExit as stopped:
        return stopped


@pytest.mark.parametrize("end", ["trained-out", "early-stop"])
def test_a_signal_at_the_last_step_ends_the_run_as_it_would_have(demo_args, tmp_path: Path, capfd, caplog,
                                                                 end: str) -> None:
    # its validation done at the epoch's end: a resume line would have nothing to train (refused), or would train on
    # past the early stop
    early = ["callbacks=[default,early_stopping]", "+callbacks.early_stopping.stopping_threshold=0",
             "trainer.max_epochs=3"]  # the app's early stop, after the epoch's validation
    metrics = _signalled_at_the_last_step(demo_args, tmp_path, *(early if end == "early-stop" else []),
                                          limit="max_steps" if end == "trained-out" else "limit_train_batches")
    assert isinstance(metrics, dict), metrics
    assert metrics["status"] == "completed" and metrics["global_step"] == 4 and metrics["val_top1"] is not None
    said = "".join(capfd.readouterr()) + caplog.text  # Lightning's rank-zero logger: a handler of the app's or pytest's
    assert "SIGTERM came after the last training step and its validation" in said


def test_a_signal_at_the_last_step_before_the_final_validation_prints_the_command_that_validates(
        demo_args: list[str], tmp_path: Path, capfd) -> None:
    # trained out in the middle of an epoch (max_steps): the final validation is left to do
    stopped = _signalled_at_the_last_step(demo_args, tmp_path, steps=3)
    assert isinstance(stopped, SystemExit) and stopped.code == 143
    err = capfd.readouterr().err
    assert "its training is complete; the final validation was not run: validate it with: " in err
    assert err.rstrip().endswith("evaluate_only=true")
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 3


def test_a_signal_during_an_evaluation_says_to_run_it_again(demo_args: list[str], tmp_path: Path, capfd) -> None:
    # it said "at step 0; no checkpoint was written (stopped before training)" of a run that trains nothing
    from cltrain.app.cli import compose_config
    from cltrain.app.train import train
    from tests.helpers import SMOKE

    common = [*SMOKE, *demo_args, "device=cpu", "amp=false", "trainer.enable_progress_bar=false"]
    trained = train(compose_config([*common, f"run_dir={tmp_path / 'a'}", "trainer.max_steps=1"]))
    with pytest.raises(SystemExit) as stopped:
        train(compose_config([*common, f"run_dir={tmp_path / 'b'}", "evaluate_only=true",
                              f"ckpt_path={trained['last_checkpoint']}",
                              "+callbacks.stop._target_=tests.helpers.signals.SignalAtValidation"]))
    assert stopped.value.code == 143
    assert "interrupted by SIGTERM at step 0; its validation was not finished: run the same command again" in \
        capfd.readouterr().err


def test_a_stopped_runs_last_step_reaches_its_logger(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import CSVLogger

    module = _Signalling(at=4, signum=signal.SIGINT)
    trainer, stopped = _fit_stopped(module, tmp_path, logger=CSVLogger(tmp_path / "csv"), log_every_n_steps=1)
    assert stopped is not None and module.steps == 5
    rows = [r for r in csv.DictReader(open(next((tmp_path / "csv").rglob("metrics.csv")))) if r.get("loss")]
    assert [int(r["step"]) for r in rows] == list(range(5))  # the fifth step's loss too
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 5


def test_sigterm_stops_a_two_process_ddp_run_with_the_resume_line(demo_args: list[str], tmp_path: Path) -> None:
    # Lightning's SIGTERM handler broadcast from inside the signal handler on rank 0, meeting whatever collective the
    # other rank ran then (the loss check's reduction at each printed step): both ranks waited for ever (3 runs of 3
    # hung). The flag alone now reaches every rank at the next batch, by Lightning's own per-batch broadcast.
    run_dir = tmp_path / "ddp"
    status, output = run_until_signalled(
        ["experiment=smoke", "model=timm", "model.name=test_resnet", *demo_args, "device=cpu", "trainer=ddp",
         "trainer.devices=2", "trainer.max_epochs=40", "trainer.enable_progress_bar=false", "print_freq=1",
         "channels_last_layout=channels_last", f"hydra.run.dir={run_dir}"],
        signal.SIGTERM, "Epoch: [2][")
    assert status == 143, output[-3000:]
    assert output.count("resume with: ") == 1 and "ckpt_path=" in output, output[-3000:]
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "interrupted"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_process_group_stops_a_ddp_run_at_one_batch_end(demo_args: list[str], tmp_path: Path,
                                                                       signum: int) -> None:
    # Ctrl+C (SIGINT) or a scheduler's SIGTERM reaches every rank and every loader worker, each at its own moment.
    # Each rank raised at once where the signal found it: the checkpoint of a step half done (its batch ready, not
    # completed), and in 1 run of 3 rank 1's checkpoint barrier met rank 0's next collective ("Connection closed by
    # peer", a traceback). The ranks now agree at each batch end. The workers, killed by the SIGTERM, were an error
    # raised in the middle of the stop (no resume line, 4 runs of 4): they let a first signal pass now.
    run_dir = tmp_path / "ddp"
    status, output = run_until_signalled(
        ["experiment=smoke", "model=timm", "model.name=test_resnet", *demo_args, "device=cpu", "trainer=ddp",
         "trainer.devices=2", "trainer.max_epochs=40", "trainer.enable_progress_bar=false", "print_freq=1",
         "channels_last_layout=channels_last", "data.num_workers=2", f"hydra.run.dir={run_dir}"],
        signum, "Epoch: [2][", group=True)
    assert status == 128 + signum, output[-3000:]
    assert output.count("resume with: ") == 1, output[-3000:]
    assert f"interrupted by {signal.Signals(signum).name}" in output, output[-3000:]
    assert "Traceback" not in output and "error" not in output.lower(), output[-3000:]
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    progress = ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert progress["ready"] == progress["completed"] == ckpt["global_step"] >= 5, progress
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "interrupted"


def test_a_signal_the_main_thread_cannot_take_ends_the_process_after_the_grace() -> None:
    # a rank waiting at the rendezvous for a rank that never came (SLURM, torchrun) ignored every SIGTERM and SIGINT:
    # Python runs a handler only between bytecodes, and the wait is inside C++
    code = ("import datetime, socket, torch.distributed as dist\n"
            "import cltrain.app.signals as s\n"
            "s.STUCK_GRACE = 1.0\n"
            "sock = socket.socket(); sock.bind(('127.0.0.1', 0)); port = sock.getsockname()[1]; sock.close()\n"
            "with s.SignalStop():\n"
            "    print('waiting', flush=True)\n"
            "    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=2,\n"
            "                            timeout=datetime.timedelta(seconds=120))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env())
    try:
        assert proc.stdout.readline().strip() == "waiting"
        time.sleep(1.0)  # inside the rendezvous
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and "waits inside a call that Python cannot interrupt" in out, out


def test_a_first_signal_while_the_next_batch_stalls_stops_the_run_after_the_grace(tmp_path: Path, monkeypatch,
                                                                                    capfd) -> None:
    # a read from a store that stalls (about 2.5 minutes until its client gives up): the first signal waited for the
    # next batch's end, past a preemption's notice, and the run ended "failed" on the read's error
    import cltrain.app.signals as signals
    from torch.utils.data import Dataset

    monkeypatch.setattr(signals, "DATA_GRACE", 1.0, raising=False)

    class Stalls(Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int):
            if i == 6:  # the fourth batch: the signal comes while it is read
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
            return (torch.randn(2),)

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from cltrain.app.on_exception import KeepOnException

    stop = signals.SignalStop()
    trainer = pl.Trainer(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, max_epochs=1,
                         callbacks=[KeepOnException(tmp_path, holding=stop.holding), stop])
    started = time.monotonic()
    with stop, stop.deferred(), pytest.raises(signals.RunInterrupted) as stopped:
        trainer.fit(_Signalling(at=-1), DataLoader(Stalls(), batch_size=2))
    assert time.monotonic() - started < 15 and stopped.value.at_once and trainer.global_step == 3
    assert "the next batch has not come in 1 s" in capfd.readouterr().err


def test_a_signal_to_the_launching_rank_alone_ends_the_ranks_it_started_while_their_reads_stall() -> None:
    # `kill` of the launching process while every rank waited for a stalled read: it stopped after the grace, and the
    # rank it started, which no signal reached, went on waiting for its read (minutes; orphaned once the launcher left)
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.stall_ddp_run"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=_env(), start_new_session=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if sum("stalling" in seen for seen in lines) == 2:  # both ranks wait for their read
                break
        else:
            pytest.fail("".join(lines[-30:]))
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, "".join(lines[-30:])
        while time.monotonic() - sent < 30:
            try:
                os.killpg(proc.pid, 0)  # a process of the run is left
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            pytest.fail("a rank of the run still waits for its read: " + "".join(lines[-30:]))
        assert "".join(lines).count("stopped by 15") == 1, "".join(lines[-30:])  # the launching rank's
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
