"""The forked interpreter of :mod:`tests.helpers.warm` behaves as ``python`` started afresh, each call compared with a
real start of the same command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, warm

SELF = """
import json, os, random, sys
import __main__
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "env": os.environ.get("WARM_PROBE"),
                  "spec": getattr(__main__.__spec__, "name", None), "file": getattr(__main__, "__file__", None),
                  "stdin": sys.stdin.read(), "extra_path": sys.path[1], "random": random.random(),
                  "lightning": "lightning" in sys.modules}))
sys.exit(int(sys.argv[-1]))
"""


def _both(args: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    return (warm.run([sys.executable, *args], capture_output=True, text=True, timeout=120, **kwargs),
            subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, **kwargs))


@pytest.mark.parametrize("how", ["-c", "script", "-m"])
def test_a_warm_child_sees_what_a_started_python_sees(tmp_path: Path, how: str) -> None:
    (tmp_path / "probe_mod.py").write_text(SELF)
    args = {"-c": ["-c", SELF], "script": [str(tmp_path / "probe_mod.py")], "-m": ["-m", "probe_mod"]}[how]
    env = {**os.environ, "WARM_PROBE": "yes", "PYTHONPATH": str(tmp_path / "extra")}
    warm_done, fresh = _both([*args, "a b", "3"], cwd=tmp_path, env=env, input="stdin text")
    assert warm_done.returncode == fresh.returncode == 3, warm_done.stderr[-2000:]
    seen, expected = json.loads(warm_done.stdout), json.loads(fresh.stdout)
    assert seen.pop("random") != expected.pop("random")
    assert seen.pop("lightning") and not expected.pop("lightning")  # the one difference: what is already imported
    assert seen == expected and seen["env"] == "yes" and seen["stdin"] == "stdin text"


def test_each_warm_child_draws_its_own_random_numbers() -> None:
    code = "import random, numpy; print(random.random(), numpy.random.rand())"
    first, second = (warm.run([sys.executable, "-c", code], capture_output=True, text=True) for _ in range(2))
    assert first.stdout.split() and set(first.stdout.split()).isdisjoint(second.stdout.split())


def test_an_uncaught_exception_a_signal_and_a_timeout_end_a_warm_child_as_they_end_python() -> None:
    raised, fresh = _both(["-c", "raise ValueError('the message')"])
    assert raised.returncode == fresh.returncode == 1
    assert raised.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "ValueError: the message"
    proc = warm.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                      stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n" and proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    proc.stdout.close()
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    assert time.monotonic() - started < 30


def test_an_import_time_variable_gets_a_real_start(tmp_path: Path) -> None:
    code = "import sys; print('lightning' in sys.modules)"
    env = {**os.environ, "OMP_NUM_THREADS": "1" if os.environ.get("OMP_NUM_THREADS") != "1" else "2"}
    assert warm.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout == "False\n"
    assert warm.run([sys.executable, "-c", code], capture_output=True, text=True, fresh=True).stdout == "False\n"
    # the control: the same call without the variable is served warm
    assert warm.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO).stdout == "True\n"


def test_poll_and_wait_after_the_end_keep_the_status() -> None:
    proc = warm.Popen([sys.executable, "-c", "import sys; sys.exit(5)"])
    while proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() == proc.wait() == proc.returncode == 5


def test_nested_makes_the_childs_own_python_processes_forks_too() -> None:
    # the child starts a grandchild as a script that runs each case in a process of its own would
    code = ("import subprocess, sys\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import sys; sys.exit(3 if \"lightning\" in sys.modules else 4)'])\n"
            "status = p.wait(timeout=float('inf'))\n"
            "done = subprocess.run([sys.executable, '-c', 'print(7)'], capture_output=True, text=True, timeout=60)\n"
            "print(status, done.returncode, done.stdout.strip())")
    nested = warm.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, nested=True)
    assert nested.stdout.split() == ["3", "0", "7"], nested.stderr  # 3: a fork of the server, which holds Lightning
    # the control: without nested=True the grandchild is a real start
    plain = warm.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert plain.stdout.split() == ["4", "0", "7"], plain.stderr


def test_a_file_size_limit_holds_in_a_warm_child_as_in_a_started_python(tmp_path: Path) -> None:
    code = ("import sys\ntry:\n    open(sys.argv[1], 'wb').write(bytes(2_000_000))\nexcept OSError as e:\n"
            "    print(e.errno)\nelse:\n    print('written')")
    for fresh in (False, True):
        out = warm.run([sys.executable, "-c", code, str(tmp_path / f"{fresh}.bin")], capture_output=True, text=True,
                       file_size_limit=1_000_000, fresh=fresh)
        assert (out.returncode, out.stdout.strip()) == (0, "27"), (fresh, out.stderr)  # EFBIG, not SIGXFSZ
    # the control: without the limit the write succeeds
    assert warm.run([sys.executable, "-c", code, str(tmp_path / "free.bin")], capture_output=True,
                    text=True).stdout.strip() == "written"


def test_a_timed_out_child_and_what_it_started_are_ended() -> None:
    # the child starts a process that holds its output open (a DDP rank, a loader worker): on the timeout both end,
    # and the test goes on (it waited for the child's status forever before)
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            "time.sleep(300)")
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3)
    assert time.monotonic() - started < 30
