"""scripts.timing on a fake clock: the order of interleaved rounds, medians, and the sync hook before each clock read."""

from __future__ import annotations

import time

import pytest

from scripts.timing import Stopwatch, interleaved, median_seconds, rotated, timed
from tests.helpers import REPO


class FakeClock:
    """``time.perf_counter`` that moves only when told; each read is logged as ``"clock"``."""

    def __init__(self, log: list[str]) -> None:
        self.now, self.log = 100.0, log

    def __call__(self) -> float:
        self.log.append("clock")
        return self.now


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    events: list[str] = []
    monkeypatch.setattr(time, "perf_counter", FakeClock(events))
    return events


def clock() -> FakeClock:
    assert isinstance(time.perf_counter, FakeClock)
    return time.perf_counter


def test_interleaved_calls_each_case_once_a_round_in_order() -> None:
    calls: list[str] = []
    cases = {name: (lambda name=name: calls.append(name) or len(calls)) for name in "ABC"}
    out = interleaved(2, cases)
    assert calls == list("ABCABC")
    assert out == {"A": [1, 4], "B": [2, 5], "C": [3, 6]}


def test_interleaved_rotate_puts_each_case_first_in_turn() -> None:
    calls: list[str] = []
    out = interleaved(4, {name: (lambda name=name: calls.append(name) or name) for name in "BA"}, rotate=True)
    assert "".join(calls) == "BAABBAAB"
    assert out == {"B": ["B"] * 4, "A": ["A"] * 4} and list(out) == ["B", "A"]
    calls.clear()
    interleaved(3, {name: (lambda name=name: calls.append(name)) for name in "ABC"}, rotate=True)
    assert "".join(calls) == "ABCBCACAB"


def test_rotated() -> None:
    assert rotated(("x", "y"), 0) == ["x", "y"] and rotated(("x", "y"), 3) == ["y", "x"]
    assert rotated([], 5) == []


def test_timed_reads_the_clock_around_the_call(log: list[str]) -> None:
    def fn() -> None:
        log.append("fn")
        clock().now += 2.5

    assert timed(fn) == 2.5
    assert log == ["clock", "fn", "clock"]


@pytest.mark.parametrize("sync", [None, "cpu"])
def test_no_sync_on_the_cpu(log: list[str], sync: str | None) -> None:
    timed(lambda: log.append("fn"), sync=sync)
    assert log == ["clock", "fn", "clock"]


def test_the_sync_hook_runs_before_each_clock_read(log: list[str]) -> None:
    timed(lambda: log.append("fn"), sync=lambda: log.append("sync"))
    assert log == ["sync", "clock", "fn", "sync", "clock"]
    log.clear()
    with Stopwatch(lambda: log.append("sync")):
        log.append("block")
    assert log == ["sync", "clock", "block", "sync", "clock"]


def test_median_seconds_times_each_call_after_untimed_warmup(log: list[str]) -> None:
    durations = iter([100.0, 5.0, 1.0, 3.0])

    def fn() -> None:
        clock().now += next(durations)

    assert median_seconds(fn, 3, warmup=1) == 3.0
    assert log.count("clock") == 6  # two reads per timed call, none for the warm-up


def test_stopwatch_keeps_running_and_the_block_leaves_its_seconds(log: list[str]) -> None:
    watch = Stopwatch().start()
    clock().now += 2.0
    assert watch.elapsed() == 2.0
    clock().now += 3.0
    assert watch.elapsed() == 5.0
    watch.start()
    assert watch.elapsed() == 0.0
    with Stopwatch() as block:
        clock().now += 7.0
    clock().now += 1.0
    assert block.seconds == 7.0


def test_the_scripts_time_through_this_module() -> None:
    """A new hand-written clock loop under scripts/ goes through scripts.timing instead."""
    own = [p.relative_to(REPO).as_posix() for p in (REPO / "scripts").rglob("*.py")
           if "perf_counter" in p.read_text() and p.name != "timing.py"]
    assert own == []
