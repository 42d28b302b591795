"""What a first run prints: each line once, no library noise, one progress display; real warnings still shown."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from cltrain.app.console import LIBRARY_NOTICES
from tests.helpers import REPO, SMOKE

#: Lines a first run must not print: the notices filtered by text, the fit() warnings the app avoids,
#: and a second progress display (Rich's or tqdm's bar).
NOISE = (*(start for _, start in LIBRARY_NOTICES), "ckpt_path", "LeafSpec", "━", "it/s]")


def _run(tmp_path: Path, demo_args: list[str], *overrides: str, env: dict[str, str] | None = None) -> list[str]:
    # a start of Python (not the warm server's fork): what the console prints depends on the order of the imports
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *SMOKE, *demo_args, "device=cpu",
         f"hydra.run.dir={tmp_path / 'run'}", *overrides],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (proc.stdout + proc.stderr).splitlines()


def _problems(lines: list[str]) -> list[str]:
    counts = Counter(line for line in lines if line.strip())
    repeated = [f"printed {n}x: {line}" for line, n in counts.items() if n > 1]
    noise = [f"noise: {line}" for line in lines if any(text in line for text in NOISE)]
    return repeated + noise


def test_problems_finds_a_repeated_line_and_noise() -> None:
    assert _problems(["INFO: a", "INFO: a"]) == ["printed 2x: INFO: a"]
    assert _problems(["INFO: 💡 Tip: For seamless cloud logging, try ..."]) != []
    assert _problems(["INFO: a", "Epoch: [0][1/4]  Loss 2.1"]) == []


@pytest.mark.slow
def test_the_smoke_run_prints_each_line_once_without_library_noise(tmp_path: Path, demo_args: list[str]) -> None:
    lines = _run(tmp_path, demo_args)
    assert _problems(lines) == []
    assert any(line.startswith("Epoch: [0][4/4]") for line in lines)  # main_amp's lines are the progress display
    assert any(line.startswith("INFO: cltrain: precision") for line in lines)  # Lightning's records, once
    assert sum("cltrain: val top-1" in line for line in lines) == 1
    assert "cltrain: precision" in (tmp_path / "run" / "train.log").read_text()  # the log file keeps them


@pytest.mark.slow
def test_a_real_warning_still_shows(tmp_path: Path, demo_args: list[str]) -> None:
    """amp=true on a CPU running AVX2 kernels (emulated here): bf16 autocast is emulated, and the run says so."""
    lines = _run(tmp_path, demo_args, "amp=true",
                 env={"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"})
    assert any("amp=true on a CPU without native bf16" in line for line in lines), "\n".join(lines)
    assert _problems(lines) == []


def test_quiet_console_sets_lightning_s_own_handler_aside_while_the_root_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import logging
    import warnings

    import lightning  # noqa: F401 - adds its console handler to the "lightning" logger

    from cltrain.app.console import quiet_console

    root_stream, own_stream, pytorch_stream = io.StringIO(), io.StringIO(), io.StringIO()
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [logging.StreamHandler(root_stream)])
    own = logging.StreamHandler(own_stream)
    monkeypatch.setattr(logging.getLogger("lightning"), "handlers", [own])
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    log.info("before")  # the control: both handlers print it
    # lightning.pytorch imported before the root had a handler (the app's config check): its own, not propagated
    pytorch = logging.getLogger("lightning.pytorch")
    monkeypatch.setattr(pytorch, "handlers", [logging.StreamHandler(pytorch_stream)])
    monkeypatch.setattr(pytorch, "propagate", False)
    with quiet_console():
        log.info("inside")
        log.info("💡 Tip: For seamless cloud logging and experiment tracking, ...")
        log.info("💡 Tip: For seamless cloud uploads and versioning, try installing [litmodels](...)")
        log.warning("a real warning")
        warnings.warn("a warnings.warn of a library", UserWarning, stacklevel=1)  # went to stderr, not train.log
    assert own_stream.getvalue().splitlines() == ["before"] and pytorch_stream.getvalue() == ""
    assert root_stream.getvalue().splitlines()[:3] == ["before", "inside", "a real warning"]
    printed = root_stream.getvalue()
    assert "UserWarning: a warnings.warn of a library" in printed and "\n\n" not in printed  # no blank line after
    assert warnings.showwarning is not logging._showwarning  # given back
    assert logging.getLogger("lightning").handlers == [own]  # restored
    assert len(pytorch.handlers) == 1 and not pytorch.propagate


def test_lightnings_advice_against_evaluating_under_ddp_is_dropped() -> None:
    # said at a DDP run's trainer.validate() (a max_steps stop, evaluate_only): EveryImageOnce evaluates every image once
    import warnings

    from lightning.pytorch.utilities import rank_zero_warn
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    from cltrain.app.console import quiet_console

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_console():
            rank_zero_warn("Using `DistributedSampler` with the dataloaders. During `trainer.validate()`, it is "
                           "recommended to use `Trainer(devices=1, num_nodes=1)`", category=PossibleUserWarning)
            warnings.warn("a real warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["a real warning"]
