"""Time a model in both layouts in a child process: a native crash in a backend kernel ends the child, not the run.

What ``ChannelsLast(mode="auto")`` runs. The model is written with ``torch.save`` (the whole module) to a
private temporary folder and a fresh Python process, which sees the caller's ``sys.path``, loads it and
runs ``cltrain.timing.layouts.time_layouts``, reporting each step as it starts. A crash (segfault,
abort), an exception, or no progress for too long gives ``"contiguous"`` and one line saying why; the
caller's process is never at risk.

A model the child cannot load is timed in this process instead, with the guardrails applied
(``cltrain.guardrails.apply_guardrails``), and ``ProbeResult.method`` says so and why: a model that does
not pickle (a lambda among its attributes, a class defined inside a function), or classes defined in a
``__main__`` the child cannot import (``python -c``, a REPL, a notebook, or a script without an
``if __name__ == "__main__":`` guard, which running again would start the whole training again). Classes
defined in a guarded script are found by running the script's top level in the child, as
multiprocessing's ``spawn`` does. Only loading falls back: a crash, an exception or a hang while timing
in the child still gives ``"contiguous"``.

Example::

    >>> import torchvision
    >>> from cltrain.timing.probe import probe_layout
    >>> result = probe_layout(torchvision.models.resnet18(), (8, 3, 64, 64), steps=2)  # doctest: +SKIP
    >>> result.layout, result.failure                                                   # doctest: +SKIP
    ('channels_last', None)
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cltrain.timing.layouts import time_layouts

__all__ = ["ProbeResult", "probe_layout"]

log = logging.getLogger(__name__)

_MAIN_GUARD = re.compile(r"""^if\s+__name__\s*==\s*['"]__main__['"]\s*:""", re.MULTILINE)


@dataclass(frozen=True)
class ProbeResult:
    """What ``probe_layout`` found.

    Attributes:
        layout: ``"channels_last"`` or ``"contiguous"`` (always ``"contiguous"`` after a failure).
        timings: ``{"channels_last": s, "contiguous": s}``, median seconds per step; ``None`` after a failure.
        failure: one line saying why no timings came back (a crash, an exception, a timeout), or ``None``.
        seconds: the whole probe's wall time: sending the model, starting the process, timing.
        method: how the layouts were timed: ``"child process"``, or ``"in-process (the model could not be
            loaded in a child process: <reason>)"`` (always with the guardrails applied, since no child
            process stands between a known-bad kernel and the caller).
    """

    layout: str
    timings: dict[str, float] | None
    failure: str | None
    seconds: float
    method: str


# ``ProbeResult.method`` when the child process timed the model.
_CHILD = "child process"


class _Unloadable(Exception):
    """The child process could not load the model; the message says why."""


#: Seconds the probe process may take to start and load the model before its first step (``timeout`` applies
#: from then on).
STARTUP_S = 120.0

