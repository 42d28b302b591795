"""cltrain.timing.clock and cltrain.timing.rounds on a fake clock: the order of the rounds, what warm-up leaves out,
how the minimum window sizes a round, the sync before each clock read, a failing case dropped, medians and spreads."""

from __future__ import annotations

import time

import pytest

from cltrain.timing.clock import Stopwatch, cpu_seconds, timed
from cltrain.timing.rounds import interleaved, rate_after_first, rotated, time_steps
from cltrain.timing.stats import log_ratio, spread, t_quantile


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


def step_taking(seconds: float, log: list[str] | None = None, name: str = "step"):
    def step() -> None:
        if log is not None:
            log.append(name)
        clock().now += seconds
    return step


def test_interleaved_rotates_the_order_and_leaves_the_warmup_rounds_out() -> None:
    calls: list[str] = []
    out = interleaved({name: (lambda name=name: calls.append(name) or len(calls)) for name in "ABC"}, 3, warmup=1)
    assert "".join(calls) == "CABABCBCACAB"  # the warm-up round is round -1 of the rotation
    assert out == {"A": [4, 9, 11], "B": [5, 7, 12], "C": [6, 8, 10]}
    calls.clear()
    assert interleaved({n: (lambda n=n: calls.append(n)) for n in "AB"}, 2, rotate=False) and calls == list("ABAB")
    assert interleaved({"A": lambda r: r}, 2, warmup=1, with_round=True) == {"A": [1, 2]}  # a seed per round
    with pytest.raises(ValueError, match="rounds >= 1"):
        interleaved({"A": lambda: 1}, 0)


def test_rotated_puts_each_first_in_turn() -> None:
    assert rotated(("x", "y"), 0) == ["x", "y"] and rotated(("x", "y"), 3) == ["y", "x"] and rotated([], 5) == []


def test_the_sync_runs_before_each_clock_read(log: list[str]) -> None:
    assert timed(step_taking(2.5, log), sync=lambda: log.append("sync")) == 2.5
    assert log == ["sync", "clock", "step", "sync", "clock"]
    log.clear()
    timed(lambda: log.append("fn"), sync="cpu")  # a CPU device: nothing to wait for
    assert log == ["clock", "fn", "clock"]


def test_the_stopwatch_keeps_running_and_a_block_keeps_its_seconds(log: list[str]) -> None:
    watch = Stopwatch().start()
    clock().now += 2.0
    assert watch.elapsed() == 2.0
    with Stopwatch() as block:
        clock().now += 7.0
    clock().now += 1.0
    assert block.seconds == 7.0 and watch.elapsed() == 10.0
    clock().now += 1.0
    assert watch.lap() == 11.0 and log.count("clock") == 6  # one reading ends a lap and starts the next
    clock().now += 2.0
    assert watch.lap() == 2.0


def test_cpu_seconds_count_this_process_its_ended_children_and_another_process() -> None:
    import os
    import subprocess
    import sys

    own, kids = cpu_seconds(), cpu_seconds("children")
    sum(i * i for i in range(300_000))  # busy, not asleep
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(300_000))"], check=True)
    assert cpu_seconds() > own and cpu_seconds("children") > kids
    assert 0 < cpu_seconds(os.getpid()) <= cpu_seconds() + 0.05  # /proc counts in clock ticks


def test_time_steps_warms_up_untimed_then_times_one_window_per_case_and_round(log: list[str]) -> None:
    timing = time_steps({"a": step_taking(1.0, log, "a"), "b": step_taking(3.0, log, "b")}, rounds=3, warmup=2,
                        min_steps=2, sync=lambda: log.append("sync"))
    assert timing.steps == {"a": 2, "b": 2} and timing.seconds == {"a": [1.0] * 3, "b": [3.0] * 3}
    steps = [e for e in log if e in "ab"]
    assert "".join(steps) == "aabb" + "aabb" + "bbaa" + "aabb"  # warm-up, then the rounds in rotating order
    # one sync and one clock read at each end of a window, none between its steps
    assert log[:7] == ["sync", "clock", "a", "a", "sync", "clock", "sync"]
    assert timing.per_step()["b"].median == 3.0 and timing.rates(units=6)["b"].cell(1) == "2.0 (2.0-2.0)"


