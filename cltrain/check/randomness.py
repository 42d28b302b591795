"""The same randomness in both layouts: random ops draw in the logical (NCHW) order whatever the strides, and every
RNG the step can read (torch's, CUDA's, Python's, NumPy's) is set before a run and restored after it. Under several
ranks a ``torch.distributed`` collective the step calls raises in the check's runs: the check runs on rank 0 alone,
where the collective would wait for ever for the other ranks (a contrastive loss's ``all_gather``)."""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Any

import torch
import torch.distributed as dist

from cltrain.check.result import COPY_LIMIT
from cltrain.layout.function_mode import UserFrameMode

__all__ = ["SameRandomness", "rng_state", "same_randomness", "set_rng_state"]


_RANDOM_OUT = {
    torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout, torch.nn.functional.feature_alpha_dropout,
    torch.dropout, torch.feature_dropout, torch.alpha_dropout, torch.feature_alpha_dropout, torch.bernoulli,
    torch.Tensor.bernoulli, torch.rand_like, torch.randn_like, torch.randint_like,
}
_RANDOM_IN_PLACE = {
    torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.exponential_,
    torch.Tensor.geometric_, torch.Tensor.cauchy_, torch.Tensor.log_normal_, torch.Tensor.random_,
    torch.dropout_, torch.feature_dropout_, torch.alpha_dropout_, torch.feature_alpha_dropout_,
}


class SameRandomness(UserFrameMode):
    """Random ops draw in the logical (NCHW) order whatever the strides, so the same RNG state gives the
    same dropout mask in both layouts (a kernel fills a mask in memory order)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if "c10d" in (getattr(func, "__module__", None) or "") and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(f"torch.distributed's {getattr(func, '__name__', func)} is a collective, which "
                               f"{COPY_LIMIT} cannot run: the check runs on rank 0 alone")
        kwargs = kwargs or {}
        x = args[0] if args else kwargs.get("input")
        if (func not in _RANDOM_OUT and func not in _RANDOM_IN_PLACE) or not isinstance(x, torch.Tensor) \
                or x.dim() < 2 or x.is_contiguous():
            return func(*args, **kwargs)
        rest = args[1:] if args else ()
        kwargs = {k: v for k, v in kwargs.items() if k != "input"}
        in_place = func in _RANDOM_IN_PLACE or bool(kwargs.get("inplace")) or (len(args) > 3 and args[3] is True)
        if func in _RANDOM_IN_PLACE:
            tmp = x.clone(memory_format=torch.contiguous_format)
            func(tmp, *rest, **kwargs)
            with torch.no_grad() if not x.requires_grad else contextlib.nullcontext():
                return x.copy_(tmp)
        if in_place:
            kwargs["inplace"] = False
            if len(rest) > 2:
                rest = (*rest[:2], False, *rest[3:])
        result = func(x.clone(memory_format=torch.contiguous_format), *rest, **kwargs)
        if in_place:
            return x.copy_(result)
        return torch.empty_like(x, dtype=result.dtype).copy_(result)


@contextlib.contextmanager
def same_randomness() -> Any:
    """``SameRandomness`` around the check's step and backward, also in a non-reentrant activation checkpoint's
    recompute during the backward, where torch runs no function mode: its dropout drew the forward's mask again in
    memory order, another one in channels_last, and the check saw a fault the run does not have."""
    import torch.utils.checkpoint as ckpt

    impl = getattr(ckpt, "_checkpoint_without_reentrant_generator_impl", None)  # where torch passes context_fn on

    def with_mode(*args: Any, **kwargs: Any) -> Any:
        context_fn = kwargs.get("context_fn")
        if context_fn is not None and not kwargs.get("debug"):  # debug=True takes no context_fn of ours
            def both() -> tuple[Any, Any]:
                forward, recompute = context_fn()
                return forward, _entered_at_recompute(recompute)
            kwargs["context_fn"] = both
        return impl(*args, **kwargs)

    if impl is not None:
        ckpt._checkpoint_without_reentrant_generator_impl = with_mode
    try:
        with SameRandomness():
            yield
    finally:
        if impl is not None:
            ckpt._checkpoint_without_reentrant_generator_impl = impl


@contextlib.contextmanager
def _entered_at_recompute(recompute: Any) -> Any:
    """``recompute`` (the checkpoint's own context), then ``SameRandomness``, entered when the recompute starts."""
    with recompute, SameRandomness():
        yield


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])
