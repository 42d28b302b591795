"""cltrain: channels_last (NHWC) as the fast, safe default for training image models.

Packages and modules, bottom up (lower ones never import higher ones):

* ``platform``: what this machine's CPU and backends can do (bf16, oneDNN ISA);
* ``devices``: a module's device, and device names as users type them, checked against this machine;
* ``precision``: the dtype a precision computes in, ``amp="auto"``'s choice, loss-scaling safety;
* ``atomic``: files written atomically (same-folder temp file, fsync, rename);
* ``checkpoint_io``: ``AtomicCheckpointIO``, Lightning checkpoints saved atomically, loaded ``weights_only``;
* ``layout``: tensors, modules and batches put in channels_last (``to_channels_last``, ``to_contiguous``);
* ``sharding``: which sharding engine (FSDP2, FSDP, DeepSpeed) holds a model, and the layout it keeps;
* ``ddp``: DistributedDataParallel's gradient buckets built again after a parameter changes layout;
* ``guardrails``: workarounds for backend kernels known to fail in channels_last on this device;
* ``nchw_code``: workarounds for torch code that calls ``view`` on a weight (pruning, flat-parameter utilities);
* ``timing``: the race of the layouts on a run's own training steps (``LayoutRace``), and models timed on copies;
* ``audit``: the ops that lose channels_last in a model (``cltrain-audit`` on the command line);
* ``model_names``: torchvision and timm models by name, with random weights;
* ``check``: the first-batch layout check and the NCHW fallbacks it chooses, and how a Lightning step and a plain
  step are run for it;
* ``host``: ``Host``, what a front door lends the session (say a line, which rank decides, a broadcast and a sum over
  the ranks, a logger, the optimizers and the model's copies), for one process or ``torch.distributed``'s group;
* ``batch_inputs``: ``BatchInputs``, a batch's model inputs put in the model's layout and traced through the first
  forward of each kind: the one input path of every door;
* ``session``: ``LayoutSession``, a model's channels_last run (start, each batch and step, boundaries, save and
  resume, end): every feature lives here, and the front doors below map their framework's events onto it;
* ``options``: the front doors' arguments, checked alike (one line naming the call, the argument and what it takes);
* ``lightning_access``: what cltrain reads of a LightningModule, for ``lightning`` and ``pytorch_lightning``;
* ``callback``: ``ChannelsLast``, the Lightning door; ``pl``: it and ``AtomicCheckpointIO`` as classes of the
  standalone ``pytorch_lightning`` package too;
* ``loops``: ``ChannelsLastRun``, the door for plain and Fabric loops; the same steps by hand; a contiguous copy for
  export;
* ``integrations``: the Hugging Face ``Trainer`` door and the Accelerate door;
* ``data``: the NHWC data path (decoding, transforms, collate, normalisation, DataModules, demo data);
* ``app``: the Hydra training application behind ``train.py``;
* ``tools``: the console scripts (``cltrain-train``, ``cltrain-audit``, ...).

Only the torch-only layers are imported here. ``ChannelsLast`` and ``AtomicCheckpointIO`` are imported on
first use (Lightning's import takes seconds, which ``cltrain-audit`` and plain layout users need not pay);
``cltrain.data``, ``cltrain.integrations`` and ``cltrain.app`` on demand.
"""

from cltrain.layout import (
    is_channels_last,
    is_channels_last_1d,
    layout_of,
    layout_summary,
    to_channels_last,
    to_channels_last_1d,
)
from cltrain.timing.layouts import choose_layout, time_layouts
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
