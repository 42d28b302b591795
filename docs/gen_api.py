"""The API reference, generated at build time from the package: one page per public module and the nav.

Run by mkdocs-gen-files (``plugins: gen-files`` in ``mkdocs.yml``); nothing under ``docs/api/`` is written
by hand, so a new module needs no page. The package is read as source (``ast``), never imported: the docs
build needs neither torch nor the optional dependencies.

The public API, the one rule: a module under ``cltrain/`` is in the reference when

* no part of its dotted name starts with ``_``;
* it is not inside ``cltrain.app`` (the training application's internals) other than ``APP_PUBLIC``,
  the parts users import, nor inside ``cltrain.tools`` (console scripts: their interface is the command line);
* it declares its public names in ``__all__``;
* it is not a deprecated alias (a module that calls ``warnings.warn(..., DeprecationWarning)`` on import).

A module's page renders its ``__all__`` (``filters: public``). A package's page renders its docstring and
links each name of its ``__all__`` to the page of the module that defines it, or renders it in place when
that module is not in the reference.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "cltrain"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
#: The parts of the training application users import: ``ConfigError`` and ``train(cfg)``.
APP_PUBLIC = ("cltrain.app", "cltrain.app.train")
#: Packages whose modules are never in the reference, except the ones in ``APP_PUBLIC``.
INTERNAL = ("cltrain.app", "cltrain.tools")


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module and package under ``root``, by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def exported_names(tree: ast.Module) -> list[str] | None:
    """The module's ``__all__`` (a literal list or tuple of strings), or ``None`` when it has none."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            return [elt.value for elt in node.value.elts if isinstance(elt, ast.Constant)]
    return None


def warns_deprecation_on_import(tree: ast.Module) -> bool:
    """A module-level ``warnings.warn(..., DeprecationWarning)``: a deprecated alias of another module."""
    for node in tree.body:
        call = node.value if isinstance(node, ast.Expr) else None
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "warn"
                and "DeprecationWarning" in ast.unparse(call)):
            return True
    return False


def is_public(name: str, tree: ast.Module, internal: tuple[str, ...] = INTERNAL,
              app_public: tuple[str, ...] = APP_PUBLIC) -> bool:
    """The rule of this module's docstring."""
    if any(part.startswith("_") for part in name.split(".")):
        return False
    if name not in app_public and any(name == p or name.startswith(p + ".") for p in internal):
        return False
    return exported_names(tree) is not None and not warns_deprecation_on_import(tree)


def public_modules(root: Path = ROOT, package: str = PACKAGE, **rule: tuple[str, ...]) -> dict[str, list[str]]:
    """``{module: its __all__}`` for every module of the public API, sorted by name."""
    modules = {}
    for name, path in module_files(root, package).items():
        tree = ast.parse(path.read_text())
        if is_public(name, tree, **rule):
            modules[name] = exported_names(tree)
    return modules


def _sources(tree: ast.Module, package: str) -> dict[str, tuple[str, str]]:
    """``{name: (module, name there)}`` for every ``from X import name`` in a package's ``__init__``."""
    sources = {}
    for node in ast.walk(tree):  # also the imports inside a PEP 562 __getattr__
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = package.split(".")
            module = node.module if node.level == 0 else ".".join([*parts[: len(parts) - node.level + 1], node.module])
            for alias in node.names:
                sources[alias.asname or alias.name] = (module, alias.name)
    return sources


def _package_page(name: str, exported: list[str], tree: ast.Module, modules: dict[str, list[str]]) -> str:
    rows, in_place = [], []
    for export in sorted(exported, key=str.lower):
        module, original = _sources(tree, name).get(export, (name, export))
        if f"{module}.{original}" in modules:  # a submodule
            rows.append(f"| [`{export}`][{module}.{original}] | module |")
        elif module != name and original in modules.get(module, []):  # rendered on its module's page
            rows.append(f"| [`{export}`][{module}.{original}] | [`{module}`][{module}] |")
        else:  # defined in the package itself, or in a module outside the reference
            in_place.append(export)
    lines = [f"# `{name}`", "", f"::: {name}", "    options:", "      members: false", ""]
    if rows:
        lines += ["| name | documented in |", "|---|---|", *rows, ""]
    for export in in_place:
        lines += [f"::: {name}.{export}", "    options:", "      show_root_heading: true", ""]
    return "\n".join(lines)


def api_pages(root: Path = ROOT, package: str = PACKAGE, **rule: tuple[str, ...]) -> dict[str, str]:
    """``{page file name: markdown}``: one page per public module, and ``SUMMARY.md``, the nav (literate-nav)."""
    modules = public_modules(root, package, **rule)
    files = module_files(root, package)
    pages = {}
    for name, exported in modules.items():
        if files[name].name == "__init__.py":
            pages[f"{name}.md"] = _package_page(name, exported, ast.parse(files[name].read_text()), modules)
        else:
            pages[f"{name}.md"] = f"# `{name}`\n\n::: {name}\n"
    pages["SUMMARY.md"] = "".join(f"* [{name}]({name}.md)\n" for name in modules)
    return pages


def write_pages(folder: str = "api") -> None:
    """Write the pages into the build (mkdocs-gen-files' virtual files), each editable as its module's source."""
    import mkdocs_gen_files

    files = module_files()
    for page, text in api_pages().items():
        with mkdocs_gen_files.open(f"{folder}/{page}", "w") as f:
            f.write(text)
        module = page.removesuffix(".md")
        if module in files:
            mkdocs_gen_files.set_edit_path(f"{folder}/{page}", files[module].relative_to(ROOT.parent))


if __name__ == "<run_path>":  # run by mkdocs-gen-files
    write_pages()
