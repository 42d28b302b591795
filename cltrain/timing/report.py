"""The one report writer of the timings: Markdown tables and pages, the command that made them, and the files a
benchmark leaves (``.md``, ``.json``, ``.csv``), each written atomically (``cltrain.atomic``).

Example::

    >>> from cltrain.timing.report import table
    >>> print(table(["model", "img/s"], [["resnet50", "17.2"], ["a|b", "1.0"]], align="lr"))
    | model | img/s |
    |---|---:|
    | resnet50 | 17.2 |
    | a\\|b | 1.0 |
"""

from __future__ import annotations

import csv
import io
import json
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cltrain.atomic import atomic_write_text

__all__ = ["command_line", "escape_cell", "page", "table", "table_row", "write_report"]


def escape_cell(cell: Any) -> str:
    """``cell`` as the text of one Markdown table cell: ``|`` escaped, line breaks as spaces."""
    return str(cell).replace("|", "\\|").replace("\n", " ")


def table_row(cells: Iterable[Any]) -> str:
    """One line of a Markdown table (cells escaped): what a long run prints as each row is measured, below
    ``table(header, [])``."""
    return "| " + " | ".join(escape_cell(c) for c in cells) + " |"


def table(header: Sequence[Any], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A Markdown table: the ``header``, then a line per row (cells escaped). ``align``: a letter per column, ``l``
    (``---``) or ``r`` (``---:``), the columns past its end ``l``."""
    rule = "|" + "".join("---:|" if align[i:i + 1] == "r" else "---|" for i in range(len(header)))
    return "\n".join([table_row(header), rule, *(table_row(r) for r in rows)])


def page(title: str, intro: Sequence[str], sections: Mapping[str, Sequence[str]]) -> str:
    """A Markdown page: ``# title``, the ``intro`` paragraphs, then each ``## section`` with its lines."""
    lines = [f"# {title}", ""]
    for paragraph in intro:
        lines += [paragraph, ""]
    for name, body in sections.items():
        lines += [f"## {name}", "", *body, ""]
    return "\n".join(lines)


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """``python -m module ARGS`` as typed: ``argv`` (default this process's arguments), shell-quoted."""
    return " ".join(["python", "-m", module, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])


def write_report(stem: Path, *, markdown: str | None = None, data: Any = None,
                 csv_rows: Sequence[Mapping[str, Any]] | None = None, csv_fields: Sequence[str] | None = None,
                 ) -> list[Path]:
    """``stem.md`` (``markdown``), ``stem.json`` (``data``, indented, anything else as ``str``) and ``stem.csv``
    (``csv_rows``, the columns ``csv_fields`` or the first row's keys), those given, each written atomically; the
    folder is made. Returns the paths written."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    written = []
    if data is not None:
        written.append(atomic_write_text(stem.with_suffix(".json"), json.dumps(data, indent=1, default=str)))
    if csv_rows is not None:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(csv_fields or (csv_rows[0] if csv_rows else [])))
        writer.writeheader()
        writer.writerows(csv_rows)
        written.append(atomic_write_text(stem.with_suffix(".csv"), buf.getvalue()))
    if markdown is not None:
        written.append(atomic_write_text(stem.with_suffix(".md"), markdown))
    return written
