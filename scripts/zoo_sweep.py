"""Which real models train correctly, and faster, under ``ChannelsLast``: a sweep of timm, torchvision
and Hugging Face models (the list: ``scripts/zoo_models.py``; random weights, nothing downloaded).

Every model runs in its own subprocess with a timeout, so a native crash or a hang is a row, not
the end of the sweep. In it, from one seeded initialisation and the same two batches:

1. **references**, on batch 0: one forward + backward in float64 (NCHW): the exact gradient; in
   float64 channels_last: the layout's own kernels must give the same numbers (per parameter within
   1e-8, else MISS: a kernel computing something else); and in fp32 with oneDNN disabled, NCHW and
   channels_last: more correct fp32 kernels, to gauge fp32 noise in each layout.
2. **contiguous**: a real Lightning ``Trainer``, 2 SGD steps, no callback.
3. **channels_last**: the same with ``ChannelsLast()``. The step-0 loss and *every* parameter's
   gradient are compared elementwise with the float64 ones: per parameter
   ``err = max|g - g64| / max|g64|`` (the denominator floored at 1e-7 of the model's largest
   gradient). A wrong-gradient kernel can leave the gradient's norm close; it cannot hide from a
   max over elements. fp32 noise per parameter is the largest error of the three other fp32 runs
   (NCHW with oneDNN, NCHW and channels_last without). Verdict: **MISS** where
   ``err_CL > 0.1`` and ``err_CL > 10 * max(noise, 1e-3)`` (O(1) off where correct fp32 kernels
   are not: a wrong oneDNN kernel, as oneDNN #6035's silent case); **ok** where
   ``err_CL <= 1e-3``; **numerics** otherwise, with the noise of the same parameter and how small
   its exact gradient is beside it (ill-conditioned gradients, as BatchNorm at batch 2 makes them,
   are as far off in other fp32 kernels; CPU BatchNorm in channels_last sums its statistics less
   accurately, see ``scripts/cpu_bn_channels_last_accuracy.py``, so channels_last runs are further
   off there whatever the convolution kernels). The step-0 loss is judged the same way (MISS
   where it is > 1e-3 off and 10x the fp32 runs' error). Without a float64 reference (a model
   that cannot run in float64) the Trainer's NCHW run is the reference. The table also says how
   many conv weights are channels_last and which guardrail the callback applied.
4. **speed**: training steps/s (forward, cross-entropy, backward, SGD step) of the two trained
   models, in interleaved rounds (median), fp32 and, where the CPU has native bf16, bf16 autocast.
5. **auto**: what ``ChannelsLast(mode="auto")`` keeps, in a one-step ``Trainer`` run (fp32, and
   ``bf16-mixed`` where native).
6. **compile** (tv ``resnet50``, timm ``convnext_atto``, timm ``efficientnet_b0``): the parity and
   speed checks again under ``torch.compile``, the model converted with
   :func:`cltrain.loops.convert_model` before compiling.

Usage::

    python scripts/zoo_sweep.py                            # the whole zoo -> docs/zoo.md, docs/zoo.json, docs/zoo.csv
    python scripts/zoo_sweep.py --resume                   # go on after an interruption (rows already in the JSON kept)
    python scripts/zoo_sweep.py --fast --out /tmp/zoo      # one model per special case, small and quick (the test suite's)
    python scripts/zoo_sweep.py --models resnet50,hf:swin --out /tmp/zoo
    python scripts/zoo_sweep.py --list

Outputs (each written atomically after every model, so an interrupted sweep keeps its rows):
``<out>.md`` (the table, the command, the CPU and its flags), ``<out>.json`` (every measurement,
per-parameter worst errors included) and ``<out>.csv``; child logs under ``--log-dir``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from cltrain.atomic import atomic_write_text

sys.path.insert(0, str(Path(__file__).resolve().parent))  # zoo_models, beside this file
from zoo_models import (  # noqa: E402
    Spec, all_specs, batch_to, build, clone_batch, find, logits_of, loss_of, make_batch, quiet_random_layers,
)

OK_BELOW = 1e-3     # worst per-parameter gradient error at or below this: ok
MISS_ABOVE = 0.1    # above this, and 10x the fp32 noise of the same parameter: a wrong kernel
FLOOR = 1e-7        # error denominators are at least this fraction of the model's largest exact gradient
LAYOUT_F64_MAX = 1e-8  # float64 channels_last vs float64 NCHW, per parameter: only rounding below this
FAST = ["timm:repvgg_a0", "timm:mobileone_s0", "timm:fastvit_t8", "timm:resnet26d", "timm:vit_tiny_patch16_224",
        "tv:googlenet", "hf:resnet_small"]
LR = 0.01


# ---- the verdict --------------------------------------------------------------------------------


def grad_errors(grads: dict[str, torch.Tensor | None], exact: dict[str, torch.Tensor | None]) -> dict[str, float]:
    """Per parameter, ``max|g - exact| / max(max|exact|, FLOOR * largest exact gradient)``.

    A parameter with a gradient on one side and none on the other is ``inf``; none on both is left out."""
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
    """The row's gradient verdict from per-parameter errors of channels_last and of correct fp32
    kernels (``noise``: NCHW fp32 with and without oneDNN, the larger), both against the same
    reference; ``noise`` ``None`` counts as none."""
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


def _why(verdict: dict[str, Any]) -> str:
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


def _step_grads(net: torch.nn.Module, spec: Spec, batch: Any) -> tuple[dict[str, torch.Tensor | None], float]:
    loss = loss_of(net, batch, spec.dict_batch)
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): None if p.grad is None else p.grad.detach().clone()  # torch.compile's wrapper
             for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    return grads, float(loss)


# ---- one model, in the child process ------------------------------------------------------------


def _native_bf16() -> bool:
    from cltrain.precision import cpu_bf16_support

    return cpu_bf16_support()[0]


def _module_class():
    from lightning.pytorch import LightningModule

    class ZooModule(LightningModule):
        """A classifier around any zoo model; keeps the step-0 gradients and the losses."""

        def __init__(self, net: torch.nn.Module, dict_batch: bool):
            super().__init__()
            self.net, self.dict_batch = net, dict_batch
            self.losses: list[torch.Tensor] = []
            self.step0_grads: dict[str, torch.Tensor | None] | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return logits_of(self.net, x, self.dict_batch)

        def train(self, mode: bool = True):
            super().train(mode)
            quiet_random_layers(self)
            return self

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = loss_of(self.net, batch, self.dict_batch)
            self.losses.append(loss.detach())
            return loss

        def on_after_backward(self) -> None:
            if self.step0_grads is None:
                self.step0_grads = {n: None if p.grad is None else p.grad.detach().clone()
                                    for n, p in self.net.named_parameters()}

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    return ZooModule


def _fit(net: torch.nn.Module, spec: Spec, batches: list[Any], callback: Any, max_steps: int, precision: str = "32-true"):
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    module = _module_class()(net, spec.dict_batch).train()  # Lightning keeps each submodule's mode: quiet them here
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=max_steps, precision=precision, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=[callback] if callback else [])
    trainer.fit(module, DataLoader([clone_batch(b) for b in batches], batch_size=None))
    return module


def _guardrails_of(callback: Any) -> str:
    """Which known-fault workarounds the callback applied (its ``guardrails`` records), in a few words."""
    records = getattr(callback, "guardrails", None) or []
    return "; ".join(f"{getattr(r, 'fault', r)} ({len(getattr(r, 'modules', ()))} modules)" for r in records)


def _conv_layout(net: torch.nn.Module) -> str:
    from cltrain.layout import CONV_TYPES, is_channels_last

    weights = [m.weight for m in net.modules() if isinstance(m, CONV_TYPES) and m.weight.dim() in (4, 5)]
    return f"{sum(is_channels_last(w) for w in weights)}/{len(weights)}"


def _time_training(runs: dict[str, tuple[torch.nn.Module, Any]], dict_batch: bool, dtype: torch.dtype | None,
                   rounds: int, min_window: float, warmup: int = 1) -> dict[str, float]:
    """Median training steps/s of each ``(net, batch)``, timed in interleaved rounds of the same
    number of steps (enough for ``min_window`` seconds on the faster one)."""
    from cltrain.autolayout import autocast_for

    optimizers = {k: torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9) for k, (net, _) in runs.items()}

    def steps(key: str, n: int) -> float:
        net, batch = runs[key]
        start = time.perf_counter()
        for _ in range(n):
            optimizers[key].zero_grad(set_to_none=True)
            with autocast_for("cpu", dtype):
                loss = loss_of(net, batch, dict_batch)
            loss.backward()
            optimizers[key].step()
        return time.perf_counter() - start

    for key in runs:
        steps(key, warmup)
    per_step = min(steps(key, 1) for key in runs)
    n = max(1, math.ceil(min_window / max(per_step, 1e-9)))
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        for key in runs if r % 2 == 0 else reversed(list(runs)):
            rates[key].append(n / steps(key, n))
    return {k: statistics.median(v) for k, v in rates.items()}


def _speed_runs(nets: dict[str, torch.nn.Module], batch: Any, dtype: torch.dtype | None):
    """Each layout's net with its own copy of ``batch`` (in ``dtype``), the channels_last one converted."""
    from cltrain.loops import convert_batch

    cast = batch_to(batch, dtype) if dtype is not None else batch
    return {"contiguous": (nets["contiguous"], clone_batch(cast)),
            "channels_last": (nets["channels_last"], convert_batch(clone_batch(cast)))}


