"""The harness every script measures through, in one import: ``cltrain.timing``'s clock (``Stopwatch``, ``timed``,
``cpu_seconds``), rounds (``interleaved``, ``time_steps``, ``rate_after_first``), steps (``training_step``,
``layout_steps`` in each of the ``LAYOUTS``), ``spread`` and report (``table``, ``write_report``, ``command_line``);
``machine_line``; ``options``, a script's command line from its defaults; ``random_batches``, the seeded batches the
steps train on. A case may run in a child process of its own (``run_child``), so a native crash, a raise or a hang is
a row of the table, not the end of the run; what it measured comes back as lines it printed with ``emit``. A script
hands its child the case whole (``run_case``: ``--case JSON``, which the child's ``options(..., case=CASE)`` parses
back)::

    child = run_case("scripts.bench.default_speed", {"model": "resnet50", ...}, timeout=600)
    child.status()        # "ok", "timeout after 600 s", "crashed (SIGSEGV)", "exited 1"
    child.failure()       # None, or the status with the last error line: "exited 1: ValueError: ..."
    child.results()       # every object the child emitted
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cltrain.timing.clock import Stopwatch, cpu_seconds, synchronize, timed
from cltrain.timing.machine import PACKAGES, machine
from cltrain.timing.machine import machine_line as line_of
from cltrain.timing.report import command_line, table, table_row, write_report
from cltrain.timing.rounds import interleaved, rate_after_first, rotated, time_steps
from cltrain.timing.stats import spread
from cltrain.timing.steps import LAYOUTS, layout_steps, training_step

__all__ = ["CASE", "LAYOUTS", "REPO", "Child", "Stopwatch", "command_line", "cpu_seconds", "emit", "interleaved",
           "layout_steps", "machine_line", "options", "python_module", "random_batches", "rate_after_first", "rotated",
           "run_case", "run_child", "signal_name", "spread", "synchronize", "table", "table_row", "time_steps", "timed",
           "training_step", "write_report"]

#: The repository root: children run from there (``python -m scripts...`` needs no install).
REPO = Path(__file__).resolve().parents[1]
#: What starts a line of a child's result.
RESULT = "SCRIPTS-RESULT "
#: A script's ``--case`` option (``options(..., case=CASE)``): the case its child runs, as :func:`run_case` gives it.
CASE = (json.loads, "(a child's process: its case, as JSON)")


def machine_line(device: Any = None, packages: Sequence[str] = PACKAGES) -> str:
    """The machine (``cltrain.timing.machine``; ``device`` default CUDA where there is one) as one line."""
    return line_of(machine(device, packages=packages))


class _Parser(argparse.ArgumentParser):
    """Applies its presets after parsing: a preset's flag given, its values replace those parsed."""

    presets: dict[str, dict[str, Any]]

    def parse_args(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        parsed = super().parse_args(*args, **kwargs)
        for name, values in self.presets.items():
            if getattr(parsed, name):
                vars(parsed).update(values)
        return parsed


def options(doc: str, **defaults: Any) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first line, with an option per keyword (``batch_size``: ``--batch-size``) whose
    value is its default, or ``(default, help)``. The type is the default's: ``False`` makes a flag, a dict a flag
    whose values replace the parsed ones when given (``quick={"batch_size": 2}``), a list takes one or more values of
    its first item's type (any number of strings when empty), a tuple is the choices (the first the default; always
    inside ``(choices, help)``), a callable (``int``, ``Path``, a parser of the text) an option it parses that
    defaults to ``None``. Options of other kinds are added to the parser returned."""
    parser = _Parser(description=doc.strip().splitlines()[0])
    parser.presets = {}
    for name, value in defaults.items():
        default, help_ = value if isinstance(value, tuple) else (value, None)
        flag = "--" + name.replace("_", "-")
        if isinstance(default, dict):
            parser.presets[name] = default
            parser.add_argument(flag, action="store_true", help=help_)
        elif isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=help_)
        elif isinstance(default, tuple):
            parser.add_argument(flag, choices=default, default=default[0], help=help_)
        elif callable(default):
            parser.add_argument(flag, type=default, default=None, help=help_)
        elif isinstance(default, list):
            parser.add_argument(flag, type=type(default[0]) if default else str, default=default, help=help_,
                                nargs="+" if default else "*")
        else:
            parser.add_argument(flag, type=type(default), default=default, help=help_)
    return parser


def emit(result: Any) -> None:
    """Print ``result`` (JSON-ready; anything else as ``str``) as one result line for the parent."""
    print(RESULT + json.dumps(result, default=str), flush=True)


def signal_name(code: int) -> str:
    """The name of the signal a negative exit status stands for (``-11`` -> ``SIGSEGV``)."""
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def python_module(module: str, *args: Any) -> list[str]:
    """``[python, -m, module, *args]`` with this interpreter, every argument as a string."""
    return [sys.executable, "-m", module, *map(str, args)]


@dataclass(frozen=True)
class Child:
    """A finished child: its exit status (``None``: killed at its time limit), its output, its seconds."""

    code: int | None
    output: str
    seconds: float
    limit: float | None

    def status(self) -> str:
        """``"ok"``, ``"timeout after N s"``, ``"crashed (SIGNAL)"`` or ``"exited N"``."""
        if self.code is None:
            return f"timeout after {self.limit:g} s"
        if self.code < 0:
            return f"crashed ({signal_name(self.code)})"
        return "ok" if self.code == 0 else f"exited {self.code}"

    def failure(self) -> str | None:
        """``None`` where it exited 0; else its :meth:`status`, after a raise or a crash with its :meth:`last_error`."""
        if self.code == 0:
            return None
        return self.status() if self.code is None else f"{self.status()}: {self.last_error()}"

    def last_error(self) -> str:
        """The last line naming an error or exception (else the last line), cut to 200 characters."""
        lines = [line.strip() for line in self.output.splitlines() if line.strip() and RESULT not in line]
        errors = [line for line in lines if "Error" in line.split(":", 1)[0] or "Exception" in line.split(":", 1)[0]]
        return (errors or lines or ["(no output)"])[-1][:200]

    def results(self) -> list[Any]:
        """Every object the child :func:`emit`-ted, in order."""
        # split, not startswith: a progress bar's unfinished line on stderr may stand before it
        return [json.loads(line.split(RESULT, 1)[1]) for line in self.output.splitlines() if RESULT in line]


def run_child(cmd: Sequence[str], *, timeout: float | None = None, log: Path | None = None, cwd: Path = REPO,
              env: dict[str, str] | None = None) -> Child:
    """Run ``cmd`` in a session of its own, standard output and error into ``log`` (a temporary file when
    ``None``); past ``timeout`` seconds, or when this process is stopped meanwhile (Ctrl-C, SIGTERM), its process
    group is killed: a stopped benchmark leaves no child busy on the cores the next measurement needs."""
    watch = Stopwatch().start()
    with open(log, "w+") if log is not None else tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(list(cmd), cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # its own group: a timeout kills what it started too
        code: int | None = None
        try:
            with _sigterm_raises(), contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(timeout=timeout)
        finally:
            if code is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0)
        return Child(code, out.read(), watch.elapsed(), timeout)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM as ``SystemExit(143)`` while waiting for a child, so ``finally`` runs (Python's default ends the
    process on the spot); a handler the caller set, or a thread other than the main one, is left alone."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_case(module: str, case: dict[str, Any], *, timeout: float | None = None) -> Child:
    """``python -m module --case JSON`` in a child (:func:`run_child`): the case whole, one option for its fields."""
    return run_child(python_module(module, "--case", json.dumps(case)), timeout=timeout)


def random_batches(count: int, shape: Sequence[int], *, classes: int = 1000, device: torch.device | str = "cpu",
                   memory_format: torch.memory_format = torch.contiguous_format) -> list[tuple[torch.Tensor, ...]]:
    """``count`` ``(inputs, labels)`` batches: random inputs of ``shape`` on ``device`` in ``memory_format``, labels
    below ``classes``, all drawn from one generator seeded 0."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(*shape, generator=gen).to(device, memory_format=memory_format),
             torch.randint(0, classes, (shape[0],), generator=gen).to(device)) for _ in range(count)]
