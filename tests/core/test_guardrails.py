"""Guardrails against known-bad backend kernels (cltrain.guardrails), each fault in its own process.

Every entry of KNOWN_FAULTS has a test that shows the fault without the workaround (a crash, a hang, or
wrong gradients; skipped with the reason where this machine does not show it) and one that shows the
workaround gives reference gradients. The cases run in tests/helpers/guard_cases.py and scripts/repro/.
"""

from __future__ import annotations

import copy
import io
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from cltrain import is_channels_last, to_channels_last
from cltrain.guardrails import (
    KNOWN_FAULTS,
    Platform,
    SubsampledConv2d,
    apply_guardrails,
    current_platform,
    find_hazards,
)
from tests.helpers import warm

HERE = Path(__file__).resolve().parents[1] / "helpers"
REPRO = Path(__file__).resolve().parents[2] / "scripts" / "repro"  # standalone files, run by path
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
X86_ONEDNN = platform.machine() in ("x86_64", "AMD64") and torch.backends.mkldnn.is_available()
needs_x86_onednn = pytest.mark.skipif(not X86_ONEDNN, reason="the faults are in oneDNN's x86 kernels")
ONE_BY_ONE, CONV3D = (f.key for f in KNOWN_FAULTS)


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess | None:
    """Run ``python args`` with this checkout importable; ``None`` when it outlives ``timeout`` (a hang)."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
               "PYTHONWARNINGS": "ignore", **(env or {})}
    try:
        return warm.run([sys.executable, *args], env=environ, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def case(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> dict:
    proc = run([str(HERE / "guard_cases.py"), *args], env, timeout)
    assert proc is not None, f"guard_cases.py {' '.join(args)} hung"
    assert proc.returncode == 0, f"guard_cases.py {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plat(isa: str, device: str = "cpu") -> Platform:
    flags = frozenset({"avx2", "avx512f"} if isa == "avx512" else {"avx2"})
    return Platform(device, "x86_64", (2, 14, 1), (3, 12, 0), isa.upper(), None, flags)


# ---- the table's predicates and the platform ----------------------------------------------------------------


def test_channel_block_follows_the_isa_onednn_may_use(monkeypatch):
    assert plat("avx512").channel_block == 16 and plat("avx2").channel_block == 8
    capped = Platform("cpu", "x86_64", (2, 14, 1), (3, 12, 0), "AVX512", "AVX2", frozenset({"avx512f"}))
    assert capped.onednn_isa == "avx2"
    unknown = Platform("cpu", "x86_64", (2, 14, 1), (3, 12, 0), "AVX512", None, None)
    assert unknown.channel_block == 16  # no flags: the wider block, the wider fault range
    assert Platform("cpu", "aarch64", (2, 14, 1), (3, 12, 0), "DEFAULT", None, None).onednn_isa == "other"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert current_platform("cpu").channel_block == 8
    assert "oneDNN ISA avx2 (block 8)" in current_platform("cpu").describe()


def test_the_platform_is_the_one_of_cltrain_platform():
    import cltrain.platform

    assert Platform is cltrain.platform.Platform and current_platform is cltrain.platform.current_platform


@pytest.fixture
def avx512_x86(monkeypatch):
    """This process on an x86 CPU with AVX-512 and oneDNN 3.12, whatever this machine is; no cap set."""
    import types

    import cltrain.platform

    # the hardware facts are cached per process: replaced, not cleared
    monkeypatch.setattr(cltrain.platform, "_cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    monkeypatch.setattr(cltrain.platform, "_onednn_version", lambda: (3, 12, 0))
    monkeypatch.setattr(cltrain.platform, "_platform", types.SimpleNamespace(machine=lambda: "x86_64"))
    for variable in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


@pytest.mark.parametrize("variable", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
def test_either_onednn_variable_caps_the_isa_the_guardrails_guard(avx512_x86, variable):
    stem = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2))  # 8 input channels: below the AVX-512 block only
    assert find_hazards(stem, device="cpu") == {ONE_BY_ONE: ["0"]}
    avx512_x86.setenv(variable, "avx2")  # oneDNN's names, in any case
    assert current_platform("cpu").onednn_isa == "avx2" and find_hazards(stem, device="cpu") == {}
    avx512_x86.setenv(variable, "AVX512_CORE_BF16")  # a cap at or above AVX-512 leaves the block at 16
    assert find_hazards(stem, device="cpu") == {ONE_BY_ONE: ["0"]}


def test_onednn_max_cpu_isa_comes_before_dnnl_max_cpu_isa():
    from cltrain.platform import onednn_max_isa

    assert onednn_max_isa({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "DNNL_MAX_CPU_ISA": "AVX2"}) == "AVX512_CORE"
    assert onednn_max_isa({"ONEDNN_MAX_CPU_ISA": "", "DNNL_MAX_CPU_ISA": " avx2 "}) == "AVX2"  # empty: unset
    assert onednn_max_isa({}) is None


@pytest.mark.parametrize("machine", ["x86_64", "AMD64", "amd64", "i386", "i686"])
def test_every_x86_machine_name_is_x86(machine):
    flags = frozenset({"avx512f"})
    assert Platform("cpu", machine, (2, 14, 1), (3, 12, 0), "AVX512", None, flags).onednn_isa == "avx512"


@pytest.mark.parametrize(
    "conv, on_avx512, on_avx2",
    [
        (nn.Conv2d(3, 48, 1, stride=2), True, True),
        (nn.Conv2d(8, 48, 1, stride=2), True, False),
        (nn.Conv2d(15, 48, 1, stride=(1, 2)), True, False),
        (nn.Conv2d(16, 48, 1, stride=2), False, False),
        (nn.Conv2d(3, 48, 1, stride=1), False, False),
        (nn.Conv2d(3, 48, 3, stride=2), False, False),
        (nn.Conv2d(3, 48, 1, stride=2, padding=1), False, False),  # oneDNN's gemm implementation
        (nn.Conv2d(3, 48, 1, stride=2, padding=1, padding_mode="reflect"), True, True),  # padded outside the conv
        (nn.Conv2d(8, 8, 1, stride=2, groups=8), False, False),  # depthwise: another implementation
        (nn.Conv3d(3, 16, 1, stride=2), False, False),  # 3-D: another implementation
        (nn.LazyConv2d(16, 1, stride=2), True, True),  # input channels unknown: guarded
    ],
)
def test_1x1_pattern_matches_the_measured_fault_range(conv, on_avx512, on_avx2):
    fault = KNOWN_FAULTS[0]
    assert fault.matches(conv, plat("avx512")) == on_avx512
    assert fault.matches(conv, plat("avx2")) == on_avx2


def test_no_hazard_off_the_cpu_or_in_the_other_layout():
    model = nn.Sequential(nn.Conv2d(3, 48, 1, stride=2), nn.Conv3d(48, 8, 3, padding=1))
    assert find_hazards(model, device="cuda", dtype=torch.bfloat16) == {}
    assert ONE_BY_ONE not in find_hazards(model, device="cpu", layout="contiguous")
    assert CONV3D not in find_hazards(model, device="cpu", dtype=None)  # fp32: the bf16 fault needs bf16


# ---- the workarounds, in this process (no faulty kernel runs) -----------------------------------------------


@needs_x86_onednn
def test_apply_guardrails_changes_only_the_matching_conv():
    torch.manual_seed(0)  # the weights and input this test's tolerance was set on, whatever ran before in the worker
    model = to_channels_last(nn.Sequential(nn.Conv2d(3, 48, 1, stride=2), nn.ReLU(), nn.Conv2d(48, 48, 3)))
    plain = copy.deepcopy(model)
    records = apply_guardrails(model, device="cpu")
    assert [(r.fault, r.modules) for r in records] == [(ONE_BY_ONE, ("0",))]
    assert "oneDNN #6035" in records[0].line() and records[0].as_dict()["modules"] == ["0"]
    assert type(model[0]) is SubsampledConv2d and type(model[2]) is nn.Conv2d
    assert is_channels_last(model[0].weight) and is_channels_last(model[2].weight)  # layouts unchanged
    assert model.state_dict().keys() == plain.state_dict().keys()
    x = to_channels_last(torch.randn(2, 3, 17, 16))
    with torch.no_grad():  # forward only: the faulty kernel is in the backward
        assert torch.allclose(model(x), plain(x), atol=1e-6) and is_channels_last(model(x))
    apply_guardrails(model, device="cpu")
    assert type(model[0]) is SubsampledConv2d


@needs_x86_onednn
def test_a_conv2d_subclass_keeps_its_forward_and_gets_nchw_instead():
    from tests.helpers.guard_cases import UserConv2d

    model = to_channels_last(nn.Sequential(UserConv2d(3, 48, 1, stride=2), nn.Conv2d(48, 48, 3)))
    apply_guardrails(model, device="cpu")
    assert type(model[0]) is UserConv2d
    assert model[0].weight.stride() == (3, 1, 1, 1) and not is_channels_last(model[0].weight)  # canonical NCHW
    assert is_channels_last(model[1].weight)  # the rest stays channels_last
    seen = []
    model[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].stride()))
    with torch.no_grad():
        out = model(to_channels_last(torch.randn(2, 3, 16, 16)))
    assert seen == [(768, 256, 16, 1)]  # the guarded conv saw NCHW
    assert is_channels_last(out)  # and the next conv's channels_last weight brings the layout back
    apply_guardrails(model, device="cpu")
    assert len(model[0]._forward_pre_hooks) == 2  # ours once, the test's probe once


@needs_x86_onednn
def test_guarded_model_deepcopies_and_pickles():
    from tests.helpers.guard_cases import UserConv2d

    model = to_channels_last(nn.Sequential(nn.Conv2d(1, 8, 1, stride=2), nn.Conv3d(8, 8, 3, padding=1)))
    model.append(UserConv2d(1, 8, 1, stride=2))  # few input channels: a hazard on every x86 ISA
    apply_guardrails(model, device="cpu", dtype=torch.bfloat16)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert type(clone[0]) is SubsampledConv2d and len(clone[1]._forward_hooks) == 1
        assert len(clone[2]._forward_pre_hooks) == 1


@needs_x86_onednn
def test_conv3d_guard_runs_only_shallow_inputs_in_fp32():
    conv = nn.Conv3d(4, 4, 3, padding=1)
    apply_guardrails(conv, device="cpu", dtype=torch.bfloat16)
    with torch.autocast("cpu", torch.bfloat16):
        shallow, deep = conv(torch.randn(1, 4, 2, 6, 6)), conv(torch.randn(1, 4, 8, 6, 6))
        still_on = torch.is_autocast_enabled("cpu")
    assert shallow.dtype == torch.float32 and deep.dtype == torch.bfloat16 and still_on
    with torch.autocast("cpu", torch.bfloat16):
        with pytest.raises(RuntimeError):
            conv(torch.randn(1, 5, 2, 6, 6))  # wrong channels: forward raises inside the guarded call
        assert torch.is_autocast_enabled("cpu")  # the always-called hook turned autocast back on


# ---- oneDNN #6035: the 1x1 strided conv with few input channels ---------------------------------------------


# The repro ends in about 2 s when it crashes or computes; where the fault is a hang, 30 s says so.
REPRO_TIMEOUT = 30


@needs_x86_onednn
@pytest.mark.parametrize("isa, cin", [("native", 3), ("avx2", 7)])
def test_1x1_fault_shows_without_the_guard(isa, cin):
    proc = run([str(REPRO / "onednn_1x1_strided_conv.py"), "--cin", str(cin), "--repeats", "10"],
               AVX2 if isa == "avx2" else None, timeout=REPRO_TIMEOUT)
    if proc is not None and proc.returncode == 0:
        pytest.skip(f"oneDNN #6035 did not show on this machine ({isa}, {cin} input channels): {proc.stdout[:200]}")
    # a hang (None), a crash (negative: the signal) or wrong gradients (1)
    assert proc is None or proc.returncode != 0


@needs_x86_onednn
def test_1x1_fault_gives_silently_wrong_gradients_on_avx2():
    # 8 px on AVX2: no crash, no error, and every other call's weight gradient is off by ~21%, with two threads on a
    # quiet machine. With one thread (a test worker's share, conftest.py), or beside another busy process (a second
    # test worker), the same kernel corrupts the heap and aborts instead: the test then skips; -n 0 sees the gradients
    proc = run([str(REPRO / "onednn_1x1_strided_conv.py"), "--cin", "3", "--cout", "32", "--size", "8",
                "--repeats", "6"], {**AVX2, "OMP_NUM_THREADS": "2"}, timeout=REPRO_TIMEOUT)
    if proc is not None and proc.returncode == 0:
        pytest.skip(f"oneDNN #6035 gave right gradients on this machine: {proc.stdout[-300:]}")
    if proc is None or proc.returncode < 0:
        pytest.skip("oneDNN #6035 crashed or hung here instead of returning wrong gradients")
    assert proc.returncode == 1 and "FAULT: wrong" in proc.stdout


@needs_x86_onednn
@pytest.mark.parametrize(
    "isa, cin, dtype, size, conv",
    # the sizes where the unguarded stem crashes (96 px) or returns wrong numbers (8 px, AVX2) here; nn.Conv2d
    # becomes SubsampledConv2d, a subclass keeps its forward with NCHW weight and input
    [("native", 3, "fp32", 96, "conv2d"), ("native", 3, "bf16", 96, "conv2d"), ("avx2", 7, "fp32", 96, "conv2d"),
     ("avx2", 3, "fp32", 8, "conv2d"), ("native", 3, "fp32", 96, "subclass"), ("avx2", 3, "fp32", 8, "subclass")],
)
def test_1x1_guard_gives_reference_gradients(isa, cin, dtype, size, conv):
    result = case("stem", str(cin), dtype, "1", str(size), conv, env=AVX2 if isa == "avx2" else None)
    assert result["guarded"] == [["conv_1x1"]]
    assert result["class"] == ("SubsampledConv2d" if conv == "conv2d" else "UserConv2d")
    tolerance = 1e-3 if dtype == "fp32" else 2e-2  # fp32 lands near 3e-5 (a bias), bf16 autocast near 7e-3
    assert max(result["errors"].values()) < tolerance, result["errors"]


@pytest.mark.slow
@needs_x86_onednn
@pytest.mark.parametrize("guard", [True, False])
def test_1x1_guard_holds_under_torch_compile(guard):
    # Inductor picks its own layouts; SubsampledConv2d never calls the strided kernel whatever they are.
    proc = run([str(HERE / "guard_cases.py"), "stem", "3", "fp32", str(int(guard)), "128", "conv2d", "compile"],
               timeout=600)
    if guard:
        assert proc is not None and proc.returncode == 0, (proc.stderr if proc else "hung")[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert max(result["errors"].values()) < 1e-3, result["errors"]
    elif proc is not None and proc.returncode == 0:
        pytest.skip("the compiled, unguarded stem did not crash on this machine")
    else:
        assert proc is None or proc.returncode < 0  # the negative control: the same stem without the guard


@needs_x86_onednn
def test_channels_last_trains_a_repvgg_style_stem_with_nchw_parity():
    result = case("trainer", "repstem", "1", "96")
    assert [r["modules"] for r in result["guardrails"]] == [["net.conv_1x1"]]
    assert max(result["contiguous"].values()) < 1e-4 and max(result["channels_last"].values()) < 1e-4, result


# ---- bf16 Conv3d weight gradients ----------------------------------------------------------------------------


@needs_x86_onednn
@pytest.mark.parametrize("layer", ["conv3d", "convtranspose3d"])
def test_bf16_conv3d_fault_shows_without_the_guard(layer):
    result = case(layer, "0")
    if result["errors"]["0.weight"] < 0.5:
        pytest.skip(f"the bf16 {layer} fault did not show on this machine: {result['errors']}")
    assert result["guarded"] == []


@needs_x86_onednn
@pytest.mark.parametrize("layer", ["conv3d", "convtranspose3d"])
def test_bf16_conv3d_guard_gives_fp32_gradients(layer):
    # a ConvTranspose3d was not guarded: weight gradients of 1e33 or not finite under bf16 autocast
    result = case(layer, "1")
    assert result["guarded"] in ([["0", "2"]], [["0"]]), result["guarded"]
    assert max(result["errors"].values()) < 2e-2, result["errors"]


@needs_x86_onednn
def test_a_loop_that_names_no_dtype_is_guarded_under_its_own_bf16_autocast():
    # Fabric's bf16-mixed or the loop's torch.autocast, without ChannelsLastRun(dtype=...): weight gradients of 1e37
    result = case("conv3d", "1", "loop")
    assert result["guarded"] == [["0"]] and max(result["errors"].values()) < 2e-2, result  # (1, 3, 3): not at risk


# ---- real models: the timm stems that crashed under ChannelsLast ----------------------------------------------


@pytest.mark.slow
@needs_x86_onednn
@pytest.mark.parametrize("name", ["repvgg_a0", "fastvit_t8"])  # mobileone_s0 has the same stem
def test_timm_stem_models_train_under_channels_last_with_parity(name):
    pytest.importorskip("timm")
    result = case("trainer", name, "1", "96")
    assert any(ONE_BY_ONE == r["fault"] for r in result["guardrails"]), result["guardrails"]
    # Every parameter's first gradient against a float64 run (BatchNorm on running statistics, which keeps
    # them well-conditioned: 1e-6 here in either layout); a faulty kernel is off by O(1) or not finite.
    assert max(result["contiguous"].values()) < 1e-4 and max(result["channels_last"].values()) < 1e-4, result


@pytest.mark.slow
@needs_x86_onednn
def test_timm_stem_model_crashes_without_the_guard():
    pytest.importorskip("timm")
    # where the fault shows as a hang (AVX2), waiting past the guarded run's time (under 30 s) is enough to see it
    proc = run([str(HERE / "guard_cases.py"), "trainer", "repvgg_a0", "0", "96"], timeout=100)
    if proc is not None and proc.returncode == 0:
        pytest.skip("repvgg_a0 trained unguarded on this machine: oneDNN #6035 did not show")
    assert proc is None or proc.returncode != 0


# ---- DDP: ranks whose oneDNN ISA differs guard the same modules --------------------------------------------


@needs_x86_onednn
@pytest.mark.skipif(current_platform("cpu").onednn_isa != "avx512", reason="needs an AVX-512 CPU to differ from AVX2")
def test_ddp_ranks_with_different_isas_guard_the_union(tmp_path):
    proc = run([str(HERE / "guard_cases.py"), "ddp", str(tmp_path), "1"], timeout=300)
    assert proc is not None and proc.returncode == 0, (proc.stderr if proc else "hung")[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["guarded"] for r in ranks] == [[["stem"]], [["stem"]]]  # rank 1 (AVX2) alone would not
    assert ranks[0]["strides"] == ranks[1]["strides"]


@pytest.mark.slow
@needs_x86_onednn
@pytest.mark.skipif(current_platform("cpu").onednn_isa != "avx512", reason="needs an AVX-512 CPU to differ from AVX2")
def test_ddp_without_the_union_fails_on_a_stride_mismatch(tmp_path):
    # The negative control: each rank guarding only what it finds gives the stem weight different strides.
    proc = run([str(HERE / "guard_cases.py"), "ddp", str(tmp_path), "0"], timeout=300)
    assert proc is not None and proc.returncode != 0
    assert "appears not to match strides" in proc.stderr