def _parity(result: dict[str, Any], grads: dict[str, dict], losses: dict[str, float], prefix: str = "") -> None:
    """Loss and gradient verdict of ``grads["channels_last"]`` into ``result``: against ``"float64"``, with
    ``"contiguous"`` and ``"native"`` (NCHW fp32 with and without oneDNN) as the fp32 noise; or, without
    float64, against ``"contiguous"`` with ``"native"`` as the noise."""
    reference = "float64" if "float64" in grads else "contiguous"  # without float64, the Trainer's NCHW run
    exact, base = grads[reference], losses[reference]
    err_cl = grad_errors(grads["channels_last"], exact)
    fp32 = {k: grad_errors(grads[k], exact) for k in ("contiguous", "native", "native_cl") if k in grads and k != reference}
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
    rel = lambda key: abs(losses[key] - base) / max(abs(base), 1e-12)  # noqa: E731
    loss_err = rel("channels_last")
    loss_noise = max(rel(k) for k in ("contiguous", "native", "native_cl") if k in losses and k != reference)
    if loss_err > OK_BELOW and loss_err > 10 * loss_noise:  # the loss is one number: the same rule, stricter
        verdict.update(verdict="MISS", loss_miss=True)
    verdict["why"] = _why(verdict)
    result[prefix + "grad"] = verdict
    result[prefix + "loss_err_cl"], result[prefix + "loss_noise"] = loss_err, loss_noise


