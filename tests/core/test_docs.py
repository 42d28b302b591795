"""The documentation: the API reference is generated from the package and covers every public name, the README
is a front page, no history.

The API reference is written at build time by ``docs/gen_api.py`` (mkdocs-gen-files): one page per public module
(the rule is in that file's docstring) with mkdocstrings directives, and the nav. A page either renders a whole
module (``::: cltrain.mod``: its ``__all__``, by ``filters: public`` in ``mkdocs.yml``) or a single name
(``::: cltrain.mod.Name``). A package's page renders only its docstring (``members: false``) and links each
re-exported name to the module page that renders it, so a name in a package's ``__all__`` counts as documented
when the same object is rendered, under the same name, by another directive.
"""

from __future__ import annotations

import importlib
import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = runpy.run_path(str(ROOT / "docs" / "gen_api.py"), run_name="gen_api")  # docs/ is not a package
README_MAX_LINES = 260
HISTORY = [
    r"\bthis round\b",
    r"\blast round\b",
    r"\bprevious round\b",
    r"\bissues? #?\d+",
    r"\brun [123]\b",
    r"\bruns [123] and [123]\b",
    r"\bearlier session\b",
    r"\bthis session\b",
]

_DIRECTIVE = re.compile(r"^::: *(\S+)\s*$")
_LINK = re.compile(r"\]\[([\w.]+)\]")


def public_modules() -> dict[str, object]:
    """Every module of the public API (the generator's rule), imported, by name."""
    return {name: importlib.import_module(name) for name in GENERATOR["public_modules"]()}


def directives(pages: dict[str, str]) -> list[tuple[str, bool]]:
    """``(target, renders_members)`` for every ``::: target`` in the API pages."""
    found = []
    for _, text in sorted(pages.items()):
        lines = text.splitlines()
        for i, line in enumerate(lines):
            match = _DIRECTIVE.match(line)
            if not match:
                continue
            options = []
            for following in lines[i + 1 :]:
                if not following.startswith(" "):
                    break
                options.append(following.strip())
            found.append((match.group(1), "members: false" not in options))
    return found


def documented(modules: dict[str, object], pages: dict[str, str]) -> set[tuple[str, str]]:
    """The ``(module, name)`` pairs that a directive renders."""
    pairs = set()
    for target, members in directives(pages):
        if target in modules:
            if members:
                pairs |= {(target, name) for name in modules[target].__all__}
            continue
        module, _, name = target.rpartition(".")
        if module in modules:
            pairs.add((module, name))
    return pairs


def undocumented(modules: dict[str, object], pairs: set[tuple[str, str]]) -> list[str]:
    """``module.name`` for every name in an ``__all__`` that no directive renders, also not elsewhere."""
    missing = []
    for module_name, module in modules.items():
        for name in module.__all__:
            if (module_name, name) in pairs:
                continue
            obj = getattr(module, name)
            if not any(n == name and getattr(modules[m], n, None) is obj for m, n in pairs):
                missing.append(f"{module_name}.{name}")
    return missing


def test_every_public_name_is_in_the_api_reference():
    assert "filters: public" in (ROOT / "mkdocs.yml").read_text()  # a module directive renders its __all__
    modules = public_modules()
    assert undocumented(modules, documented(modules, GENERATOR["api_pages"]())) == []


def test_every_api_directive_and_link_names_something_public():
    modules = public_modules()
    pages = GENERATOR["api_pages"]()
    targets = [target for target, _ in directives(pages)] + [t for text in pages.values() for t in _LINK.findall(text)]
    stale = []
    for target in targets:
        module, _, name = target.rpartition(".")
        if target not in modules and not (module in modules and name in modules[module].__all__):
            stale.append(target)
    assert stale == []


def test_the_nav_lists_every_page():
    pages = GENERATOR["api_pages"]()
    listed = re.findall(r"^\* \[[\w.]+\]\(([\w.]+\.md)\)$", pages["SUMMARY.md"], re.M)
    assert sorted(listed) == sorted(set(pages) - {"SUMMARY.md"})
    assert "nav_file: SUMMARY.md" in (ROOT / "mkdocs.yml").read_text() and not (ROOT / "docs" / "api").exists()


