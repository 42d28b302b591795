"""cltrain: channels_last (NHWC) as the fast, safe default for training image models.

Layers, bottom up (lower ones never import higher ones):

* :mod:`cltrain.layout`: tensor and module layout helpers;
* :mod:`cltrain.callback`: the Lightning callback :class:`ChannelsLast`;
* :mod:`cltrain.data`: the NHWC data path (transforms, collate, normalisation,
  an ImageFolder DataModule, demo data);
* :mod:`cltrain.app`: the Hydra training application behind ``train.py``.
"""

from cltrain.callback import ChannelsLast
from cltrain.layout import is_channels_last, layout_of, layout_summary, to_channels_last

__all__ = ["ChannelsLast", "is_channels_last", "layout_of", "layout_summary", "to_channels_last"]
__version__ = "0.1.0"

import warnings  # noqa: E402

from cltrain.audit import AuditReport, audit  # noqa: E402  (the function shadows the module name, as tqdm.tqdm does)
from cltrain.autolayout import choose_layout, time_layouts  # noqa: E402

__all__ += ["AuditReport", "audit", "choose_layout", "time_layouts"]
# `python -m cltrain.audit` executes a module this package has already imported; runpy's warning about it is moot.
warnings.filterwarnings("ignore", message="'cltrain.audit' found in sys.modules", category=RuntimeWarning)