def _compile_phase(spec: Spec, net0: torch.nn.Module, batches: list[Any], speed_batch: Any,
                   exact: dict[str, tuple[dict, float]], dtypes: list[tuple[str, torch.dtype | None]],
                   args: argparse.Namespace, result: dict) -> None:
    """Parity and speed of ``torch.compile``-d copies, NCHW and converted by :func:`cltrain.loops.convert_model`."""
    from cltrain.loops import convert_batch, convert_model

    nets, grads, losses = {}, {}, {}
    for layout in ("contiguous", "channels_last"):
        net = quiet_random_layers(copy.deepcopy(net0).train())
        if layout == "channels_last":
            convert_model(net)
        nets[layout] = torch.compile(net)
        batch = clone_batch(batches[0])
        start = time.perf_counter()
        batch = convert_batch(batch) if layout == "channels_last" else batch
        grads[layout], losses[layout] = _step_grads(nets[layout], spec, batch)
        result[f"compile_seconds_{layout}"] = round(time.perf_counter() - start, 1)
    for key, value in (exact or {}).items():
        grads[key], losses[key] = value
    _parity(result, grads, losses, prefix="compile_")
    for label, dtype in dtypes:
        result[f"compile_speed_{label}"] = _time_training(_speed_runs(nets, speed_batch, dtype), spec.dict_batch, dtype,
                                                          args.rounds, args.min_window, warmup=2)


