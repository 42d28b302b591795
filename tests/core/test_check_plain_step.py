"""cltrain.check.plain_step: a plain step checked in both layouts on copies; the model itself is not touched."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cltrain.check.plain_step import check_plain_step
from cltrain.loops import convert_model
from tests.helpers.user_code import FilterNormSGD, ViewHead, ViewHeadFlat


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)


def _step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def test_code_that_assumes_nchw_is_found_and_layout_agnostic_code_passes() -> None:
    torch.manual_seed(0)
    for model, verdict in ((ViewHead(), "fallback"), (ViewHeadFlat(), "passed")):
        model = convert_model(model)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        result = check_plain_step(model, _batch(), _step, samples=None)
        assert result.verdict == verdict, result.line()
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is not touched
        assert all(p.grad is None for p in model.parameters())


def test_an_optimizer_whose_update_reads_nchw_memory_is_run_on_copies_and_found() -> None:
    # FilterNormSGD normalises each filter through a view of the gradient's memory as NCHW: only its step diverges
    torch.manual_seed(0)
    model = convert_model(ViewHeadFlat())
    optimizer = FilterNormSGD(model.parameters(), lr=0.1)
    with_update = check_plain_step(model, _batch(), _step, optimizer=optimizer, samples=None)
    without = check_plain_step(model, _batch(), _step, samples=None)  # the control: the step alone passes
    assert without.verdict == "passed" and with_update.verdict != "passed", with_update.line()
    assert all(not s for s in optimizer.state.values())  # the optimizer's own state is not touched
