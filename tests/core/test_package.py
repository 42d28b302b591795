"""The package's public names: `import cltrain` stays torch-only; ChannelsLast loads Lightning on first use; the
submodules are modules (`cltrain.audit` the module, `cltrain.audit_model` its function); the old names still work
for one release, with a DeprecationWarning."""

import subprocess
import sys
import types
import warnings

import pytest
import torch


def test_import_cltrain_does_not_import_lightning_until_channels_last_is_used():
    code = (
        "import sys, cltrain\n"
        "assert 'lightning' not in sys.modules, 'lightning imported by import cltrain'\n"
        "from cltrain import ChannelsLast, audit_model, to_channels_last, to_channels_last_1d\n"
        "assert 'lightning' in sys.modules and ChannelsLast.__module__ == 'cltrain.callback'\n"
        "assert audit_model.__module__ == 'cltrain.audit'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_cltrain_audit_is_the_module_and_calling_it_still_audits_with_a_warning():
    import cltrain
    import cltrain.audit
    from cltrain import audit

    assert isinstance(cltrain.audit, types.ModuleType) and audit is sys.modules["cltrain.audit"]
    assert cltrain.audit_model is cltrain.audit.audit_model
    model = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    with pytest.warns(DeprecationWarning, match="audit_model"):
        report = cltrain.audit(model, torch.randn(1, 3, 8, 8))
    assert isinstance(report, cltrain.AuditReport)
    with pytest.warns(DeprecationWarning, match="audit_model"):
        from cltrain.audit import audit as old_name
    assert old_name is cltrain.audit_model


def test_old_model_builders_warn_and_give_the_renamed_functions():
    from cltrain.model_names import build_untrained_model

    sys.modules.pop("cltrain.zoo", None)
    with pytest.warns(DeprecationWarning, match="cltrain.model_names"):
        from cltrain.zoo import build_model
    assert build_model is build_untrained_model
    from cltrain.app import models

    with pytest.warns(DeprecationWarning, match="build_classifier"):
        assert models.build_model is models.build_classifier
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from cltrain.app.models import build_classifier  # noqa: F401  the new names do not warn
        from cltrain.model_names import build_untrained_model  # noqa: F401,F811


def test_console_scripts_all_live_in_cltrain_tools():
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts") if e.name.startswith("cltrain-")}
    assert set(scripts) == {"cltrain-train", "cltrain-audit", "cltrain-data-check", "cltrain-pack", "cltrain-sweep-report"}
    assert all(value.startswith("cltrain.tools.") and value.endswith(":main") for value in scripts.values()), scripts