def child(spec: Spec, args: argparse.Namespace, out: Path) -> None:
    """Measure one model; ``out`` (JSON) is rewritten after every phase, so a crash leaves what was done
    and the phase it died in."""
    import warnings

    from cltrain import ChannelsLast

    warnings.filterwarnings("ignore")
    result: dict[str, Any] = {"key": spec.key, "family": spec.family, "size": spec.size, "note": spec.note}
    clock = [time.perf_counter()]

    def phase(name: str) -> None:
        if "phase" in result:  # seconds spent in the phase that ends here
            result.setdefault("phase_seconds", {})[result["phase"]] = round(time.perf_counter() - clock[0], 1)
        clock[0] = time.perf_counter()
        result["phase"] = name
        atomic_write_text(out, json.dumps(result, default=str))

    phase("build")
    torch.manual_seed(0)
    net0 = build(spec)
    result["params_m"] = round(sum(p.numel() for p in net0.parameters()) / 1e6, 1)
    if result["params_m"] > args.max_params:
        result["skipped"] = f"{result['params_m']:.0f}M parameters: over --max-params {args.max_params:g}M"
        return phase("done")
    gen = torch.Generator().manual_seed(0)
    batches = [make_batch(spec, args.batch, gen) for _ in range(2)]

    phase("references")
    exact = _references(spec, net0, batches[0], result)
    grads: dict[str, dict] = {k: g for k, (g, _) in exact.items()}
    losses: dict[str, float] = {k: loss for k, (_, loss) in exact.items()}

    nets = {}
    for layout, callback in (("contiguous", None), ("channels_last", ChannelsLast())):
        phase(layout)
        module = _fit(copy.deepcopy(net0), spec, batches, callback, max_steps=2)
        nets[layout] = module.train().net
        losses[layout] = float(module.losses[0])
        grads[layout] = module.step0_grads
        result[f"losses_{layout}"] = [float(v) for v in module.losses]
        result[f"trains_{layout}"] = len(module.losses) == 2 and all(math.isfinite(v) for v in result[f"losses_{layout}"])
        if callback is not None:
            result["conv_weights_cl"] = _conv_layout(module.net)
            result["guardrails"] = _guardrails_of(callback)
    _parity(result, grads, losses)
    del grads, losses

    dtypes: list[tuple[str, torch.dtype | None]] = [("fp32", None)] if "fp32" in args.dtypes else []
    if "bf16" in args.dtypes and _native_bf16():
        dtypes.append(("bf16", torch.bfloat16))
    speed_batch = batches[0] if args.quick else make_batch(spec, args.speed_batch, torch.Generator().manual_seed(1))
    for label, dtype in dtypes if not args.no_speed else []:
        phase(f"speed {label}")
        result[f"speed_{label}"] = _time_training(_speed_runs(nets, speed_batch, dtype), spec.dict_batch, dtype,
                                                  args.rounds, args.min_window)
    del nets

    if not args.no_auto:
        image = speed_batch["pixel_values"] if spec.dict_batch else speed_batch[0]
        for label, dtype in dtypes:
            phase(f"auto {label}")
            callback = ChannelsLast(mode="auto", input_shape=tuple(image.shape), auto_steps=2 if args.quick else 3)
            _fit(copy.deepcopy(net0), spec, batches, callback, max_steps=1,
                 precision="32-true" if dtype is None else "bf16-mixed")
            result[f"auto_{label}"] = callback.layout
            result[f"auto_{label}_ms"] = {k: round(v * 1e3, 1) for k, v in (callback.timings or {}).items()}

    if spec.compile and not args.no_compile:
        phase("compile")
        _compile_phase(spec, net0, batches, speed_batch, exact, dtypes, args, result)
    phase("done")


