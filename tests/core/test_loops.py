"""cltrain.loops: channels_last in a Lightning Fabric loop and a plain PyTorch loop, and exporting a
model trained channels_last (torch.export, TorchScript, ONNX)."""

import json
import os
import logging
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
import torchvision
from lightning.fabric import Fabric
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from cltrain import is_channels_last, layout_summary
from cltrain.loops import contiguous_copy, convert_batch, convert_model
from tests.helpers import REPO
from tests.helpers.plain_modules import channels_last_strides, loader
from tests.helpers import warm

BUCKET_WARNING = "Grad strides do not match bucket view strides"


def small_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )


def train(model, batches, fabric=None, channels_last=True):
    """Three SGD steps; returns the losses and the strides of what reached the model."""
    if channels_last:
        model = convert_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if fabric is not None:
        model, optimizer = fabric.setup(model, optimizer)
        batches = fabric.setup_dataloaders(batches)
    losses, seen = [], []
    for batch in batches:
        x, y = convert_batch(batch) if channels_last else batch
        seen.append(x.stride())
        loss = F.cross_entropy(model(x), y)
        fabric.backward(loss) if fabric is not None else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return model, torch.stack(losses), seen


@pytest.mark.parametrize("use_fabric", [True, False], ids=["fabric", "plain"])
def test_a_loop_trains_channels_last_with_parity(use_fabric):
    fabric = Fabric(accelerator="cpu", devices=1) if use_fabric else None
    model, losses, seen = train(small_net(), loader(12, 4), fabric)
    _, reference, _ = train(small_net(), loader(12, 4), channels_last=False)
    assert seen == [channels_last_strides((4, 3, 32, 32))] * 3
    assert layout_summary(model)["channels_last"] == 2 and "contiguous" not in layout_summary(model)
    torch.testing.assert_close(losses, reference, rtol=1e-4, atol=1e-5)


def test_convert_model_keeps_parameter_objects_and_ranks():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Conv3d(4, 4, 1))
    params = list(model.parameters())
    assert convert_model(model) is model and list(model.parameters()) == params
    assert is_channels_last(model[0].weight) and model[1].weight.is_contiguous(memory_format=torch.channels_last_3d)


def test_convert_model_applies_the_guardrails(caplog):
    from cltrain.guardrails import find_hazards

    stem = nn.Sequential(nn.Conv2d(3, 8, 1, stride=2), nn.ReLU())  # oneDNN #6035's pattern on x86 CPUs
    if not find_hazards(stem, device="cpu"):
        pytest.skip("no known kernel fault for this model on this platform")
    with caplog.at_level(logging.INFO, logger="cltrain.loops"):
        convert_model(stem)
    assert type(stem[0]).__name__ == "SubsampledConv2d" and "worked around known kernel faults" in caplog.text
    bare = convert_model(nn.Sequential(nn.Conv2d(3, 8, 1, stride=2)), guard=False)
    assert type(bare[0]) is nn.Conv2d and is_channels_last(bare[0].weight)


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="convert_model\\(guard='yes'\\)"):
        convert_model(nn.Conv2d(3, 4, 1), guard="yes")
    with pytest.raises(ValueError, match="convert_model\\(mode='fast'\\)"):
        convert_model(nn.Conv2d(3, 4, 1), mode="fast")
    with pytest.raises(ValueError, match="convert_batch\\(layout='nhwc'\\)"):
        convert_batch(torch.randn(1, 3, 2, 2), layout="nhwc")
    with pytest.raises(ValueError, match="convert_batch\\(inputs=2.0\\)"):
        convert_batch(torch.randn(1, 3, 2, 2), inputs=2.0)


