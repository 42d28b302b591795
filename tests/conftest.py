"""Test set-up shared by every test module.

* The tests folder is importable (``plain_modules``, ``data_fixtures``).
* Tests run on the CPU unless marked ``@pytest.mark.cuda``, also on a CUDA machine: an
  autouse fixture sets ``PL_TRAINER_ACCELERATOR=cpu`` (Lightning's env default for
  every ``Trainer`` made without an explicit ``accelerator``) and ``CUDA_VISIBLE_DEVICES=""``
  (every subprocess a test starts, ``train.py`` with ``device=auto`` included, sees no GPU).
  In-process code that asks ``torch.cuda.is_available()`` itself (``device=auto`` in
  ``compose_config``) still sees the GPU: such tests pass ``device=cpu`` explicitly.
* Tests marked ``cuda`` are skipped where CUDA is not available.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# The CUDA runtime reads CUDA_VISIBLE_DEVICES once, at its first call: make that call now, before
# the fixture below hides the GPU from subprocesses, so this process keeps seeing it for the
# tests marked `cuda` whatever order the tests run in.
HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if not HAS_CUDA and item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_unless_marked_cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv("PL_TRAINER_ACCELERATOR", "cpu")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    yield
