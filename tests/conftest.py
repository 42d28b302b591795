"""Set-up shared by every test.

* Tests run on the CPU unless marked ``@pytest.mark.cuda``, also on a CUDA machine: an
  autouse fixture sets ``PL_TRAINER_ACCELERATOR=cpu`` (Lightning's env default for
  every ``Trainer`` made without an explicit ``accelerator``) and ``CUDA_VISIBLE_DEVICES=""``
  (every subprocess a test starts, ``train.py`` with ``device=auto`` included, sees no GPU).
  In-process code that asks ``torch.cuda.is_available()`` itself still sees the GPU: such
  tests pass ``device=cpu`` explicitly.
* Tests marked ``cuda`` are skipped where CUDA is not available.
* The file-index cache (``CLTRAIN_CACHE_DIR``) is a session temporary folder, not the user's; so is torch.compile's
  (``TORCHINDUCTOR_CACHE_DIR``), unless set.
* ``demo_root`` / ``demo_args``: the tiny demo set (:data:`tests.helpers.TINY_DEMO`), made once per session.
* Under pytest-xdist (``-n auto`` in pyproject.toml, one worker per core, a test module per worker), each worker
  and the processes its tests start use an equal share of the CPUs: two workers each running torch on every core
  make both many times slower. ``-n 0`` runs the tests in one process.
* A test starts Python with ``tests.helpers.warm.run`` / ``Popen`` (``subprocess``'s arguments): a fork of a server
  that imported torch and Lightning once, unless the test is about a start (``subprocess`` itself) or sets a variable
  read at import (``warm`` then starts Python).
* Each test starts with torch's own ``parameters_to_vector``, ``vector_to_parameters`` and pruning masks: a session
  that an earlier test in the same worker started and never ended (the Hugging Face callback's, Accelerate's, a run
  that raised) holds ``cltrain.nchw_code``'s versions, which a later test's negative control must not meet.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import TINY_DEMO, demo_overrides

# The CUDA runtime reads CUDA_VISIBLE_DEVICES once, at its first call: make that call now, before
# the fixture below hides the GPU from subprocesses, so this process keeps seeing it for the
# tests marked `cuda` whatever order the tests run in.
HAS_CUDA = torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        # torch.compile's cache a run of its own (its workers and their processes share it): the machine's shared one
        # (/tmp/torchinductor_<user>) keeps what a run with the ISA capped (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY)
        # compiled under the same key, and a later run's compiled stem crashed on it (free(): invalid pointer)
        import shutil
        import tempfile

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="cltrain-tests-inductor-")
        config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        from cltrain.data.loader_threads import usable_cores

        share = max(1, usable_cores() // workers)
        torch.set_num_threads(share)
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the train.py and DDP processes a test starts
            os.environ[name] = str(share)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if not HAS_CUDA and item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
    # the modules with the most slow tests first: xdist hands a module to a free worker in this order, so the long
    # ones start early and the short ones fill in at the end (the order within a module stays)
    slow = Counter(item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.nodeid.split("::")[0]])


def reset_torch_utilities() -> None:
    """torch's own ``parameters_to_vector`` and pruning masks, whatever an earlier test left holding cltrain's (a hold
    of a session the collector finds later then gives back nothing: ``cltrain.nchw_code``)."""
    from cltrain import nchw_code

    with nchw_code._lock:
        nchw_code._holders.clear()
        nchw_code._pruning_holders.clear()
        nchw_code._sync()
    nchw_code._unbind(None)  # modules that bound torch's functions by name: torch's again


@pytest.fixture(autouse=True)
def torchs_own_utilities() -> None:
    reset_torch_utilities()


@pytest.fixture(autouse=True)
def _emulated_bf16_unsaid() -> None:
    from cltrain import precision

    precision._EMULATED_SAID.clear()  # said once per process: once per test here


@pytest.fixture(scope="session")
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def _cpu_unless_marked_cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
                            _cache_dir: Path) -> Iterator[None]:
    monkeypatch.setenv("CLTRAIN_CACHE_DIR", str(_cache_dir))  # file indexes: never the user's cache folder
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv("PL_TRAINER_ACCELERATOR", "cpu")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    yield



@pytest.fixture
def steady() -> Iterator[None]:
    """The race of the layouts timed on a steady clock (``tests.helpers.plain_modules.SteadyClock``): ``SlowIn``'s and
    ``SlowStep``'s pauses decide it, however busy the machine."""
    from tests.helpers.plain_modules import steady_clock

    with steady_clock():
        yield


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo set (:data:`tests.helpers.TINY_DEMO`), made once for the whole session."""
    from cltrain.data import make_demo_dataset

    return make_demo_dataset(tmp_path_factory.mktemp("data") / "demo", **TINY_DEMO)


@pytest.fixture(scope="session")
def demo_args(demo_root: Path) -> list[str]:
    """The overrides that point ``train.py`` at :func:`demo_root`."""
    return demo_overrides(demo_root)
