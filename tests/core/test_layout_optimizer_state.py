"""cltrain.layout.optimizer_state: optimizer state takes its parameter's strides (a restored checkpoint, a verdict that
changed a parameter's layout), and the check's pre-step hook does it for its own parameters only."""

from __future__ import annotations

import torch

from cltrain.layout.optimizer_state import restride_optimizer_state, state_in_param_strides

CL = torch.channels_last


def _param(layout: torch.memory_format = CL) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(4, 3, 3, 3).to(memory_format=layout))


def _stepped(optimizer_class, param, **options) -> torch.optim.Optimizer:
    optimizer = optimizer_class([param], lr=0.1, **options)
    param.grad = torch.randn_like(param)
    optimizer.step()
    return optimizer


def test_restored_momentum_and_adam_moments_take_their_parameters_strides_with_their_values():
    for optimizer_class, options in ((torch.optim.SGD, {"momentum": 0.9}), (torch.optim.AdamW, {})):
        param = _param()
        optimizer = _stepped(optimizer_class, param, **options)
        state = optimizer.state[param]
        saved = {k: v.contiguous() for k, v in state.items() if v.dim() == 4}  # as a checkpoint restores them
        state.update(saved)
        assert all(v.stride() != param.stride() for v in saved.values())  # the control: NCHW state
        restride_optimizer_state([optimizer])
        for key, value in saved.items():
            assert state[key].stride() == param.stride() and torch.equal(state[key], value), key


def test_a_wrapper_holding_the_optimizer_is_restrided_and_scalars_are_left_alone():
    param = _param()
    optimizer = _stepped(torch.optim.Adam, param)
    optimizer.state[param]["exp_avg"] = optimizer.state[param]["exp_avg"].contiguous()
    step = optimizer.state[param]["step"]

    class Wrapper:  # Lightning's and Accelerate's optimizers hold the torch one as .optimizer
        def __init__(self, inner):
            self.optimizer = inner

    restride_optimizer_state([Wrapper(optimizer)])
    assert optimizer.state[param]["exp_avg"].stride() == param.stride() and optimizer.state[param]["step"] is step


def test_a_parameter_dense_in_neither_layout_keeps_its_state_as_it_is():
    base = torch.randn(4, 3, 3, 6)[..., ::2]  # a strided view: neither NCHW- nor channels_last-dense
    param = torch.nn.Parameter(base)
    optimizer = _stepped(torch.optim.SGD, param, momentum=0.9)
    buffer = optimizer.state[param]["momentum_buffer"]
    restride_optimizer_state([optimizer])
    assert optimizer.state[param]["momentum_buffer"] is buffer


def test_the_pre_step_hook_restrides_its_own_parameters_only_and_stops_when_removed():
    mine, other = _param(), _param()
    optimizer = torch.optim.SGD([mine, other], lr=0.1, momentum=0.9)
    for p in (mine, other):
        p.grad = torch.randn_like(p)
    optimizer.step()
    for p in (mine, other):
        optimizer.state[p]["momentum_buffer"] = optimizer.state[p]["momentum_buffer"].contiguous()
    handle = state_in_param_strides([mine])
    try:
        optimizer.step()  # the hook runs before the step
    finally:
        handle.remove()
    assert optimizer.state[mine]["momentum_buffer"].stride() == mine.stride()
    assert optimizer.state[other]["momentum_buffer"].stride() != other.stride()
    optimizer.state[mine]["momentum_buffer"] = optimizer.state[mine]["momentum_buffer"].contiguous()
    optimizer.step()  # removed: nothing restrides it
    assert optimizer.state[mine]["momentum_buffer"].stride() != mine.stride()
