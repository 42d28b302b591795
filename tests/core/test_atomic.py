"""cltrain.atomic: the target is its old content or the complete new one; temp files are cleaned up;
a full disk (a real EFBIG from RLIMIT_FSIZE, a real ENOSPC on a small tmpfs) is one clear error."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cltrain.atomic import (TEMP_PREFIX, DiskFullError, NotWritableError, atomic_open, atomic_torch_save,
                            atomic_write_bytes, atomic_write_json, atomic_write_text, remove_leftovers)
from tests.helpers import warm


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(TEMP_PREFIX))


def test_writes_replace_the_target_and_leave_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "metrics.json"
    target.write_text("old")
    atomic_write_json(target, {"top1": 76.1}, indent=2)
    assert json.loads(target.read_text()) == {"top1": 76.1} and target.read_text().endswith("}\n")
    atomic_write_text(tmp_path / "a.md", "é\n")
    assert (tmp_path / "a.md").read_bytes() == "é\n".encode()
    with atomic_open(tmp_path / "b.bin") as f:
        f.write(b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    atomic_torch_save({"w": torch.arange(5)}, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=True)["w"].tolist() == [0, 1, 2, 3, 4]
    assert _temps(tmp_path) == []


def test_the_file_and_its_directory_are_fsynced_before_and_after_the_rename(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    def replace(src, dst) -> None:
        synced.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_write_bytes(tmp_path / "x", b"data")
    assert synced == ["file", "replace", "dir"]


def test_permissions_follow_the_umask_or_the_replaced_file(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "new", b"x")
        assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o644  # not mkstemp's 0600
        (tmp_path / "shared").write_bytes(b"x")
        os.chmod(tmp_path / "shared", 0o664)
        atomic_write_bytes(tmp_path / "shared", b"y")
        assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o664
    finally:
        os.umask(old)


def test_an_error_while_writing_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"previous")
    with pytest.raises(ZeroDivisionError):
        with atomic_open(target) as f:
            f.write(b"half of the new")
            1 / 0
    with pytest.raises(AttributeError, match="pickle local object"):
        atomic_torch_save({"f": lambda: None}, target)  # torch.save fails half-way: a lambda cannot be pickled
    assert target.read_bytes() == b"previous" and _temps(tmp_path) == []


def test_no_overwrite_refuses_an_existing_file(tmp_path: Path) -> None:
    target = tmp_path / "metrics.json"
    atomic_write_text(target, "first", overwrite=False)
    with pytest.raises(FileExistsError, match="metrics.json exists and is not replaced"):
        atomic_write_text(target, "second", overwrite=False)
    assert target.read_text() == "first" and _temps(tmp_path) == []


_FSIZE = """
import resource, signal, sys, torch
from cltrain.atomic import DiskFullError, atomic_open, atomic_torch_save
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process instead of failing the write
resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))
try:
    {call}
except DiskFullError as err:
    print(err.errno, err.needed, err.directory, sep="\\n")
    print(err)
"""


def _run_limited(call: str) -> list[str]:
    done = warm.run([sys.executable, "-c", _FSIZE.format(call=call)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_a_file_size_limit_is_a_disk_full_error_with_the_exact_size(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    atomic_torch_save({"w": torch.zeros(10)}, target)
    before = target.read_bytes()
    obj = {"w": torch.ones(2_000_000)}  # 8 MB, over the 1 MB limit
    code, needed, directory, message = _run_limited(
        f"atomic_torch_save({{'w': torch.ones(2_000_000)}}, {str(target)!r})")
    assert int(code) == 27  # EFBIG, from the kernel
    reference = atomic_torch_save(obj, tmp_path / "reference.pt")  # the same object, without the limit
    assert int(needed) == reference.stat().st_size  # the bytes the file needs, exactly
    assert directory == str(tmp_path)
    assert message.startswith(f"cannot write last.ckpt in {tmp_path}: the file is larger than the filesystem or "
                              "this process's file size limit allows (ulimit -f: 1,000,000 bytes); it needs ")
    assert f"it needs {int(needed):,} bytes" in message and "last.ckpt keeps its previous content" in message
    assert target.read_bytes() == before and _temps(tmp_path) == []
    reference.unlink()


def test_a_stream_over_the_limit_reports_the_bytes_written_so_far(tmp_path: Path) -> None:
    lines = _run_limited(f"with atomic_open({str(tmp_path / 'big.bin')!r}) as f:\n"
                         "        for _ in range(100): f.write(b'x' * 100_000)")
    assert int(lines[0]) == 27 and int(lines[1]) >= 1_000_000 and "it needs at least" in lines[3]
    assert "no big.bin was written" in lines[3]
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 1 MiB tmpfs (needs the right to mount; skipped otherwise)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'}); the RLIMIT_FSIZE tests cover EFBIG")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_folder_that_is_not_writable_is_one_line_and_the_previous_file_stays(small_tmpfs: Path) -> None:
    # a checkpoint folder made read-only mid-run: a PermissionError / OSError naming the temporary file, chained
    # with the same failure of the exception-time save (two tracebacks, the last line naming the wrong file)
    target = small_tmpfs / "last.ckpt"
    atomic_write_bytes(target, b"p" * 1000)
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    with pytest.raises(NotWritableError) as caught:
        atomic_write_bytes(target, b"n" * 1000)
    assert str(caught.value) == (f"cannot write last.ckpt in {small_tmpfs}: read-only file system for this process; "
                                 "last.ckpt keeps its previous content; make the folder writable, or write elsewhere")
    assert caught.value.errno == errno.EROFS and target.read_bytes() == b"p" * 1000 and _temps(small_tmpfs) == []


def test_a_full_filesystem_is_a_disk_full_error_and_the_previous_file_stays(small_tmpfs: Path) -> None:
    target = small_tmpfs / "last.ckpt"
    atomic_write_bytes(target, b"p" * 600_000)  # fits once; the new copy cannot fit beside it
    with pytest.raises(DiskFullError) as caught:
        atomic_write_bytes(target, b"n" * 600_000)
    err = caught.value
    assert err.errno == 28 and err.needed == 600_000 and err.directory == small_tmpfs  # ENOSPC
    assert str(err).startswith(f"cannot write last.ckpt in {small_tmpfs}: no space left on the device; "
                               "it needs 600,000 bytes (0.6 MiB)")
    assert target.read_bytes() == b"p" * 600_000 and _temps(small_tmpfs) == []
    atomic_write_bytes(small_tmpfs / "small", b"x")  # the failed write's space was given back


_SAVER = """
import sys, torch
from cltrain.atomic import atomic_torch_save
n = 0
while True:
    n += 1
    atomic_torch_save({"n": n, "w": torch.full((2_000_000,), float(n))}, sys.argv[1])
    print(n, flush=True)
