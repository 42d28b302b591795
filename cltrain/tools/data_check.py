"""``cltrain-data-check``: the unreadable files of an image folder (``cltrain.data.check.main``), the same as
``python -m cltrain.data.check``.

    cltrain-data-check /data/imagenet --workers 8 --out bad_files.tsv
"""

from typing import Any

from cltrain.tools import run_script

__all__ = ["main"]


def main() -> Any:
    """``cltrain-data-check``: ``cltrain.data.check.main``, a missing extra said in one line."""
    return run_script("cltrain-data-check", "cltrain.data.check")
