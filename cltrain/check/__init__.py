"""The first-batch layout check: one step in both layouts on copies, and the NCHW fallbacks it chooses.

* ``cltrain.check.record``: one step run with every module's inputs, outputs and gradients recorded;
* ``cltrain.check.compare``: ``check_layout``, the two runs compared, the fault located, the fallback chosen;
* ``cltrain.check.fallback``: ``Fallback`` and ``apply_fallbacks``, the parts of a model that run in NCHW;
* ``cltrain.check.lightning_step``: the check on a Lightning step, for ``cltrain.ChannelsLast``.

``cltrain.loops.verify_layout`` is the entry point for Fabric and plain loops.
"""

from cltrain.check.compare import Finding, LayoutCheck, check_layout, projection_loss
from cltrain.check.fallback import Fallback, apply_fallbacks

__all__ = ["Fallback", "Finding", "LayoutCheck", "apply_fallbacks", "check_layout", "projection_loss"]
