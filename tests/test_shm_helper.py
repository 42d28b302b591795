"""``shm_left_behind``, the leak check of the signal tests, tells an entry nobody holds (left behind) from one a
live process still maps (another test's, running beside it), and counts files only (a folder is another library's)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from tests.helpers import shm_entries, shm_left_behind

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")

HOLDER = """
import multiprocessing, sys
lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore: /dev/shm/sem.mp-...
print("ready", flush=True)
sys.stdin.read()
"""


def test_an_entry_nobody_holds_is_left_behind_and_one_a_live_process_maps_is_not():
    before = shm_entries()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    orphan = f"/dev/shm/cltrain-test-{uuid.uuid4().hex}"
    folder = f"/dev/shm/cltrain-test-folder-{uuid.uuid4().hex}"  # another library's (joblib's memory-mapping folder)
    os.mkdir(folder)
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert any(n.startswith("sem.mp-") for n in shm_entries() - before)  # the holder's semaphore is there
        with open(orphan, "wb") as f:
            f.write(b"x")
        assert shm_left_behind(before, settle=0.5) == {os.path.basename(orphan)}
    finally:
        os.unlink(orphan)
        os.rmdir(folder)
        holder.communicate("")
    assert not shm_left_behind(before)  # the holder's semaphore went with it
