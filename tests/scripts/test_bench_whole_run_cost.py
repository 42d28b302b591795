"""scripts/bench/whole_run_cost.py: every figure it prints is measured on the real objects, in one short run."""

from __future__ import annotations

from scripts.bench.whole_run_cost import main


def test_a_short_run_times_each_cost_against_the_step(capsys) -> None:
    figures = main(["--model", "resnet18", "--batch", "2", "--size", "32", "--rounds", "1"])
    assert set(figures) == {"step", "boundary, nothing moved", "boundary, every weight moved", "note_taken",
                            "loader state_dict", "BatchNorm statistics held", "stream: a sample's seed",
                            "stream: a batch's place"}
    assert all(seconds > 0 for seconds in figures.values()), figures
    printed = capsys.readouterr().out
    assert "| what | when | ms | of one step |" in printed and "CPU " in printed  # each ratio to the step, the machine
