"""No host sync in a steady-state training step of ``train(cfg)`` (issue 9.1).

A ``TorchDispatchMode`` counts the ATen ops that need a device value on the host
(``_local_scalar_dense`` behind ``.item()``/``float()``, ``is_nonzero``, ``equal``,
``nonzero``, ``masked_select``, ``unique*``) over a real run of the smoke
experiment, attributed per training batch. Print steps (the main_amp line syncs
there on purpose), logger steps (``log_every_n_steps``: the logger converts to
Python numbers), the first batch of the run and epoch ends are left out; every
other batch must count zero. The data path runs in a worker process, outside the
mode: host-side ``.item()`` on CPU tensors there is no device sync.

The run has ``ema.enabled=true``, so the EMA update is counted too. On CUDA the same run goes under
``torch.cuda.set_sync_debug_mode("warn")`` in the steady-state steps, which warns on every synchronising CUDA
call (blocking copies too, which no ATen op count sees); the test fails naming the stack of each.
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from cltrain.app.cli import compose_config
from cltrain.app.train import train
from cltrain.data import make_demo_dataset
from cltrain.timing.host_syncs import SyncOps
from tests.helpers.trainer_probes import CountingTrainer
from tests.helpers import SMOKE

DEMO = {"num_classes": 4, "train_per_class": 16, "val_per_class": 2, "image_size": [48, 40]}
PRINT_FREQ = 4  # = log_every_n_steps: batches 3 and 7 print and log
BATCHES = 8


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data") / "demo"
    make_demo_dataset(root, **DEMO)
    return root


def _config(demo_root: Path, run_dir: Path, *overrides: str):
    demo = [f"data.demo.{k}={v}".replace(" ", "") for k, v in DEMO.items()]
    return compose_config([
        *SMOKE, f"data.root={demo_root}", *demo, f"run_dir={run_dir}",
        "trainer._target_=tests.helpers.trainer_probes.CountingTrainer", f"trainer.limit_train_batches={BATCHES}",
        f"trainer.log_every_n_steps={PRINT_FREQ}", f"print_freq={PRINT_FREQ}", "data.num_workers=1",
        "trainer.enable_progress_bar=true", *overrides,
    ])


def _steady_state_syncs(mode: SyncOps, trainer: CountingTrainer) -> dict[tuple, Counter]:
    steps = trainer.counter.steps
    assert len(steps) == BATCHES, steps
    steady = [s for s in steps[1:] if (s[1] + 1) % PRINT_FREQ and (s[2] + 1) % PRINT_FREQ and s[1] + 1 < BATCHES]
    assert len(steady) == 5  # batches 1, 2, 4, 5, 6
    return {s: mode.counts[s] for s in steady if mode.counts[s]}


def _run(cfg) -> tuple[dict, SyncOps, CountingTrainer]:
    CountingTrainer.mode = mode = SyncOps()
    try:
        with mode:
            metrics = train(cfg)
    finally:
        CountingTrainer.mode = None
    return metrics, mode, CountingTrainer.last


@pytest.mark.slow
def test_no_host_sync_in_a_steady_state_step(demo_root: Path, tmp_path: Path) -> None:
    # ema=true: the EMA update runs every step too (Lightning's AveragedModel would read n_averaged twice)
    metrics, mode, trainer = _run(_config(demo_root, tmp_path / "run", "device=cpu", "amp=true", "ema.enabled=true"))
    assert metrics["global_step"] == BATCHES
    assert _steady_state_syncs(mode, trainer) == {}
    # the counter sees syncs where they are expected: the print/log steps read loss and accuracy
    print_step = trainer.counter.steps[PRINT_FREQ - 1]
    assert sum(mode.counts[print_step].values()) >= 1, mode.counts[print_step]


class _SyncDebugInSteadySteps(Callback):
    """Turns on ``set_sync_debug_mode("warn")`` for exactly the steady-state batches."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        stepped = trainer.fit_loop.epoch_loop._batches_that_stepped
        steady = 0 < batch_idx < BATCHES - 1 and (batch_idx + 1) % PRINT_FREQ and (stepped + 1) % PRINT_FREQ
        torch.cuda.set_sync_debug_mode("warn" if steady else 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # what follows (logger, progress bar, scheduler) stays in the window until the next batch start,
        # except the print/last batches, whose own hooks synchronise on purpose
        if (batch_idx + 1) % PRINT_FREQ == 0 or batch_idx + 1 >= BATCHES - 1:
            torch.cuda.set_sync_debug_mode(0)

    def on_train_epoch_end(self, trainer, pl_module):
        torch.cuda.set_sync_debug_mode(0)

    def on_exception(self, trainer, pl_module, exception):
        torch.cuda.set_sync_debug_mode(0)  # the on-exception checkpoint copies to the host on purpose


SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's words for each sync in "warn" mode


@contextmanager
def sync_stacks() -> Iterator[list[str]]:
    """The Python stack (innermost frames last) of every sync warning raised inside, one string each: where a
    sync comes from, all of them in one run (``"error"`` mode would stop at the first, inside Lightning's loop)."""
    stacks: list[str] = []

    def show(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
            stacks.append("".join(traceback.format_list(frames[-12:])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        yield stacks


def test_sync_stacks_name_the_code_that_synchronised() -> None:
    def reads_a_device_value() -> None:
        warnings.warn(f"{SYNC_WARNING} in a test", UserWarning)

    with sync_stacks() as stacks:
        reads_a_device_value()
        warnings.warn("an unrelated warning", UserWarning)
    assert len(stacks) == 1 and "in reads_a_device_value" in stacks[0].splitlines()[-2]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("amp_dtype", ["fp16", "bf16"])
def test_no_host_sync_on_cuda(demo_root: Path, tmp_path: Path, amp_dtype: str) -> None:
    if amp_dtype == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    # fp16 with SGD builds the fused SGD with zeroed momentum buffers, whose step takes the overflow flag on the device.
    cfg = _config(demo_root, tmp_path / "run", "device=cuda", f"amp={amp_dtype}", "ema.enabled=true")
    CountingTrainer.mode = SyncOps()
    original = CountingTrainer.__init__

    def with_debug_mode(self, *args, callbacks=None, **kwargs):
        original(self, *args, callbacks=[_SyncDebugInSteadySteps(), *(callbacks or [])], **kwargs)

    CountingTrainer.__init__ = with_debug_mode
    try:
        with sync_stacks() as stacks:
            metrics = train(cfg)
    finally:
        CountingTrainer.__init__ = original
        CountingTrainer.mode = None
        torch.cuda.set_sync_debug_mode(0)
    assert metrics["global_step"] == BATCHES
    unique = list(dict.fromkeys(stacks))
    assert not unique, f"{len(stacks)} syncs in steady-state steps, from:\n" + "\n---\n".join(unique[:4])


def test_the_device_side_train_accuracy_agrees_with_torchmetrics() -> None:
    from torchmetrics.classification import MulticlassAccuracy

    from cltrain.app.topk import TopKAccuracy

    g = torch.Generator().manual_seed(0)
    ours = [TopKAccuracy(top_k=k) for k in (1, 5)]
    theirs = [MulticlassAccuracy(num_classes=10, top_k=k, average="micro") for k in (1, 5)]
    for _ in range(3):
        logits, targets = torch.randn(16, 10, generator=g), torch.randint(0, 10, (16,), generator=g)
        for a, b in zip(ours, theirs):
            assert a(logits, targets) == pytest.approx(float(b(logits, targets)))
    for a, b in zip(ours, theirs):
        assert float(a.compute()) == pytest.approx(float(b.compute()))
    with SyncOps() as mode:
        ours[1](torch.randn(4, 10), torch.tensor([1, 2, 3, 4]))
    assert not mode.counts
