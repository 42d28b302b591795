"""channels_last in a hand-written Accelerate loop, with a real ``Accelerator`` on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

from cltrain.integrations.accelerate import prepare_channels_last  # noqa: E402
from cltrain.integrations.inputs_hook import ChannelsLastInputs  # noqa: E402
from cltrain.loops import convert_batch, convert_model, verify_layout  # noqa: E402
from tests.helpers.hf_models import build, dataset  # noqa: E402
from tests.helpers.hf_trainer_run import Probe, conv_weights  # noqa: E402


def _train(model: nn.Module, accelerator: Accelerator, convert: bool = False, steps: int = 3) -> Probe:
    """The loop of Accelerate's examples: prepare, then forward, backward, step; ``convert``: ``convert_batch``."""
    probe = Probe(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(dataset("resnet"), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _, batch in zip(range(steps), (batch for _ in range(steps) for batch in loader)):  # epochs, as needed
        if convert:
            convert_batch(batch)
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return probe


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    # One AcceleratorState per process: each test (and a Trainer test before) may ask for another precision.
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def nchw_losses() -> list[float]:
    return _train(build("resnet"), Accelerator(cpu=True)).losses


def test_the_documented_order(nchw_losses):
    accelerator = Accelerator(cpu=True)
    model = convert_model(build("resnet"), device=accelerator.device)  # before accelerator.prepare
    first = next(iter(DataLoader(dataset("resnet"), batch_size=4)))
    check = verify_layout(model, first, step=lambda m, batch: m(**batch).loss)
    probe = _train(model, accelerator, convert=True)
    assert check.verdict == "passed"
    assert probe.first_conv_input == [True] * 3 and all(conv_weights(model).values())
    torch.testing.assert_close(probe.losses, nchw_losses, rtol=1e-4, atol=1e-6)


def test_without_convert_batch_the_inputs_stay_nchw():
    model = convert_model(build("resnet"))
    probe = _train(model, Accelerator(cpu=True), steps=1)
    assert probe.first_conv_input == [False]


def test_prepare_channels_last_is_the_one_line(nchw_losses):
    accelerator = Accelerator(cpu=True)
    model = prepare_channels_last(build("resnet"), accelerator)
    probe = _train(model, accelerator)  # no convert_batch, no verify_layout in the loop
    hook = ChannelsLastInputs.of(model)
    assert probe.first_conv_input == [True] * 3 and all(conv_weights(model).values())
    assert hook.layout_checks["train"].verdict == "passed" and hook.autocast_dtype is None
    torch.testing.assert_close(probe.losses, nchw_losses, rtol=1e-4, atol=1e-6)
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))  # a positional image argument, in evaluation
    assert probe.first_conv_input[-1] and hook.layout_checks["eval"].verdict == "passed"


def test_prepare_channels_last_under_bf16():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = prepare_channels_last(build("resnet"), accelerator)
    probe = _train(model, accelerator, steps=1)
    assert ChannelsLastInputs.of(model).autocast_dtype == torch.bfloat16
    assert probe.first_conv_input == [True] and torch.isfinite(torch.tensor(probe.losses)).all()


def test_a_model_accelerate_compiles_is_not_raced():
    accelerator = Accelerator(cpu=True, dynamo_backend="eager")  # accelerator.prepare compiles the model
    model = prepare_channels_last(build("resnet"), accelerator)
    probe = _train(model, accelerator, steps=6)
    # the race's first NCHW step would be the 6th: not raced, as each switch would compile the model again
    assert probe.first_conv_input == [True] * 6
    assert ChannelsLastInputs.of(model).session.untimed == "torch.compile compiled the training step"


def test_a_model_compiled_after_the_hook_is_compiled_once():
    # the first forward's trace ran inside the compiled call: Dynamo compiled it as ~50 graphs, and again at the next
    # step (resnet18 at 64 px: a first step of 110 s against 42 s, then 10 s more)
    from cltrain.layout.tensors import compiled_frames

    accelerator = Accelerator(cpu=True, dynamo_backend="eager")
    model = prepare_channels_last(build("resnet"), accelerator, layout="channels_last")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch, frames = next(iter(DataLoader(dataset("resnet"), batch_size=4))), [compiled_frames()]
    for _ in range(3):
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        frames.append(compiled_frames())
    assert frames[1] - frames[0] <= 8 and frames[1] == frames[3], frames  # the hook's graph breaks: a few frames


