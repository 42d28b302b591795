"""The search for the fallbacks a channels_last step needs: what each run found, and the fallback to try next.

Each run of the channels_last copy either agrees with the NCHW run or shows its first fault (a finding at a
position among the run's events). A fault further along than the last one means the last fallback worked: the fault
is recorded, and its candidates (``cltrain.check.localise.candidates``) are tried in turn. A fallback verified on one
instance of a class is tried on every instance at once, and kept on the one instance if that does worse. A fault at
the same position means the last fallback did not help: the next candidate replaces it.

Example::

    search = FallbackSearch(model)
    while (fault := fault_of(run_with(search.fallbacks))) is not None:
        if not search.learn(*fault):
            break  # nothing left to try: the whole model stays NCHW
"""

from __future__ import annotations

import dataclasses

from torch import nn

from cltrain.check.fallback import Fallback
from cltrain.check.localise import candidates, class_wide
from cltrain.check.result import Finding

__all__ = ["FallbackSearch"]


class FallbackSearch:
    """The fallbacks in place and the findings so far (``fallbacks``, ``findings``); ``learn`` takes each run's
    fault and says whether there is a next fallback to try."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.fallbacks: list[Fallback] = []
        self.findings: list[Finding] = []
        self._pending: list[Fallback] = []  # the candidates of the last finding not tried yet
        self._widened: list[Fallback] = []  # the instances of a class just given the verified fallback
        self._classes: set[str] = set()  # the classes already widened to
        self._position = -1  # where the last finding was

    def learn(self, finding: Finding, position: int, context: tuple[str | None, str | None], phase: str) -> bool:
        """Take the fault the last run (with ``fallbacks``) showed; ``False``: no fallback is left to try."""
        if position > self._position:  # the last fallback moved the fault (or this is the first fault)
            wide = class_wide(self.model, self.fallbacks[-1], self.findings[-1].module) \
                if self.fallbacks and not self._widened else []
            if wide and wide[0].group not in self._classes:  # verified on one instance: every instance, one more run
                self._classes.add(wide[0].group)
                self.fallbacks[-1] = dataclasses.replace(self.fallbacks[-1], group=wide[0].group)
                self.findings[-1] = dataclasses.replace(self.findings[-1], others=len(wide), module_type=wide[0].group)
                self._widened = wide
                self.fallbacks += wide
                return True
            self._widened = []
            self.findings.append(finding)
            self._pending = [c for c in candidates(context, phase) if c not in self.fallbacks]
            self._position = position
        elif self._widened:  # the class-wide fallback did worse than the one instance's: keep that one
            self.fallbacks = [f for f in self.fallbacks if f not in self._widened]
            self.fallbacks[-1] = dataclasses.replace(self.fallbacks[-1], group="")
            self.findings[-1] = dataclasses.replace(self.findings[-1], others=0, module_type=None)
            self._widened = []
            return True
        elif self.fallbacks:  # the last fallback did not move the fault: the next candidate instead
            self.fallbacks.pop()
        if not self._pending:
            return False
        choice = self._pending.pop(0)
        if choice.kind == "model":
            return False
        self.fallbacks.append(choice)
        return True
