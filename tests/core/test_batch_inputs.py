"""``cltrain.batch_inputs``: the one input path of every door, on its own."""

from __future__ import annotations

import torch
from torch import nn

from cltrain.batch_inputs import BatchInputs
from cltrain.layout import is_channels_last, to_channels_last


def _said() -> tuple[list[str], BatchInputs]:
    said: list[str] = []
    return said, BatchInputs(lambda line, warn: said.append(line))


def test_in_place_it_converts_the_input_alone_and_gives_the_loaders_tensors_back() -> None:
    said, inputs = _said()
    x, heatmap = torch.randn(2, 3, 8, 8), torch.rand(2, 5, 8, 8)
    batch = (x, heatmap)
    assert inputs.convert(batch, "train", nn.Conv2d(3, 4, 3), "channels_last") is batch
    assert is_channels_last(x) and heatmap.is_contiguous() and batch[0] is x  # the same objects, restrided
    inputs.restore()
    assert x.is_contiguous() and not is_channels_last(x)  # a loader that hands the same tensor out again finds it so


def test_not_in_place_it_builds_a_new_batch_and_autograd_reaches_the_callers_tensor() -> None:
    _, inputs = _said()
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    new = inputs.convert({"pixel_values": x, "labels": torch.tensor([0, 1])}, "train", nn.Conv2d(3, 4, 3),
                         "channels_last", in_place=False)
    assert is_channels_last(new["pixel_values"]) and not is_channels_last(x) and new["labels"].tolist() == [0, 1]
    new["pixel_values"].sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones_like(x))


def test_an_input_the_model_reshapes_before_any_convolution_is_left_as_it_arrives(caplog) -> None:
    class Frames(nn.Module):  # (B, T, C, H, W) flattened to (B*T, C, H, W): the stack's layout reaches no conv
        def __init__(self) -> None:
            super().__init__()
            self.conv = to_channels_last(nn.Conv2d(3, 4, 3))

        def forward(self, x):
            return self.conv(x.contiguous().flatten(0, 1))

    said, inputs = _said()
    model = Frames()
    for _ in range(2):
        batch = (torch.randn(2, 4, 3, 8, 8),)
        inputs.convert(batch, "train", model, "channels_last")
        inputs.start_trace(model, "channels_last")
        model(batch[0])
        inputs.end_trace()
        inputs.restore()
    assert inputs.trace.left_as_is["train"] == frozenset({0})
    assert [line for line in said if "reaches no convolution" in line] and len(said) == 1
    assert "a convolution gets it only out of that format" in said[0], said  # not "replaces it": it reaches conv
    assert batch[0].is_contiguous()  # the second batch was not converted


def test_an_input_no_convolution_gets_is_said_to_be_replaced() -> None:
    class Replaces(nn.Module):  # the forward computes on a tensor of its own: the input reaches nothing
        def __init__(self) -> None:
            super().__init__()
            self.conv = to_channels_last(nn.Conv2d(3, 4, 3))

        def forward(self, x):
            return self.conv(torch.zeros(2, 3, 8, 8).to(memory_format=torch.channels_last)) + x.mean()

    said, inputs = _said()
    model, batch = Replaces(), (torch.randn(2, 3, 8, 8),)
    inputs.convert(batch, "train", model, "channels_last")
    inputs.start_trace(model, "channels_last")
    model(batch[0])
    inputs.end_trace()
    assert len(said) == 1 and "or other code replaces it, first" in said[0], said


def _steps(inputs: BatchInputs, model: nn.Module, make, n: int = 3) -> None:
    """``n`` batches through ``inputs`` as a door runs them: convert, trace the forward, give the tensors back."""
    for _ in range(n):
        batch = (make(),)
        inputs.convert(batch, "eval", model, "channels_last")
        inputs.start_trace(model, "channels_last")
        model(batch[0])
        inputs.end_trace()
        inputs.restore()


def test_batches_arriving_in_another_layout_are_said_once_and_channels_last_ones_not_at_all() -> None:
    said, inputs = _said()
    model = to_channels_last(nn.Conv2d(3, 4, 3))
    _steps(inputs, model, lambda: torch.randn(2, 3, 8, 8))
    assert len([line for line in said if "arrive in another layout" in line]) == 1
    quiet, nhwc = _said()
    _steps(nhwc, model, lambda: to_channels_last(torch.randn(2, 3, 8, 8)))
    assert quiet == []


def test_a_batch_without_a_model_input_it_can_find_is_said_once() -> None:
    said, inputs = _said()
    batch = {"scan": torch.randn(2, 3, 8, 8), "target": torch.tensor([0, 1])}
    for _ in range(2):
        inputs.convert(batch, "train", nn.Conv2d(3, 4, 3), "channels_last")
    assert len(said) == 1 and "inputs=KEY" in said[0] and "'scan'" in said[0]
    assert batch["scan"].is_contiguous()


def test_a_detectors_list_of_images_is_found_below_the_batch_only() -> None:
    # a batch (x, y) of two 3-D tensors (a spectrogram and its target) was taken for a list of two images
    from cltrain.layout.batches import first_image_list

    spectrogram, target = torch.randn(8, 16, 20), torch.randn(8, 16, 20)
    assert first_image_list((spectrogram, target)) is None
    images = [torch.randint(0, 255, (3, 10, 12), dtype=torch.uint8), torch.rand(3, 9, 8)]  # a model normalises them
    found = first_image_list((images, [{"boxes": torch.ones(1, 4)}] * 2))
    assert found is not None and len(found) == 2 and found[0] is images[0]
