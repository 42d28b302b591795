"""Small Lightning projects in the styles users write (``tests.helpers.user_projects``), under the standalone
``pytorch_lightning`` package and ``lightning``, each in its own process: the check passes (their code is right in
either layout), the run with it trains exactly as the run without it (nothing of the real run changed), and
channels_last trains like NCHW within the noise of NCHW with its weights nudged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cltrain.layout.closures import rebound
from tests.helpers.user_projects import run_project

CASES = [("notebook", "pytorch_lightning"), ("energy", "pytorch_lightning"), ("flow", "pytorch_lightning"),
         ("uint8", "lightning"), ("probe", "lightning"), ("reads_trainer", "lightning")]


@pytest.mark.slow
@pytest.mark.parametrize(("project", "package"), CASES)
def test_a_users_project_trains_the_same_with_the_check_and_the_check_is_true(project: str, package: str) -> None:
    runs = run_project(project, package)
    checked, unchecked, nchw, nudged = runs["checked"], runs["unchecked"], runs["nchw"], runs["nudged"]
    assert not any(r["error"] for r in runs.values()), runs
    assert checked["verdicts"] and set(checked["verdicts"].values()) == {"passed"}, checked["lines"]
    assert all(len(line) <= 300 for line in checked["lines"].values()), checked["lines"]
    # Nothing of the real run changed: with the check it trains bit for bit as without it.
    assert checked["losses"] == unchecked["losses"] and checked["weights"] == unchecked["weights"]
    # The verdict is true: channels_last without the check stays within the noise reference of NCHW.
    noise = max(abs(a - b) for a, b in zip(nchw["losses"], nudged["losses"]))
    gap = max(abs(a - b) for a, b in zip(nchw["losses"], unchecked["losses"]))
    assert gap <= max(10 * noise, 1e-5), (gap, noise)


class _Probe:
    """A callback holding the model, as online-probe callbacks do."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module


def test_a_closure_over_a_callback_that_holds_the_model_reaches_the_copy() -> None:
    # The mechanism behind the probe project (its negative control: the same project with plain closures is
    # "skipped: the step changed the real model ... probes.probe.weight (gradient)").
    real = nn.Linear(2, 2)
    probe = _Probe(real)
    hook = lambda: probe.module.weight  # noqa: E731 - a closure, as a library registers it
    memo: dict[int, object] = {}
    clone = __import__("copy").deepcopy(real, memo)
    moved = rebound(hook, memo)
    assert moved() is clone.weight and hook() is real.weight and probe.module is real
    assert rebound(lambda: torch.zeros(1), memo)().shape == (1,)  # a closure holding nothing original is kept
