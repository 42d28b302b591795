"""torch's pruning and flat-parameter utilities on channels_last weights (pytorch#96743): ``view`` raises.

Plain PyTorch only. Each case runs torch's own function on a channels_last ``Conv2d`` and says whether it raised::

    python -m scripts.repro.prune_channels_last

* ``l1_unstructured``: ``torch.abs(t).view(-1)`` in ``L1Unstructured.compute_mask``;
* ``global_unstructured``: ``parameters_to_vector``, whose ``param.view(-1)`` raises;
* ``vector_to_parameters``: does not raise, and leaves the weight in NCHW (``view_as``);
* ``random_unstructured``: ``rand_like(t).view(-1)``; ``rand_like`` also draws in memory order, so even a
  ``reshape`` would give another mask than an NCHW weight's under the same seed.

Exits 1 while any case still shows the fault (``cltrain.nchw_code`` works around each); 0 once torch fixed them all.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, prune, vector_to_parameters


def _conv() -> nn.Conv2d:
    torch.manual_seed(0)
    return nn.Conv2d(8, 16, 3).to(memory_format=torch.channels_last)


def _raises(fn) -> str | None:
    try:
        fn()
    except RuntimeError as error:
        return str(error).splitlines()[0][:90]
    return None


def cases() -> dict[str, str | None]:
    """Each case's fault in one line, ``None`` where torch behaves as on an NCHW weight."""
    found = {"l1_unstructured": _raises(lambda: prune.l1_unstructured(_conv(), "weight", amount=0.3)),
             "global_unstructured": _raises(lambda: prune.global_unstructured(
                 [(_conv(), "weight")], pruning_method=prune.L1Unstructured, amount=0.3))}
    conv = _conv()
    vector_to_parameters(parameters_to_vector([conv.bias]), [conv.bias])
    w = torch.randn(16, 8, 3, 3).to(memory_format=torch.channels_last)
    vector_to_parameters(w.reshape(-1), [w])
    found["vector_to_parameters"] = None if w.is_contiguous(memory_format=torch.channels_last) else \
        "the weight comes back in NCHW strides"
    found["random_unstructured"] = _raises(lambda: prune.random_unstructured(_conv(), "weight", amount=0.3))
    return found


def main() -> int:
    print(f"torch {torch.__version__}")
    found = cases()
    for name, fault in found.items():
        print(f"{name:<22} {fault or 'as on an NCHW weight'}")
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
