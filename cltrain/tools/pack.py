"""``cltrain-pack``: an image folder packed into WebDataset shards (``cltrain.data.pack.main``), the same as
``python -m cltrain.data.pack``.

    cltrain-pack /data/imagenet /data/imagenet-shards --shard-size 1000
"""

from cltrain.data.pack import main

__all__ = ["main"]