def probe_layout(
    model: nn.Module,
    input_shape: tuple[int, ...],
    *,
    steps: int = 3,
    warmup: int = 1,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
    guardrails: bool = True,
    timeout: float = 300.0,
) -> ProbeResult:
    """The faster layout for ``model``, timed by ``cltrain.timing.layouts.time_layouts`` in a child process,
    or in this process with the guardrails applied when the child cannot load the model.

    Args:
        model: the model to time, as it will be trained (not modified).
        input_shape: as for ``time_layouts``.
        steps: as for ``time_layouts``.
        warmup: as for ``time_layouts``.
        autocast_dtype: as for ``time_layouts``.
        device: where to time (default: the model's device); the child uses the same device.
        guardrails: time each layout with ``cltrain.guardrails.apply_guardrails`` applied, as it
            would train; ``False`` times the bare kernels (in a child process only).
        timeout: seconds to wait for the model to load and the first step to finish; after that a step
            may take 10 times the slowest one seen (at least 30 s, at most ``timeout``).

    Returns:
        A ``ProbeResult``; after any failure its layout is ``"contiguous"`` and ``failure`` says why;
        ``method`` says where the layouts were timed.

    Raises:
        ValueError: ``input_shape`` is not 3-D, 4-D or 5-D, ``steps < 1``, ``warmup < 0`` or ``timeout <= 0``.
    """
    if len(input_shape) not in (3, 4, 5):
        raise ValueError(f"probe_layout: input_shape must be 3-D, 4-D or 5-D, got {input_shape!r}.")
    if steps < 1 or warmup < 0 or timeout <= 0:
        raise ValueError(f"probe_layout: need steps >= 1, warmup >= 0, timeout > 0; got {steps}, {warmup}, {timeout}.")
    start = time.perf_counter()
    if device is None:
        device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    main_path, main_guarded = _main_script()
    job = {
        "shape": tuple(input_shape),
        "options": dict(steps=steps, warmup=warmup, device=str(device), autocast_dtype=autocast_dtype,
                        guardrails=guardrails),
        "settings": dict(threads=torch.get_num_threads(), cudnn_benchmark=torch.backends.cudnn.benchmark,
                         matmul_precision=torch.get_float32_matmul_precision()),
        "main_path": main_path,
        "main_guarded": main_guarded,
        "argv": list(sys.argv),
    }
    reason = _main_unloadable(model, main_path, main_guarded)
    if reason is not None:
        return _time_in_process(model, input_shape, reason, start, job["options"])
    folder = None
    try:
        folder = Path(tempfile.mkdtemp(prefix="cltrain-probe-"))
        try:
            torch.save(model, folder / "model.pt")
        except Exception as error:  # noqa: BLE001 - any pickling failure: lambdas, local classes, open handles
            reason = f"it does not pickle ({type(error).__name__}: {error})"
        else:
            torch.save(job, folder / "job.pt")
            try:
                timings, failure = _run_child(folder, timeout)
                return _result(timings, failure, start, _CHILD)
            except _Unloadable as error:
                reason = str(error)
    except Exception as error:  # noqa: BLE001 - no temp folder, no process: not a reason to stop the run
        failure = f"the timing process could not be started ({type(error).__name__}: {error})"
        return _result(None, failure, start, _CHILD)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return _time_in_process(model, input_shape, reason, start, job["options"])


def _time_in_process(
    model: nn.Module, input_shape: tuple[int, ...], reason: str, start: float, options: dict[str, Any]
) -> ProbeResult:
    method = f"in-process (the model could not be loaded in a child process: {reason})"
    where = "copying the model"

    def on_step(layout: str) -> None:
        nonlocal where
        where = f"timing a {layout} step"

    # No child process takes a crash here: the known-bad kernels are worked around whatever was asked.
    try:
        timings = time_layouts(model, input_shape, on_step=on_step, **{**options, "guardrails": True})
    except Exception as error:  # noqa: BLE001 - a layout that cannot run is a reason to keep contiguous
        return _result(None, f"the in-process timing raised while {where}: {type(error).__name__}: {error}",
                       start, method)
    return _result(timings, None, start, method)


def _result(timings: dict[str, float] | None, failure: str | None, start: float, method: str) -> ProbeResult:
    seconds = time.perf_counter() - start
    if timings is None:
        log.info("auto layout probe, %s, failed after %.1f s: %s -> contiguous", method, seconds, failure)
        return ProbeResult("contiguous", None, failure, seconds, method)
    layout = "channels_last" if timings["channels_last"] <= timings["contiguous"] else "contiguous"
    log.info("auto layout probe, %s: channels_last %.1f ms/step, contiguous %.1f ms/step -> %s (%.1f s)",
             method, 1e3 * timings["channels_last"], 1e3 * timings["contiguous"], layout, seconds)
    return ProbeResult(layout, timings, None, seconds, method)


def _main_unloadable(model: nn.Module, main_path: str | None, main_guarded: bool) -> str | None:
    """Why a child process could not import the model's classes from ``__main__``, or ``None``. Finding it
    here saves starting a child that can only fail; ``_load_model`` still catches what this misses."""
    if main_guarded or not any(type(m).__module__ == "__main__" for m in model.modules()):
        return None
    if main_path is None:
        return ("its classes are defined in __main__, which has no file to import them from "
                "(python -c, a REPL, a notebook)")
    return _unguarded(main_path)