def run_fabric_ddp(tmp_path, when):
    proc = warm.run([sys.executable, "-m", "tests.helpers.fabric_ddp_run", str(tmp_path), when],
                    capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_fabric_ddp_converted_before_setup_has_matching_buckets(tmp_path):
    for rank in run_fabric_ddp(tmp_path, "before"):
        assert rank["world_size"] == 2
        assert rank["params_cl"] == rank["grads_match"] == rank["inputs_cl"] == [True] * 3, rank
        assert not [w for w in rank["warnings"] if BUCKET_WARNING in w], rank["warnings"]


@pytest.mark.slow
def test_fabric_ddp_check_catches_conversion_after_setup(tmp_path):
    # the negative control: restriding after Fabric wrapped the model in DDP is what convert_model avoids
    ranks = run_fabric_ddp(tmp_path, "after")
    assert any(BUCKET_WARNING in w for r in ranks for w in r["warnings"])


@pytest.mark.slow
def test_fabric_ddp_ranks_on_different_isas_guard_the_same_modules_and_apply_rank_0s_check(tmp_path):
    ranks = run_fabric_ddp(tmp_path, "united")
    assert [r["guarded"] for r in ranks] == [["stem"], ["stem"]]  # rank 1 (block 8) alone finds nothing
    assert [r["check"] for r in ranks] == ["passed", "passed"]  # rank 0 checked; rank 1's planted raise never ran
    assert ranks[0]["strides"] == ranks[1]["strides"]
    # the negative control: each rank guarding what it finds gives the stem's weight other strides on each rank
    alone = warm.run([sys.executable, "-m", "tests.helpers.fabric_ddp_run", str(tmp_path), "alone"],
                     capture_output=True, text=True, timeout=600, cwd=REPO)
    assert alone.returncode != 0 and "appears not to match strides" in alone.stderr, alone.stderr[-3000:]


# ---- export --------------------------------------------------------------------------------------


def trained_channels_last(model, size):
    """``model`` after two SGD steps in channels_last, in eval mode, and an input for it."""
    model = convert_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = convert_batch((torch.randn(2, 3, size, size, generator=g), torch.randint(0, 4, (2,), generator=g)))
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), torch.randn(2, 3, size, size, generator=g)


def four_d(tensors):
    return [t for t in tensors if t.dim() == 4]


def export_and_compare(model, x, onnx_path):
    """Export a contiguous copy of ``model`` three ways; every artifact holds NCHW weights and
    computes what the eager channels_last model does."""
    with torch.no_grad():
        eager = model(x)
    copy = contiguous_copy(model)
    assert four_d(copy.parameters()) and all(t.is_contiguous() for t in four_d(copy.parameters()))
    assert all(is_channels_last(t) for t in four_d(model.parameters()))  # the model itself is untouched

    program = torch.export.export(copy, (x,))
    assert all(t.is_contiguous() for t in four_d(program.state_dict.values()))
    torch.testing.assert_close(program.module()(x), eager, rtol=1e-3, atol=1e-4)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (DeprecationWarning, FutureWarning))  # torch.jit is deprecated upstream
        traced = torch.jit.trace(copy, x)
    assert all(t.is_contiguous() for t in four_d(traced.parameters()))
    torch.testing.assert_close(traced(x), eager, rtol=1e-3, atol=1e-4)

    onnx = pytest.importorskip("onnx")
    torch.onnx.export(copy, (x,), str(onnx_path))
    onnx.checker.check_model(str(onnx_path))
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), eager, rtol=1e-3, atol=1e-4)


def test_export_a_small_model_trained_channels_last(tmp_path):
    pytest.importorskip("onnxscript")  # torch.onnx.export's exporter
    model, x = trained_channels_last(small_net(), 16)
    export_and_compare(model, x, tmp_path / "small.onnx")


def test_export_resnet18_trained_channels_last(tmp_path):
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    model, x = trained_channels_last(torchvision.models.resnet18(num_classes=4), 64)
    export_and_compare(model, x, tmp_path / "resnet18.onnx")


def test_contiguous_copy_unwraps_fabric_and_leaves_the_model_alone():
    fabric = Fabric(accelerator="cpu", devices=1)
    model = convert_model(small_net())
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    wrapped = fabric.setup_module(model)
    copy = contiguous_copy(wrapped)
    assert isinstance(copy, nn.Sequential) and copy[0].weight.grad is None
    assert copy[0].weight.is_contiguous() and is_channels_last(model[0].weight)
    assert model[0].weight.grad is not None and is_channels_last(model[0].weight.grad)


def test_verify_layout_checks_a_slice_of_the_batch_and_the_whole_batch_on_request():
    seen: list[int] = []

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.shape[0])
            return self.conv(x)

    from cltrain.loops import convert_model, verify_layout

    model = convert_model(Net())
    batch = (torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,)))
    assert verify_layout(model, batch).verdict == "passed"
    assert seen and set(seen) == {4}
    seen.clear()
    assert verify_layout(model, batch, samples=None).verdict == "passed"
    assert set(seen) == {16}


