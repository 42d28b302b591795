"""What a recorded value of the check's run is, and where it was: the key every run's values are compared by.

Example::

    >>> Event("forward-out", "layer1.0.conv1#0").module, Event("param", "layer1.0.conv1.weight").module
    ('layer1.0.conv1', 'layer1.0.conv1')
    >>> Event("grad-in", "fc#0", 1).phase, Event("result").module is None
    ('backward', True)
"""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = ["Event", "Kind"]

#: ``forward-in`` / ``forward-out``: a module call's inputs / outputs; ``grad-in`` / ``grad-out``: the gradients
#: arriving at them; ``param``: a parameter's gradient; ``update``: a parameter's change over the run; ``result``:
#: what the step returned (its loss)
Kind = Literal["forward-in", "forward-out", "grad-in", "grad-out", "param", "update", "result"]

_PHASES = {"forward-in": "forward", "forward-out": "forward", "grad-in": "backward", "grad-out": "backward",
           "param": "backward", "update": "update", "result": "step"}


class Event(NamedTuple):
    """One recorded value: its ``kind``, the module call (``"<module>#<call>"``) or parameter
    (``"<module>.<name>"``) it belongs to, and its place among the call's tensors (gradients of a call)."""

    kind: Kind
    name: str = ""
    index: int = 0

    @property
    def module(self) -> str | None:
        """The module it belongs to (``None``: the step's result)."""
        if self.kind == "result":
            return None
        return self.name.rpartition("." if self.kind in ("param", "update") else "#")[0]

    @property
    def phase(self) -> str:
        """Where in the step it is made: ``forward``, ``backward``, ``update`` or ``step``."""
        return _PHASES[self.kind]

    def describe(self) -> str:
        """``"<kind> of <name>"``, for a finding's detail."""
        return f"{self.kind} of {self.name or 'the result'}"
