"""The fallback search (``cltrain.check.search.FallbackSearch``) and the event key (``cltrain.check.events.Event``),
driven by hand: which fallback comes next for each fault a run shows, with no model run."""

from __future__ import annotations

import pytest
from torch import nn

from cltrain.check.events import Event
from cltrain.check.fallback import Fallback
from cltrain.check.result import Finding
from cltrain.check.search import FallbackSearch


class Block(nn.Module):  # a class defined outside torch: a fault in one instance is tried in all
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return self.conv(x)


def _model() -> nn.Module:
    return nn.Sequential(Block(), Block(), Block())


def _fault(module: str, position: int, phase: str = "forward") -> tuple:
    return Finding("raised", phase, module, None, "RuntimeError: view"), position, (module, None), phase


def test_a_fault_that_moves_on_keeps_the_fallback_and_widens_it_to_the_class():
    search = FallbackSearch(_model())
    assert search.learn(*_fault("0", 10))
    assert search.fallbacks == [Fallback("module", "0")]  # the smallest candidate first
    assert search.learn(*_fault("9", 20))  # the fault moved on: verified; every Block at once
    assert search.fallbacks == [Fallback("module", "0", group="Block"), Fallback("module", "1", group="Block"),
                                Fallback("module", "2", group="Block")]
    assert search.findings[0].others == 2 and search.findings[0].module_type == "Block"


def test_a_class_wide_fallback_that_does_worse_is_kept_on_the_one_instance():
    search = FallbackSearch(_model())
    search.learn(*_fault("0", 10))
    search.learn(*_fault("9", 20))  # widened
    assert search.learn(*_fault("1", 5))  # no further than before: back to the one instance
    assert search.fallbacks == [Fallback("module", "0")]
    assert search.findings[0].others == 0 and search.findings[0].module_type is None


def test_a_fallback_that_does_not_move_the_fault_is_replaced_by_the_next_candidate():
    search = FallbackSearch(nn.Sequential(nn.Sequential(nn.Conv2d(3, 3, 1))))
    assert search.learn(*_fault("0.0", 10))
    assert search.fallbacks == [Fallback("module", "0.0")]
    assert search.learn(*_fault("0.0", 10))  # the same place: the enclosing module instead
    assert search.fallbacks == [Fallback("module", "0")]
    assert not search.learn(*_fault("0.0", 10))  # only the whole model is left: the search ends
    assert len(search.findings) == 1


def test_a_fault_after_the_backward_tries_the_weights_in_nchw():
    search = FallbackSearch(_model())
    assert search.learn(Finding("diverged", "update", None, None, "0.5"), 30, (None, None), "update")
    assert search.fallbacks == [Fallback("weights", "")]


@pytest.mark.parametrize("event,module,phase,text", [
    (Event("forward-out", "layer1.0.conv1#2"), "layer1.0.conv1", "forward", "forward-out of layer1.0.conv1#2"),
    (Event("grad-in", "fc#0", 1), "fc", "backward", "grad-in of fc#0"),
    (Event("param", "layer1.0.conv1.weight"), "layer1.0.conv1", "backward", "param of layer1.0.conv1.weight"),
    (Event("update", "fc.bias"), "fc", "update", "update of fc.bias"),
    (Event("result"), None, "step", "result of the result"),
])
def test_an_event_names_its_module_phase_and_place(event, module, phase, text):
    assert (event.module, event.phase, event.describe()) == (module, phase, text)
    assert event == Event(*event) and len({event, Event(*event)}) == 1  # a dictionary key by value
