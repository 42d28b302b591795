"""scripts/ measures through one harness: no clock, device synchronisation, rotation, machine description or
Markdown table of its own, no private imports between scripts, every benchmark's quick mode run by a test; and
``scripts.harness`` runs a case in a child process whose crash, hang or error is a status, not the end of the run."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts import harness
from scripts.harness import emit, python_module, run_child
from tests.helpers import REPO

SCRIPTS = sorted((REPO / "scripts").rglob("*.py"))
#: Upstream repros import nothing from this repository, so a file can go to an upstream report as it is
#: (scripts/repro/__init__.py): they keep their own machine line.
PLAIN_PYTORCH = {"scripts/repro/onednn_1x1_strided_conv.py", "scripts/repro/cpu_bf16_conv3d_grad.py",
                 "scripts/repro/cpu_bn_channels_last_accuracy.py"}


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _module(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def _hand_rotation(node: ast.AST) -> bool:
    """``a if r % 2 == 0 else reversed(a)`` (or ``a[::-1]``, or another literal order): a rotation written by hand."""
    if not isinstance(node, ast.IfExp) or "% 2" not in ast.unparse(node.test):
        return False
    other = node.orelse
    return (isinstance(other, (ast.Tuple, ast.List)) or "[::-1]" in ast.unparse(other)
            or isinstance(other, ast.Call) and ast.unparse(other.func) == "reversed")


#: What only the harness does: its clock (``cltrain.timing.clock``), its device synchronisation, the machine
#: (``cltrain.timing.machine``) and the report's tables (``cltrain.timing.report``: a table's rule line).
OWN = ("perf_counter", "monotonic", "torch.cuda.synchronize", "torch.cuda.Event", "/proc/cpuinfo", "get_device_name",
       "|---")


def test_no_clock_rotation_or_machine_description_of_their_own() -> None:
    found = []
    for path in SCRIPTS:
        if _rel(path) in PLAIN_PYTORCH:
            continue
        text = path.read_text()
        found += [f"{_rel(path)}: {what}" for what in OWN if what in text]
        found += [f"{_rel(path)}:{n.lineno}: {ast.unparse(n)}" for n in ast.walk(ast.parse(text)) if _hand_rotation(n)]
    assert found == []


def test_the_rotation_check_finds_a_hand_written_one() -> None:  # the negative control of the test above
    for source in ("x = a if r % 2 == 0 else a[::-1]", "x = (1, 2) if r % 2 == 0 else (2, 1)",
                   "x = a if r % 2 == 0 else reversed(a)"):
        assert any(_hand_rotation(n) for n in ast.walk(ast.parse(source))), source
    assert not any(_hand_rotation(n) for n in ast.walk(ast.parse("q = 2 if i % 2 == 0 else 0")))


def test_no_private_imports_between_scripts() -> None:
    private = [f"{_rel(path)}: from {n.module} import {a.name}" for path in SCRIPTS
               for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)
               and (n.module or "").startswith("scripts") for a in n.names if a.name.startswith("_")]
    assert private == []


def _runnable() -> set[str]:
    return {_module(p) for p in SCRIPTS if re.search(r"^if __name__ == .__main__.:", p.read_text(), re.M)
            and not _rel(p).startswith("scripts/repro/")}


def _run_by_tests() -> set[str]:
    """Modules a test runs: ``"-m", "scripts...."``, or the ``main`` of an imported module called."""
    run = set()
    for path in (REPO / "tests" / "scripts").glob("test_*.py"):
        text = path.read_text()
        run |= set(re.findall(r'"-m", "(scripts[\w.]*)"', text))
        for module, names in re.findall(r"^\s*from (scripts[\w.]*) import ([\w ,]+?)\s*(?:#.*)?$", text, re.M):
            for name, _, alias in (part.strip().partition(" as ") for part in names.split(",")):
                if name == "main" and re.search(r"\bmain\(", text):
                    run.add(module)
                elif re.search(rf"\b{alias or name}\.main\(", text):
                    run.add(f"{module}.{name}")
    return run


def test_every_benchmark_has_its_quick_mode_run_by_a_test() -> None:
    assert _runnable() - _run_by_tests() == set()


def test_a_child_that_crashes_hangs_or_raises_is_a_status(tmp_path: Path) -> None:
    code = ("import json, os, sys, time; print('SCRIPTS-RESULT ' + json.dumps({'argv': sys.argv[1:]}), flush=True); "
            "{'crash': lambda: os.abort(), 'hang': lambda: time.sleep(60), 'raise': lambda: 1 / 0, 'ok': int}"
            "[sys.argv[1]]()")
    runs = {how: run_child([sys.executable, "-S", "-c", code, how], timeout=1 if how == "hang" else 60,
                           log=tmp_path / f"{how}.log") for how in ("ok", "crash", "hang", "raise")}
    assert {how: run.status() for how, run in runs.items()} == {
        "ok": "ok", "crash": "crashed (SIGABRT)", "hang": "timeout after 1 s", "raise": "exited 1"}
    assert runs["ok"].results() == [{"argv": ["ok"]}] and runs["hang"].results() == [{"argv": ["hang"]}]
    assert runs["raise"].last_error() == "ZeroDivisionError: division by zero"
    assert {how: run.failure() for how, run in runs.items()} == {
        "ok": None, "crash": f"crashed (SIGABRT): {runs['crash'].last_error()}", "hang": "timeout after 1 s",
        "raise": "exited 1: ZeroDivisionError: division by zero"}
    assert (tmp_path / "raise.log").read_text() == runs["raise"].output and runs["hang"].seconds < 30


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (one whose parent is gone may wait here for a reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stopped_benchmark_leaves_no_child_running(tmp_path: Path, signum: int) -> None:
    pids = tmp_path / "pids"
    # the child starts a process of its own (as a DataLoader worker would), then both sleep
    child = ("import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-S', '-c', "
             "'import time; time.sleep(120)']); open(sys.argv[1], 'w').write(f'{os.getpid()} {p.pid}'); "
             "time.sleep(120)")
    # Ctrl-C's default handler set first: a shell's background job starts with SIGINT ignored, which Python keeps
    parent = subprocess.Popen([sys.executable, "-c", "import signal, sys; from scripts.harness import run_child; "
                               "signal.signal(signal.SIGINT, signal.default_int_handler); "
                               f"run_child([sys.executable, '-S', '-c', {child!r}, {str(pids)!r}], timeout=120)"],
                              cwd=REPO)
    deadline = time.monotonic() + 60
    while not (pids.exists() and len(pids.read_text().split()) == 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    started = [int(p) for p in pids.read_text().split()]
    assert all(map(_running, started))
    parent.send_signal(signum)
    try:
        assert parent.wait(timeout=30) != 0
    finally:
        parent.kill()  # a parent that did not stop is no one's to leave running
    deadline = time.monotonic() + 10
    while any(map(_running, started)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in started if _running(p)]
    for p in left:  # the control's cleanup: the test fails either way
        os.kill(p, signal.SIGKILL)
    assert not left, f"still running after the parent stopped: {left}"


def test_emit_prints_the_line_a_parent_reads(capsys: pytest.CaptureFixture[str]) -> None:
    emit({"path": Path("/x"), "n": 1})
    out = capsys.readouterr().out
    assert out == 'SCRIPTS-RESULT {"path": "/x", "n": 1}\n'
    assert harness.Child(0, out + "a line\n", 1.0, None).results() == [{"path": "/x", "n": 1}]
    assert python_module("scripts.x", 1)[1:] == ["-m", "scripts.x", "1"]


def test_options_makes_each_option_of_its_default_type() -> None:
    parser = harness.options("A script.\n\nMore.", batch_size=(8, "images"), window=0.5, out=Path("x"),
                             quick=False, threads=[1, 2])
    assert vars(parser.parse_args([])) == {"batch_size": 8, "window": 0.5, "out": Path("x"), "quick": False,
                                           "threads": [1, 2]}
    args = parser.parse_args(["--batch-size", "4", "--window", "1", "--out", "/y", "--quick", "--threads", "3", "4"])
    assert (args.batch_size, args.window, args.out, args.quick, args.threads) == (4, 1.0, Path("/y"), True, [3, 4])
    assert parser.description == "A script." and "images" in parser.format_help()


def test_options_makes_choices_and_options_without_a_default() -> None:
    parser = harness.options("A script.", optimizer=(("sgd", "adamw"), None), batch=(int, "default: per device"),
                             sizes=lambda s: [int(x) for x in s.split(",")], data=[])
    assert vars(parser.parse_args([])) == {"optimizer": "sgd", "batch": None, "sizes": None, "data": []}
    args = parser.parse_args(["--optimizer", "adamw", "--batch", "4", "--sizes", "32,64", "--data", "a=1", "b=2"])
    assert (args.optimizer, args.batch, args.sizes, args.data) == ("adamw", 4, [32, 64], ["a=1", "b=2"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--optimizer", "adam"])


def test_an_options_preset_replaces_the_parsed_values_only_when_given() -> None:
    parser = harness.options("A script.", batch=8, rounds=(3, "rounds"), quick=({"batch": 2, "rounds": 1}, "quick"))
    assert vars(parser.parse_args(["--batch", "16"])) == {"batch": 16, "rounds": 3, "quick": False}
    assert vars(parser.parse_args(["--batch", "16", "--quick"])) == {"batch": 2, "rounds": 1, "quick": True}
