"""The console scripts, every one of them here (``[project.scripts]`` in ``pyproject.toml`` points only into this package):

* ``cltrain-train`` (``cltrain.tools.train``): the training application, as ``python train.py``;
* ``cltrain-audit`` (``cltrain.tools.audit``): which operators of a torchvision or timm model drop channels_last;
* ``cltrain-data-check`` (``cltrain.tools.data_check``): the unreadable files of an image folder, as
  ``python -m cltrain.data.check``;
* ``cltrain-pack`` (``cltrain.tools.pack``): an image folder packed into WebDataset shards, as
  ``python -m cltrain.data.pack``;
* ``cltrain-sweep-report`` (``cltrain.tools.sweep_report``): a sweep's runs as a table and a chart.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

#: The top-level module a console script may miss -> the extra that brings it.
EXTRAS = {"hydra": "app", "omegaconf": "app", "torchmetrics": "app", "torchvision": "data", "PIL": "data",
          "simplejpeg": "data", "turbojpeg": "data", "webdataset": "shards", "matplotlib": "report"}


def run_script(script: str, module: str) -> Any:
    """The console script ``script``: ``module``'s ``main()``, run; where a package of an extra is missing, one line
    naming it and the extra (``EXTRAS``), exit status 1, instead of an import's traceback."""
    try:
        return importlib.import_module(module).main()
    except ModuleNotFoundError as err:
        extra = EXTRAS.get((err.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"{script}: error: needs {err.name}, which cltrain's {extra!r} extra brings: "
              f"pip install 'cltrain[{extra}]'", file=sys.stderr)
        raise SystemExit(1) from None
