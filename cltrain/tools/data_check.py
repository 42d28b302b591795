"""``cltrain-data-check``: the unreadable files of an image folder (``cltrain.data.check.main``), the same as
``python -m cltrain.data.check``.

    cltrain-data-check /data/imagenet --workers 8 --out bad_files.tsv
"""

from cltrain.data.check import main

__all__ = ["main"]