def _references(spec: Spec, net0: torch.nn.Module, batch: Any, result: dict) -> dict[str, tuple[dict, float]]:
    """Step-0 gradients and loss of ``net0`` on ``batch`` beside the Trainer's runs: ``"native"`` and
    ``"native_cl"`` (fp32 with oneDNN disabled, NCHW and channels_last: other correct fp32 kernels, to
    gauge fp32 noise in each layout), ``"float64"`` (the exact ones) and ``"float64_cl"`` (float64 in
    channels_last: the layout's own kernels must give the same numbers). A model that cannot run in
    float64 gets no float64 entries; why goes in ``result``."""
    from cltrain.layout import to_channels_last
    from cltrain.loops import convert_batch

    def cl(net: torch.nn.Module) -> torch.nn.Module:  # no guardrails: none of these runs reaches oneDNN
        return to_channels_last(net)

    refs = {}
    with torch.backends.mkldnn.flags(enabled=False):
        for key, layout in (("native", lambda n: n), ("native_cl", cl)):
            b = clone_batch(batch)
            refs[key] = _step_grads(layout(quiet_random_layers(copy.deepcopy(net0).train())), spec,
                                    convert_batch(b) if key.endswith("_cl") else b)
    try:
        for key, layout in (("float64", lambda n: n), ("float64_cl", cl)):
            b = batch_to(batch, torch.float64)
            refs[key] = _step_grads(layout(quiet_random_layers(copy.deepcopy(net0).double().train())), spec,
                                    convert_batch(b) if key.endswith("_cl") else b)
    except Exception as err:  # noqa: BLE001 - some models hard-code float32 somewhere: CL is compared with NCHW then
        result["float64_error"] = f"{type(err).__name__}: {err}".splitlines()[0][:200]
        refs.pop("float64", None)
    return refs


# ---- the sweep, in the parent process -----------------------------------------------------------


def machine() -> dict[str, Any]:
    """The CPU, its flags that matter here, and the software versions."""
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                info["flags"] = [f for f in ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile",
                                             "amx_bf16") if f in have]
                break
    except OSError:
        pass
    import lightning
    import torchvision

    versions = {"torch": torch.__version__, "torchvision": torchvision.__version__, "lightning": lightning.__version__}
    for name in ("timm", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = "missing"
    info.update(logical_cpus=os.cpu_count(), torch_threads=torch.get_num_threads(),
                capability=torch.backends.cpu.get_cpu_capability(), native_bf16=_native_bf16(),
                onednn=next(iter(re.findall(r"(?:MKL-DNN|oneDNN) v([\d.]+)", torch.__config__.show())), ""),
                versions=versions, emulation={k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
                                                 if k in os.environ})
    return info


def _machine_line(m: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    emulated = f"; emulating {m['emulation']}" if m["emulation"] else ""
    return (f"CPU {m['cpu']} ({m['logical_cpus']} logical, torch threads {m['torch_threads']}); flags "
            f"{' '.join(m['flags']) or 'none of avx2/avx512/amx'}; ATen capability {m['capability']}; native bf16 "
            f"{'yes' if m['native_bf16'] else 'no'}{emulated}; oneDNN {m['onednn'] or '?'}; {versions}")


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def run_one(spec: Spec, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """One model in a subprocess; a crash, a raise or a timeout comes back as the row's ``status``."""
    log = log_dir / f"{spec.key.replace(':', '_')}.log"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", spec.key, "--result", str(out),
               *_child_options(args)]
        start = time.perf_counter()
        with open(log, "w") as log_file:
            try:
                proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, timeout=_timeout(spec, args))
                code: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                code = None
        result = json.loads(out.read_text()) if out.exists() else {"key": spec.key, "family": spec.family}
    result["seconds"] = round(time.perf_counter() - start, 1)
    phase = result.get("phase", "start")
    if code == 0 and phase == "done":
        result["status"] = "skipped" if "skipped" in result else "ok"
    elif code is None:
        result["status"] = f"timeout after {_timeout(spec, args)}s in {phase}"
    elif code < 0:
        result["status"] = f"crashed ({_signal_name(code)}) in {phase}"
    else:
        result["status"] = f"raised in {phase}: {_last_error(log)}"
    result["log"] = str(log)
    return result


def _timeout(spec: Spec, args: argparse.Namespace) -> int:
    return args.timeout * (3 if spec.compile and not args.no_compile else 1)  # 4 compilations: minutes each on a CPU


def _last_error(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":", 1)[0] or "Exception" in line.split(":", 1)[0]]
    return (errors or lines or ["(no output)"])[-1][:200]


