"""A run's results as a file: ``metrics.json`` in its run directory (read by ``cltrain-sweep-report``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cltrain.atomic import atomic_write_json

__all__ = ["METRICS_FILE", "read_metrics", "write_metrics"]

METRICS_FILE = "metrics.json"


def write_metrics(run_dir: str | Path, metrics: dict[str, Any], replace: bool = False) -> Path:
    """Write ``metrics`` as ``<run_dir>/metrics.json``, atomically (refusing to replace an existing file
    unless ``replace``)."""
    return atomic_write_json(Path(run_dir) / METRICS_FILE, metrics, overwrite=replace, indent=2, default=str)


def read_metrics(path: str | Path) -> dict[str, Any]:
    """The dict a ``metrics.json`` holds."""
    with open(path) as f:
        return json.load(f)
