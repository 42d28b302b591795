"""cltrain: channels_last (NHWC) as the fast, safe default for training image models.

Layers, bottom up (lower ones never import higher ones):

* :mod:`cltrain.layout`: tensor and module layout helpers (channels-last 1-D too);
* :mod:`cltrain.autolayout` and :mod:`cltrain.audit`: time a model in both layouts; find the
  ops that lose channels_last (``cltrain-audit resnet50`` on the command line);
* :mod:`cltrain.callback`: the Lightning callback :class:`ChannelsLast`, with its pieces in
  :mod:`cltrain.batch_layout` (restriding batches) and :mod:`cltrain.model_access` (the modules
  around a LightningModule: step target, averaged copies, hook wrapping, optimizer state);
* :mod:`cltrain.loops`: the same for Lightning Fabric and plain loops, and a contiguous copy for export;
* :mod:`cltrain.atomic` (atomic file writes) and :mod:`cltrain.checkpoint_io`
  (:class:`AtomicCheckpointIO`: ``Trainer(plugins=[AtomicCheckpointIO()])`` saves checkpoints
  atomically on any local filesystem and loads them with ``weights_only=True``);
* :mod:`cltrain.data`: the NHWC data path (transforms, collate, normalisation,
  an ImageFolder DataModule, demo data);
* :mod:`cltrain.app`: the Hydra training application behind ``train.py``.

Only the torch-only library layers are imported here. :class:`ChannelsLast` and
:class:`AtomicCheckpointIO` are imported on first use (they need Lightning, whose import takes
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
from cltrain.audit import AuditReport, audit  # the function shadows the module name, as tqdm.tqdm does

__all__ = [
    "AtomicCheckpointIO",
    "AuditReport",
    "ChannelsLast",
    "audit",
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
