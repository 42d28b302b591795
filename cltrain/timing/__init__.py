"""Timing a model in both layouts: what ``ChannelsLast(mode="auto")`` decides by.

* ``cltrain.timing.layouts``: ``time_layouts`` / ``choose_layout``, a few steps of copies in each layout;
* ``cltrain.timing.probe``: ``probe_layout``, the same in a child process that a native crash cannot take down.
"""

from cltrain.timing.layouts import choose_layout, time_layouts
from cltrain.timing.probe import ProbeResult, probe_layout

__all__ = ["ProbeResult", "choose_layout", "probe_layout", "time_layouts"]
