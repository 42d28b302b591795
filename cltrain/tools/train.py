"""``cltrain-train``: the training application (``cltrain.app.cli.main``), the same as ``python train.py``.

    cltrain-train model=resnet50 channels_last=true
    python -m cltrain.tools.train model=resnet50 channels_last=true
"""

import sys
from typing import Any

from cltrain.tools import run_script

__all__ = ["main"]


def main() -> Any:
    """``cltrain-train``: ``cltrain.app.cli.main``, a missing extra said in one line."""
    return run_script("cltrain-train", "cltrain.app.cli")


if __name__ == "__main__":
    sys.exit(main())
