"""The package's import graph, read from the source (imports inside functions included): no cycle,
and no layer imports a higher one: library < data < app < tools."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cltrain"
#: What each layer may import from the package, besides itself.
BELOW = {"library": set(), "data": {"library"}, "app": {"library", "data"}, "tools": {"library", "data", "app"}}
#: Third-party packages the library layer may import (``pip install cltrain``).
LIBRARY_DEPS = {"torch", "lightning", "lightning_utilities", "typing_extensions", "numpy"}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, here: str | None = None, modules: set[str] = frozenset()) -> set[str]:
    """Every module ``path`` (the module ``here``) imports, anywhere in the file, as dotted names;
    ``from package import submodule`` counts as importing the submodule when it is one of ``modules``."""
    tree = ast.parse(path.read_text(), str(path))
    here = here or _module(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join([*parent, base]) if base else ".".join(parent)
            names = {f"{base}.{alias.name}" for alias in node.names}
            submodules = names & set(modules)
            found |= submodules if submodules == names else {base} | submodules
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path, modules=set(modules)) if m in modules and m != name}
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ("data", "app", "tools") else "library"


def test_the_package_has_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_no_layer_imports_a_higher_one() -> None:
    bad = [f"{a} -> {b}" for a, targets in _graph().items() for b in sorted(targets)
           if _layer(b) != _layer(a) and _layer(b) not in BELOW[_layer(a)] and b != "cltrain"]
    assert not bad, "upward imports: " + "; ".join(bad)


def test_the_library_layer_imports_torch_and_lightning_only() -> None:
    third_party = {}
    for path in PACKAGE.glob("*.py"):
        tops = {m.split(".")[0] for m in _imports(path)} - {"cltrain", "__future__"}
        import sys

        outside = {t for t in tops if t not in sys.stdlib_module_names} - LIBRARY_DEPS
        if outside:
            third_party[path.name] = sorted(outside)
    # torchvision and timm only inside functions of the model zoo, named by the `data`/`timm` extras; the standalone
    # Lightning package only in the module that makes cltrain's classes its own (imported by its users alone)
    assert third_party == {"model_names.py": ["timm", "torchvision"],
                           "pl.py": ["lightning_fabric", "pytorch_lightning"]}, third_party


def test_the_platform_module_imports_torch_and_the_standard_library_only() -> None:
    import sys

    tops = {m.split(".")[0] for m in _imports(PACKAGE / "platform.py")} - {"__future__"}
    assert {t for t in tops if t not in sys.stdlib_module_names} == {"torch"}  # no Lightning, nothing of cltrain


def test_the_checker_sees_a_cycle_through_a_function_body(tmp_path: Path) -> None:
    """Negative control: an import inside a function counts."""
    (tmp_path / "a.py").write_text("def f():\n    from cltrain.b import g\n")
    assert _imports(tmp_path / "a.py", "cltrain.a") == {"cltrain.b"}
