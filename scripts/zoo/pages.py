"""What the zoo's pages share: the record a rerun keeps rows from, the load and the time as the pages give them, an
error's cell and the machine's lines. The pages: ``sweep_page`` (docs/zoo.md), ``check_page`` (docs/zoo_check.md),
``projects_page`` (docs/projects.md)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from cltrain.timing.machine import machine_line

__all__ = ["fmt_err", "load", "machine_lines", "now", "pair", "record"]


def load() -> str:
    """The load averages, as the pages give them."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def now() -> str:
    """The date and time, to the minute, as the pages give them."""
    return time.strftime("%Y-%m-%d %H:%M")


def record(out: Path, keep: bool = True) -> dict[str, Any]:
    """``<out>.json``, the record a rerun keeps rows from; ``{}`` where there is none or ``keep`` is off."""
    path = out.with_suffix(".json")
    return json.loads(path.read_text()) if keep and path.exists() else {}


def fmt_err(value: Any) -> str:
    """An error or a gap as the zoo's tables give it (``1.2e-03``, ``inf``); "" for none."""
    if value is None:
        return ""
    return "inf" if value == math.inf else f"{value:.1e}"


def pair(a: Any, b: Any) -> str:
    """Two errors as one cell (``a / b``); "" where both are missing."""
    return "" if a is None and b is None else f"{fmt_err(a)} / {fmt_err(b)}"


def machine_lines(m: dict[str, Any], after: str = ".") -> str:
    """The machine's line and the load averages a sweep started and ended at."""
    return (f"Machine: {machine_line(m)}.\n"
            f"Load average at the start: {m.get('load_start', '?')}, at the end: {m.get('load_end', '?')}{after}")
