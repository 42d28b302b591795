"""cltrain.check.events: the key the check's runs are compared by names its module and its phase."""

from __future__ import annotations

import pytest

from cltrain.check.events import Event


@pytest.mark.parametrize("event,module,phase", [
    (Event("forward-in", "layer1.0.conv1#2"), "layer1.0.conv1", "forward"),
    (Event("forward-out", "head#0"), "head", "forward"),
    (Event("grad-in", "layer1.0.bn1#0", 1), "layer1.0.bn1", "backward"),
    (Event("grad-out", "stem.conv#0"), "stem.conv", "backward"),
    (Event("param", "layer1.0.conv1.weight"), "layer1.0.conv1", "backward"),
    (Event("update", "fc.bias"), "fc", "update"),
    (Event("result"), None, "step"),
])
def test_each_kind_names_its_module_and_phase(event, module, phase):
    assert event.module == module and event.phase == phase


def test_a_module_named_like_a_call_keeps_its_dots_and_an_event_is_a_dict_key():
    # a parameter's module is everything before its last dot; a call's, everything before its '#'
    assert Event("forward-out", "blocks.1.attn#3").module == "blocks.1.attn"
    assert Event("param", "blocks.1.attn.qkv.weight").module == "blocks.1.attn.qkv"
    seen = {Event("param", "fc.weight"): 1}
    assert seen[Event("param", "fc.weight", 0)] == 1 and Event("param", "fc.weight", 1) not in seen
    assert Event("grad-in", "fc#0", 1).describe() == "grad-in of fc#0" and Event("result").describe() == "result of the result"
