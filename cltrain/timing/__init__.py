"""Timing how a model trains: which layout is faster (on the run's own steps, or on copies) and which precision.

* ``cltrain.timing.layout_race``: ``LayoutRace``, the run's first training steps in both layouts: what the default
  ``layout="auto"`` of every front door decides by;
* ``cltrain.timing.layouts``: ``time_layouts`` / ``choose_layout``, a few steps of copies in each layout;
* ``cltrain.timing.precision``: ``time_precisions`` / ``choose_precision``, the training step in each mixed precision.
* ``cltrain.timing.host_syncs``: ``SyncOps``, the ops of a piece of code that wait for the device (``.item()``).
"""

from cltrain.timing.layout_race import LayoutDecision, LayoutRace
from cltrain.timing.layouts import choose_layout, time_layouts
from cltrain.timing.precision import PrecisionTrial, choose_precision, time_precisions

__all__ = ["LayoutDecision", "LayoutRace", "PrecisionTrial", "choose_layout", "choose_precision", "time_layouts",
           "time_precisions"]
