"""``cltrain-train``: the training application (``cltrain.app.cli.main``), the same as ``python train.py``.

    cltrain-train model=resnet50 channels_last=true
"""

from cltrain.app.cli import main

__all__ = ["main"]