def _child_options(args: argparse.Namespace) -> list[str]:
    opts = ["--batch", str(args.batch), "--speed-batch", str(args.speed_batch), "--rounds", str(args.rounds),
            "--min-window", str(args.min_window), "--max-params", str(args.max_params), "--dtypes", args.dtypes]
    return opts + [f"--{flag.replace('_', '-')}" for flag in ("quick", "no_speed", "no_auto", "no_compile") if getattr(args, flag)]


# ---- the report ---------------------------------------------------------------------------------


def _fmt_err(value: Any) -> str:
    if value is None:
        return ""
    return "inf" if value == math.inf else f"{value:.1e}"


def _fmt_speed(speed: dict[str, float] | None) -> str:
    if not speed:
        return ""
    return f"{speed['channels_last']:.2f} / {speed['contiguous']:.2f} = **{speed['channels_last'] / speed['contiguous']:.2f}x**"


def _fmt_grad(grad: dict[str, Any]) -> str:
    if not grad:
        return ""
    cell = f"{_fmt_err(grad.get('err_cl'))} / {_fmt_err(grad.get('err_nc'))}"
    if grad.get("verdict") != "ok" and grad.get("grad_scale") is not None:
        cell += f" (its gradient {grad['grad_scale']:.0e} of the largest)"
    return cell + (f": {grad['why']}" if grad.get("why") else "")


def _row_cells(r: dict[str, Any]) -> list[str]:
    grad = r.get("grad") or {}
    status = r.get("status", "")
    trains = "" if "trains_contiguous" not in r else (
        f"{'yes' if r['trains_contiguous'] else 'NO'} / {'yes' if r.get('trains_channels_last') else 'NO'}")
    verdict = grad.get("verdict", "")
    if grad and "float64_error" in r:
        verdict += " (vs NCHW fp32)"
    if "compile_grad" in r:
        verdict += f"; compiled: {r['compile_grad']['verdict']}"
    note = "; ".join(filter(None, [r.get("note", ""), r.get("skipped", ""),
                                   f"no float64: {r['float64_error']}" if "float64_error" in r else ""]))
    speed = _fmt_speed(r.get("speed_fp32"))
    bf16 = _fmt_speed(r.get("speed_bf16"))
    if "compile_speed_fp32" in r:
        speed += f"<br>compiled {_fmt_speed(r['compile_speed_fp32'])}"
        bf16 += f"<br>compiled {_fmt_speed(r.get('compile_speed_bf16'))}" if r.get("compile_speed_bf16") else ""
    auto = " / ".join(r[k] or "?" for k in ("auto_fp32", "auto_bf16") if k in r)
    return [
        f"`{r['key']}`", r.get("family", ""), str(r.get("params_m", "")), status if status != "ok" else "ok", trains,
        f"{_fmt_err(r['loss_err_cl'])} / {_fmt_err(r.get('loss_noise'))}" if "loss_err_cl" in r else "", _fmt_grad(grad),
        f"`{grad.get('worst_param', '')}`" if grad.get("worst_param") else "", verdict, r.get("conv_weights_cl", ""),
        r.get("guardrails", ""), speed, bf16, auto, note,
    ]


