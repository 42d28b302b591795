"""A run's results as a file: ``metrics.json`` in its run directory (read by ``cltrain-sweep-report``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["METRICS_FILE", "read_metrics", "write_metrics"]

METRICS_FILE = "metrics.json"


def write_metrics(run_dir: str | Path, metrics: dict[str, Any], replace: bool = False) -> Path:
    """Write ``metrics`` as ``<run_dir>/metrics.json`` (refusing to replace an existing file unless ``replace``)."""
    path = Path(run_dir) / METRICS_FILE
    with open(path, "w" if replace else "x") as f:
        json.dump(metrics, f, indent=2, default=str)
        f.write("\n")
    return path


def read_metrics(path: str | Path) -> dict[str, Any]:
    """The dict a ``metrics.json`` holds."""
    with open(path) as f:
        return json.load(f)