def _unguarded(main_path: str) -> str:
    return (f"its classes are defined in {main_path}, which has no `if __name__ == '__main__':` guard: "
            "loading them would run it again")


def _main_script() -> tuple[str | None, bool]:
    """The running script's path (``None`` for ``-c``, a REPL, a notebook) and whether it has a main guard."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not os.path.isfile(path):
        return None, False
    try:
        return path, bool(_MAIN_GUARD.search(Path(path).read_text(errors="replace")))
    except OSError:
        return path, False


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _run_child(folder: Path, timeout: float) -> tuple[dict[str, float] | None, str | None]:
    # A fresh interpreter rather than multiprocessing's spawn, which runs the caller's whole script again
    # when it has no main guard (the training with it).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(os.path.abspath(p or ".") for p in sys.path)}
    code = "from cltrain.timing.probe import _child_main; _child_main()"
    process = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, env=env, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        with process.stdout:  # closed by the thread that reads it, once the child's end is closed
            for line in process.stdout:
                lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    # Starting Python, importing torch and loading the model is no step of the model: on a slow or busy machine it
    # took longer than a 12 s timeout, which then read as a hang; it gets STARTUP_S at least.
    where, limit, slowest, last = "loading the model", max(timeout, STARTUP_S), 0.0, time.perf_counter()
    try:
        while True:
            try:
                line = lines.get(timeout=limit)
            except queue.Empty:
                process.kill()
                return None, f"no progress for {limit:.0f} s while {where} (a hang); the probe process was killed"
            if line is None:
                code = process.wait()
                died = f"crashed ({_signal_name(code)})" if code < 0 else f"exited ({code})"
                return None, f"the probe process {died} while {where}"
            try:
                message = json.loads(line)
            except ValueError:
                continue
            kind, value, now = message["kind"], message["value"], time.perf_counter()
            if kind == "step" and where == "loading the model":
                limit = timeout
            if kind == "step":
                if where.startswith("timing"):
                    slowest = max(slowest, now - last)
                    limit = min(timeout, max(30.0, 10 * slowest))
                where = f"timing a {value} step"
            elif kind == "done":
                return value, None
            elif kind == "error":
                return None, f"the probe raised while {where}: {value}"
            elif kind == "unloadable":
                raise _Unloadable(value)
            last = now
    finally:
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(5)


def _child_main() -> None:
    """The probe process (``python -c``): load the model, time it, report on the original stdout."""
    folder = Path(sys.argv[1])
    messages = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the model prints goes to stderr, not among the messages

    def send(kind: str, value: Any = None) -> None:
        messages.write(json.dumps({"kind": kind, "value": value}) + "\n")

    try:
        job = torch.load(folder / "job.pt", weights_only=False)  # our own files, written a moment ago
        settings = job["settings"]
        torch.set_num_threads(settings["threads"])
        torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]
        torch.set_float32_matmul_precision(settings["matmul_precision"])
        sys.argv = job["argv"]  # as spawn does: the script's top level may read it
        try:
            model = _load_model(folder / "model.pt", job["main_path"], job["main_guarded"])
        except Exception as error:  # noqa: BLE001 - reported to the parent, which times in its own process
            send("unloadable", f"{type(error).__name__}: {error}")
            return
        send("loaded")
        timings = time_layouts(model, job["shape"], on_step=lambda layout: send("step", layout), **job["options"])
        send("done", timings)
    except Exception as error:  # noqa: BLE001 - reported to the parent, which keeps contiguous
        send("error", f"{type(error).__name__}: {error}")
    finally:
        messages.close()


def _load_model(path: Path, main_path: str | None, main_guarded: bool) -> nn.Module:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except AttributeError as error:
        if "__main__" not in str(error) or main_path is None:
            raise
        if not main_guarded:
            raise RuntimeError(_unguarded(main_path)) from error
    # As multiprocessing's spawn does: the script's top level, without its `if __name__ == "__main__":` block.
    main = types.ModuleType("__mp_main__")
    main.__dict__.update(runpy.run_path(main_path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main
    return torch.load(path, map_location="cpu", weights_only=False)
