"""How ``scripts/zoo/sweep.py`` judges channels_last's gradients: elementwise against float64, with the
noise of other correct fp32 kernels as the yardstick (the rules: docs/benchmarks.md#zoo-sweep).

Pure functions on ``{parameter name: gradient}`` dicts; torch only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

OK_BELOW = 1e-3     # worst per-parameter gradient error at or below this: ok
MISS_ABOVE = 0.1    # above this, and 10x the fp32 noise of the same parameter: a wrong kernel
FLOOR = 1e-7        # error denominators are at least this fraction of the model's largest exact gradient
LAYOUT_F64_MAX = 1e-8  # float64 channels_last vs float64 NCHW, per parameter: only rounding below this


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


def grad_errors(grads: dict[str, torch.Tensor | None], exact: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """Per parameter, ``max|g - exact| / max(max|exact|, FLOOR * largest exact gradient)``; ``inf`` where one side
    has no gradient."""
    scale = max((float(g.abs().max()) for g in exact.values() if g is not None and g.numel()), default=0.0)
    floor = max(FLOOR * scale, torch.finfo(torch.float64).tiny)
    errors: dict[str, float] = {}
    for name in exact.keys() | grads.keys():
        g, ref = grads.get(name), exact.get(name)
        if g is None and ref is None:
            continue
        if g is None or ref is None:
            errors[name] = math.inf
            continue
        ref = ref.double()
        diff = float((g.double() - ref).abs().max()) if ref.numel() else 0.0
        errors[name] = diff / max(float(ref.abs().max()) if ref.numel() else 0.0, floor)
    return errors


def judge(err_cl: dict[str, float], noise: dict[str, float] | None) -> dict[str, Any]:
    """The gradient verdict from per-parameter errors of channels_last and of correct fp32 kernels (``noise``, the
    larger of NCHW with and without oneDNN), both against the same reference."""
    if not err_cl:
        return {"verdict": "ok", "worst_param": "", "err_cl": 0.0, "err_nc": None, "misses": 0}
    floor = noise or {}
    missed = [n for n, e in err_cl.items() if e > MISS_ABOVE and e > 10 * max(floor.get(n, 0.0), OK_BELOW)]
    worst = max(missed or err_cl, key=lambda n: err_cl[n])
    verdict = "MISS" if missed else "ok" if err_cl[worst] <= OK_BELOW else "numerics"
    return {"verdict": verdict, "worst_param": worst, "err_cl": err_cl[worst],
            "err_nc": floor.get(worst) if noise is not None else None, "misses": len(missed)}


_RUN_NAMES = {"contiguous": "NCHW fp32", "native": "NCHW fp32 without oneDNN",
              "native_cl": "channels_last fp32 without oneDNN"}


def why(verdict: dict[str, Any]) -> str:
    """One phrase on a verdict that is not "ok"."""
    if verdict["verdict"] == "ok":
        return ""
    if verdict.get("layout_miss"):
        return f"channels_last kernels give other gradients in float64 ({verdict['layout_err_f64']:.0e})"
    if verdict["verdict"] == "MISS":
        loss = "the loss and " if verdict.get("loss_miss") else ""
        return f"{loss}{verdict['misses']} parameter(s) O(1) off where fp32 kernels are not"
    scale, noise = verdict.get("grad_scale"), verdict.get("err_nc")
    if scale is not None and scale < 1e-6:
        return "its exact gradient is ~0 (cancels)"
    if noise is not None and noise >= verdict["err_cl"] / 10:
        runs = verdict.get("noise_by_run") or {}
        run = max(runs, key=lambda k: runs[k] or 0.0) if runs else "contiguous"
        return f"{_RUN_NAMES.get(run, run)} is as far off (ill-conditioned)"
    return "within 10x of the fp32 noise"


def parity(result: dict[str, Any], grads: dict[str, dict], losses: dict[str, float], prefix: str = "") -> None:
    """Loss and gradient verdict of ``grads["channels_last"]`` into ``result``: against float64 (else NCHW), fp32
    noise from the other NCHW runs."""
    reference = "float64" if "float64" in grads else "contiguous"  # without float64, the Trainer's NCHW run
    exact, base = grads[reference], losses[reference]
    err_cl = grad_errors(grads["channels_last"], exact)
    others = [k for k in ("contiguous", "native", "native_cl") if k in grads and k != reference]  # fp32 references
    fp32 = {k: grad_errors(grads[k], exact) for k in others}
    noise = {n: max(e.get(n, 0.0) for e in fp32.values()) for n in err_cl}
    verdict = judge(err_cl, noise)
    if "float64_cl" in grads:  # the layout's own kernels, in exact arithmetic: any difference is a wrong kernel
        layout_err = max(grad_errors(grads["float64_cl"], exact).values(), default=0.0)
        verdict["layout_err_f64"] = layout_err
        if layout_err > LAYOUT_F64_MAX:
            verdict.update(verdict="MISS", layout_miss=True)
    verdict["noise_by_run"] = {k: e.get(verdict["worst_param"]) for k, e in fp32.items()}
    if verdict["worst_param"]:  # how small the worst parameter's gradient is: ill-conditioned ones are tiny
        largest = max((float(g.abs().max()) for g in exact.values() if g is not None and g.numel()), default=0.0)
        ref = exact.get(verdict["worst_param"])
        verdict["grad_scale"] = float(ref.abs().max()) / largest if ref is not None and largest > 0 else None
    loss_err = loss_gap([losses["channels_last"]], [base])
    loss_noise = max(loss_gap([losses[k]], [base]) for k in others)
    if loss_err > OK_BELOW and loss_err > 10 * loss_noise:  # the loss is one number: the same rule, stricter
        verdict.update(verdict="MISS", loss_miss=True)
    verdict["why"] = why(verdict)
    result[prefix + "grad"] = verdict
    result[prefix + "loss_err_cl"], result[prefix + "loss_noise"] = loss_err, loss_noise
