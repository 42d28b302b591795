"""The shard cache's node-wide locks under threads of several processes: record locks belong to a process, so the
kernel sees a cycle where threads of two processes wait on each other's ranges though none can deadlock."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import warm

SETUP = """
import pathlib, sys, threading, time
from cltrain.data.shard_cache import ShardCache
cache, signals = ShardCache("s3://bucket/pack", sys.argv[1], limit=2**20), pathlib.Path(sys.argv[2])
cache.open()
def wait(name):
    while not (signals / name).exists():
        time.sleep(0.01)
"""
# A holds the lock of a shard and waits for the accounting lock, which B holds while a second thread of B asks for
# A's shard: A waits on B and B on A for the kernel, yet B's first thread lets go without needing anything of A's.
HOLDS_A_SHARD = SETUP + """
with cache._locked("train/shard-000000.tar"):
    wait("b_holds")
    (signals / "a_waits").touch()
    with cache._locked(""):
        pass
print("a done")
"""
HOLDS_THE_ACCOUNTING = SETUP + """
got = []
def second():
    with cache._locked("train/shard-000000.tar"):
        got.append("shard")
with cache._locked(""):
    (signals / "b_holds").touch()
    wait("a_waits")
    time.sleep(0.5)  # A is now blocked on the accounting lock
    thread = threading.Thread(target=second)
    thread.start()
    time.sleep(0.5)
thread.join()
assert got == ["shard"], got
print("b done")
"""


def test_threads_of_two_processes_waiting_on_each_others_locks_all_get_them(tmp_path):
    signals = tmp_path / "signals"
    signals.mkdir()
    procs = [warm.Popen([sys.executable, "-c", code, str(tmp_path / "cache"), str(signals)], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True) for code in (HOLDS_A_SHARD, HOLDS_THE_ACCOUNTING)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err.strip().splitlines()[-3:] for _, err in outs]
    assert [out.strip() for out, _ in outs] == ["a done", "b done"]
