"""Which precision a device trains fastest in, the dtype each precision computes in, and whether a fused
optimizer is safe under loss scaling.

* ``autocast_dtype``, ``compute_dtype``: the dtype a Lightning precision flag autocasts to
  (``bf16-mixed`` -> ``torch.bfloat16``; ``32-true`` -> None), and the dtype convolutions compute in
  (autocast's, or the parameters' for ``bf16-true`` / ``16-true``); ``autocast_for``: the autocast
  context of a device and dtype.
* ``auto_precision``: the Lightning precision flag ``amp="auto"`` means on a device:
  bf16 autocast where bf16 is native (on the CPU: ``cltrain.platform.cpu_bf16_support``, which
  ``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA`` and ``DNNL_MAX_CPU_ISA`` can turn off on a CPU
  that has AVX512-BF16), fp16 with loss scaling on CUDA GPUs without bf16, fp32 elsewhere;
  with the reason, in words. ``cltrain.timing.precision`` picks by running the recipe's step in each
  instead (``python -m scripts.gpu_check --mark`` reports its pick; not the default).
* ``loss_scaling_safe``: one overflowed step of an optimizer under a ``GradScaler``
  on scratch tensors, compared with the unfused optimizer. A fused optimizer gets the
  overflow check handed to its kernel; ``SGD(fused=True, momentum>0)`` writes an
  uninitialised momentum buffer on an overflowed first step and trains to NaN.
* ``zero_momentum_buffers``: starts SGD's momentum buffers at zero, which makes the
  fused SGD pass ``loss_scaling_safe`` (``dampening=0``).
* ``full_float32``: float32 convolutions and matmuls computed in IEEE float32 inside (no TF32 on CUDA,
  no bf16/TF32 shortcuts in oneDNN), the user's settings restored after.

Example::

    >>> import torch
    >>> from cltrain.precision import auto_precision, autocast_dtype, loss_scaling_safe, zero_momentum_buffers
    >>> autocast_dtype("bf16-mixed"), autocast_dtype("32-true")
    (torch.bfloat16, None)
    >>> auto_precision(torch.device("cpu")).flag in ("bf16-mixed", "32-true")
    True
    >>> loss_scaling_safe(torch.optim.SGD, torch.device("cpu"), lr=0.1, momentum=0.9)
    False
    >>> loss_scaling_safe(torch.optim.SGD, torch.device("cpu"), prepare=zero_momentum_buffers, lr=0.1, momentum=0.9)
    True
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.deterministic

from cltrain.platform import cpu_bf16_support

__all__ = ["AUTOCAST_DTYPES", "PrecisionChoice", "auto_precision", "autocast_dtype", "autocast_for",
           "compute_dtype", "full_float32", "loss_scaling_safe", "zero_momentum_buffers"]

#: The Lightning precision flag -> the dtype its autocast computes in.
AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
# The dtype convolutions compute in: autocast's, or the parameters' once cast.
_COMPUTE_DTYPES: dict[str, torch.dtype] = {**AUTOCAST_DTYPES, "bf16-true": torch.bfloat16, "16-true": torch.float16}



#: The backends whose float32 math has a reduced-precision mode (``fp32_precision``: "tf32", "bf16").
_FP32_BACKENDS = ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def _fp32_settings() -> list[Any]:
    found = []
    for path in _FP32_BACKENDS:
        obj: Any = torch.backends
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, "fp32_precision"):
            found.append(obj)
    return found


@contextmanager
def full_float32() -> Iterator[None]:
    """float32 convolutions and matmuls in IEEE float32 inside, whatever the user set (TF32 is CUDA's default
    for cuDNN convolutions); each backend's ``fp32_precision`` is restored on the way out.

    TF32 rounds a convolution's inputs to 10 bits, and the two layouts' kernels round differently: the
    layout check compares in full float32 so that rounding cannot pass for a layout fault.
    """
    settings = _fp32_settings()
    saved = [s.fp32_precision for s in settings]
    try:
        for s in settings:
            s.fp32_precision = "ieee"
        yield
    finally:
        for s, value in zip(settings, saved):
            s.fp32_precision = value


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype a Lightning precision flag autocasts to (``"bf16-mixed"`` -> ``torch.bfloat16``); None
    for a precision without autocast (``"32-true"``, ``"bf16-true"``)."""
    return AUTOCAST_DTYPES.get(str(precision))


