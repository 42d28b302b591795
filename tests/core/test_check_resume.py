"""cltrain.check.resume: the verdict a checkpoint carries, and what decides that a resumed run is the same one."""

from __future__ import annotations

import lightning.pytorch as pl
from torch import nn

from cltrain.check.fallback import Fallback
from cltrain.check.resume import RESTORED, restored_check, run_fingerprint, saved_check
from cltrain.check.result import LayoutCheck


def _fingerprint(module: pl.LightningModule, precision: str = "32-true") -> str:
    return run_fingerprint(module, precision=precision, device="cpu", code=[type(module).training_step])


def _module(width: int = 4, edited: bool = False) -> pl.LightningModule:
    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, width, 3)

        if edited:
            def training_step(self, batch, batch_idx):
                return self.conv(batch).sum() * 2
        else:
            def training_step(self, batch, batch_idx):
                return self.conv(batch).sum()

    return Net()


def test_the_fingerprint_is_the_same_for_the_same_run_and_changes_with_the_model_step_or_precision() -> None:
    same = _fingerprint(_module())
    assert _fingerprint(_module()) == same
    assert _fingerprint(_module(), "bf16-mixed") != same
    assert _fingerprint(_module(width=8)) != same
    assert _fingerprint(_module(edited=True)) != same  # an edit to the step's code


def test_a_saved_verdict_comes_back_with_its_fallbacks_and_says_where_it_came_from() -> None:
    check = LayoutCheck("fallback", fallbacks=(Fallback("module", "head"),), notes=("a note",))
    restored = restored_check(saved_check(check))
    assert restored.verdict == "fallback" and restored.fallbacks == check.fallbacks
    assert restored.notes == ("a note", RESTORED) and RESTORED in restored.line()
    again = restored_check(saved_check(restored))  # a resumed run's checkpoint, resumed: said once
    assert again.notes == ("a note", RESTORED) and again.line().count(RESTORED) == 1
