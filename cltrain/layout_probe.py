"""Time a model in both layouts in a child process: a native crash in a backend kernel ends the child, not the run.

What ``ChannelsLast(mode="auto")`` runs. The model is sent to a fresh ``spawn`` process (``torch.save``
of the whole module through a temporary file), which runs :func:`cltrain.autolayout.time_layouts` and
reports each step as it starts. A crash (segfault, abort), an exception, or no progress for too long
gives ``"contiguous"`` and one line saying why; the caller's process is never at risk. A model that does
not pickle (a lambda or an open file among its attributes, a class defined inside a function) is not timed:
``"contiguous"`` again, and the line says so. Rebuilding it from a ``state_dict`` would need its
constructor's arguments, which an arbitrary module does not record (a LightningModule's ``hparams``
often leave the network out), and timing a different model would be worse than not timing.

Example::

    >>> import torchvision
    >>> from cltrain.layout_probe import probe_layout
    >>> result = probe_layout(torchvision.models.resnet18(), (8, 3, 64, 64), steps=2)  # doctest: +SKIP
    >>> result.layout, result.failure                                                   # doctest: +SKIP
    ('channels_last', None)
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cltrain.autolayout import time_layouts

__all__ = ["ProbeResult", "probe_layout"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeResult:
    """What :func:`probe_layout` found.

    Attributes:
        layout: ``"channels_last"`` or ``"contiguous"`` (always ``"contiguous"`` after a failure).
        timings: ``{"channels_last": s, "contiguous": s}``, median seconds per step; ``None`` after a failure.
        failure: one line saying why no timings came back (a crash, an exception, a timeout, a model that
            cannot be sent), or ``None``.
        seconds: the whole probe's wall time: sending the model, starting the process, timing.
    """

    layout: str
    timings: dict[str, float] | None
    failure: str | None
    seconds: float


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _save_model(model: nn.Module, path: Path) -> str | None:
    """Write ``model`` so a fresh process can load it; the reason it cannot be, or ``None``."""
    try:
        torch.save(model, path)
        return None
    except Exception as error:  # noqa: BLE001 - any pickling failure: lambdas, local classes, open handles
        return f"{type(error).__name__}: {error}"


def _load_model(path: str) -> nn.Module:
    # Our own file, written by the parent a moment ago: not an untrusted checkpoint.
    return torch.load(path, map_location="cpu", weights_only=False)


def _child(path: str, shape: tuple[int, ...], options: dict[str, Any], settings: dict[str, Any], conn: Any) -> None:
    """The probe process: load the model, time it, send each step's start and the result."""
    try:
        torch.set_num_threads(settings["threads"])
        torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]
        torch.set_float32_matmul_precision(settings["matmul_precision"])
        model = _load_model(path)
        conn.send(("loaded", None))
        timings = time_layouts(model, shape, on_step=lambda layout: conn.send(("step", layout)), **options)
        conn.send(("done", timings))
    except Exception as error:  # noqa: BLE001 - reported to the parent, which keeps contiguous
        conn.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        conn.close()


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
    """The faster layout for ``model``, timed by :func:`cltrain.autolayout.time_layouts` in a child process.

    Args:
        model: the model to time, as it will be trained (not modified).
        input_shape, steps, warmup, autocast_dtype: as for :func:`~cltrain.autolayout.time_layouts`.
        device: where to time (default: the model's device); the child uses the same device.
        guardrails: time each layout with :func:`cltrain.guardrails.apply_guardrails` applied, as it
            would train; ``False`` times the bare kernels.
        timeout: seconds to wait for the model to load and the first step to finish; after that a step
            may take 10 times the slowest one seen (at least 30 s, at most ``timeout``).

    Returns:
        A :class:`ProbeResult`; after any failure its layout is ``"contiguous"`` and ``failure`` says why.

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
    options = dict(steps=steps, warmup=warmup, device=str(device), autocast_dtype=autocast_dtype, guardrails=guardrails)
    settings = dict(threads=torch.get_num_threads(), cudnn_benchmark=torch.backends.cudnn.benchmark,
                    matmul_precision=torch.get_float32_matmul_precision())
    folder = None
    try:
        folder = Path(tempfile.mkdtemp(prefix="cltrain-probe-"))
        reason = _save_model(model, folder / "model.pt")
        if reason is not None:
            failure = (f"the model could not be sent to the timing process ({reason}); keep its classes at module "
                       "level and unpicklable objects off it, or choose mode='full'")
            return _result(None, failure, start)
        timings, failure = _run_child(folder / "model.pt", tuple(input_shape), options, settings, timeout)
        return _result(timings, failure, start)
    except Exception as error:  # noqa: BLE001 - no temp dir, no child (a daemonic parent, ...): not worth the run
        return _result(None, f"the timing process could not be started ({type(error).__name__}: {error})", start)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _result(timings: dict[str, float] | None, failure: str | None, start: float) -> ProbeResult:
    seconds = time.perf_counter() - start
    if timings is None:
        log.info("auto layout probe failed after %.1f s: %s -> contiguous", seconds, failure)
        return ProbeResult("contiguous", None, failure, seconds)
    layout = "channels_last" if timings["channels_last"] <= timings["contiguous"] else "contiguous"
    log.info("auto layout probe: channels_last %.1f ms/step, contiguous %.1f ms/step -> %s (%.1f s)",
             1e3 * timings["channels_last"], 1e3 * timings["contiguous"], layout, seconds)
    return ProbeResult(layout, timings, None, seconds)


def _run_child(
    path: Path, shape: tuple[int, ...], options: dict[str, Any], settings: dict[str, Any], timeout: float
) -> tuple[dict[str, float] | None, str | None]:
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(str(path), shape, options, settings, send), daemon=True)
    process.start()
    send.close()  # the child holds the only writer: EOF here means the child is gone
    where, limit, slowest, last = "loading the model", timeout, 0.0, time.perf_counter()
    try:
        while True:
            if not receive.poll(limit):
                process.kill()
                return None, f"no progress for {limit:.0f} s while {where} (a hang); the probe process was killed"
            try:
                kind, value = receive.recv()
            except EOFError:
                process.join()
                code = process.exitcode
                died = f"crashed ({_signal_name(code)})" if code is not None and code < 0 else f"exited ({code})"
                return None, f"the probe process {died} while {where}"
            now = time.perf_counter()
            if kind == "step":
                if where.startswith("timing"):
                    slowest = max(slowest, now - last)
                    limit = min(timeout, max(30.0, 10 * slowest))
                where = f"timing a {value} step"
            elif kind == "done":
                return value, None
            elif kind == "error":
                return None, f"the probe raised while {where}: {value}"
            last = now
    finally:
        receive.close()
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