@pytest.mark.parametrize("program", ["sets up no logging", "logs warnings only"])
def test_the_runs_lines_show_in_a_program_that_sets_up_no_logging(program) -> None:
    # Python shows warnings only where nothing is set up: the run's lines would not show (its check, its race)
    code = ("import logging, torch; from cltrain.loops import ChannelsLastRun\n"
            + ("logging.basicConfig(level=logging.WARNING)\n" if program == "logs warnings only" else "")
            + "run = ChannelsLastRun(torch.nn.Conv2d(3, 8, 3), layout='channels_last', verify=False); run.end()")
    done = warm.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    said = "ChannelsLastRun(mode='full'): model layout is channels_last; parameters and buffers" in done.stderr
    assert said is (program == "sets up no logging"), done.stderr  # a program's own set-up is kept


@pytest.mark.slow
def test_ddp_an_evaluation_on_rank_0_alone_does_not_wait_for_the_other_ranks(tmp_path):
    # the check of an evaluation shares its verdict with every rank: run on rank 0 alone, it waited for the others
    proc = warm.run([sys.executable, "-m", "tests.helpers.torchrun", "--standalone", "--nproc_per_node", "2", "-m",
                     "tests.helpers.eval_rank0_ddp", str(tmp_path)], capture_output=True, text=True, timeout=180,
                    cwd=REPO, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["checks"]["train"] == "passed" and ranks[0]["checks"]["eval"] == "not checked", ranks
    assert "eval" not in ranks[1]["checks"] and all(r["weights_cl"] for r in ranks), ranks


def _raced_loop(monkeypatch, steps: int = 16, stop: int | None = None, state: dict | None = None):
    """A plain loop through ``ChannelsLastRun(layout="auto")``, NCHW's steps scripted faster; with ``stop``, the
    loop saves after that batch's optimizer step (before it asks for the next batch) and ends there."""
    import copy

    import cltrain.session
    from cltrain.loops import ChannelsLastRun
    from tests.core.test_session import ScriptedClock

    monkeypatch.setattr(cltrain.session, "StepTimer", ScriptedClock)
    monkeypatch.setattr(ScriptedClock, "times", {"channels_last": 0.3, "contiguous": 0.2})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.Flatten(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = ChannelsLastRun(model, optimizer, step=lambda m, b: m(b[0]).square().mean())
    ScriptedClock.session = run.session
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        run.load_state_dict(state["run"])
        start = state["next"]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, generator=g),) for _ in range(steps)]
    layouts = []
    for i, (x,) in enumerate(run.batches(batches[start:]), start):
        layouts.append(run.session.layout)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if i == stop:  # the state as the loop saves it: run.state_dict() after the step, before the next batch
            return layouts, {"model": copy.deepcopy(model.state_dict()), "run": copy.deepcopy(run.state_dict()),
                             "optimizer": copy.deepcopy(optimizer.state_dict()), "next": i + 1}
    run.end()
    return layouts, model.state_dict()


@pytest.mark.parametrize("stop", [4, 5, 7, 12])
def test_a_loop_saved_after_its_optimizer_step_goes_on_at_its_place_in_the_race(monkeypatch, stop):
    # the step open at the save was ended only when the loop asked for its next batch: the checkpoint's race lacked
    # it, and the resumed run ran that step of the schedule again (its layouts one step behind)
    whole, final = _raced_loop(monkeypatch)
    first, state = _raced_loop(monkeypatch, stop=stop)
    rest, resumed = _raced_loop(monkeypatch, state=state)
    # the schedule goes on where it stopped (the uninterrupted race decides at the end of its third round, step 10;
    # a resumed one times its steps afresh, so it decides later)
    assert (first + rest)[:11] == whole[:11] and whole[11:] == ["contiguous"] * 5
    if stop > 10:  # decided before the save: the same run, bit for bit
        assert first + rest == whole and all(torch.equal(final[k], resumed[k]) for k in final)


