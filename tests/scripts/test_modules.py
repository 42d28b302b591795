"""scripts/ is a package tree: every script imports as a module (``python -m scripts.<group>.<name>``), says in its
docstring the command that runs it, and none edits ``sys.path`` to reach another."""

from __future__ import annotations

import ast
import importlib
import pkgutil

import pytest

import scripts
from tests.helpers import REPO

MODULES = sorted(m.name for m in pkgutil.walk_packages(scripts.__path__, "scripts."))


def test_the_groups_are_there():
    assert {"scripts.bench", "scripts.repro", "scripts.zoo", "scripts.gpu_check", "scripts.harness"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_each_script_imports_and_names_its_command(name):
    module = importlib.import_module(name)
    path = REPO / name.replace(".", "/")
    source = ast.parse((path / "__init__.py" if hasattr(module, "__path__") else path.with_suffix(".py")).read_text())
    if any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in source.body):  # a runnable script
        assert f"python -m {name}" in module.__doc__, f"{name}: its docstring should give `python -m {name} ...`"
    inserts = [n for n in ast.walk(source) if isinstance(n, ast.Call) and ast.unparse(n.func) == "sys.path.insert"]
    assert not inserts or name == "scripts.gpu_check" and len(inserts) == 1  # only --wheels' install target