def test_the_reference_is_the_public_api_only():
    names = set(GENERATOR["public_modules"]())
    assert {"cltrain", "cltrain.layout", "cltrain.data", "cltrain.data.video", "cltrain.app", "cltrain.app.train",
            "cltrain.model_names"} <= names
    assert not any(n.startswith(("cltrain.tools", "cltrain.app.")) for n in names - {"cltrain.app.train"})
    assert "cltrain.zoo" not in names  # a deprecated alias


def test_a_new_module_gets_a_page_with_no_hand_written_file(tmp_path):
    package = tmp_path / "pkg"
    (package / "app").mkdir(parents=True)
    (package / "__init__.py").write_text('"""A package."""\nfrom pkg.new import fresh\n__all__ = ["OWN", "fresh"]\nOWN = 1\n')
    (package / "new.py").write_text('"""A new module."""\n__all__ = ["fresh"]\n\ndef fresh():\n    """New."""\n')
    (package / "_private.py").write_text('__all__ = ["hidden"]\n')
    (package / "old.py").write_text('import warnings\nfrom pkg.new import fresh\n__all__ = ["fresh"]\n'
                                    'warnings.warn("use pkg.new", DeprecationWarning, stacklevel=2)\n')
    (package / "app" / "__init__.py").write_text('__all__ = []\n')
    (package / "app" / "inner.py").write_text('__all__ = ["x"]\nx = 1\n')
    pages = GENERATOR["api_pages"](package, "pkg", internal=("pkg.app",), app_public=())
    assert sorted(pages) == ["SUMMARY.md", "pkg.md", "pkg.new.md"]
    assert "::: pkg.new\n" in pages["pkg.new.md"] and "[`fresh`][pkg.new.fresh]" in pages["pkg.md"]
    assert "::: pkg.OWN\n" in pages["pkg.md"]  # defined in the package: rendered on its page
    assert pages["SUMMARY.md"] == "* [pkg](pkg.md)\n* [pkg.new](pkg.new.md)\n"


def test_a_name_missing_from_the_reference_is_found():
    modules = public_modules()
    pages = GENERATOR["api_pages"]()
    pages["cltrain.loops.md"] = "# `cltrain.loops`\n\n::: cltrain.loops.convert_model\n"
    missing = undocumented(modules, documented(modules, pages))
    assert missing == ["cltrain.loops.ChannelsLastRun", "cltrain.loops.contiguous_copy", "cltrain.loops.convert_batch",
                       "cltrain.loops.verify_layout"]


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the details belong in docs/"


def history_phrases(paths: list[Path], root: Path = ROOT) -> list[str]:
    """``path:line: phrase`` for every history phrase in the files."""
    pattern = re.compile("|".join(HISTORY), re.IGNORECASE)
    hits = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in pattern.finditer(line):
                hits.append(f"{path.relative_to(root)}:{number}: {match.group(0)}")
    return hits


def test_docs_and_docstrings_say_what_is_not_when():
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "cltrain").rglob("*.py"))]
    assert history_phrases(paths) == []


def test_a_history_phrase_is_found(tmp_path):
    note = tmp_path / "notes.md"
    note.write_text("Measured in run 2 of this round, after issue 12.\n")
    hits = history_phrases([note], root=tmp_path)
    assert [hit.rsplit(": ", 1)[1].lower() for hit in hits] == ["run 2", "this round", "issue 12"]


def test_the_extras_table_names_every_extra_and_what_all_holds():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    table = (ROOT / "docs" / "index.md").read_text().split("| extra | what it adds |", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`([a-z0-9-]+)`", "\n".join(line.split("|")[1] for line in table.splitlines()[2:])))
    assert set(extras) <= named, sorted(set(extras) - named)
    inside = re.findall(r"^\| `all` \| (.*) \|$", table, re.M)[0]
    assert set(re.findall(r"`([a-z0-9-]+)`", inside)) == set(extras["all"][0].split("[")[1].rstrip("]").split(","))
