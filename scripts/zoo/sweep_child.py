"""What one model's process of ``python -m scripts.zoo.sweep`` measures (``child``): float64 and oneDNN-free
references, a real ``Trainer`` with and without ``ChannelsLast``, the gradients' verdict (``scripts/zoo/parity.py``),
training steps/s in each layout and ``torch.compile``-d copies. ``scripts/zoo/sweep.py`` starts
it with ``--child KEY``; ``--check-only``'s process is ``scripts/zoo/confirm.py``'s ``check_child``."""

from __future__ import annotations

import argparse
import copy
import math
import warnings
from typing import Any

import torch

from cltrain import ChannelsLast
from cltrain.layout import to_channels_last
from cltrain.loops import convert_batch, convert_model
from cltrain.platform import cpu_bf16_support
from cltrain.timing.clock import Stopwatch
from cltrain.timing.rounds import time_steps
from cltrain.timing.steps import training_step
from scripts.harness import emit
from scripts.zoo.confirm import check_child, record_check
from scripts.zoo.models import (
    Spec, batch_to, build, clone_batch, conv_weights_cl, fit, grads_of, make_batch, quiet_random_layers, training_loss,
)
from scripts.zoo.parity import parity

__all__ = ["child"]


def _step_grads(net: torch.nn.Module, spec: Spec, batch: Any) -> tuple[dict[str, torch.Tensor | None], float]:
    torch.manual_seed(0)  # as ``fit`` does: a detector's samplers draw from the global RNG
    loss = training_loss(net, batch, spec)
    loss.backward()
    grads = grads_of(net)
    net.zero_grad(set_to_none=True)
    return grads, float(loss)


def _time_training(nets: dict[str, torch.nn.Module], spec: Spec, batch: Any, dtype: torch.dtype | None,
                   args: argparse.Namespace, warmup: int = 3) -> dict[str, float]:
    """Median training steps/s of each layout's net on its own copy of ``batch`` (in ``dtype``; the channels_last
    one converted), interleaved rounds filling ``--min-window``; ``warmup`` untimed steps first (oneDNN primitives,
    allocator pools)."""
    cast = batch_to(batch, dtype) if dtype is not None else batch
    batches = {"contiguous": clone_batch(cast), "channels_last": convert_batch(clone_batch(cast))}
    steps = {key: training_step(net, lambda net=net, batch=batches[key]: training_loss(net, batch, spec),
                                optimizer=torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9),
                                autocast_dtype=dtype)
             for key, net in nets.items()}
    timing = time_steps(steps, rounds=args.rounds, warmup=warmup, min_window=args.min_window, max_steps=100_000)
    return {key: s.median for key, s in timing.rates().items()}


def _compile_phase(spec: Spec, net0: torch.nn.Module, batches: list[Any], speed_batch: Any,
                   refs: tuple[dict, dict], dtypes: list[tuple[str, torch.dtype | None]],
                   args: argparse.Namespace, result: dict) -> None:
    """Parity and speed of ``torch.compile``-d copies, NCHW and converted by ``cltrain.loops.convert_model``."""
    nets, grads, losses = {}, dict(refs[0]), dict(refs[1])
    for layout in ("contiguous", "channels_last"):
        net = quiet_random_layers(copy.deepcopy(net0).train())
        if layout == "channels_last":
            convert_model(net)
        nets[layout] = torch.compile(net)
        batch = clone_batch(batches[0])
        with Stopwatch() as watch:
            batch = convert_batch(batch) if layout == "channels_last" else batch
            grads[layout], losses[layout] = _step_grads(nets[layout], spec, batch)
        result[f"compile_seconds_{layout}"] = round(watch.seconds, 1)
    parity(result, grads, losses, prefix="compile_")
    for label, dtype in dtypes:
        result[f"compile_speed_{label}"] = _time_training(nets, spec, speed_batch, dtype, args, warmup=4)


