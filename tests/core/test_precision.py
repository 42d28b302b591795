"""Precision that picks itself, and fused optimizers that are safe under fp16 loss scaling."""

from __future__ import annotations

import copy
import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cltrain.app.module import ImageClassifier, build_optimizer
from cltrain.precision import (
    PrecisionChoice,
    auto_precision,
    cpu_bf16_support,
    loss_scaling_safe,
    zero_momentum_buffers,
)
from tests.helpers import warm

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


def test_zero_momentum_buffers_make_the_fused_sgd_pass_the_probe() -> None:
    before = torch.are_deterministic_algorithms_enabled()  # an earlier Trainer(deterministic=True) may have set it
    assert loss_scaling_safe(torch.optim.SGD, "cpu", prepare=zero_momentum_buffers, **SGD)
    assert loss_scaling_safe(torch.optim.SGD, "cpu", prepare=zero_momentum_buffers, nesterov=True, **SGD)
    assert torch.are_deterministic_algorithms_enabled() is before  # the probe's NaN-filled allocations ended with it


def _params() -> list[nn.Parameter]:
    # one matrix and one channels_last conv weight: the zero buffers must keep each parameter's strides
    conv = torch.linspace(-1.0, 1.0, 2 * 3 * 2 * 2).reshape(2, 3, 2, 2).to(memory_format=torch.channels_last)
    return [nn.Parameter(torch.linspace(-1.0, 1.0, 64).reshape(8, 8)), nn.Parameter(conv)]


