"""The package's public names: `import cltrain` stays torch-only; ChannelsLast loads Lightning on first use."""

import subprocess
import sys


def test_import_cltrain_does_not_import_lightning_until_channels_last_is_used():
    code = (
        "import sys, cltrain\n"
        "assert 'lightning' not in sys.modules, 'lightning imported by import cltrain'\n"
        "from cltrain import ChannelsLast, audit, to_channels_last, to_channels_last_1d\n"
        "assert 'lightning' in sys.modules and ChannelsLast.__module__ == 'cltrain.callback'\n"
        "assert callable(audit) and audit.__module__ == 'cltrain.audit'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