def child(spec: Spec, args: argparse.Namespace) -> dict[str, Any]:
    """Measure one model; its row is emitted after every phase (``scripts.harness.emit``), so a crash leaves what
    was done and the phase it died in. Returns the row."""
    warnings.filterwarnings("ignore")
    result: dict[str, Any] = {"key": spec.key, "family": spec.family, "size": spec.size, "note": spec.note}
    clock = Stopwatch().start()

    def phase(name: str) -> dict[str, Any]:
        if "phase" in result:  # seconds spent in the phase that ends here
            result.setdefault("phase_seconds", {})[result["phase"]] = round(clock.elapsed(), 1)
        clock.start()
        result["phase"] = name
        emit(result)
        return result

    phase("build")
    torch.manual_seed(0)
    net0 = build(spec)
    result["params_m"] = round(sum(p.numel() for p in net0.parameters()) / 1e6, 1)
    if result["params_m"] > args.max_params:
        result["skipped"] = f"{result['params_m']:.0f}M parameters: over --max-params {args.max_params:g}M"
        return phase("done")
    gen = torch.Generator().manual_seed(0)
    batches = [make_batch(spec, args.batch, gen) for _ in range(max(2, args.confirm_steps if args.check_only else 2))]

    if args.check_only:
        check_child(spec, net0, batches, args, result, phase)
        return phase("done")

    phase("references")
    refs = _references(spec, net0, batches[0], result)
    grads, losses = dict(refs[0]), dict(refs[1])
    nets = {}
    # The kernels and the guardrails, without the first-batch check's fallbacks (``--check-only`` measures those).
    callbacks = {"contiguous": None, "channels_last": ChannelsLast(layout="channels_last", verify=False)}
    for layout, callback in callbacks.items():
        phase(layout)
        module = fit(copy.deepcopy(net0), spec, batches, callback, max_steps=2)
        nets[layout] = module.train().net
        losses[layout] = float(module.losses[0])
        grads[layout] = module.step0_grads
        result[f"losses_{layout}"] = [float(v) for v in module.losses]
        result[f"trains_{layout}"] = len(module.losses) == 2 and all(map(math.isfinite, result[f"losses_{layout}"]))
        if callback is not None:
            result["conv_weights_cl"] = conv_weights_cl(module.net)
            # the known-fault workarounds the callback applied, in a few words
            result["guardrails"] = "; ".join(f"{r.fault} ({len(r.modules)} modules)" for r in callback.guardrails or [])
            record_check(result, callback)
    parity(result, grads, losses)
    del grads, losses

    dtypes = [("fp32", None), *([("bf16", torch.bfloat16)] if cpu_bf16_support()[0] else [])]
    speed_batch = batches[0] if args.quick else make_batch(spec, args.speed_batch, torch.Generator().manual_seed(1))
    for label, dtype in dtypes if not args.no_speed else []:
        phase(f"speed {label}")
        result[f"speed_{label}"] = _time_training(nets, spec, speed_batch, dtype, args)
    del nets

    if spec.compile and not args.no_compile:
        phase("compile")
        _compile_phase(spec, net0, batches, speed_batch, refs, dtypes, args, result)
    return phase("done")


def _references(spec: Spec, net0: torch.nn.Module, batch: Any, result: dict) -> tuple[dict, dict[str, float]]:
    """Step-0 gradients and losses of ``net0``, by run: ``native``/``native_cl`` (fp32 without oneDNN) and
    ``float64``/``float64_cl`` (none where float64 fails; why goes in ``result``)."""
    grads: dict[str, dict] = {}
    losses: dict[str, float] = {}
    for key in ("native", "native_cl", "float64", "float64_cl"):
        exact = key.startswith("float64")
        try:
            net = copy.deepcopy(net0)
            net = quiet_random_layers((net.double() if exact else net).train())
            b = batch_to(batch, torch.float64) if exact else clone_batch(batch)
            if key.endswith("_cl"):  # no guardrails: none of these runs reaches oneDNN
                net, b = to_channels_last(net), convert_batch(b)
            with torch.backends.mkldnn.flags(enabled=exact):  # fp32 without oneDNN; float64 never reaches it
                grads[key], losses[key] = _step_grads(net, spec, b)
        except Exception as err:  # noqa: BLE001 - some models hard-code float32 somewhere: CL is compared with NCHW
            if not exact:
                raise
            result["float64_error"] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
            grads.pop("float64", None)
            losses.pop("float64", None)
            break
    return grads, losses
