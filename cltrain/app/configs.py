"""Where the training application's Hydra configs are.

The package's own configs (``conf/`` in the source tree, installed as ``cltrain.conf``),
found with ``importlib.resources``; never the current folder. ``$CLTRAIN_CONFIG_DIR``
replaces them with a folder of the user's; Hydra's ``--config-dir`` adds one beside them.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

from cltrain.app.errors import ConfigError

__all__ = ["CONFIG_DIR", "config_dir"]


def config_dir() -> Path:
    """``$CLTRAIN_CONFIG_DIR`` when set, else the installed ``cltrain.conf`` package's folder.

    Raises:
        ConfigError: ``$CLTRAIN_CONFIG_DIR`` holds no ``config.yaml``.
    """
    env = os.environ.get("CLTRAIN_CONFIG_DIR")
    if env:
        path = Path(env).expanduser()
        if not (path / "config.yaml").is_file():
            raise ConfigError("CLTRAIN_CONFIG_DIR", env, "no config.yaml in that folder",
                              "a folder holding config.yaml and its groups, or unset it to use cltrain's own configs")
        return path.resolve()
    return Path(str(importlib.resources.files("cltrain.conf")))


CONFIG_DIR = config_dir()
