"""The committed pages are what ``scripts.zoo.pages.write_page`` renders from the committed records: docs/zoo.md and
docs/zoo.csv from docs/zoo.json, docs/zoo_check.md from docs/zoo_check.json, docs/projects.md from docs/projects.json,
byte for byte, so a page cannot drift from its writer. No model runs."""

import json
from pathlib import Path

import pytest

from scripts.zoo.pages import write_page
from scripts.zoo.sweep import recorded_args
from tests.helpers import REPO

DOCS = REPO / "docs"


def rendered(record: dict, out: Path) -> Path:
    write_page(out, record, recorded_args(record["command"]) if "command" in record else None)
    return out


PAGES = {"zoo": (".md", ".csv", ".json"), "zoo_check": (".md", ".json"), "projects": (".md", ".json")}


@pytest.mark.parametrize("name", PAGES)
def test_each_committed_page_is_its_writer_output(tmp_path, name):
    suffixes = PAGES[name]
    out = rendered(json.loads((DOCS / f"{name}.json").read_text()), tmp_path / name)
    for suffix in suffixes:
        assert out.with_suffix(suffix).read_bytes() == (DOCS / name).with_suffix(suffix).read_bytes(), (
            f"docs/{name}{suffix} differs from what its writer renders from docs/{name}.json: render it again")


def test_a_changed_cell_is_found(tmp_path):
    record = json.loads((DOCS / "zoo.json").read_text())
    record["rows"][0]["params_m"] += 0.1  # one cell of the table (and of the CSV)
    out = rendered(record, tmp_path / "zoo")
    assert out.with_suffix(".md").read_bytes() != (DOCS / "zoo.md").read_bytes()
    assert out.with_suffix(".csv").read_bytes() != (DOCS / "zoo.csv").read_bytes()
    record = json.loads((DOCS / "zoo_check.json").read_text())
    record["rows"][0]["layout_check_seconds"] += 0.01  # one cell of the check's table
    assert rendered(record, tmp_path / "zoo_check").with_suffix(".md").read_bytes() != (
        DOCS / "zoo_check.md").read_bytes()
