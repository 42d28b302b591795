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


def test_the_cache_cleans_its_own_and_dead_writers_files_not_another_containers(tmp_path, monkeypatch):
    # Containers that share the host's name and a cache disk have PIDs of their own (often 1 in each): a process's exit
    # removed every temporary file named with its pid, another container's download in progress with it; and a file
    # an older cltrain left on this host (tagged with the host's name alone) must still go once its writer is gone.
    import hashlib
    import os
    import socket

    from cltrain.atomic import TEMP_PREFIX, _host_tag
    from cltrain.data import shard_cache

    folder = tmp_path / "cache"
    folder.mkdir()
    mine = folder / f"{TEMP_PREFIX}{os.getpid()}-{_host_tag()}-0000-a.tar"
    theirs = folder / f"{TEMP_PREFIX}{os.getpid()}-0f0f0f0f-0000-b.tar"  # the same pid in another PID namespace
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    legacy = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
    old = folder / f"{TEMP_PREFIX}{int(dead.stdout)}-{legacy}-0000-c.tar"
    for f in (mine, theirs, old):
        f.write_bytes(b"x")
    shard_cache._own_temps(str(folder))
    assert sorted(p.name for p in folder.iterdir()) == [theirs.name]


def test_a_jobs_failure_note_is_the_same_for_all_its_processes_and_not_for_another_jobs(tmp_path, monkeypatch):
    from cltrain.data import shard_cache
    from cltrain.data.shard_cache import ShardCache

    for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    url = "s3://bucket/pack"
    monkeypatch.setenv("MASTER_PORT", "29500")  # exported for every job alike: not a job's
    alone, other = ShardCache(url, str(tmp_path)), ShardCache(url, str(tmp_path))
    assert alone._note() != other._note()
    early = ShardCache(url, str(tmp_path))  # rank 0 of Lightning's launcher: made before the launch sets its variables
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert early._note() == ShardCache(url, str(tmp_path))._note()  # rank 1, made with them
    here = early._note()
    monkeypatch.setattr(shard_cache, "this_machine", lambda: "node-2~4026531836")
    assert early._note() != here  # the same one-node torchrun on another node, a network folder between them
    for loopback in ("LOCALHOST", "[::1]", "0:0:0:0:0:0:0:1", "::ffff:127.0.0.1", "0.0.0.0", "127.0.1.1"):
        assert shard_cache._loopback(loopback), loopback
    assert not any(shard_cache._loopback(a) for a in ("10.0.0.5", "node-1", "[fe80::1]"))
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    far = early._note()
    monkeypatch.setattr(shard_cache, "this_machine", lambda: "node-3~4026531836")
    assert early._note() == far  # one job over nodes: every node's ranks share its master's address
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    step = ShardCache(url, str(tmp_path))._note()
    monkeypatch.setenv("SLURM_STEP_ID", "1")
    assert ShardCache(url, str(tmp_path))._note() != step  # another srun of the allocation: another job
