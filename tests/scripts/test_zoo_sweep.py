"""scripts.zoo: the gradient verdict separates fp32 numerics from a wrong kernel, a crash is a
row, and the fast subset of real models (the crashing stems included) runs through the script; ``--check-only``
runs each optimizer, the segmentation, detection and video models, and confirms a fallback or calls it false."""

import dataclasses
import importlib.util
import json
import math
import sys

import pytest
import torch
from torch import nn

from scripts.zoo import confirm, miss_check, models, pages, parity, sweep_child
from scripts.zoo import sweep as zoo_sweep
from tests.helpers import REPO
from tests.helpers import warm


def sweep(tmp_path, *args, timeout=900):
    proc = warm.run([sys.executable, "-m", "scripts.zoo.sweep", "--out", str(tmp_path / "zoo"), "--log-dir",
                     str(tmp_path / "logs"), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                    nested=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["key"]: r for r in json.loads((tmp_path / "zoo.json").read_text())["rows"]}
    return rows, proc.stdout


def perturbed(exact, relative, generator):
    return {n: g + relative * g.abs().max() * torch.randn(g.shape, generator=generator, dtype=g.dtype)
            for n, g in exact.items()}


def test_verdict_separates_ill_conditioned_numerics_from_a_wrong_kernel():
    g = torch.Generator().manual_seed(0)
    exact = {"stem.weight": torch.randn(8, 3, 1, 1, dtype=torch.float64, generator=g),
             "head.weight": torch.randn(5, 8, dtype=torch.float64, generator=g)}
    fp32 = perturbed(exact, 1e-6, g)
    assert parity.judge(parity.grad_errors(fp32, exact), parity.grad_errors(fp32, exact))["verdict"] == "ok"
    # ill-conditioned: every correct fp32 kernel is ~1e-2 off, channels_last a bit more
    noisy_nc, noisy_cl = perturbed(exact, 1e-2, g), perturbed(exact, 3e-2, g)
    verdict = parity.judge(parity.grad_errors(noisy_cl, exact), parity.grad_errors(noisy_nc, exact))
    assert verdict["verdict"] == "numerics" and verdict["misses"] == 0
    # a wrong kernel: one weight gradient 3.4x, its norm direction unchanged, the rest exact
    wrong = dict(fp32, **{"stem.weight": 3.4 * exact["stem.weight"]})
    verdict = parity.judge(parity.grad_errors(wrong, exact), parity.grad_errors(noisy_nc, exact))
    assert verdict["verdict"] == "MISS" and verdict["worst_param"] == "stem.weight"


def test_grad_errors_floor_zero_gradients_and_flag_a_missing_one():
    exact = {"bias_before_bn": torch.zeros(4, dtype=torch.float64), "w": torch.ones(4, dtype=torch.float64)}
    errors = parity.grad_errors({"bias_before_bn": torch.full((4,), 1e-9), "w": torch.ones(4)}, exact)
    assert errors["w"] == 0.0 and errors["bias_before_bn"] == pytest.approx(1e-9 / (parity.FLOOR * 1.0))
    assert parity.grad_errors({"w": torch.ones(4)}, exact)["bias_before_bn"] == float("inf")


def test_parity_flags_a_layout_kernel_that_is_wrong_in_float64_too():
    # a fault in a kernel every dtype shares shows in the fp32 noise runs as well; float64 catches it
    exact = {"w": torch.linspace(-1, 1, 8, dtype=torch.float64)}
    fp32 = {"w": exact["w"].float()}
    grads = {"float64": exact, "float64_cl": {"w": 1.5 * exact["w"]}, "contiguous": fp32, "native": fp32,
             "native_cl": {"w": 1.5 * fp32["w"]}, "channels_last": {"w": 1.5 * fp32["w"]}}
    losses = dict.fromkeys(grads, 1.0)
    result = {}
    parity.parity(result, grads, losses)
    assert result["grad"]["verdict"] == "MISS" and result["grad"]["layout_miss"]
    assert "float64" in result["grad"]["why"]
    grads["float64_cl"] = exact  # the same fault without the float64 check would pass as noise
    parity.parity(result, grads, losses)
    assert result["grad"]["verdict"] == "numerics"


@pytest.mark.slow
def test_planted_faults_are_found_and_a_crash_is_a_row(tmp_path):
    # the negative controls of the sweep itself: a 3.4x weight gradient under channels_last is a MISS,
    # and a segfault under channels_last ends that model's subprocess only; --resume keeps done rows
    keys = "planted:wrong_grad,planted:crash"
    done, _ = sweep(tmp_path, "--quick", "--no-speed", "--models", keys)
    first = done["planted:wrong_grad"]
    assert first["status"] == "ok" and first["grad"]["verdict"] == "MISS"
    assert first["grad"]["worst_param"] == "conv.weight" and first["grad"]["err_cl"] > 1.0
    rows, out = sweep(tmp_path, "--quick", "--no-speed", "--resume", "--models", keys)
    assert rows == done  # nothing run again
    crash = rows["planted:crash"]
    assert crash["status"] == "crashed (SIGSEGV) in channels_last" and crash["trains_contiguous"] is True
    table = (tmp_path / "zoo.md").read_text()
    assert "| `planted:crash` |" in table and "crashed (SIGSEGV) in channels_last" in table and "CPU " in table
    assert "Crashed or timed out: 1: planted:crash" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "zoo.csv", "zoo.json", "zoo.md"]  # no temp files
    # The first-batch layout check finds the planted wrong gradient too, and runs that conv in NCHW.
    rows, out = sweep(tmp_path / "check", "--check-only", "--optimizers", "sgd", "--models", "planted:wrong_grad")
    checked = rows["planted:wrong_grad"]
    assert checked["layout_check"] == "fallback" and "`net.conv`" in checked["layout_check_line"], checked
    # scripts.zoo.miss_check on the MISS row: the planted conv is off alone too, a kernel fault (exit 1)
    proc = warm.run([sys.executable, "-m", "scripts.zoo.miss_check", "--out", str(tmp_path / "zoo")], cwd=REPO,
                    capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "kernel faults: planted:wrong_grad" in proc.stdout
    examined = {r["key"]: r for r in json.loads((tmp_path / "zoo.json").read_text())["rows"]}["planted:wrong_grad"]
    assert examined["examined"]["verdict"] == "kernel" and "MISS, examined: kernel" in (tmp_path / "zoo.md").read_text()


def _guardrails_present() -> bool:
    return importlib.util.find_spec("cltrain.guardrails") is not None


@pytest.mark.slow
def test_fast_subset_of_real_models(tmp_path):
    # one of --fast's models through the whole script: the stem oneDNN #6035 crashed (the sweep's other paths: the
    # planted faults, the check-only runs below)
    keys = ["timm:repvgg_a0"]
    assert set(keys) <= set(zoo_sweep.FAST)
    rows, out = sweep(tmp_path, "--fast", "--models", ",".join(keys), timeout=1500)
    assert set(rows) == set(keys)
    stems = {"timm:repvgg_a0"}
    for key, row in rows.items():
        assert row["trains_contiguous"] is True, (key, row["status"])
        if key in stems and not _guardrails_present():
            # oneDNN #6035 kills these under channels_last; the sweep survives and says where
            assert row["status"].startswith("crashed (") and row["status"].endswith("in channels_last"), row["status"]
            continue
        assert row["status"] == "ok", (key, row["status"])
        assert row["trains_channels_last"] is True, key
        assert row["grad"]["verdict"] in ("ok", "numerics"), (key, row["grad"])
        assert row["loss_err_cl"] < 1e-4, key
    assert "AMD" in out or "Intel" in out or "CPU" in out


def test_miss_check_tells_a_right_kernel_from_one_that_is_off_alone():
    class WrongUnderChannelsLast(torch.nn.Conv2d):  # the weight gradient 3.4x off for channels_last input
        def forward(self, x):
            return self._conv_forward(x, models._WrongGradUnderChannelsLast.apply(self.weight, x), self.bias)

    right = miss_check.layer_alone(torch.nn.Conv2d(16, 16, 3, padding=1), (2, 16, 8, 8))
    assert max(right.values()) <= miss_check.RIGHT_ALONE
    wrong = miss_check.layer_alone(WrongUnderChannelsLast(16, 16, 3, padding=1), (2, 16, 8, 8))
    assert wrong["contiguous"] <= miss_check.RIGHT_ALONE and wrong["channels_last"] > 1.0


def check_rows(tmp_path, *args):
    """``--check-only`` through the script: its rows by (model, optimizer), its table and its output."""
    proc = warm.run([sys.executable, "-m", "scripts.zoo.sweep", "--check-only", "--out", str(tmp_path / "zoo"),
                     "--log-dir", str(tmp_path / "logs"), *args], cwd=REPO, capture_output=True, text=True,
                    timeout=600, nested=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {(r["key"], r["optimizer"]): r for r in json.loads((tmp_path / "zoo.json").read_text())["rows"]}
    return rows, (tmp_path / "zoo.md").read_text(), proc.stdout


def test_check_only_confirms_a_planted_fallback_with_each_optimizer(tmp_path):
    # a head doing x.view(x.size(0), -1): the check falls back, and channels_last without the check raises
    rows, table, out = check_rows(tmp_path, "--optimizers", "sgd,adamw", "--models", "planted:view_head")
    assert set(rows) == {("planted:view_head", "sgd"), ("planted:view_head", "adamw")}
    for row in rows.values():
        assert row["status"] == "ok" and row["layout_check"] == "fallback", row
        assert "`net.head`" in row["layout_check_line"]
        runs = row["confirm"]
        assert runs["verdict"] == "confirmed" and "view size is not compatible" in runs["error_channels_last"]
        assert len(runs["losses_nchw"]) == len(runs["losses_nudged"]) == runs["steps"] == 4
    assert "| model | family | px | params (M) | SGD | AdamW |" in table and "fallback (confirmed)" in table
    assert "**False fallbacks: 0** of 2" in out and "Confirmed fallbacks: 2" in out


@pytest.mark.parametrize(("key", "optimizer", "size", "confirms"), [("smp:unet_resnet18", "adam", 64, False),
                                                                   ("tv-det:fcos_resnet18_fpn", "sgd", 64, False),
                                                                   ("hf:timesformer", "adamw", 32, True)])
def test_segmentation_detection_and_video_models_run_the_check(key, optimizer, size, confirms):
    # the child's own path, in this process, at a tiny size: the check, and for the video model the three
    # confirmation runs (--confirm-passes)
    args = zoo_sweep.parse_args(["--check-only", "--optimizer", optimizer, "--confirm-steps", "2", "--size", str(size),
                                 *(["--confirm-passes", key.split(":")[0] + ":"] if confirms else [])])
    row = sweep_child.child(dataclasses.replace(models.find([key])[0], size=size), args)
    assert row["phase"] == "done" and row["layout_check"] in pages.VERDICTS, row
    assert row["optimizer"] == optimizer and len(row["losses_channels_last"]) == 2, row
    if not confirms:
        assert "confirm" not in row or row["layout_check"] in confirm.FALLBACK_VERDICTS
        return
    runs = row["confirm"]
    assert runs["verdict"] in confirm.JUDGED, runs
    assert all(len(runs[f"losses_{run}"]) == 2 and all(map(math.isfinite, runs[f"losses_{run}"]))
               for run in confirm.RUNS), runs


def _view_head_net_and_batches(steps):
    spec = models.find(["planted:view_head"])[0]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    return spec, models.build(spec), [models.make_batch(spec, 2, gen) for _ in range(steps)]


def test_the_confirmation_calls_a_fallback_on_a_healthy_model_false():
    spec, net, batches = _view_head_net_and_batches(2)
    net.head = nn.Sequential(nn.Flatten(), net.head.fc)  # the same head, layout-agnostic
    runs = confirm.confirm(spec, net, batches, "sgd", steps=2)
    assert "error_channels_last" not in runs and confirm.diverges(runs) is False, runs
    assert confirm.judge("fallback", runs) == "FALSE" and confirm.judge("contiguous", runs) == "FALSE"
    assert confirm.judge("passed", runs) == "right"
    spec, faulty, batches = _view_head_net_and_batches(2)
    runs = confirm.confirm(spec, faulty, batches, "adam", steps=2)
    assert confirm.judge("fallback", runs) == "confirmed" and confirm.judge("passed", runs) == "MISSED"


def _gaps(loss, update, noise_loss, noise_update):
    return {"gap": {"loss": loss, "update": update}, "noise": {"loss": noise_loss, "update": noise_update}}


def test_a_gap_counts_above_ten_times_the_noise_and_the_least_gap():
    assert confirm.diverges(_gaps(2e-3, 0.0, 1e-4, 0.0)) is True
    assert confirm.diverges(_gaps(9e-4, 0.0, 1e-4, 0.0)) is False       # under 10x the nudged run's
    assert confirm.diverges(_gaps(0.0, 5e-6, 0.0, 1e-9)) is False       # under the least gap
    assert confirm.diverges(_gaps(0.0, 2e-5, 0.0, 1e-9)) is True
    assert confirm.diverges({"error_channels_last": "RuntimeError: view"}) is True
    assert confirm.judge("fallback", {"error_nchw": "ValueError: x", "error_channels_last": "y"}) == "no reference"
    assert confirm.loss_gap([1.0, math.nan], [1.0, 2.0]) == math.inf and confirm.loss_gap([1.0], [1.0, 1.0]) == math.inf


def test_a_native_crash_in_the_channels_last_run_confirms_and_elsewhere_is_unjudged():
    row = {"layout_check": "contiguous", "status": "crashed (SIGSEGV) in confirm channels_last",
           "confirm": {"losses_nchw": [1.0], "losses_nudged": [1.0]}}
    crash = row["status"]
    confirm.settle_confirmation(row, "confirm channels_last", crashed=True)
    assert row["confirm"]["verdict"] == "confirmed" and row["status"] == "ok"
    assert row["confirm"]["error_channels_last"] == crash
    row = {"layout_check": "fallback", "status": "timeout after 60s in confirm nudged", "confirm": {}}
    confirm.settle_confirmation(row, "confirm nudged", crashed=False)
    assert row["confirm"]["verdict"] == "unfinished: timeout after 60s in confirm nudged"
    assert row["status"] == "timeout after 60s in confirm nudged"


def test_the_summary_counts_each_optimizer_and_names_each_false_fallback():
    def row(key, optimizer, verdict, judged=None, **extra):
        confirmed = {"confirm": {"verdict": judged}} if judged else {}
        return {"key": key, "optimizer": optimizer, "status": "ok", "layout_check": verdict,
                "layout_check_line": f"layout check: {key} line", **confirmed, **extra}

    rows = [row("a", "sgd", "passed"), row("a", "adam", "fallback", "FALSE"),
            row("b", "sgd", "contiguous", "confirmed"), row("b", "adam", "passed", "MISSED"),
            *({"key": "c", "optimizer": o, "status": "skipped"} for o in ("sgd", "adam"))]
    lines = pages.check_summary(rows, ["sgd", "adam"])
    assert lines[0].startswith("- 3 models x 2 optimizers (SGD, Adam): 2 models checked with each optimizer, "
                               "1 skipped")
    assert lines[1] == "- SGD: 2 models; passed 1, fallback 0, contiguous 1, not checked 0."
    assert lines[2] == "- Adam: 2 models; passed 1, fallback 1, contiguous 0, not checked 0."
    assert lines[3] == "- **False fallbacks: 1** of 2 fallback or contiguous verdicts: a (Adam): layout check: a line"
    assert lines[4] == "- Confirmed fallbacks: 1: b (SGD)."
    assert "**missed 1**: b (Adam)" in lines[5]


def test_a_spec_shrinks_for_tiny_runs():
    # --size: every model at another input size, the task models too (a Hugging Face video config follows it)
    for key in ("hf:videomae", "tv-video:mc3_18", "smp:fpn_resnet18"):
        spec = dataclasses.replace(models.find([key])[0], size=32)
        batch = models.make_batch(spec, 2, torch.Generator().manual_seed(0))
        assert (batch["pixel_values"] if spec.dict_batch else batch[0]).shape[-2:] == (32, 32)
        assert torch.isfinite(models.training_loss(models.build(spec), batch, spec))
