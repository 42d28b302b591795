"""Was the first-batch check's verdict right? Three short trainings of the same model tell (nchw, nudged,
channels_last); the model's process of ``python -m scripts.zoo.sweep --check-only``. The method: docs/zoo_check.md.
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from cltrain import ChannelsLast
from scripts.zoo.models import Spec, fit
from scripts.zoo.parity import loss_gap

FACTOR = 10.0      #: how many times the nudged run's gap a channels_last gap must exceed to count
MIN_GAP = 1e-5     #: and the least relative gap that counts
NUDGE = 1e-7       #: the relative nudge of every parameter in the noise reference
RUNS = ("nchw", "nudged", "channels_last")
FALLBACK_VERDICTS = ("fallback", "contiguous")
JUDGED = ("confirmed", "FALSE", "right", "MISSED")  #: what ``judge`` says where there is a reference


def nudge(net: torch.nn.Module, relative: float = NUDGE, seed: int = 1) -> torch.nn.Module:
    """``net`` with every parameter multiplied by ``1 + relative * N(0, 1)`` (its own draw), in place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(1 + relative * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return net


def update_gap(updates: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, str | None]:
    """The relative difference of two runs' parameter updates over the whole model, and the parameter whose own
    relative difference is the largest (it names where to look; it does not decide)."""
    diff2, scale2, worst, where = 0.0, 0.0, -1.0, None
    for name, ref in reference.items():
        update = updates[name]
        if not (update.isfinite().all() and ref.isfinite().all()):  # both non-finite in the same places: alike
            if not torch.equal(update.isfinite(), ref.isfinite()):
                return math.inf, name
            continue
        diff, scale = float((update - ref).double().norm()), float(ref.double().norm())
        diff2, scale2 = diff2 + diff ** 2, scale2 + scale ** 2
        own = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        if own > worst:
            worst, where = own, name
    gap = math.sqrt(diff2 / scale2) if scale2 > 0 else (0.0 if diff2 == 0 else math.inf)
    return gap, where


def diverges(result: dict[str, Any]) -> bool | None:
    """Does the channels_last run differ from NCHW beyond the noise reference? ``None``: no reference."""
    if result.get("error_nchw") or result.get("error_nudged"):
        return None
    if result.get("error_channels_last"):
        return True
    gap, noise = result["gap"], result["noise"]
    return any(gap[k] > max(FACTOR * noise[k], MIN_GAP) for k in ("loss", "update"))


def judge(verdict: str, result: dict[str, Any]) -> str:
    """``"confirmed"`` / ``"FALSE"`` for a fallback or contiguous verdict, ``"right"`` / ``"MISSED"`` for a
    pass, ``"no reference"`` where the NCHW runs raised."""
    apart = diverges(result)
    if apart is None:
        return "no reference"
    if verdict in FALLBACK_VERDICTS:
        return "confirmed" if apart else "FALSE"
    return "MISSED" if apart else "right"


def numerics(result: dict[str, Any]) -> bool | None:
    """Is a diverging channels_last run as close to float64 as the farther NCHW fp32 run (within ``FACTOR``)?
    ``None``: no float64 run."""
    exact = result.get("float64")
    if not exact or "nchw" not in exact:
        return None
    nchw = [exact[name] for name in ("nchw", "nchw_native") if name in exact]
    return all(exact["channels_last"][k] <= FACTOR * max(MIN_GAP, *(run[k] for run in nchw))
               for k in ("loss", "update"))


def confirm(spec: Spec, net0: torch.nn.Module, batches: list[Any], optimizer: str, steps: int,
            phase: Callable[[str], None] = lambda name: None, result: dict[str, Any] | None = None) -> dict[str, Any]:
    """The nchw, nudged and channels_last runs of ``net0`` (copies) and their gaps into ``result``, ``phase(name)``
    called before each; a float64 run where channels_last diverges (docs/zoo_check.md)."""
    result = {} if result is None else result
    result["steps"] = steps
    updates: dict[str, dict[str, torch.Tensor]] = {}

    def run(name: str, callback: Any = None, precision: str = "32-true", onednn: bool = True) -> None:
        phase(f"confirm {name}")
        net = nudge(copy.deepcopy(net0)) if name == "nudged" else copy.deepcopy(net0)
        initial = {n: p.detach().clone() for n, p in net.named_parameters()}
        try:
            with torch.backends.mkldnn.flags(enabled=onednn):
                module = fit(net, spec, batches, callback, max_steps=steps, precision=precision, optimizer=optimizer)
        except Exception as err:  # noqa: BLE001 - a raise is a result here
            result[f"error_{name}"] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
            return
        result[f"losses_{name}"] = [float(v) for v in module.losses]
        updates[name] = {n: p.detach() - initial[n].to(p.dtype) for n, p in module.net.named_parameters()}

    run("nchw")
    run("nudged")
    run("channels_last", ChannelsLast(layout="channels_last", verify=False))
    if not all(name in updates for name in RUNS):
        return result
    for key, name in (("gap", "channels_last"), ("noise", "nudged")):
        gap, where = update_gap(updates[name], updates["nchw"])
        result[key] = {"loss": loss_gap(result[f"losses_{name}"], result["losses_nchw"]), "update": gap,
                       "update_param": where}
    if diverges(result):
        run("float64", precision="64-true")
        run("nchw_native", onednn=False)
        if "float64" in updates:
            result["float64"] = {
                name: {"loss": loss_gap(result[f"losses_{name}"], result["losses_float64"]),
                       "update": update_gap({n: u.double() for n, u in updates[name].items()}, updates["float64"])[0]}
                for name in ("nchw", "nchw_native", "channels_last") if name in updates}
    return result


def record_check(result: dict[str, Any], callback: Any) -> None:
    """The first-batch layout check's verdict, line, the layout kept, and the largest agreeing difference."""
    check = callback.layout_checks.get("train")
    if check is not None:
        result["layout_check"] = check.verdict
        result["layout_check_line"] = check.line()
        result["layout_check_worst"] = check.worst
        result["layout_check_seconds"] = round(check.seconds, 2)
    result["layout_kept"] = callback.layout


def check_child(spec: Spec, net0: torch.nn.Module, batches: list[Any], args: argparse.Namespace,
                result: dict[str, Any], phase: Callable[[str], None]) -> None:
    """``--check-only``: ``ChannelsLast()``'s check with ``args.optimizer`` on ``batches[:2]``, and where it fell back
    (or the spec is in ``--confirm-passes``) the three runs of :func:`confirm` on ``batches``."""
    phase("channels_last")
    callback = ChannelsLast()
    module = fit(copy.deepcopy(net0), spec, batches[:2], callback, max_steps=2, optimizer=args.optimizer)
    result.update(optimizer=args.optimizer, batch=args.batch, losses_channels_last=[float(v) for v in module.losses])
    record_check(result, callback)
    scope = args.confirm_passes  # "all", or comma-separated key prefixes whose passes are confirmed too
    if result.get("layout_check") in FALLBACK_VERDICTS or scope == "all" or any(
            spec.key.startswith(p) for p in scope.split(",") if p):
        runs = result["confirm"] = {}
        confirm(spec, net0, batches, args.optimizer, args.confirm_steps, phase, runs)
        runs["verdict"] = judge(result["layout_check"], runs)


def settle_confirmation(result: dict[str, Any], phase: str, crashed: bool) -> None:
    """A row whose process died in a confirmation run (``phase``): a native crash (``crashed``) in the channels_last
    run is that run's result and the row is ``ok``; anything else leaves the confirmation unjudged."""
    runs = result.get("confirm")
    if runs is None or "verdict" in runs:
        return
    if phase == "confirm channels_last" and crashed:
        runs["error_channels_last"] = result["status"]
        runs["verdict"] = judge(result["layout_check"], runs)
        result["status"] = "ok" if runs["verdict"] in JUDGED else result["status"]
    else:
        runs["verdict"] = f"unfinished: {result.get('status', phase)}"