def autocast_for(device: torch.device | str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``device``'s type in ``dtype``, or a no-op context when ``dtype`` is ``None``."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype convolutions compute in under a Lightning precision flag: autocast's, or the
    parameters' for ``"bf16-true"`` / ``"16-true"``; None for float32 (``"32-true"``)."""
    return _COMPUTE_DTYPES.get(str(precision))


@dataclass(frozen=True)
class PrecisionChoice:
    """A Lightning precision flag (``"bf16-mixed"``, ``"16-mixed"``, ``"32-true"``) and why it was chosen."""

    flag: str
    reason: str


#: What bf16 autocast cost on a CPU without native bf16 (ResNet-50 training, docs/performance.md).
CPU_BF16_EMULATED_SLOWDOWN = "ResNet-50 trained 14.5x slower than in fp32 (0.8 vs 11.6 img/s)"
_EMULATED_SAID: list[str] = []  # the line below, once per process: the app's and every door's


def say_bf16_emulated(say: Callable[[str], Any], asked: str, fix: str) -> str:
    """Where bf16 autocast on this CPU is emulated (``cpu_bf16_support``), ``say`` it once per process: ``asked``
    (what asked for bf16), the reason, the cost and ``fix``. Returns ``cpu_bf16_support``'s reason."""
    native, reason = cpu_bf16_support()
    if not native and not _EMULATED_SAID:
        _EMULATED_SAID.append(asked)
        say(f"{asked} on a CPU without native bf16 ({reason}): bf16 runs, but emulated; "
            f"{CPU_BF16_EMULATED_SLOWDOWN}. {fix}")
    return reason


def auto_precision(device: torch.device) -> PrecisionChoice:
    """The precision ``amp="auto"`` picks on ``device``.

    CUDA with bf16 (compute capability 8.0 and later): ``bf16-mixed``, no loss scaling;
    older CUDA GPUs (V100, T4): ``16-mixed`` with loss scaling; a CPU with native bf16
    (``cpu_bf16_support``): ``bf16-mixed``; any other CPU, MPS and the rest: ``32-true``.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        if major >= 8:
            return PrecisionChoice("bf16-mixed", f"{name} (compute capability {major}.{minor}) computes bf16 natively")
        return PrecisionChoice("16-mixed", f"{name} (compute capability {major}.{minor}) has no fast bf16: fp16 "
                                           "with loss scaling")
    if device.type == "cpu":
        native, reason = cpu_bf16_support()
        return PrecisionChoice("bf16-mixed" if native else "32-true", reason)
    return PrecisionChoice("32-true", f"no mixed precision is chosen automatically on {device.type}")


@contextmanager
def _uninitialised_memory_is_nan() -> Iterator[None]:
    # A kernel that leaves an `empty_like` buffer unwritten must show NaN, not whatever the allocator
    # hands back (often zeros or a freed tensor's finite values). Deterministic mode fills every
    # `torch.empty*` result; warn_only, because the probe needs the fill, not deterministic kernels.
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _run_sequence(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                  device: torch.device) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    param = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 64, device=device).reshape(8, 8))
    optimizer = make([param])
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16)
    weights = torch.linspace(0.5, 1.5, 64, device=device).reshape(8, 8)
    snapshots = []
    for overflow in (True, False, True, False):
        optimizer.zero_grad(set_to_none=True)
        loss = (param * weights).sum() * (float("inf") if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        state = {k: v.detach().clone() for k, v in optimizer.state.get(param, {}).items()
                 if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0}
        snapshots.append((param.detach().clone(), state))
    return snapshots


def zero_momentum_buffers(optimizer: torch.optim.SGD) -> torch.optim.SGD:
    """Start every momentum buffer of ``optimizer`` at zero, so that its fused step is safe under loss scaling.

    Call it on the new optimizer, before its first step::

        optimizer = zero_momentum_buffers(torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True))

    With ``dampening=0`` a zero buffer gives SGD's first step unchanged (``0 * momentum + grad``
    is the ``grad`` it starts from), and the fused kernel, which skips an overflowed step,
    no longer allocates an uninitialised buffer for it. Groups with ``momentum=0`` have no
    buffer, and groups with ``dampening != 0`` start from ``(1 - dampening) * grad`` instead,
    so both are left alone (``loss_scaling_safe`` still fails such a fused SGD).

    ``optimizer.load_state_dict`` keeps both properties, for a state dict saved by the
    unfused SGD too: parameters without a saved buffer get a zero one, and every group keeps
    the ``fused`` and ``foreach`` flags the optimizer was built with (the loaded groups would
    make the step unfused, and the unfused step refuses a ``GradScaler``'s overflow flag).
    Parameters added later with ``add_param_group`` need another call.

    Returns:
        ``optimizer``.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.SGD``.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        raise TypeError(f"zero_momentum_buffers takes a torch.optim.SGD, got {type(optimizer).__name__}")
    _zero_missing_buffers(optimizer)
    optimizer.register_load_state_dict_post_hook(_keep_zero_buffers_after_load)
    return optimizer


def _zero_missing_buffers(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        if group["momentum"] == 0 or group["dampening"] != 0:
            continue
        for param in group["params"]:
            state = optimizer.state[param]
            if state.get("momentum_buffer") is None:
                # zeros_like keeps the parameter's strides (channels_last), as the fused kernel's buffers have
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _keep_zero_buffers_after_load(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for key in ("fused", "foreach"):
            group[key] = optimizer.defaults[key]
    _zero_missing_buffers(optimizer)


def loss_scaling_safe(optimizer_class: type[torch.optim.Optimizer], device: torch.device | str, *,
                      prepare: Callable[[torch.optim.Optimizer], Any] | None = None, **kwargs: Any) -> bool:
    """Whether ``optimizer_class(..., fused=True, **kwargs)`` is safe under a ``GradScaler`` on ``device``.

    Runs overflowed, finite, overflowed and finite steps on a scratch parameter with the
    fused optimizer and with the unfused one (``foreach=False``); safe when, after every step,
    the parameter and every state tensor both optimizers hold are finite and equal (to
    float rounding). Costs a few milliseconds; the GradScaler's unfused path reads the
    overflow flag on the host, which is fine for a probe.

    Args:
        optimizer_class: the optimizer, e.g. ``torch.optim.SGD``.
        device: where it would run.
        prepare: called on the fused optimizer right after it is built, as the caller will
            call it on the real one (e.g. ``zero_momentum_buffers``); its return value is unused.
        **kwargs: the optimizer's arguments, other than ``fused`` and ``foreach``.

    Returns:
        ``False`` also when the fused optimizer cannot be built on ``device``.
    """
    device = torch.device(device)

    def build_fused(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = optimizer_class(params, fused=True, **kwargs)
        if prepare is not None:
            prepare(optimizer)
        return optimizer

    try:
        with _uninitialised_memory_is_nan():
            fused = _run_sequence(build_fused, device)
    except (RuntimeError, TypeError, ValueError):  # no fused kernel for this device or dtype
        return False
    plain = _run_sequence(lambda p: optimizer_class(p, foreach=False, **kwargs), device)
    for (p_fused, s_fused), (p_plain, s_plain) in zip(fused, plain):
        tensors = [p_fused, *s_fused.values()]
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            return False
        if not torch.allclose(p_fused, p_plain, rtol=1e-5, atol=1e-7):
            return False
        for key in s_fused.keys() & s_plain.keys():
            if not torch.allclose(s_fused[key], s_plain[key], rtol=1e-5, atol=1e-7):
                return False
    return True
