"""cltrain: channels_last (NHWC) as the fast, safe default for training image models.

Layers, bottom up (lower ones never import higher ones):

* ``cltrain.layout``: tensor and module layout helpers (channels-last 1-D too);
* ``cltrain.autolayout`` and ``cltrain.audit``: time a model in both layouts; find the
  ops that lose channels_last (``cltrain-audit resnet50`` on the command line);
* ``cltrain.model_names``: torchvision and timm models by name, with random weights;
* ``cltrain.callback``: the Lightning callback ``ChannelsLast``, with its pieces in
  ``cltrain.batch_layout`` (restriding batches) and ``cltrain.model_access`` (the modules
  around a LightningModule: step target, averaged copies, hook wrapping, optimizer state);
* ``cltrain.loops``: the same for Lightning Fabric and plain loops, and a contiguous copy for export;
* ``cltrain.atomic`` (atomic file writes) and ``cltrain.checkpoint_io``
  (``AtomicCheckpointIO``: ``Trainer(plugins=[AtomicCheckpointIO()])`` saves checkpoints
  atomically on any local filesystem and loads them with ``weights_only=True``);
* ``cltrain.data``: the NHWC data path (transforms, collate, normalisation,
  an ImageFolder DataModule, demo data);
* ``cltrain.app``: the Hydra training application behind ``train.py``;
* ``cltrain.tools``: the console scripts (``cltrain-train``, ``cltrain-audit``, ...).

Only the torch-only library layers are imported here. ``ChannelsLast`` and
``AtomicCheckpointIO`` are imported on first use (they need Lightning, whose import takes
seconds, which ``cltrain-audit`` and plain layout users need not pay); ``cltrain.data`` and ``cltrain.app`` on demand.
"""

from cltrain.layout import (
    is_channels_last,
    is_channels_last_1d,
    layout_of,
    layout_summary,
    to_channels_last,
    to_channels_last_1d,
)
from cltrain.autolayout import choose_layout, time_layouts
from cltrain.audit import AuditReport, audit_model

__all__ = [
    "AtomicCheckpointIO",
    "AuditReport",
    "ChannelsLast",
    "audit_model",
    "choose_layout",
    "is_channels_last",
    "is_channels_last_1d",
    "layout_of",
    "layout_summary",
    "time_layouts",
    "to_channels_last",
    "to_channels_last_1d",
]
__version__ = "0.1.0"



def __getattr__(name: str):  # PEP 562: `from cltrain import ChannelsLast` imports Lightning only then
    if name == "ChannelsLast":
        from cltrain.callback import ChannelsLast

        return ChannelsLast
    if name == "AtomicCheckpointIO":
        from cltrain.checkpoint_io import AtomicCheckpointIO

        return AtomicCheckpointIO
    raise AttributeError(f"module 'cltrain' has no attribute {name!r}")
