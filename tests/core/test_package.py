"""The package's public names: `import cltrain` stays torch-only; ChannelsLast loads Lightning on first use; the
submodules are modules (`cltrain.audit` the module, `cltrain.audit_model` its function); no module is a
deprecation shim, and every public module is listed in its package's map."""

import subprocess
import sys
import types



def test_cltrain_audit_is_the_module_and_audit_model_its_function():
    import cltrain
    from cltrain import audit

    assert isinstance(cltrain.audit, types.ModuleType) and audit is sys.modules["cltrain.audit"]
    assert cltrain.audit_model is cltrain.audit.audit_model
    assert not callable(cltrain.audit)


def _modules() -> list[str]:
    import pkgutil

    import cltrain

    return [m.name for m in pkgutil.walk_packages(cltrain.__path__, "cltrain.")]


def test_import_cltrain_leaves_lightning_until_channels_last_and_no_module_is_a_deprecation_shim():
    # One fresh interpreter for both. Nothing has been released: an old name is removed, not kept behind a warning.
    code = (
        "import importlib, sys, warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "warnings.filterwarnings('ignore', category=DeprecationWarning, module='(?!cltrain)')\n"
        "import cltrain\n"
        "assert 'lightning' not in sys.modules, 'lightning imported by import cltrain'\n"
        "from cltrain import ChannelsLast, audit_model, to_channels_last, to_channels_last_1d\n"
        "assert 'lightning' in sys.modules and ChannelsLast.__module__ == 'cltrain.callback'\n"
        "assert audit_model.__module__ == 'cltrain.audit'\n"
        f"for name in {_modules()!r}:\n"
        "    importlib.import_module(name)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for old in ("cltrain.zoo", "cltrain.app.schema", "cltrain.app.rules", "cltrain.layout_check", "cltrain.autolayout"):
        assert old not in _modules()


def test_each_package_map_lists_every_public_module_once():
    import importlib
    import pkgutil
    import re

    for package in ("cltrain", "cltrain.app", "cltrain.layout", "cltrain.check", "cltrain.timing"):
        module = importlib.import_module(package)
        doc = module.__doc__ or ""
        public = [m.name for m in pkgutil.iter_modules(module.__path__) if not m.name.startswith("_")]
        named = set(re.findall(r"``(?:" + re.escape(package) + r"\.)?([a-z_]+)", doc))
        missing = [m for m in public if m not in named]
        assert missing == [], f"{package}'s docstring does not name {missing}"


def test_console_scripts_all_live_in_cltrain_tools():
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts") if e.name.startswith("cltrain-")}
    assert set(scripts) == {"cltrain-train", "cltrain-audit", "cltrain-data-check", "cltrain-pack", "cltrain-sweep-report"}
    assert all(value.startswith("cltrain.tools.") and value.endswith(":main") for value in scripts.values()), scripts
