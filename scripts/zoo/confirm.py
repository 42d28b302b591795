"""Was the first-batch check's verdict right? Three short trainings of the same model tell.

From one initialisation, the same seed, the same batches and the same optimizer, ``steps`` training steps each
(``scripts.zoo.training.fit``, a real ``Trainer``):

1. **nchw**: NCHW, no callback: the reference;
2. **nudged**: NCHW with every parameter nudged by a relative 1e-7 (``p.mul_(1 + 1e-7 * randn_like(p))``): how far
   rounding alone moves the run (the noise reference: Adam's first steps amplify it);
3. **channels_last**: ``ChannelsLast(layout="channels_last", verify=False)``: channels_last without the check's
   fallbacks (and without the race of the layouts, which would run steps in NCHW).

``gap`` is how far a run is from **nchw**: the largest relative difference of its losses (per step), and the
relative difference of its parameter updates over the whole model (``|u - u_nchw| / |u_nchw|``, ``u`` = final
minus initial parameters as one vector, so the nudge itself does not count). The channels_last run **diverges**
where it raised or crashed, or where a gap is above ``FACTOR`` x the nudged run's gap and above ``MIN_GAP``. A
fallback or contiguous verdict is then **confirmed**, else **FALSE** (a false fallback); a passing verdict is
**right**, or **MISSED** where the channels_last run diverges (a fault the check let through). Where the NCHW runs themselves raise there is no
reference, and nothing is judged.

Where the channels_last run trained and diverges, two more runs tell rounding from a fault: NCHW in float64 (the
exact run) and NCHW fp32 with oneDNN disabled (other correct fp32 kernels). Where channels_last fp32 is as close to
float64 as the farther of the two NCHW fp32 runs (within ``FACTOR``), the gap is fp32 kernels rounding differently
(an ill-conditioned gradient, as BatchNorm at a small batch makes them, amplified by Adam), not a fault; the verdict
stays, and ``numerics`` says so beside it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from scripts.zoo.models import Spec
from scripts.zoo.training import fit

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


def loss_gap(losses: list[float], reference: list[float]) -> float:
    """The largest relative difference between two runs' losses, step by step (``inf`` where a run stopped
    early or one is finite and the other not)."""
    if len(losses) != len(reference):
        return math.inf
    gaps = []
    for a, b in zip(losses, reference):
        if not (math.isfinite(a) and math.isfinite(b)):
            gaps.append(0.0 if a == b or (math.isnan(a) and math.isnan(b)) else math.inf)
        else:
            gaps.append(abs(a - b) / max(abs(b), 1e-12))
    return max(gaps, default=0.0)


def update_gap(updates: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, str | None]:
    """The relative difference between two runs' parameter updates over the whole model (the norm of the difference
    over the norm of the reference's, all parameters as one vector), and the parameter whose own relative
    difference is the largest (one ill-conditioned parameter, a BatchNorm weight at batch 2, is far off in any two
    fp32 runs: it names where to look, it does not decide)."""
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


def died(row: dict[str, Any], phase: str, crash: str | None) -> str:
    """The confirmation's verdict where its process died in ``phase`` (``crash``: how, for a native crash; ``None``
    for a timeout or a raise outside the runs): a native crash in the channels_last run is that run's result, as a
    raise would be; anything else leaves it unjudged."""
    runs = row["confirm"]
    if phase == "confirm channels_last" and crash:
        runs["error_channels_last"] = crash
        return judge(row["layout_check"], runs)
    return f"unfinished: {row.get('status', phase)}"


def _updates(module: torch.nn.Module, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: p.detach() - initial[n].to(p.dtype) for n, p in module.named_parameters()}


def numerics(result: dict[str, Any]) -> bool | None:
    """Is a diverging channels_last run as close to the float64 run as an NCHW fp32 run is (the farther of NCHW with
    and without oneDNN, within ``FACTOR``)? Then the fp32 runs differ by their kernels' rounding, not by a fault.
    ``None``: no float64 run."""
    exact = result.get("float64")
    if not exact or "nchw" not in exact:
        return None
    nchw = [exact[name] for name in ("nchw", "nchw_native") if name in exact]
    return all(exact["channels_last"][k] <= FACTOR * max(MIN_GAP, *(run[k] for run in nchw))
               for k in ("loss", "update"))


def confirm(spec: Spec, net0: torch.nn.Module, batches: list[Any], optimizer: str, steps: int,
            phase: Callable[[str], None] = lambda name: None, result: dict[str, Any] | None = None,
            precision: str = "32-true") -> dict[str, Any]:
    """The three runs of ``net0`` (copies) for ``steps`` steps on ``batches`` with ``optimizer``, and their gaps.

    ``phase(name)`` is called before each run (``"confirm nchw"``, ...) and ``result`` filled as the runs end, so
    what a native crash leaves says which run it was in. Returns ``result``: the losses of each run, ``gap``
    (channels_last against nchw) and ``noise`` (nudged against nchw), each ``{"loss", "update", "update_param"}``,
    and ``error_<run>`` for a run that raised. Where the channels_last run trained and diverges, a fourth run in
    float64 (NCHW) says how far each fp32 run is from it (``float64``: ``{"nchw": gaps, "channels_last": gaps}``;
    ``numerics`` reads it).
    """
    from cltrain import ChannelsLast

    result = {} if result is None else result
    result["steps"] = steps
    updates: dict[str, dict[str, torch.Tensor]] = {}

    def run(name: str, callback: Any = None, run_precision: str = precision, onednn: bool = True) -> None:
        phase(f"confirm {name}")
        net = nudge(copy.deepcopy(net0)) if name == "nudged" else copy.deepcopy(net0)
        initial = {n: p.detach().clone() for n, p in net.named_parameters()}
        try:
            with torch.backends.mkldnn.flags(enabled=onednn):
                module = fit(net, spec, batches, callback, max_steps=steps, precision=run_precision,
                             optimizer=optimizer)
        except Exception as err:  # noqa: BLE001 - a raise is a result here
            result[f"error_{name}"] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
            return
        result[f"losses_{name}"] = [float(v) for v in module.losses]
        updates[name] = _updates(module.net, initial)

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
        run("float64", run_precision="64-true")
        run("nchw_native", onednn=False)
        if "float64" in updates:
            result["float64"] = {
                name: {"loss": loss_gap(result[f"losses_{name}"], result["losses_float64"]),
                       "update": update_gap({n: u.double() for n, u in updates[name].items()}, updates["float64"])[0]}
                for name in ("nchw", "nchw_native", "channels_last") if name in updates}
    return result
