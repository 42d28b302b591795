"""The first-batch layout check: one step in both layouts on copies, and the NCHW fallbacks it chooses.

* ``cltrain.check.record``: one step run with every module's inputs, outputs, gradients and updates recorded;
* ``cltrain.check.events``: ``Event``, what a recorded value is and where (the key runs are compared by);
* ``cltrain.check.signature``: a tensor's norm and projections, and the relative difference of two;
* ``cltrain.check.randomness``: the same random draws and RNG state in both layouts;
* ``cltrain.check.gradient_tape``: the reference's gradients given to every run's code after the backward;
* ``cltrain.check.compare``: ``check_layout``, the two runs compared and the fallback chosen;
* ``cltrain.check.search``: ``FallbackSearch``, what each run found and the fallback to try next;
* ``cltrain.check.localise``: where a fault is, and the fallbacks to try for it;
* ``cltrain.check.isolation``: every module run on the reference run's values (rounding carried to a kink);
* ``cltrain.check.result``: ``Finding`` and ``LayoutCheck``, and the one log line;
* ``cltrain.check.fallback``: ``Fallback`` and ``apply_fallbacks``, the parts of a model that run in NCHW;
* ``cltrain.check.copies``: the copies the check runs on, and ``checking()`` / ``is_check_copy()`` for user
  code with side effects;
* ``cltrain.check.untouched``: what a copy still reaches of the real model, and the real model's tensors put back;
* ``cltrain.check.budget``: the check on a slice of the batch; an out-of-memory error is never a verdict;
* ``cltrain.check.lightning_step``: the check on a Lightning step, for ``cltrain.ChannelsLast``;
* ``cltrain.check.plain_step``: the check on a plain step (a model, a loop's loss code, an optimizer), for Fabric
  and plain loops and the Hugging Face hook;
* ``cltrain.check.resume``: the verdict carried in a checkpoint, applied again for the same model and step.

``cltrain.loops.verify_layout`` is the entry point for Fabric and plain loops.
"""

from cltrain.check.compare import check_layout, projection_loss
from cltrain.check.copies import checking, is_check_copy
from cltrain.check.fallback import Fallback, apply_fallbacks
from cltrain.check.result import Finding, LayoutCheck

__all__ = ["Fallback", "Finding", "LayoutCheck", "apply_fallbacks", "check_layout", "checking", "is_check_copy",
           "projection_loss"]