"""


def test_kill_9_at_random_moments_leaves_a_complete_file_and_a_removable_leftover(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    rng = random.Random(0)
    leftovers = 0
    for kill in range(4):
        proc = warm.Popen([sys.executable, "-c", _SAVER, str(target)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip()  # one save finished
        if kill % 2 == 0:  # a random moment
            time.sleep(rng.uniform(0.0, 0.3))
        else:  # surely in the middle of a save: its temporary file is there
            while not _temps(tmp_path):
                pass
            time.sleep(rng.uniform(0.0, 0.01))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        state = torch.load(target, weights_only=True)  # whatever the moment, the file is a complete save
        assert state["w"].eq(float(state["n"])).all()
        found = _temps(tmp_path)
        assert len(found) <= 1 and all(f.startswith(f"{TEMP_PREFIX}{proc.pid}-") for f in found)
        leftovers += len(found)
        assert [p.name for p in remove_leftovers(tmp_path)] == found and _temps(tmp_path) == []
    assert leftovers >= 1  # at least one kill left a half-written temporary file, and the target was whole


def test_remove_leftovers_keeps_files_of_running_writers(tmp_path: Path) -> None:
    from cltrain.atomic import _host_tag

    sleeper = warm.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f"{TEMP_PREFIX}{sleeper.pid}-{_host_tag()}-0000-last.ckpt"
        mine = tmp_path / f"{TEMP_PREFIX}{os.getpid()}-{_host_tag()}-0000-last.ckpt"
        remote_new = tmp_path / f"{TEMP_PREFIX}123-ffffffff-0000-last.ckpt"
        remote_old = tmp_path / f"{TEMP_PREFIX}123-ffffffff-0001-last.ckpt"
        other = tmp_path / "last.ckpt"
        for p in (live, mine, remote_new, remote_old, other):
            p.write_bytes(b"x")
        os.utime(remote_old, (time.time() - 7200, time.time() - 7200))
        assert remove_leftovers(tmp_path) == [remote_old]
        sleeper.kill()
        sleeper.wait()
        assert remove_leftovers(tmp_path) == [live]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, remote_new.name, other.name])
    finally:
        sleeper.kill()
    assert remove_leftovers(tmp_path / "missing") == []


_HELD_WRITE = """
import sys
from cltrain.atomic import atomic_open
with atomic_open(sys.argv[1], "wb") as f:
    f.write(b"x")
    f.flush()
    print("writing", flush=True)
    sys.stdin.read()  # until the test closes its end
"""


def test_a_writer_in_another_pid_namespace_of_this_host_keeps_its_temporary_file(tmp_path: Path) -> None:
    # Containers that share the host's name and a cache disk (Kubernetes hostNetwork pods, docker --net=host): a pid
    # of the other container's namespace was looked up in this one, found gone, and its download in progress removed.
    from cltrain.atomic import this_machine

    last = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1000  # a pid no process of this namespace can have
    shell = f"echo {last} > /proc/sys/kernel/ns_last_pid && {sys.executable} -c '{_HELD_WRITE}' {tmp_path / 'a'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        writer = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", shell], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        pytest.skip("no unshare on this machine")
    try:
        if writer.stdout.readline().strip() != "writing":
            pytest.skip(f"no PID namespace for this user here: {writer.stderr.read()[-300:]}")
        found = _temps(tmp_path)
        pid = int(found[0][len(TEMP_PREFIX):].split("-")[0])
        assert len(found) == 1 and pid == last + 1
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the writer's pid means nothing here
        assert remove_leftovers(tmp_path) == [] and _temps(tmp_path) == found  # kept: its writer runs
        assert this_machine().startswith(os.uname().nodename + "~")
    finally:
        writer.stdin.close()  # the writer ends, its file renamed into place
        writer.wait(timeout=60)
    assert (tmp_path / "a").read_bytes() == b"x" and _temps(tmp_path) == []
