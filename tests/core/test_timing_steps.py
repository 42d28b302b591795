"""cltrain.timing.steps: a training step as a callable, and the one builder of "a step in each layout": each copy
and its input in its layout, the optimizer stepping the copies, the given model untouched."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from cltrain import is_channels_last_1d, layout_of
from cltrain.timing.steps import layout_steps, training_step


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4))


def test_a_training_step_steps_the_optimizer_and_leaves_the_loss_on_the_device() -> None:
    model, x, y = net(), torch.randn(2, 3, 8, 8), torch.tensor([0, 3])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    step = training_step(model, lambda: F.cross_entropy(model(x), y), optimizer=opt, autocast_dtype=torch.bfloat16)
    before = model[5].weight.detach().clone()
    loss = step()
    assert not loss.requires_grad and loss.dim() == 0 and seen == [torch.bfloat16]
    assert not torch.equal(before, model[5].weight)
    plain = training_step(model, lambda: F.cross_entropy(model(x), y))  # no optimizer: gradients only
    kept = model[5].weight.detach().clone()
    plain()
    assert torch.equal(kept, model[5].weight) and model[5].weight.grad is not None


def convs_run(step) -> list[tuple[str, str]]:
    """(input layout, weight layout) of every convolution ``step`` runs (they run in copies of the model)."""
    seen: list[tuple[str, str]] = []

    def note(module: nn.Module, args: tuple) -> None:
        if isinstance(module, (nn.Conv1d, nn.Conv2d)):
            seen.append(tuple(("channels_last" if is_channels_last_1d(t) else "contiguous") if t.dim() == 3
                              else layout_of(t) for t in (args[0], module.weight)))

    hook = register_module_forward_pre_hook(note)
    try:
        assert step().dim() == 0
    finally:
        hook.remove()
    return seen


def test_layout_steps_train_a_copy_per_layout_and_leave_the_model_alone() -> None:
    model = net()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    steps = layout_steps(model, torch.randn(2, 3, 8, 8), targets=torch.tensor([1, 2]),
                         loss=lambda output, targets: F.cross_entropy(output, targets),
                         optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert list(steps) == ["contiguous", "channels_last"]
    assert {layout: convs_run(step) for layout, step in steps.items()} == {
        "contiguous": [("contiguous", "contiguous")], "channels_last": [("channels_last", "channels_last")]}
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and layout_of(model[0].weight) == "contiguous"


def test_a_1d_input_and_its_conv_weights_get_channels_last_1d_strides() -> None:
    steps = layout_steps(nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU()), torch.randn(2, 2, 16))
    assert convs_run(steps["channels_last"]) == [("channels_last", "channels_last")]
    assert convs_run(steps["contiguous"]) == [("contiguous", "contiguous")]