def test_a_window_is_sized_to_last_the_minimum_on_the_fastest_case(log: list[str]) -> None:
    fast = 1 / 64  # exact in binary: the fake clock's sums stay exact
    timing = time_steps({"fast": step_taking(fast), "slow": step_taking(4 * fast)}, rounds=2, warmup=0, min_window=0.5,
                        max_steps=10_000)
    assert timing.steps == {"fast": 48, "slow": 48}  # 1.5 x 0.5 s / (1/64 s): the margin keeps a quicker round long
    assert min(s * 48 for v in timing.seconds.values() for s in v) >= 0.5
    each = time_steps({"fast": step_taking(fast), "slow": step_taking(4 * fast)}, rounds=1, warmup=0, min_window=0.5,
                      size_each=True)
    assert each.steps == {"fast": 48, "slow": 12} and each.per_step()["slow"].median == 4 * fast
    capped = time_steps({"fast": step_taking(fast)}, rounds=1, warmup=0, min_window=0.5, max_steps=20)
    assert capped.steps == {"fast": 20}


def test_a_case_that_raises_is_dropped_with_its_error_and_the_others_go_on(log: list[str]) -> None:
    left = iter(range(3))

    def breaks() -> None:
        if next(left, None) is None:
            raise RuntimeError("CUDA out of memory\nmore lines")

    timing = time_steps({"ok": step_taking(1.0), "breaks": breaks}, rounds=4, warmup=1, catch=(RuntimeError,))
    assert timing.errors == {"breaks": "RuntimeError: CUDA out of memory"}
    assert len(timing.seconds["ok"]) == 4 and len(timing.seconds["breaks"]) == 2 and set(timing.per_step()) == {"ok", "breaks"}
    with pytest.raises(ValueError, match="not caught"):  # what is not in `catch` ends the timing
        time_steps({"x": lambda: (_ for _ in ()).throw(ValueError("not caught"))}, catch=(RuntimeError,))


def test_rate_after_first_leaves_the_first_item_out_of_the_window(log: list[str]) -> None:
    def batches():
        clock().now += 100.0  # worker start-up, before the first batch
        yield 4
        for _ in range(3):
            clock().now += 2.0
            yield 4

    rate = rate_after_first(batches(), count=lambda n: n)
    assert (rate.items, rate.seconds, rate.per_second) == (12, 6.0, 2.0)
    assert rate_after_first(batches(), count=lambda n: n, limit=1).items == 4
    assert rate_after_first(iter(())).per_second is None


def test_spread_quotes_the_median_and_the_range() -> None:
    s = spread([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.low, s.high) == (2.5, 1.0, 10.0) and spread([1234.5]).cell(0, thousands=True) == "1,234 (1,234-1,234)"
    with pytest.raises(ValueError, match="no values"):
        spread([])


def test_a_ratio_beyond_the_noise_of_its_own_samples_has_a_bound_that_excludes_one() -> None:
    a, b = [1.0, 1.02, 0.98, 1.0, 1.01], [1.5, 1.52, 1.49, 1.5, 1.51]
    clear = log_ratio(a, b)
    assert clear.medians == (1.0, 1.5) and clear.factor == pytest.approx(1.5) and clear.df == 8
    assert clear.log - clear.bound(0.999) > 0  # b slower beyond doubt
    noisy = log_ratio(a, [0.7, 2.2, 1.1, 1.9, 1.05])  # the same median ratio would not be believed from these
    assert noisy.log - noisy.bound(0.999) < 0 < noisy.log
    widened = log_ratio(a, b, spread_only=[3.0])  # a slow warm-up step widens the bound, not the medians
    assert widened.medians == clear.medians and widened.width > clear.width
    assert log_ratio([1.0], [1.0]).width == pytest.approx(0.01 * 2 ** 0.5)  # the floor: never certain of nothing
    assert t_quantile(1, 0.999) == 318.3 and t_quantile(100, 0.975) == 1.96 and t_quantile(0, 0.975) == pytest.approx(127.1)
