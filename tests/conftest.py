"""Test set-up shared by every test module: the tests folder is importable (plain_modules)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
