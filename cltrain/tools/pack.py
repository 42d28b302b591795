"""``cltrain-pack``: an image folder packed into WebDataset shards (``cltrain.data.pack.main``), the same as
``python -m cltrain.data.pack``.

    cltrain-pack /data/imagenet /data/imagenet-shards --shard-size 1000
"""

from typing import Any

from cltrain.tools import run_script

__all__ = ["main"]


def main() -> Any:
    """``cltrain-pack``: ``cltrain.data.pack.main``, a missing extra said in one line."""
    return run_script("cltrain-pack", "cltrain.data.pack")