HEADER = ["model", "family", "params (M)", "run", "trains NCHW / CL", "step-0 loss err CL / fp32 noise",
          "worst grad err CL / fp32 noise (vs float64)", "worst parameter", "gradients", "conv weights CL", "guardrail",
          "fp32 steps/s CL / NCHW", "bf16 steps/s CL / NCHW", "auto fp32 / bf16", "note"]


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """A few lines: how many ran, crashed, raised, missed; the speed ratios; auto's choices."""
    ran = [r for r in rows if r.get("status") != "skipped"]
    crashed = [r["key"] for r in ran if r.get("status", "").startswith(("crashed", "timeout"))]
    raised = [r["key"] for r in ran if r.get("status", "").startswith("raised")]
    cl_fail = [r["key"] for r in ran if r.get("trains_contiguous") and not r.get("trains_channels_last")]
    verdicts = [(r.get("grad") or {}).get("verdict") for r in ran]
    lines = [
        f"- {len(rows)} models: {len(ran)} ran, {len(rows) - len(ran)} skipped (over --max-params).",
        f"- Crashed or timed out: {len(crashed)}{': ' + ', '.join(crashed) if crashed else ''}. "
        f"Raised: {len(raised)}{': ' + ', '.join(raised) if raised else ''}. "
        f"Trained without ChannelsLast but not with it: {len(cl_fail)}{': ' + ', '.join(cl_fail) if cl_fail else ''}.",
        f"- Gradients under ChannelsLast: {verdicts.count('ok')} ok (<= {OK_BELOW:g}), {verdicts.count('numerics')} "
        f"numerics, {verdicts.count('MISS')} MISS.",
    ]
    for label in ("fp32", "bf16"):
        ratios = [r[f"speed_{label}"]["channels_last"] / r[f"speed_{label}"]["contiguous"] for r in ran
                  if r.get(f"speed_{label}")]
        if ratios:
            faster = sum(x > 1.0 for x in ratios)
            lines.append(f"- {label} CL / NCHW training steps/s: median {statistics.median(ratios):.2f}x "
                         f"(range {min(ratios):.2f}-{max(ratios):.2f}); CL faster for {faster} of {len(ratios)}.")
        picks = [r[f"auto_{label}"] for r in ran if r.get(f"auto_{label}")]
        if picks:
            lines.append(f"- mode=\"auto\" ({label}) kept channels_last for {picks.count('channels_last')} of "
                         f"{len(picks)} models, contiguous for {picks.count('contiguous')}.")
    return lines


def markdown(rows: list[dict[str, Any]], m: dict[str, Any], command: str, args: argparse.Namespace) -> str:
    escape = lambda c: str(c).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    table = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    table += ["| " + " | ".join(escape(c) for c in _row_cells(r)) + " |" for r in rows]
    return "\n".join([
        "# Model zoo under ChannelsLast",
        "",
        f"Made by `{command}` ({time.strftime('%Y-%m-%d')}).",
        "",
        f"Machine: {_machine_line(m)}.",
        f"Load average at the start: {m.get('load_start', '?')}, at the end: {m.get('load_end', '?')}.",
        "",
        f"Parity: batch {args.batch} at each model's size (128 px unless noted), one initialisation, the same two "
        "batches, a real Lightning Trainer with and without `ChannelsLast()`; step-0 gradients of every parameter "
        "against float64 (`scripts/zoo_sweep.py` says how; MISS = O(1) off where NCHW fp32 is not). Speed: "
        f"training steps/s (forward, cross-entropy, backward, SGD) at batch "
        f"{args.batch if args.quick else args.speed_batch}, median of {args.rounds} interleaved rounds in one "
        "process; ratio = CL / NCHW. auto = what `ChannelsLast(mode=\"auto\")` kept.",
        "",
        "## Summary",
        "",
        *summary(rows),
        "",
        "## Every model",
        "",
        *table,
        "",
    ])


def _csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["key", "family", "params_m", "status", "trains_contiguous", "trains_channels_last", "loss_err_cl", "loss_noise",
                     "grad_verdict", "grad_why", "grad_err_cl", "grad_noise", "grad_scale", "layout_err_f64", "worst_param", "conv_weights_cl", "guardrails",
                     "fp32_cl", "fp32_nchw", "bf16_cl", "bf16_nchw", "auto_fp32", "auto_bf16", "compile_grad_verdict",
                     "compile_fp32_cl", "compile_fp32_nchw", "seconds", "note"])
    for r in rows:
        grad = r.get("grad") or {}
        speed = lambda k, layout: (r.get(k) or {}).get(layout, "")  # noqa: E731
        writer.writerow([r["key"], r.get("family", ""), r.get("params_m", ""), r.get("status", ""),
                         r.get("trains_contiguous", ""), r.get("trains_channels_last", ""), r.get("loss_err_cl", ""),
                         r.get("loss_noise", ""),
                         grad.get("verdict", ""), grad.get("why", ""), grad.get("err_cl", ""), grad.get("err_nc", ""),
                         grad.get("grad_scale", ""), grad.get("layout_err_f64", ""),
                         grad.get("worst_param", ""), r.get("conv_weights_cl", ""), r.get("guardrails", ""),
                         speed("speed_fp32", "channels_last"), speed("speed_fp32", "contiguous"),
                         speed("speed_bf16", "channels_last"), speed("speed_bf16", "contiguous"),
                         r.get("auto_fp32", ""), r.get("auto_bf16", ""), (r.get("compile_grad") or {}).get("verdict", ""),
                         speed("compile_speed_fp32", "channels_last"), speed("compile_speed_fp32", "contiguous"),
                         r.get("seconds", ""), r.get("note", "")])
    return buf.getvalue()