def test_a_loop_run_given_the_prepared_optimizer_checks_its_first_batch():
    # ChannelsLastRun given accelerator.prepare's optimizer: "the check itself failed (AttributeError:
    # 'AcceleratedOptimizer' object has no attribute '_optimizer_step_pre_hooks')"
    from torch.nn import functional as F

    from cltrain.loops import ChannelsLastRun

    accelerator = Accelerator(cpu=True)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    run = ChannelsLastRun(model, optimizer, step=lambda m, b: F.cross_entropy(m(b[0]), b[1]), layout="channels_last")
    for x, y in run.batches([(torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 0, 1]))] * 2):
        accelerator.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    run.end()
    assert run.layout_checks["train"].verdict == "passed", run.layout_checks["train"]


@pytest.mark.parametrize("precision, faulty", [("no", True), ("bf16", True), ("bf16", False)])
def test_a_backward_that_assumes_nchw_is_found_in_a_model_giving_logits(precision, faulty):
    # the loop computes the loss: the check compared the forward alone and passed; under mixed precision the copies
    # kept accelerate's autocast forward, and the float32 check ran in bfloat16, whose noise hid the fault
    from tests.helpers.plain_modules import NCHWBackwardNet

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    model = prepare_channels_last(NCHWBackwardNet(faulty), accelerator, layout="channels_last")
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    accelerator.backward(nn.functional.cross_entropy(model(torch.randn(8, 3, 16, 16)), torch.randint(0, 10, (8,))))
    check = ChannelsLastInputs.of(model).layout_checks["train"]
    assert check.verdict == ("contiguous" if faulty else "passed"), check.line()


@pytest.mark.parametrize("kwargs, named", [
    ({"mode": "auto"}, "mode='auto'"), ({"inputs": 0}, "inputs=0"), ({"guard": 1}, "guard=1"),
    ({"inputs": "all"}, "inputs='all'"),  # the loop door's word; here it named a forward argument 'all'
])
def test_bad_arguments_are_named(kwargs, named):
    with pytest.raises(ValueError, match=f"prepare_channels_last\\({named}\\)"):
        prepare_channels_last(nn.Conv2d(3, 8, 3), Accelerator(cpu=True), **kwargs)


