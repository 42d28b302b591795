"""Precision that picks itself, and fused optimizers that are safe under fp16 loss scaling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cltrain.app.module import build_optimizer
from cltrain.precision import auto_precision, cpu_bf16_support, loss_scaling_safe

AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}
REPO = Path(__file__).resolve().parents[2]


def _overflowed_step(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(param.sum() * float("inf")).backward()
    scaler.step(optimizer)
    scaler.update()


def test_fused_sgd_with_momentum_fails_the_probe_and_really_writes_its_state_on_an_overflow() -> None:
    assert not loss_scaling_safe(torch.optim.SGD, "cpu", **SGD)
    param = torch.nn.Parameter(torch.ones(8, 8))
    fused = torch.optim.SGD([param], fused=True, **SGD)
    _overflowed_step(fused, param)
    assert "momentum_buffer" in fused.state[param]  # the skipped step left a buffer the next step trusts


@pytest.mark.parametrize("optimizer,kwargs", [(torch.optim.AdamW, {"lr": 1e-3}), (torch.optim.SGD, {"lr": 0.1})])
def test_optimizers_that_honour_the_overflow_flag_pass_the_probe(optimizer: type, kwargs: dict) -> None:
    assert loss_scaling_safe(optimizer, "cpu", **kwargs)  # AdamW, and SGD without momentum (no buffer)


def test_the_app_builds_an_unfused_sgd_under_loss_scaling_and_an_overflow_leaves_it_untouched() -> None:
    param = torch.nn.Parameter(torch.linspace(-1, 1, 64).reshape(8, 8))
    before = param.detach().clone()
    optimizer, note = build_optimizer([param], "sgd", torch.device("cpu"), fused=True, loss_scaling=True, **SGD)
    assert not optimizer.defaults["fused"] and "unfused SGD" in note and "host sync" in note
    _overflowed_step(optimizer, param)
    assert torch.equal(param.detach(), before) and not optimizer.state[param]
    # without loss scaling (bf16, fp32) the fused step is kept, and AdamW keeps it under loss scaling too
    assert build_optimizer([param], "sgd", torch.device("cpu"), fused=True, loss_scaling=False, **SGD)[0].defaults["fused"]
    adamw, note = build_optimizer([param], "adamw", torch.device("cpu"), fused=True, loss_scaling=True, lr=1e-3)
    assert adamw.defaults["fused"] and note == ""


def _in_a_fresh_process(code: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_auto_precision_is_fp32_where_kernels_are_held_to_avx2() -> None:
    code = "import torch; from cltrain.precision import auto_precision; c = auto_precision(torch.device('cpu')); print(c.flag, '|', c.reason)"
    flag, reason = _in_a_fresh_process(code, AVX2).split(" | ")
    assert flag == "32-true" and "AVX2" in reason
    flag, reason = _in_a_fresh_process(code, {"ONEDNN_MAX_CPU_ISA": "AVX2"}).split(" | ")
    assert flag == "32-true" and "ONEDNN_MAX_CPU_ISA" in reason
    native, _ = cpu_bf16_support()
    assert auto_precision(torch.device("cpu")).flag == ("bf16-mixed" if native else "32-true")


def _smoke_precision(tmp_path: Path, env: dict[str, str]) -> tuple[dict, str]:
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "experiment=smoke", f"run_dir={run}", "device=cpu",
                          "trainer.limit_train_batches=1", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false",
                          f"data.root={tmp_path / 'data' / 'demo'}", "data.demo.any_root=true",
                          "data.demo.train_per_class=2", "data.demo.val_per_class=1", "data.demo.image_size=[48,40]"],
                         cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads((run / "metrics.json").read_text()), out.stdout + out.stderr


@pytest.mark.slow
def test_the_default_smoke_run_trains_in_fp32_under_avx2_emulation(tmp_path: Path) -> None:
    metrics, output = _smoke_precision(tmp_path, AVX2)
    assert metrics["amp"] == "auto" and metrics["precision"] == "32-true"
    assert "AVX2" in metrics["precision_reason"] and "cltrain: precision 32-true (amp=auto:" in output


@pytest.mark.slow
@pytest.mark.skipif(not cpu_bf16_support()[0], reason="this CPU has no native bf16")
def test_the_default_smoke_run_trains_in_bf16_on_a_native_bf16_cpu(tmp_path: Path) -> None:
    metrics, _ = _smoke_precision(tmp_path, {})
    assert metrics["precision"] == "bf16-mixed" and "natively" in metrics["precision_reason"]
    assert metrics["optimizer"] == {"name": "SGD", "fused": False, "note": None}
