"""Putting tensors, modules and batches in channels_last, and telling whether they are.

* ``cltrain.layout.tensors``: tensors and modules (``to_channels_last``, ``to_contiguous``, ``is_channels_last``, ...);
* ``cltrain.layout.batches``: which tensors of a batch are the model's inputs, and restriding them;
* ``cltrain.layout.stacks``: 5-D inputs in the layout the model reads them in (a clip, or a stack of images);
* ``cltrain.layout.conv_reach``: which converted inputs reach a convolution in channels_last;
* ``cltrain.layout.function_mode``: the base of cltrain's function modes, whose ops' warnings name the user's line;
* ``cltrain.layout.closures``: functions that hold an original module, made to hold its copy;
* ``cltrain.layout.optimizer_state``: optimizer state in its parameter's layout.

The tensor and module helpers are importable from here (``from cltrain.layout import to_channels_last``).
"""

from cltrain.layout.tensors import (
    CONV1D_TYPES,
    CONV_TYPES,
    MODES,
    has_convolutions,
    is_channels_last,
    is_channels_last_1d,
    layout_of,
    is_materialized,
    layout_summary,
    memory_format_for,
    nchw,
    to_channels_last,
    to_channels_last_1d,
    to_contiguous,
)

__all__ = [
    "CONV1D_TYPES",
    "CONV_TYPES",
    "MODES",
    "has_convolutions",
    "is_channels_last",
    "is_channels_last_1d",
    "is_materialized",
    "layout_of",
    "layout_summary",
    "memory_format_for",
    "nchw",
    "to_channels_last",
    "to_channels_last_1d",
    "to_contiguous",
]