def test_a_model_that_is_not_a_module_or_is_prepared_already_is_one_line():
    import subprocess
    import sys

    with pytest.raises(ValueError, match=r"prepare_channels_last\(model='resnet'\): expected the model itself"):
        prepare_channels_last("resnet", Accelerator(cpu=True))
    for wrong in (None, "cpu"):  # an AttributeError on mixed_precision before
        with pytest.raises(ValueError, match=r"prepare_channels_last\(accelerator=.*\): expected the accelerate.Acc"):
            prepare_channels_last(nn.Conv2d(3, 8, 3), wrong)
    # after accelerator.prepare under DDP: the check ran DDP's collectives on rank 0 alone (gloo aborted)
    code = ("import torch, torch.distributed as dist; from torch import nn; from accelerate import Accelerator\n"
            "from cltrain.integrations.accelerate import prepare_channels_last\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
            "ddp = nn.parallel.DistributedDataParallel(nn.Conv2d(3, 8, 3))\n"
            "try:\n    prepare_channels_last(ddp, Accelerator(cpu=True))\n"
            "except ValueError as err:\n    print(err)\n"
            "dist.destroy_process_group()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "the model is already prepared; call prepare_channels_last(model, accelerator) before" in done.stdout, \
        done.stdout + done.stderr


def test_a_state_saved_after_the_optimizers_step_holds_that_step_of_the_race(tmp_path):
    # save_state in the loop's body, after optimizer.step(), before the next forward: the step ended only at that
    # forward, so the saved race lacked it and a resumed run was one step behind in the layouts' schedule
    accelerator = Accelerator(cpu=True)
    model = prepare_channels_last(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(1)), accelerator)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    for _ in range(5):
        accelerator.backward(model(torch.randn(2, 3, 8, 8)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    accelerator.save_state(str(tmp_path / "state"))
    (saved,) = json.loads((tmp_path / "state" / "cltrain_layout.json").read_text())["sessions"]
    assert [heat["position"] for heat in saved["race"]["racing"]] == [5]  # all five steps, the last one included


def _accelerate_run(tmp_path, cltrain: bool, resume=None, save=None):
    """Four AdamW steps of a small conv net in an Accelerate loop, with or without prepare_channels_last; from the
    state in ``resume``, saved to ``save``: the final parameters."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(1))
    if cltrain:
        model = prepare_channels_last(model, accelerator, layout="channels_last")
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    if resume:
        accelerator.load_state(str(resume))
    for _ in range(4):
        accelerator.backward(model(torch.randn(2, 3, 8, 8)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    if save:
        accelerator.save_state(str(save))
    return model, optimizer


@pytest.mark.parametrize("before, after", [(False, True), (True, False)], ids=["adopting", "dropping"])
def test_a_state_saved_with_or_without_cltrain_loads_in_a_run_that_differs(tmp_path, before, after):
    # registered for checkpointing, the session's state made Accelerate refuse the folder of a run without cltrain
    # ("Number of custom checkpoints ... does not match"), and a run without cltrain refused cltrain's folder
    _accelerate_run(tmp_path, before, save=tmp_path / "state")
    model, optimizer = _accelerate_run(tmp_path, after, resume=tmp_path / "state")
    conv = model[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) == after
    if after:  # the restored state takes its parameter's strides (without cltrain it keeps the saved ones: harmless)
        assert optimizer.state[conv]["exp_avg"].stride() == conv.stride()


def test_two_models_of_one_accelerator_keep_their_own_states(tmp_path):
    # a GAN's generator and discriminator: one file held the last model's state, and each model loaded it
    def run(resume=None):
        accelerator = Accelerator(cpu=True)
        made = [prepare_channels_last(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(1)), accelerator,
                                      layout=layout) for layout in ("channels_last", "contiguous")]
        prepared = accelerator.prepare(*made, *(torch.optim.AdamW(m.parameters()) for m in made))
        if resume:
            accelerator.load_state(str(resume))
        for model in prepared[:2]:
            model(torch.randn(2, 3, 8, 8)).square().mean().backward()
        return accelerator, [ChannelsLastInputs.of(m).session for m in made]

    accelerator, sessions = run()
    accelerator.save_state(str(tmp_path / "state"))
    saved = json.loads((tmp_path / "state" / "cltrain_layout.json").read_text())["sessions"]
    assert saved == [s.state_dict() for s in sessions] and saved[0] != saved[1]
    _, resumed = run(tmp_path / "state")
    first, second = (s.state_dict() for s in resumed)
    assert first["fingerprint"] == saved[0]["fingerprint"] and second == saved[1]
    assert "the checkpoint resumed from" in first["layout_checks"]["train"]["notes"][0]  # its own verdict, not checked


class _ListOfImages(nn.Module):
    """A detector's call: a list of 3-D images (``model(images, labels)``), stacked inside; a head written for NCHW
    (``view`` on the convolution's output, which a channels_last one refuses)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 8 * 8, 3)

    def forward(self, images: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(torch.stack(images)))
        return nn.functional.cross_entropy(self.fc(h.view(len(h), -1)), labels)


def test_a_forward_given_a_list_of_3d_images_is_checked_on_them_as_they_come():
    # no 4-D image argument: the check did not run ("no image argument to check"), and the step raised in channels_last
    model, accelerator = _ListOfImages(), Accelerator(cpu=True)
    prepare_channels_last(model, accelerator, layout="channels_last")
    optimizer = torch.optim.AdamW(model.parameters())
    wrapped, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(2):
        accelerator.backward(wrapped([torch.randn(3, 8, 8) for _ in range(2)], torch.tensor([0, 1])))
        optimizer.step()
        optimizer.zero_grad()
    check = ChannelsLastInputs.of(model).layout_checks["train"]
    assert check.verdict == "fallback" and "view" in check.line(), check.line()  # and the steps ran


def test_a_first_call_without_pixels_is_not_checked_rather_than_passed():
    # a vision-language model's text-only first batch (pixel_values=None): its forward ran no convolution on the
    # copies, and the check said "passed"
    class TextFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.patch = nn.Embedding(10, 4), nn.Conv2d(3, 4, 2, 2)

        def forward(self, input_ids, pixel_values=None):
            text = self.embed(input_ids).mean(1)
            return text if pixel_values is None else text + self.patch(pixel_values).mean((2, 3))

    model, accelerator = TextFirst(), Accelerator(cpu=True)
    prepare_channels_last(model, accelerator, layout="channels_last")
    wrapped = accelerator.prepare(model)
    wrapped(input_ids=torch.tensor([[1, 2, 3]])).sum().backward()
    check = ChannelsLastInputs.of(model).layout_checks["train"]
    assert check.verdict == "not checked" and "no image argument" in check.line(), check.line()
