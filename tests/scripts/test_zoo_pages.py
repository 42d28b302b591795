"""The committed pages are what their writers render from the committed records: docs/zoo.md and docs/zoo.csv from
docs/zoo.json (``scripts.zoo.sweep_page``), docs/zoo_check.md from docs/zoo_check.json (``scripts.zoo.check_page``),
docs/projects.md from docs/projects.json (``scripts.zoo.projects_page``), byte for byte, so a page cannot drift from
its writer. No model runs."""

import json
from pathlib import Path

import pytest

from scripts.zoo.check_page import write_check
from scripts.zoo.projects_page import write_projects
from scripts.zoo.sweep import recorded_args
from scripts.zoo.sweep_page import write_sweep
from tests.helpers import REPO

DOCS = REPO / "docs"


def rendered_zoo(record: dict, out: Path) -> Path:
    write_sweep(out, record["rows"], record["machine"], record["command"], recorded_args(record["command"]))
    return out


def rendered_check(record: dict, out: Path) -> Path:
    write_check(out, record["rows"], record["machine"], record["command"], recorded_args(record["command"]),
                record["optimizers"])
    return out


def rendered_projects(record: dict, out: Path) -> Path:
    write_projects(out, record["rows"], record["machine"], record["runs"])
    return out


PAGES = {"zoo": (rendered_zoo, (".md", ".csv", ".json")), "zoo_check": (rendered_check, (".md", ".json")),
         "projects": (rendered_projects, (".md", ".json"))}


@pytest.mark.parametrize("name", PAGES)
def test_each_committed_page_is_its_writer_output(tmp_path, name):
    render, suffixes = PAGES[name]
    out = render(json.loads((DOCS / f"{name}.json").read_text()), tmp_path / name)
    for suffix in suffixes:
        assert out.with_suffix(suffix).read_bytes() == (DOCS / name).with_suffix(suffix).read_bytes(), (
            f"docs/{name}{suffix} differs from what its writer renders from docs/{name}.json: render it again")


def test_a_changed_cell_is_found(tmp_path):
    record = json.loads((DOCS / "zoo.json").read_text())
    record["rows"][0]["params_m"] += 0.1  # one cell of the table (and of the CSV)
    out = rendered_zoo(record, tmp_path / "zoo")
    assert out.with_suffix(".md").read_bytes() != (DOCS / "zoo.md").read_bytes()
    assert out.with_suffix(".csv").read_bytes() != (DOCS / "zoo.csv").read_bytes()
    record = json.loads((DOCS / "zoo_check.json").read_text())
    record["rows"][0]["layout_check_seconds"] += 0.01  # one cell of the check's table
    assert rendered_check(record, tmp_path / "zoo_check").with_suffix(".md").read_bytes() != (
        DOCS / "zoo_check.md").read_bytes()
