"""cltrain.check.plain_step: a plain step checked in both layouts on copies; the model itself is not touched."""

from __future__ import annotations

import pytest
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


def test_a_loss_that_reads_the_outputs_memory_as_nchw_gets_the_outputs_in_nchw() -> None:
    # silent (as_strided, no error): its gradient differs first at the head's output, and the whole model went NCHW
    def step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = model(batch[0])
        n, c, h, w = out.shape
        return F.cross_entropy(torch.as_strided(out, (n, c, h * w), (c * h * w, h * w, 1)), batch[1].flatten(1))

    torch.manual_seed(0)
    model = convert_model(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                              torch.nn.ReLU(), torch.nn.Conv2d(8, 3, 1)))
    result = check_plain_step(model, (torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4, 8, 8))), step, samples=None)
    assert result.verdict == "fallback" and [f.kind for f in result.fallbacks] == ["outputs"], result.line()


@pytest.mark.parametrize("faulty", [True, False])
def test_a_step_giving_logits_has_its_backward_checked(faulty: bool) -> None:
    # a step returning the model's logits (no loss) had its forward alone compared: a bad custom backward passed
    from tests.helpers.plain_modules import NCHWBackwardNet

    torch.manual_seed(0)
    model = convert_model(NCHWBackwardNet(faulty))
    result = check_plain_step(model, _batch(), lambda m, batch: m(batch[0]), samples=None)
    assert result.verdict == ("contiguous" if faulty else "passed"), result.line()


def test_an_optimizer_whose_update_reads_nchw_memory_is_run_on_copies_and_found() -> None:
    # FilterNormSGD normalises each filter through a view of the gradient's memory as NCHW: only its step diverges
    torch.manual_seed(0)
    model = convert_model(ViewHeadFlat())
    optimizer = FilterNormSGD(model.parameters(), lr=0.1)
    with_update = check_plain_step(model, _batch(), _step, optimizer=optimizer, samples=None)
    without = check_plain_step(model, _batch(), _step, samples=None)  # the control: the step alone passes
    assert without.verdict == "passed" and with_update.verdict != "passed", with_update.line()
    assert all(not s for s in optimizer.state.values())  # the optimizer's own state is not touched


class _Holder:
    """An object deepcopy refuses (it holds a lock), holding ``model``: the copy's holder must hold the copy."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        import threading

        self.lock, self.model = threading.Lock(), model


class _Refuses:
    """An object deepcopy refuses itself, holding ``model``: a copy sharing it would reach the real model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __deepcopy__(self, memo: dict) -> None:
        raise TypeError("cannot pickle '_Refuses' object")


def test_an_attribute_deepcopy_refuses_is_shared_with_the_copies_unless_it_reaches_the_real_model(tmp_path) -> None:
    # an open file or a lock on the model: deepcopy raised, and the check did not run at all
    model = convert_model(ViewHead())
    with open(tmp_path / "log.txt", "w") as log:
        model.conv1.log, model.lock = log, _Holder(None)
        result = check_plain_step(model, _batch(), _step, samples=None)
    assert result.verdict == "fallback", result.line()
    assert result.notes[-1] == "shared with the copies: self.lock (_Holder), self.conv1.log (TextIOWrapper)"
    # a helper holding the model and a lock: the lock alone is shared, and the copy's helper holds the copy (the check
    # was skipped, and the head's view raised at the first real step)
    model.lock = _Holder(model)
    result = check_plain_step(model, _batch(), _step, samples=None)
    assert result.verdict == "fallback" and "copies: self.lock.lock (lock)" in result.notes[-1], result.line()
    model.conv2.lock, model.fc.lock = _Holder(None), _Holder(None)  # four: the line names two, and says how many more
    result = check_plain_step(model, _batch(), _step, samples=None)
    assert "shared with the copies: self.lock.lock (lock), self.conv1.log (TextIOWrapper) and 2 more" in result.notes
    assert "shared with the copies: self.lock.lock (lock)" in result.line(), result.line()
    model.lock = _Refuses(model)  # shared, a copy's step could run the real model through it: not checked (the doors
    with pytest.raises(TypeError, match="cannot pickle"):  # say "the check itself failed (TypeError: ...)")
        check_plain_step(model, _batch(), _step, samples=None)


def test_finding_what_deepcopy_refuses_makes_no_trial_copy_of_the_model() -> None:
    # each attribute that held the model was deep-copied whole to try it: on a device, the model's memory twice
    import copy as copy_module

    from cltrain.check.copies import _share_uncopyable

    class Counted(torch.nn.Conv2d):
        copies = 0

        def __deepcopy__(self, memo):
            Counted.copies += 1
            return copy_module.deepcopy(torch.nn.Conv2d(3, 4, 3), memo)

    model = torch.nn.Sequential(Counted(3, 4, 3))
    model.helper = _Holder(model)
    shared = _share_uncopyable(model, {})
    assert list(shared) == ["self.helper.lock (lock)"] and Counted.copies == 0
