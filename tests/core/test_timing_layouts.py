"""Auto layout: timing both layouts of a model and keeping the faster."""

import time

import pytest
import torch
from torch import nn

from cltrain import is_channels_last_1d, layout_of, layout_summary, to_channels_last
from cltrain.timing.layouts import choose_layout, time_layouts
from cltrain.timing.steps import model_in_layout, scalar_loss


class SlowIn(nn.Module):
    """Identity that sleeps when its input is in ``slow_layout``: a layer with a bad kernel for one layout."""

    def __init__(self, slow_layout: str, seconds: float = 0.25) -> None:
        super().__init__()
        self.slow_layout, self.seconds = slow_layout, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if layout_of(x) == self.slow_layout:
            time.sleep(self.seconds)
        return x


def slow_model(slow_layout: str) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), SlowIn(slow_layout), nn.ReLU(), nn.Conv2d(8, 4, 1))


@pytest.mark.parametrize(("slow", "expected"), [("channels_last", "contiguous"), ("contiguous", "channels_last")])
def test_choose_layout_picks_the_faster_layout(slow, expected):
    layout, seconds = choose_layout(slow_model(slow), (2, 3, 16, 16), steps=3, warmup=1)
    assert layout == expected
    assert seconds[slow] > seconds[expected] + 0.1


def test_choose_layout_logs_both_timings_and_the_decision(caplog):
    with caplog.at_level("INFO", logger="cltrain.timing.layouts"):
        layout, _ = choose_layout(slow_model("channels_last"), (2, 3, 16, 16), steps=1, warmup=0)
    assert "channels_last" in caplog.text and "contiguous" in caplog.text and f"-> {layout}" in caplog.text


def test_time_layouts_leaves_the_model_alone():
    model = slow_model("none")
    model(torch.randn(2, 3, 16, 16)).mean().backward()  # existing grads and BN stats
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.eval()
    seconds = time_layouts(model, (2, 3, 16, 16), steps=1, warmup=1)
    assert set(seconds) == {"channels_last", "contiguous"} and all(s > 0 for s in seconds.values())
    assert not model.training
    assert layout_summary(model) == {"contiguous": 2, "rank1": 4}
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())


def test_time_layouts_handles_5d_inputs():
    model = nn.Sequential(nn.Conv3d(2, 4, 3), nn.ReLU())
    assert set(time_layouts(model, (1, 2, 6, 6, 6), steps=1, warmup=0)) == {"channels_last", "contiguous"}


def test_time_layouts_runs_under_bf16_autocast():
    seconds = time_layouts(slow_model("none"), (2, 3, 16, 16), steps=1, warmup=0, autocast_dtype=torch.bfloat16)
    assert all(s > 0 for s in seconds.values())


@pytest.mark.parametrize("shape", [(16, 16), (2, 3, 4, 4, 4, 4)])
def test_time_layouts_rejects_other_ranks(shape):
    with pytest.raises(ValueError, match="3-D, 4-D or 5-D"):
        time_layouts(slow_model("none"), shape)


class SlowIn1d(nn.Module):
    """A Conv1d net that sleeps when its input has channels-last 1-D strides (or NCL ones)."""

    def __init__(self, slow_channels_last: bool) -> None:
        super().__init__()
        self.slow_channels_last = slow_channels_last
        self.conv = nn.Conv1d(2, 8, 5)
        self.up = nn.ConvTranspose1d(8, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_channels_last_1d(x) == self.slow_channels_last and x.shape[1] > 1:
            time.sleep(0.2)
        return self.up(torch.relu(self.conv(x)))


@pytest.mark.parametrize("slow_channels_last", [True, False])
def test_choose_layout_times_1d_models_with_channels_last_1d_strides(slow_channels_last):
    layout, seconds = choose_layout(SlowIn1d(slow_channels_last), (2, 2, 64), steps=2, warmup=1)  # a first call builds kernels
    assert layout == ("contiguous" if slow_channels_last else "channels_last")
    assert abs(seconds["channels_last"] - seconds["contiguous"]) > 0.1


def test_model_in_layout_conv1d_and_back():
    cl = model_in_layout(SlowIn1d(True), "channels_last", conv1d=True)
    assert is_channels_last_1d(cl.conv.weight) and is_channels_last_1d(cl.up.weight)
    assert not is_channels_last_1d(model_in_layout(SlowIn1d(True), "channels_last").conv.weight)
    back = model_in_layout(cl, "contiguous")
    assert back.conv.weight.is_contiguous() and back.up.weight.is_contiguous()


def test_model_in_layout_copies_and_converts():
    model = to_channels_last(slow_model("none"))
    contiguous = model_in_layout(model, "contiguous")
    assert layout_summary(contiguous)["contiguous"] == 2 and layout_summary(model)["channels_last"] == 2
    assert layout_summary(model_in_layout(contiguous, "channels_last"))["channels_last"] == 2
    with pytest.raises(ValueError, match="'nhwc'"):
        model_in_layout(model, "nhwc")


def test_scalar_loss_sums_every_float_output_that_requires_grad():
    a, b = torch.ones(2, 3, requires_grad=True), torch.full((4,), 2.0, requires_grad=True)
    assert scalar_loss({"main": a, "aux": (b, torch.zeros(2, dtype=torch.long))}).item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="no floating tensor"):
        scalar_loss(torch.ones(2))


def test_scalar_loss_gives_a_4d_output_a_channels_last_gradient():
    out = to_channels_last(torch.randn(2, 3, 4, 4)).requires_grad_()
    loss = scalar_loss(out)
    assert loss.item() == pytest.approx(out.mean().item(), abs=1e-6)
    loss.backward()
    assert layout_of(out.grad) == "channels_last"
