"""Timing a model to decide how it trains: its layout (what ``ChannelsLast(mode="auto")`` decides by) and its precision.

* ``cltrain.timing.layouts``: ``time_layouts`` / ``choose_layout``, a few steps of copies in each layout;
* ``cltrain.timing.probe``: ``probe_layout``, the same in a child process that a native crash cannot take down;
* ``cltrain.timing.precision``: ``time_precisions`` / ``choose_precision``, the training step in each mixed precision.
* ``cltrain.timing.host_syncs``: ``SyncOps``, the ops of a piece of code that wait for the device (``.item()``).
"""

from cltrain.timing.layouts import choose_layout, time_layouts
from cltrain.timing.precision import PrecisionTrial, choose_precision, time_precisions
from cltrain.timing.probe import ProbeResult, probe_layout

__all__ = ["PrecisionTrial", "ProbeResult", "choose_layout", "choose_precision", "probe_layout", "time_layouts",
           "time_precisions"]
