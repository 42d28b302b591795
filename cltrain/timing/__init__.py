"""Timing, torch only: the one measuring harness of cltrain and of every benchmark in ``scripts/``.

The harness, bottom up:

* ``cltrain.timing.clock``: ``Stopwatch`` and ``timed``, the one clock, the device synchronised at each read;
* ``cltrain.timing.rounds``: ``interleaved`` and ``time_steps``, cases run in rotating rounds with warm-up and a
  minimum window; ``rate_after_first`` for loaders;
* ``cltrain.timing.stats``: ``spread`` (median, lowest, highest), ``log_ratio`` and Student's ``t_quantile``: how
  sure a ratio of two timings is;
* ``cltrain.timing.steps``: ``training_step`` and ``layout_steps``, "a training step in each layout";
* ``cltrain.timing.machine``: ``machine`` / ``machine_line``, the machine a figure was taken on;
* ``cltrain.timing.report``: ``table``, ``page`` and ``write_report``, the one report writer.

What cltrain decides by timing:

* ``cltrain.timing.layout_race``: ``LayoutRace``, the run's first training steps in both layouts: what the default
  ``layout="auto"`` of every front door decides by;
* ``cltrain.timing.layouts``: ``time_layouts`` / ``choose_layout``, a few steps of copies in each layout;
* ``cltrain.timing.precision``: ``time_precisions`` / ``choose_precision``, the training step in each mixed precision;
* ``cltrain.timing.host_syncs``: ``SyncOps``, the ops of a piece of code that wait for the device (``.item()``).
"""

from cltrain.timing.clock import Stopwatch, timed
from cltrain.timing.layout_race import LayoutDecision, LayoutRace
from cltrain.timing.layouts import choose_layout, time_layouts
from cltrain.timing.machine import machine, machine_line
from cltrain.timing.precision import PrecisionTrial, choose_precision, time_precisions
from cltrain.timing.rounds import interleaved, time_steps
from cltrain.timing.stats import spread
from cltrain.timing.steps import layout_steps, training_step

__all__ = ["LayoutDecision", "LayoutRace", "PrecisionTrial", "Stopwatch", "choose_layout", "choose_precision",
           "interleaved", "layout_steps", "machine", "machine_line", "spread", "time_layouts", "time_precisions",
           "time_steps", "timed", "training_step"]