def write_outputs(out: Path, rows: list[dict[str, Any]], m: dict[str, Any], command: str,
                  args: argparse.Namespace) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out.with_suffix(".json"), json.dumps({"machine": m, "command": command, "rows": rows}, indent=1,
                                                           default=str))
    atomic_write_text(out.with_suffix(".csv"), _csv(rows))
    atomic_write_text(out.with_suffix(".md"), markdown(rows, m, command, args))


# ---- command line -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="comma-separated keys (timm:resnet50) or names (resnet50); default all")
    p.add_argument("--fast", action="store_true", help=f"the quick subset: {', '.join(FAST)} (--quick, --no-speed, fp32 only)")
    p.add_argument("--quick", action="store_true", help="speed timed on the parity batch, 1 round, no compile")
    p.add_argument("--list", action="store_true", help="print the zoo and exit")
    p.add_argument("--out", type=Path, default=Path("docs/zoo"), help="output stem: <out>.md, .json, .csv")
    p.add_argument("--log-dir", type=Path, default=Path("bench_out/zoo/logs"), help="one log per model")
    p.add_argument("--resume", action="store_true", help="keep the rows already in <out>.json and run the others")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per model, 3x with torch.compile (default 1200)")
    p.add_argument("--batch", type=int, default=2, help="parity batch size (default 2)")
    p.add_argument("--speed-batch", type=int, default=8, help="speed batch size (default 8)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per layout (default 5)")
    p.add_argument("--min-window", type=float, default=0.5, help="seconds per timed round, at least (default 0.5)")
    p.add_argument("--max-params", type=float, default=150.0, help="skip models larger than this, millions (150)")
    p.add_argument("--dtypes", default="fp32,bf16", help="speed and auto in these (bf16 only where native; default fp32,bf16)")
    p.add_argument("--no-speed", action="store_true", help="do not time training steps")
    p.add_argument("--no-auto", action="store_true", help="do not run mode='auto'")
    p.add_argument("--no-compile", action="store_true", help="do not run the torch.compile rows")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.fast:
        args.quick, args.dtypes, args.no_speed = True, "fp32", True
        args.models = args.models or ",".join(FAST)
    if args.quick:
        args.rounds, args.min_window, args.no_compile = 1, 0.0, True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(find([args.child])[0], args, args.result)
        return 0
    try:
        specs = find(args.models.split(",")) if args.models else all_specs()
    except ValueError as err:
        print(f"zoo_sweep: error: {err}", file=sys.stderr)
        return 2
    if args.list:
        for s in specs:
            print(f"{s.key:40s} {s.family:26s} {s.size:4d}px {s.note}")
        return 0
    command = "python scripts/zoo_sweep.py " + " ".join(sys.argv[1:] if argv is None else argv)
    m = machine()
    m["load_start"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(_machine_line(m), flush=True)
    rows: list[dict[str, Any]] = []
    if args.resume and args.out.with_suffix(".json").exists():
        rows = [r for r in json.loads(args.out.with_suffix(".json").read_text())["rows"]
                if r["key"] in {s.key for s in specs}]
    done = {r["key"] for r in rows}
    args.log_dir.mkdir(parents=True, exist_ok=True)
    for i, spec in enumerate(s for s in specs if s.key not in done):
        result = run_one(spec, args, args.log_dir)
        rows.append(result)
        grad = (result.get("grad") or {}).get("verdict", "")
        print(f"[{len(rows)}/{len(specs)}] {spec.key}: {result['status']} {grad} {result['seconds']}s", flush=True)
        m["load_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
        rows.sort(key=lambda r: [s.key for s in specs].index(r["key"]))
        write_outputs(args.out, rows, m, command, args)
    print("\n".join(summary(rows)))
    print(f"wrote {args.out.with_suffix('.md')}, .json, .csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
