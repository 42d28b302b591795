"""cltrain's Lightning parts as parts of the standalone ``pytorch_lightning`` package too, by their classes.

``pytorch_lightning``'s ``Trainer`` takes an instance of ``cltrain.ChannelsLast`` as it is; what asks of the class
itself, that package's ``LightningCLI`` (``--trainer.callbacks+=cltrain.pl.ChannelsLast``, or a ``class_path`` in
its YAML), takes this one. Its ``Trainer`` refuses a checkpoint plugin that is not its own ``CheckpointIO``:
``plugins=[cltrain.pl.AtomicCheckpointIO()]`` is ``cltrain.AtomicCheckpointIO`` made one. Each is the same class
made a subclass of both packages' base, with the same hooks and arguments; the DataModules are in
``cltrain.data.pl``. Importing this module imports ``pytorch_lightning``.
"""

from __future__ import annotations

import lightning_fabric.plugins
import pytorch_lightning

from cltrain.callback import ChannelsLast as _ChannelsLast
from cltrain.checkpoint_io import AtomicCheckpointIO as _AtomicCheckpointIO

__all__ = ["AtomicCheckpointIO", "ChannelsLast"]


class ChannelsLast(_ChannelsLast, pytorch_lightning.Callback):
    __doc__ = _ChannelsLast.__doc__


class AtomicCheckpointIO(_AtomicCheckpointIO, lightning_fabric.plugins.TorchCheckpointIO):
    __doc__ = _AtomicCheckpointIO.__doc__
