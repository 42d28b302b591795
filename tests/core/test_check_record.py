"""cltrain.check.record: one step recorded module by module, what a raise leaves, and the model left as it was."""

from __future__ import annotations

import copy
import gc

import torch
import torch.nn.functional as F
from torch import nn

from cltrain.check.events import Event
from cltrain.check.randomness import rng_state
from cltrain.check.record import execute
from cltrain.check.signature import Vectors, distance


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))


def _step(model: nn.Module, layout: str) -> torch.Tensor:
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    return F.cross_entropy(model(x), torch.tensor([0, 1]))


def test_a_step_is_recorded_call_by_call_and_the_same_step_in_either_layout_agrees() -> None:
    model, rng, vectors = _net(), rng_state(), Vectors()
    nchw = execute(model, _step, "contiguous", rng, vectors, updates=True)
    assert nchw.raised is None and nchw.keys[0] == Event("forward-in", "#0")  # the whole model's call first
    assert {Event("forward-out", "0#0"), Event("grad-out", "0#0"), Event("param", "0.weight"), Event("result"),
            Event("update", "0.weight")} <= set(nchw.keys)
    assert all(isinstance(v, float) for _, values in nchw.signatures[Event("result")] for v in values)  # on the host
    assert all(p.grad is None for p in model.parameters())  # the model is left without gradients

    other = copy.deepcopy(model).to(memory_format=torch.channels_last)
    cl = execute(other, _step, "channels_last", rng, vectors, updates=True)
    assert cl.keys == nchw.keys
    assert max(distance(nchw.signatures[k], cl.signatures[k]) for k in nchw.keys) < 1e-3  # rounding only


def test_a_raise_names_its_phase_and_module_and_one_the_users_code_caught_is_none() -> None:
    class Raises(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.view(x.shape[0], -1) if x.is_contiguous() else x.view(-1)  # raises on a 3-D view only

    class Catches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Raises()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            try:
                return self.inner(x.permute(0, 2, 3, 1))
            except RuntimeError:
                return x.flatten(1)

    def step(model: nn.Module, layout: str) -> torch.Tensor:
        return model(torch.randn(2, 3, 4, 4, requires_grad=True)).sum()

    raised = execute(nn.Sequential(Raises()), lambda m, _: m(torch.randn(2, 3, 4, 4).permute(0, 2, 3, 1)).sum(),
                     "contiguous", rng_state(), Vectors())
    assert raised.raised is not None and raised.raised.phase == "forward" and raised.raised.context[0] == "0"
    caught = execute(nn.Sequential(Catches()), step, "contiguous", rng_state(), Vectors())
    assert caught.raised is None and Event("result") in caught.keys



def test_a_check_that_saw_a_raise_leaves_no_copy_of_the_model_alive() -> None:
    # the raise's traceback held the copies' activations, whose gradient hooks (held by autograd) held the recorder:
    # the copies lived for the whole run, on the model's device, and a file they shared was never flushed
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from cltrain import ChannelsLast
    from tests.helpers.user_code import Classifier, ViewHead

    callback = ChannelsLast(layout="channels_last")
    data = DataLoader(TensorDataset(torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,))), batch_size=4)
    pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=[callback]).fit(Classifier(ViewHead()), data)
    assert callback.layout_checks["train"].verdict == "fallback", callback.layout_checks["train"].line()
    gc.collect()
    assert sum(isinstance(o, ViewHead) for o in gc.get_objects()) == 1