def _scaled_steps(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], loss_factors: list[float],
                  init_scale: float = 2.0**127) -> list[tuple[list[torch.Tensor], list[torch.Tensor | None], float]]:
    """Steps under a real GradScaler; after each, the parameters, their momentum buffers and the scale.

    With the gradients in [1, 3], a scale of 2**127 overflows fp32 on the first step, 2**126 does not,
    and a loss factor of 4 overflows it again."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    weights = [torch.linspace(1.0, 3.0, p.numel()).reshape(p.shape) for p in params]
    history = []
    for factor in loss_factors:
        optimizer.zero_grad(set_to_none=True)
        loss = sum((p * w).sum() for p, w in zip(params, weights)) * factor
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        buffers = [optimizer.state[p].get("momentum_buffer") for p in params]
        history.append(([p.detach().clone() for p in params], [None if b is None else b.clone() for b in buffers],
                        scaler.get_scale()))
    return history


@pytest.mark.parametrize("nesterov", [False, True])
def test_a_zeroed_fused_sgd_steps_like_the_unfused_one_through_a_first_step_overflow(nesterov: bool) -> None:
    kwargs = {**SGD, "nesterov": nesterov}
    fused_params, plain_params = _params(), _params()
    fused = zero_momentum_buffers(torch.optim.SGD(fused_params, fused=True, **kwargs))
    plain = torch.optim.SGD(plain_params, foreach=False, **kwargs)
    factors = [1.0, 1.0, 4.0, 1.0]  # overflow, finite, overflow, finite
    fused_steps, plain_steps = _scaled_steps(fused, fused_params, factors), _scaled_steps(plain, plain_params, factors)
    assert [scale for *_, scale in plain_steps] == [2.0**126, 2.0**126, 2.0**125, 2.0**125]
    assert [scale for *_, scale in fused_steps] == [2.0**126, 2.0**126, 2.0**125, 2.0**125]
    for step, ((p_fused, b_fused, _), (p_plain, b_plain, _)) in enumerate(zip(fused_steps, plain_steps)):
        torch.testing.assert_close(p_fused, p_plain)
        if step == 0:  # the unfused SGD skipped its first step and has no buffer yet
            assert b_plain == [None, None] and all(torch.equal(b, torch.zeros_like(b)) for b in b_fused)
        else:
            torch.testing.assert_close(b_fused, b_plain)
    assert not torch.equal(fused_steps[-1][0][0], _params()[0])  # the finite steps did move the parameters
    assert fused_steps[-1][1][1].stride() == fused_params[1].stride()  # channels_last buffer, as the kernel writes it


def test_dampening_or_no_momentum_gets_no_zero_buffer_and_dampening_stays_unsafe() -> None:
    damped, still = _params(), _params()
    optimizer = zero_momentum_buffers(torch.optim.SGD(
        [{"params": damped, "dampening": 0.1}, {"params": still, "momentum": 0.0}], fused=True, **SGD))
    assert not optimizer.state  # (1 - dampening) * grad is SGD's first step there, not a zero buffer's grad
    assert not loss_scaling_safe(torch.optim.SGD, "cpu", prepare=zero_momentum_buffers, dampening=0.1, **SGD)
    with pytest.raises(TypeError, match="got AdamW"):
        zero_momentum_buffers(torch.optim.AdamW(_params()))


def test_the_app_builds_a_fused_sgd_with_zero_buffers_under_loss_scaling() -> None:
    param = nn.Parameter(torch.linspace(-1, 1, 64).reshape(8, 8))
    before = param.detach().clone()
    optimizer, note = build_optimizer([param], "sgd", torch.device("cpu"), fused=True, loss_scaling=True, **SGD)
    assert optimizer.defaults["fused"] and note == ""
    assert torch.equal(optimizer.state[param]["momentum_buffer"], torch.zeros_like(param))
    _overflowed_step(optimizer, param)
    assert torch.equal(param.detach(), before)
    assert torch.equal(optimizer.state[param]["momentum_buffer"], torch.zeros_like(param))
    # without loss scaling (bf16, fp32) the fused SGD writes its buffers on its first step, and AdamW is kept fused
    plain, note = build_optimizer([param], "sgd", torch.device("cpu"), fused=True, loss_scaling=False, **SGD)
    assert plain.defaults["fused"] and not plain.state and note == ""
    adamw, note = build_optimizer([param], "adamw", torch.device("cpu"), fused=True, loss_scaling=True, lr=1e-3)
    assert adamw.defaults["fused"] and note == ""


@pytest.mark.parametrize("steps_before", [2, 0])
def test_a_state_dict_of_the_unfused_sgd_resumes_in_the_apps_fused_sgd(steps_before: int) -> None:
    # The state dict of the app's unfused SGD; the second parameter gets no gradient before the save, so no buffer
    # is saved for it.
    saved_params = _params()
    unfused, _ = build_optimizer(saved_params, "sgd", torch.device("cpu"), fused=False, loss_scaling=True, **SGD)
    for _ in range(steps_before):
        unfused.zero_grad(set_to_none=True)
        (saved_params[0] ** 2).sum().backward()
        unfused.step()
    saved = io.BytesIO()
    torch.save(unfused.state_dict(), saved)
    state = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    assert len(state["state"]) == (1 if steps_before else 0)
    resumed_params = [nn.Parameter(p.detach().clone()) for p in saved_params]
    resumed, note = build_optimizer(resumed_params, "sgd", torch.device("cpu"), fused=True, loss_scaling=True, **SGD)
    resumed.load_state_dict(state)
    assert note == "" and resumed.param_groups[0]["fused"]  # not the loaded group's fused=None
    assert torch.equal(resumed.state[resumed_params[1]]["momentum_buffer"], torch.zeros_like(resumed_params[1]))
    factors = [1.0, 1.0, 4.0, 1.0]  # overflow, finite, overflow, finite
    for (p_resumed, b_resumed, _), (p_unfused, b_unfused, _) in zip(
            _scaled_steps(resumed, resumed_params, factors), _scaled_steps(unfused, saved_params, factors)):
        torch.testing.assert_close(p_resumed, p_unfused)
        torch.testing.assert_close(b_resumed, [torch.zeros_like(p) if b is None else b
                                               for p, b in zip(p_unfused, b_unfused)])


def _fit_fp16(model: nn.Module, fused: bool, max_steps: int, ckpt_path: Path | None) -> Trainer:
    # Lightning turns 16-mixed into bf16 on the CPU; the plugin keeps fp16 autocast with a CPU GradScaler.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = Trainer(accelerator="cpu", plugins=[plugin], max_steps=max_steps, limit_train_batches=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = ImageClassifier(model, num_classes=4, lr=0.1, warmup_epochs=0, fused=fused)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 8, 8, generator=g), torch.arange(8) % 4)
    trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return trainer


def test_a_checkpoint_of_the_unfused_sgd_resumes_fused_in_a_real_fp16_trainer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4))
    saved = _fit_fp16(model, fused=False, max_steps=2, ckpt_path=None)
    assert not saved.optimizers[0].defaults["fused"] and saved.optimizers[0].state
    ckpt = tmp_path / "unfused.ckpt"
    saved.save_checkpoint(ckpt)
    fused_model, unfused_model = copy.deepcopy(model), copy.deepcopy(model)
    fused = _fit_fp16(fused_model, fused=True, max_steps=4, ckpt_path=ckpt)
    unfused = _fit_fp16(unfused_model, fused=False, max_steps=4, ckpt_path=ckpt)
    assert fused.global_step == unfused.global_step == 4
    assert fused.optimizers[0].param_groups[0]["fused"] and fused.lightning_module.optimizer_note == ""
    torch.testing.assert_close(fused_model.state_dict(), unfused_model.state_dict())
    assert not torch.equal(fused_model[0].weight, model[0].weight)  # the resumed steps did train


def _in_a_fresh_process(code: str, env: dict[str, str]) -> str:
    out = warm.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                   timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_auto_precision_is_fp32_where_kernels_are_held_to_avx2() -> None:
    code = "import torch; from cltrain.precision import auto_precision; c = auto_precision(torch.device('cpu')); print(c.flag, '|', c.reason)"
    native, _ = cpu_bf16_support()
    # on a CPU without bf16 hardware the hardware is the reason, whatever the cap
    flag, reason = _in_a_fresh_process(code, AVX2).split(" | ")
    assert flag == "32-true" and ("AVX2" if native else "no AVX512-BF16") in reason
    flag, reason = _in_a_fresh_process(code, {"ONEDNN_MAX_CPU_ISA": "AVX2"}).split(" | ")
    assert flag == "32-true" and ("ONEDNN_MAX_CPU_ISA" if native else "no AVX512-BF16") in reason
    assert auto_precision(torch.device("cpu")).flag == ("bf16-mixed" if native else "32-true")


@pytest.fixture
def bf16_x86(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """This process on an x86 CPU with AVX512-BF16 and ATen's AVX-512 kernels, whatever this machine is; no cap set."""
    import types

    import cltrain.platform

    # the hardware facts are cached per process: replaced, not cleared
    monkeypatch.setattr(cltrain.platform, "_bf16_hardware", lambda machine: "AVX512-BF16")
    monkeypatch.setattr(cltrain.platform, "_platform", types.SimpleNamespace(machine=lambda: "x86_64"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    for variable in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


@pytest.mark.parametrize("variable", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
def test_either_onednn_variable_turns_native_bf16_off(bf16_x86: pytest.MonkeyPatch, variable: str) -> None:
    assert auto_precision(torch.device("cpu")) == PrecisionChoice("bf16-mixed", "this CPU computes bf16 natively (AVX512-BF16)")
    bf16_x86.setenv(variable, "avx512_core_vnni")  # the widest ISA without bf16 dot products, in any case
    native, reason = cpu_bf16_support()
    assert not native and "AVX512_CORE_VNNI" in reason and variable in reason
    assert auto_precision(torch.device("cpu")).flag == "32-true"
    bf16_x86.setenv(variable, "AVX512_CORE_BF16")  # capped, but not below bf16
    assert cpu_bf16_support()[0]


def test_onednn_max_cpu_isa_wins_over_dnnl_max_cpu_isa(bf16_x86: pytest.MonkeyPatch) -> None:
    bf16_x86.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    bf16_x86.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    assert cpu_bf16_support()[0]  # oneDNN reads ONEDNN_ first


def test_aten_kernels_below_avx512_turn_native_bf16_off(bf16_x86: pytest.MonkeyPatch) -> None:
    bf16_x86.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert cpu_bf16_support() == (False, "PyTorch runs AVX2 kernels here (ATEN_CPU_CAPABILITY), though the CPU has AVX512-BF16")


def test_precision_asks_cltrain_platform() -> None:
    import cltrain.platform
    import cltrain.precision

    assert cltrain.precision.cpu_bf16_support is cltrain.platform.cpu_bf16_support


def _smoke_precision(tmp_path: Path, env: dict[str, str]) -> tuple[dict, str]:
    run = tmp_path / "run"
    out = warm.run([sys.executable, str(REPO / "train.py"), "experiment=smoke", f"run_dir={run}", "device=cpu",
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
    held = "AVX2" if cpu_bf16_support()[0] else "no AVX512-BF16"  # a CPU without bf16 hardware says that instead
    assert held in metrics["precision_reason"] and "cltrain: precision 32-true (amp=auto:" in output


@pytest.mark.slow
@pytest.mark.skipif(not cpu_bf16_support()[0], reason="this CPU has no native bf16")
def test_the_default_smoke_run_trains_in_bf16_on_a_native_bf16_cpu(tmp_path: Path) -> None:
    metrics, _ = _smoke_precision(tmp_path, {})
    assert metrics["precision"] == "bf16-mixed" and "natively" in metrics["precision_reason"]
    assert metrics["optimizer"] == {"name": "SGD", "fused": False, "note": None}


def test_every_door_says_once_that_bf16_training_is_emulated_on_this_cpu(bf16_x86, tmp_path, caplog) -> None:
    from cltrain import ChannelsLast, precision
    from cltrain.loops import ChannelsLastRun
    from tests.helpers.plain_modules import Classifier, ConvStack, loader

    def run(dtype) -> list[str]:
        caplog.clear()
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2))
        model(torch.randn(1, 3, 8, 8))
        ChannelsLastRun(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=dtype).end()
        return [r.getMessage() for r in caplog.records if "without native bf16" in r.getMessage()]

    assert run(torch.bfloat16) == []  # native here
    bf16_x86.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert run(None) == []  # fp32
    said = run(torch.bfloat16)
    assert len(said) == 1 and said[0].startswith("ChannelsLast: training in bf16 on a CPU without native bf16 (oneDNN is "
                                                 "limited to AVX2") and "14.5x slower" in said[0], said
    assert run(torch.bfloat16) == []  # once per process
    precision._EMULATED_SAID.clear()
    caplog.clear()
    trainer = Trainer(accelerator="cpu", precision="bf16-mixed", max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[ChannelsLast(layout="channels_last")],
                      default_root_dir=tmp_path)
    with pytest.warns(UserWarning) as warned:
        trainer.fit(Classifier(ConvStack()), loader())
    assert sum("ChannelsLast: training in bf16 on a CPU without native bf16" in str(w.message) for w in warned) == 1


def test_a_float64_fit_passes_the_check_and_races_as_fp64() -> None:
    # "64-true": torch's own Conv2d and BatchNorm2d fell back to NCHW (float32 signatures against a float64 noise
    # floor), and the race was keyed "fp32", so an fp32 run took a float64 run's decision
    from lightning.pytorch import LightningModule

    from cltrain import ChannelsLast

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2),
                                     nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    data = DataLoader(TensorDataset(torch.randn(16, 3, 32, 32), torch.randint(0, 2, (16,))), batch_size=8)
    callback = ChannelsLast()
    Trainer(precision="64-true", max_steps=2, callbacks=[callback], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False).fit(Net(), data)
    assert callback.layout_checks["train"].verdict == "passed", callback.layout_checks["train"]
    assert callback.session._key[1] == "fp64"