def test_a_door_given_the_wrong_thing_says_which_argument_in_one_line(caplog) -> None:
    from cltrain.loops import ChannelsLastRun, verify_layout

    for call in (lambda m: ChannelsLastRun(m), convert_model, lambda m: verify_layout(m, torch.zeros(1, 3, 4, 4)),
                 contiguous_copy):
        for bad in ("resnet18", None, nn.Conv2d(3, 4, 1).state_dict()):
            with pytest.raises(ValueError, match=r"\(model=.*\): expected the model itself, a torch.nn.Module"):
                call(bad)
        with pytest.raises(ValueError, match=r"\(model=<list of 2 modules>\): one model: put them in one "
                                             r"torch.nn.ModuleDict\(\{'g': ..., 'd': ...\}\)(, with their optimizers|"
                                             r", or call)"):
            call([nn.Conv2d(3, 4, 1), nn.Conv2d(4, 3, 1)])  # a GAN's generator and discriminator
        with pytest.raises(ValueError, match=r"\(model=<tuple of 1 module>\): pass the module itself"):
            call((nn.Conv2d(3, 4, 1),))  # model = build(),
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    run = ChannelsLastRun(model, torch.optim.AdamW(model.parameters()))
    checkpoint = {"model": model.state_dict(), "cltrain": run.state_dict()}
    # the whole checkpoint: its entry named as the checkpoint names it (the fix said checkpoint['run'], not there)
    with pytest.raises(ValueError, match=r"expected what run.state_dict\(\) gave .*: pass the run's own entry "
                                         r"\(checkpoint\['cltrain'\]\)"):
        run.load_state_dict(checkpoint)
    for wrong in (model.state_dict(), "x"):  # the model's, a string
        with pytest.raises(ValueError, match=r"expected what run.state_dict\(\) gave .*the entry you saved"):
            run.load_state_dict(wrong)
    with pytest.raises(ValueError, match=r"the entry is not what run.state_dict\(\) gave \(\{'race': 'int'\}\)"):
        run.load_state_dict({"race": 3})  # the right key, a wrong value
    with pytest.raises(ValueError, match=r"ChannelsLastRun.batches\(train='yes'\): expected True or False"):
        next(run.batches([], train="yes"))
    with pytest.raises(ValueError, match=r"ChannelsLastRun.batches\(loader=None\): expected the loop's batches"):
        next(run.batches(None))
    with pytest.raises(ValueError, match=r"verify_layout\(batch=None\): expected one batch"):
        verify_layout(model, None)
    run.load_state_dict(checkpoint["cltrain"])  # the control: its own entry
    from cltrain.options import check_copies

    given = check_copies("ChannelsLastRun", lambda: "ema")  # called where the copies follow a change of layout
    with pytest.raises(ValueError, match=r"ChannelsLastRun\(copies=\.\.\.\): the function gave 'ema', not a module"):
        given()
    other = nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="cltrain"):
        ChannelsLastRun(nn.Conv2d(3, 4, 3), torch.optim.Adam(other.parameters()))
    assert "the Adam given holds none of the model's parameters" in caplog.text


