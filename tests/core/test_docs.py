"""The documentation: every public name is in the API reference, the README is a front page, no history.

The API reference (``docs/api/*.md``) is written with mkdocstrings directives. A page either
renders a whole module (``::: cltrain.mod``: its ``__all__``, by ``filters: public`` in
``mkdocs.yml``) or a single name (``::: cltrain.mod.Name``). A package's page renders only its
docstring (``members: false``) and links each re-exported name to the module page that renders
it, so a name in a package's ``__all__`` counts as documented when the same object is rendered,
under the same name, by another directive.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import cltrain

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api"
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


def public_modules() -> dict[str, object]:
    """Every ``cltrain`` module or package that declares ``__all__``, by name."""
    names = ["cltrain"] + [m.name for m in pkgutil.walk_packages(cltrain.__path__, "cltrain.")]
    modules = {name: importlib.import_module(name) for name in names}
    return {name: mod for name, mod in modules.items() if hasattr(mod, "__all__")}


def directives(api_dir: Path = API) -> list[tuple[str, bool]]:
    """``(target, renders_members)`` for every ``::: target`` in the API pages."""
    found = []
    for page in sorted(api_dir.glob("*.md")):
        lines = page.read_text().splitlines()
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


def documented(modules: dict[str, object], api_dir: Path = API) -> set[tuple[str, str]]:
    """The ``(module, name)`` pairs that a directive renders."""
    pairs = set()
    for target, members in directives(api_dir):
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
    assert undocumented(modules, documented(modules)) == []


def test_every_api_directive_names_something_public():
    modules = public_modules()
    stale = []
    for target, _ in directives():
        module, _, name = target.rpartition(".")
        if target not in modules and not (module in modules and name in modules[module].__all__):
            stale.append(target)
    assert stale == []


def test_a_name_missing_from_the_reference_is_found(tmp_path):
    modules = public_modules()
    for page in API.glob("*.md"):
        (tmp_path / page.name).write_text(page.read_text())
    (tmp_path / "cltrain.loops.md").write_text("# `cltrain.loops`\n\n::: cltrain.loops.convert_model\n")
    missing = undocumented(modules, documented(modules, tmp_path))
    assert missing == ["cltrain.loops.contiguous_copy", "cltrain.loops.convert_batch", "cltrain.loops.verify_layout"]


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