class _ImageList(nn.Module):
    """Takes a list of 3-D images, as torchvision's detection models do (which batch them themselves)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([self.conv(image[None]).mean() for image in images])


def _detector_batches() -> list[tuple[list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    sizes = [(8, 8), (9, 7), (7, 10)]  # images of any size: the model resizes them
    return [([torch.randn(3, *sizes[(i + j) % 3], generator=g) for j in range(2)],) for i in range(200)]


@pytest.mark.parametrize("door", ["plain", "accelerate", "lightning"])
def test_a_detectors_lists_of_images_are_raced_as_one_kind_of_batch(door, caplog) -> None:
    # "not raced": a detector whose steps are slower in channels_last stayed in channels_last
    model = _ImageList()
    with caplog.at_level(logging.INFO, logger="cltrain"):
        if door == "lightning":
            import lightning.pytorch as pl

            from cltrain import ChannelsLast
            from tests.helpers.plain_modules import NetCall

            callback = ChannelsLast()
            pl.Trainer(max_steps=200, accelerator="cpu", logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, callbacks=[callback]).fit(
                NetCall(model), DataLoader(_detector_batches(), batch_size=None))
            decision = callback.decision
        elif door == "accelerate":
            from accelerate import Accelerator
            from accelerate.state import AcceleratorState, GradientState

            from cltrain.integrations.accelerate import prepare_channels_last
            from cltrain.integrations.inputs_hook import ChannelsLastInputs

            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
            accelerator = Accelerator(cpu=True)
            prepare_channels_last(model, accelerator)
            wrapped, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
            for (images,) in _detector_batches():
                accelerator.backward(wrapped(images).sum())
                optimizer.step()
                optimizer.zero_grad()
            decision = next(iter(ChannelsLastInputs.of(model).session.race.decisions.values()), None)
        else:
            from cltrain.loops import ChannelsLastRun

            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            run = ChannelsLastRun(model, optimizer, step=lambda m, b: m(b[0]).sum())
            for (images,) in run.batches(_detector_batches()):
                model(images).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            run.end()
            decision = run.decision
    assert "not raced" not in caplog.text and decision is not None, caplog.text
    assert decision.key[0] == ("images",) and "lists of images" in caplog.text, caplog.text
    assert is_channels_last(model.conv.weight) == (decision.layout == "channels_last")


def _loop_check(model: nn.Module, optimizers, batch, layout: str = "channels_last", **kw):
    from cltrain.loops import ChannelsLastRun

    run = ChannelsLastRun(model, optimizers, step=lambda m, b: F.cross_entropy(m(b[0]), b[1]), layout=layout, **kw)
    for x, y in run.batches([batch]):
        F.cross_entropy(model(x), y).backward()
        for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
            optimizer.step()
            optimizer.zero_grad()
    run.end()
    return run


@pytest.mark.parametrize("faulty", [True, False])
def test_a_model_with_bfloat16_weights_is_checked_in_float32(faulty: bool) -> None:
    from tests.helpers.plain_modules import NCHWBackwardNet

    # in bfloat16 the stem's gradient is rounding noise (the check's noise run), which hid the fault: a pass
    torch.manual_seed(0)
    model = NCHWBackwardNet(faulty).to(torch.bfloat16)
    batch = (torch.randn(8, 3, 16, 16, dtype=torch.bfloat16), torch.randint(0, 10, (8,)))
    run = _loop_check(model, torch.optim.AdamW(model.parameters(), 1e-3), batch)
    assert run.layout_checks["train"].verdict == ("contiguous" if faulty else "passed"), run.layout_checks
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the real model keeps its dtype
    assert run.session.dtype == torch.bfloat16  # what its convolutions compute in: the race's line said fp32


def test_every_optimizer_of_the_loop_steps_on_the_check_s_copies() -> None:
    class FlatSGD(torch.optim.Optimizer):  # flattens with .view: raises on a channels_last gradient
        def __init__(self, params):
            super().__init__(params, {"lr": 0.01})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.view(-1).add_(p.grad.view(-1), alpha=-group["lr"])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    body, head = list(model[0].parameters()), list(model[4].parameters())
    run = _loop_check(model, [FlatSGD(body), torch.optim.AdamW(head)], (torch.randn(4, 3, 8, 8), torch.tensor([0, 1] * 2)))
    check = run.layout_checks["train"]
    assert check.verdict in ("fallback", "contiguous") and "the code after the backward raised" in check.line("train")
    assert not is_channels_last(model[0].weight)  # and the loop's own FlatSGD step ran (it would raise)


def test_lazy_modules_are_put_in_channels_last_once_made() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyConv2d(8, 3), nn.LazyBatchNorm2d(), nn.ReLU(), nn.LazyConv2d(8, 3), nn.Flatten(),
                          nn.LazyLinear(2))
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
    run = _loop_check(model, optimizer, (torch.randn(4, 3, 12, 12), torch.tensor([0, 1] * 2)))
    check = run.layout_checks["train"]
    assert check.verdict == "not checked" and "lazy modules are not made yet (0.weight)" in check.reason
    for conv in (model[0], model[3]):
        assert is_channels_last(conv.weight) and is_channels_last(optimizer.state[conv.weight]["exp_avg"])
    # the docstring's pinned run, no check
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.LazyLinear(2))
    run = _loop_check(model, torch.optim.SGD(model.parameters(), 0.1), (torch.randn(2, 3, 8, 8), torch.tensor([0, 1])),
                      verify=False)
    assert is_channels_last(model[0].weight) and model[2].weight.shape == (2, 288)
    # pinned NCHW: nothing to convert, made NCHW (to_contiguous read the shape of a weight not made yet)
    model = nn.Sequential(nn.LazyConv2d(8, 3), nn.Flatten(), nn.LazyLinear(2))
    _loop_check(model, torch.optim.SGD(model.parameters(), 0.1), (torch.randn(2, 3, 8, 8), torch.tensor([0, 1])),
                layout="contiguous")
    assert model[0].weight.is_contiguous()


def test_a_run_made_after_fabric_setup_on_one_device_checks_the_model_fabric_holds() -> None:
    from cltrain.loops import ChannelsLastRun

    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    fabric_model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    run = ChannelsLastRun(fabric_model, optimizer, step=lambda m, b: m(b).view(2, -1).sum(), layout="channels_last")
    for x in run.batches([torch.randn(2, 3, 8, 8)]):
        fabric.backward(fabric_model(x).view(2, -1).sum())  # .view on a channels_last output: found by the check
        optimizer.step()
    assert run.layout_checks["train"].verdict != "not checked", run.layout_checks["train"].reason
    assert run.model is model


def test_a_start_interrupted_while_taking_torchs_utilities_ends_without_a_second_error(monkeypatch):
    # an interrupt (or a raising line) while the session took torch's utilities left it half made: end() then raised
    # AttributeError, which in Lightning's on_exception hid the first error
    import contextlib

    import cltrain.session
    from cltrain.loops import ChannelsLastRun

    @contextlib.contextmanager
    def interrupted(say):
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(cltrain.session, "torch_utilities", interrupted)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3))
    with pytest.raises(KeyboardInterrupt) as stopped:
        ChannelsLastRun(model, layout="channels_last", verify=False)
    tb, sessions = stopped.tb, []
    while tb is not None:
        sessions += [v for v in tb.tb_frame.f_locals.values() if isinstance(v, cltrain.session.LayoutSession)]
        tb = tb.tb_next
    assert sessions
    sessions[-1].close()  # what a door's exception handler calls: no second error
    monkeypatch.undo()
    run = ChannelsLastRun(model, layout="channels_last", verify=False)  # a new run takes them as usual
    assert run.session._utilities is not None
    run.end()


def test_a_warning_the_users_step_raises_on_the_first_batch_names_the_users_line_once(tmp_path) -> None:
    # under the check's and the input trace's function modes, torch's C++ warnings named the mode's frame
    # (cltrain/layout/conv_reach.py): the user was sent to cltrain's code for a line of their own
    script = tmp_path / "users_loop.py"
    script.write_text(
        "import torch\nfrom cltrain.loops import ChannelsLastRun\n"
        "model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(144, 2))\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "def step(model, batch):\n"
        "    loss = model(batch[0]).square().mean()\n"
        "    kept = torch.tensor(loss)  # a copy construction from a tensor: torch warns\n"
        "    kept = torch.tensor(loss * 2)  # the same text from another line: its own warning\n"
        "    return loss\n"
        "run = ChannelsLastRun(model, optimizer, step=step, layout='channels_last')\n"
        "for batch in run.batches([(torch.randn(2, 3, 8, 8), torch.zeros(2))] * 3):\n"
        "    step(model, batch).backward(); optimizer.step(); optimizer.zero_grad()\n"
        "run.end()\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "default", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    warned = [line[:line.index(", it is")] for line in done.stderr.splitlines() if "UserWarning: To copy" in line]
    assert warned == [f"{script}:{line}: UserWarning: To copy construct from a tensor" for line in (7, 8)], done.stderr


def test_a_catch_warnings_the_loop_holds_across_the_first_steps_leaves_warnings_working(tmp_path) -> None:
    # a catch_warnings entered in the first step and left after the loop put the modes' hook back after they had
    # given it up; the next mode took it for the program's own, and a warning under it recursed without end
    script = tmp_path / "users_loop.py"
    script.write_text(
        "import contextlib, warnings, torch\nfrom cltrain.loops import ChannelsLastRun\n"
        "model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(144, 2))\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "run = ChannelsLastRun(model, optimizer, layout='channels_last')\n"
        "with contextlib.ExitStack() as stack:\n"
        "    for i, (x, y) in enumerate(run.batches([(torch.randn(2, 3, 8, 8), torch.zeros(2))] * 3)):\n"
        "        if i == 0:\n"
        "            stack.enter_context(warnings.catch_warnings())\n"
        "        model(x).square().mean().backward(); optimizer.step(); optimizer.zero_grad()\n"
        "model.eval()\n"
        "for x, y in run.batches([(torch.randn(2, 3, 8, 8), torch.zeros(2))], train=False):\n"
        "    warnings.warn('the eval notice of the user')\n"
        "    model(x)\n"
        "run.end()\n"
        "assert warnings.showwarning is warnings._showwarning_orig, warnings.showwarning\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{script}:13: UserWarning: the eval notice of the user" in done.stderr, done.stderr


@pytest.mark.parametrize("in_place", [True, False])
def test_a_model_compiled_in_place_after_the_run_compiles_once(in_place):
    # docs/guides/loops.md: the run follows its first forward under a TorchFunctionMode; a wrapper made after the run
    # compiles that step with the mode, and again at the next step
    from cltrain.layout.tensors import compiled_frames
    from cltrain.loops import ChannelsLastRun

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = ChannelsLastRun(model, optimizer, layout="channels_last", verify=False)
    if in_place:
        model.compile(backend="eager")
    compiled = model if in_place else torch.compile(model, backend="eager")
    frames = [compiled_frames()]
    for x, y in run.batches([(torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))] * 3):
        F.cross_entropy(compiled(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        frames.append(compiled_frames())
    run.end()
    assert (frames[1] == frames[3]) is in_place, frames


def test_a_loop_that_edits_its_inputs_in_place_and_steps_after_the_next_batch_keeps_its_gradients():
    # the loader's data went back at the next batch without the step's in-place writes: the backward of a window that
    # sums its losses read the un-normalised images (conv1's gradient 52-125% off), and so did the user's code
    from cltrain.loops import ChannelsLastRun

    mean, std = torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1), torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1)

    def window_grads(door: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(0)
        data = [(torch.rand(4, 3, 8, 8, generator=gen), torch.randint(0, 2, (4,), generator=gen)) for _ in range(4)]
        if door:
            run = ChannelsLastRun(model, optimizer, layout="channels_last", verify=False)
            batches = run.batches(data)
        else:
            model.to(memory_format=torch.channels_last)
            batches = ((x.contiguous(memory_format=torch.channels_last), y) for x, y in data)
        grads, total, seen = [], 0, []
        for i, (x, y) in enumerate(batches):
            x.sub_(mean).div_(std)
            seen.append(x)
            total = total + F.cross_entropy(model(x), y) / 2
            if i % 2:
                total.backward()  # after the window's second batch was asked for
                grads.append(model[0].weight.grad.clone())
                optimizer.step()
                optimizer.zero_grad()
                total = 0
        return grads + [s.contiguous() for s in seen]

    for got, want in zip(window_grads(True), window_grads(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def _real_train_step(model: nn.Module, optimizer: Any) -> Any:
    """A whole training step passed as a check's ``step`` that ignores the ``m`` it is given: it trains the real model
    and optimizer."""

    def train_step(m: nn.Module, batch: Any) -> torch.Tensor:
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return train_step


@pytest.mark.parametrize("optimizer_class, fabric, given", [(torch.optim.AdamW, False, True),
                                                            (torch.optim.Adam, False, True),
                                                            (torch.optim.AdamW, True, True),
                                                            (torch.optim.AdamW, False, False)])
def test_a_step_that_trains_the_real_model_leaves_its_optimizer_as_it_was(optimizer_class, fabric, given,
                                                                          monkeypatch):
    # a whole training step passed as `step`, on the real model and optimizer: the check put the model back, not the
    # optimizer (AdamW's step count 5 against 4, its moments a 4-sample step further); the optimizer Fabric's setup
    # hands the loop runs its hooks on the one inside
    import cltrain.check.plain_step as plain_step
    from cltrain.loops import ChannelsLastRun

    copied = []
    monkeypatch.setattr(plain_step, "copy_optimizer", lambda o, memo, real=plain_step.copy_optimizer: (
        copied.append(type(o).__name__), real(o, memo))[1])  # counted, then copied

    def run(verify: bool) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
        optimizer = optimizer_class(model.parameters(), lr=1e-2)
        called = model
        if fabric:
            called, optimizer = Fabric(accelerator="cpu", devices=1).setup(model, optimizer)

        train_step = _real_train_step(called, optimizer)

        # an optimizer not given to the run: under DDP only rank 0 checks, and its stepped state parted the ranks
        door = ChannelsLastRun(model, optimizer if given else None, step=train_step, layout="channels_last",
                               verify=verify)
        gen = torch.Generator().manual_seed(0)
        data = [(torch.rand(4, 3, 8, 8, generator=gen), torch.randint(0, 2, (4,), generator=gen)) for _ in range(3)]
        for x, y in door.batches(data):
            train_step(model, (x, y))
        door.end()
        return model, optimizer, door.layout_checks.get("train") if verify else None

    checked, plain = run(True), run(False)
    assert checked[2].verdict == "not checked" and "model argument of a loop's `step`" in checked[2].reason
    assert copied == []  # torch's elementwise optimizers are not stepped on copies: the hook is cltrain's own
    for a, b in zip(checked[0].state_dict().values(), plain[0].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(checked[1].state.values(), plain[1].state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a), a.keys()


@pytest.mark.parametrize("how", ["fabric", "fabric, dtype given", "fabric, NHWC batches", "own autocast", "fp32"])
def test_a_run_given_no_dtype_under_autocast_says_the_dtype_to_pass(how, caplog):
    # Fabric's bf16-mixed with no dtype: the race's lines said fp32 and nothing said why
    from cltrain.loops import ChannelsLastRun

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dtype = torch.bfloat16 if how.endswith("dtype given") else None
    run = ChannelsLastRun(model, optimizer, step=lambda m, b: F.cross_entropy(m(b[0]), b[1]), dtype=dtype)
    called, backward = model, torch.Tensor.backward
    if how.startswith("fabric"):
        fabric = Fabric(accelerator="cpu", precision="bf16-mixed", devices=1)
        (called, optimizer), backward = fabric.setup(model, optimizer), fabric.backward
    x = torch.randn(4, 3, 8, 8)
    if how.endswith("NHWC batches"):
        x = x.contiguous(memory_format=torch.channels_last)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "own autocast")
    with caplog.at_level(logging.INFO, logger="cltrain"), autocast:
        for x, y in run.batches([(x, torch.tensor([0, 1, 0, 1]))] * 2):
            backward(F.cross_entropy(called(x), y))
            optimizer.step()
            optimizer.zero_grad()
    run.end()
    said = "the model's forward runs under bf16 autocast, but the run was given no dtype: pass dtype=torch.bfloat16"
    assert caplog.text.count(said) == (how not in ("fabric, dtype given", "fp32")), caplog.text
    assert not [h for c in model.modules() for h in c._forward_pre_hooks.values()]  # the look is over


def test_a_loop_with_timms_lookahead_is_checked():
    # loops.md names timm's Lookahead; the check failed on it ("Lookahead cannot be copied"): its __dict__, made on
    # first use, took the address of a dict the model's copy had used, and the copy's memo named that address
    timm_optim = pytest.importorskip("timm.optim")
    from cltrain.loops import ChannelsLastRun

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    optimizer = timm_optim.Lookahead(torch.optim.AdamW(model.parameters(), lr=1e-2))
    run = ChannelsLastRun(model, optimizer, step=lambda m, b: F.cross_entropy(m(b[0]), b[1]), layout="channels_last")
    for x, y in run.batches([(torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 0, 1]))] * 2):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    run.end()
    assert run.layout_checks["train"].verdict == "passed", run.layout_checks["train"]


def test_verify_layout_on_a_step_that_trains_the_real_model_leaves_the_optimizer_as_it_was():
    # called on every rank before DDP: rank 0's AdamW took a step the others did not, and the replicas drifted apart
    from cltrain.loops import verify_layout

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    train_step = _real_train_step(model, optimizer)

    before = [p.detach().clone() for p in model.parameters()]
    check = verify_layout(convert_model(model), (torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 0, 1])), train_step,
                          optimizer=optimizer)
    assert check.verdict == "not checked" and not optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_copy_made_before_the_first_forward_of_a_run_given_no_dtype_saves(tmp_path):
    # the one-shot look at the first forward's autocast went with an EMA made between the first batch and its
    # forward: torch.save(ema) failed ("Can't pickle local object")
    from torch.optim.swa_utils import AveragedModel

    from cltrain.loops import ChannelsLastRun

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run, ema = ChannelsLastRun(model, optimizer, layout="channels_last", verify=False), None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for x, y in run.batches([(torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 0, 1]))] * 2):
            ema = ema or AveragedModel(model)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            ema.update_parameters(model)
    run.end()
    torch.save(ema, tmp_path / "ema.pt")
    assert not [h for m in model.modules() for h in m._forward_pre_hooks.values()]


def test_verify_layout_puts_back_the_optimizers_groups_too():
    # timm's Lookahead counts its steps in param_groups: after the check's two runs of a step on the real optimizer
    # its counter was 2, not 0, and the weights parted from a run without the check (0.0135 after 4 steps)
    timm_optim = pytest.importorskip("timm.optim")
    from cltrain.loops import verify_layout

    def run(check: bool) -> tuple[torch.Tensor, int]:
        torch.manual_seed(0)
        model = convert_model(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                            nn.Linear(8, 2)))
        optimizer = timm_optim.Lookahead(torch.optim.AdamW(model.parameters(), lr=1e-2), k=3)
        gen = torch.Generator().manual_seed(0)
        data = [(torch.rand(4, 3, 8, 8, generator=gen), torch.randint(0, 2, (4,), generator=gen)) for _ in range(4)]

        train_step = _real_train_step(model, optimizer)

        counted = 0
        if check:
            verify_layout(model, data[0], train_step, optimizer=optimizer, report=False)
            counted = optimizer.param_groups[0]["lookahead_step"]
        for batch in data:
            train_step(model, batch)
        return torch.cat([p.detach().flatten() for p in model.parameters()]), counted

    (checked, counted), (plain, _) = run(True), run(False)
    assert counted == 0 and torch.equal(checked, plain)
