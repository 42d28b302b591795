"""The sweep report: from a real tiny multirun (`python train.py -m ...`) to report.md and report.png."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from cltrain.app.metrics_file import write_metrics
from cltrain.tools.sweep_report import markdown_table, write_report
from cltrain.data import make_demo_dataset
from tests.helpers import SMOKE, TINY_DEMO as DEMO
from tests.helpers import warm

REPO = Path(__file__).resolve().parents[2]


def _run(channels_last: bool, precision: str, speed: float, top1: float) -> dict:
    return {"model": "resnet50", "image_size": 112, "global_batch": 32, "device": "cpu", "channels_last": channels_last,
            "precision": precision, "images_per_second": speed, "step_time_s": 32 / speed, "val_top1": top1, "val_top5": 90.0}


def test_speedup_is_against_the_contiguous_fp32_run(tmp_path: Path) -> None:
    runs = [(False, "32-true", 10.0, 50.0), (True, "32-true", 12.5, 51.0), (True, "bf16-mixed", 28.0, 49.5)]
    for i, r in enumerate(runs):
        (tmp_path / str(i)).mkdir()
        write_metrics(tmp_path / str(i), _run(*r))
    md, png = write_report(tmp_path)
    table = md.read_text()
    assert "| 0 | resnet50 | contiguous | 32-true | cpu | 32 | 10.0 | 3200 | 50.00 | 90.00 | 1.00x |" in table
    assert "| 2 | resnet50 | channels_last | bf16-mixed | cpu | 32 | 28.0 | 1143 | 49.50 | 90.00 | 2.80x |" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(FileExistsError):  # metrics.json is never replaced
        write_metrics(tmp_path / "0", _run(*runs[0]))


def test_runs_that_did_not_complete_are_named_and_a_baseline_differs_only_in_the_layout(tmp_path: Path) -> None:
    # an interrupted run's speed was compared as if whole, a failed job vanished, and every run was compared with the
    # first contiguous fp32 run whatever its data workers or steps
    import yaml

    from cltrain.tools.sweep_report import collect, summary

    def job(i: int, overrides: list[str], status: str | None, channels_last: bool = False, speed: float = 10.0):
        (tmp_path / str(i) / ".hydra").mkdir(parents=True)
        (tmp_path / str(i) / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        if status is not None:
            write_metrics(tmp_path / str(i), {**_run(channels_last, "32-true", speed, 50.0), "status": status})

    job(0, ["channels_last=false", "data.num_workers=0"], "completed", speed=10.0)
    job(1, ["channels_last=false", "data.num_workers=2"], "completed", speed=20.0)
    job(2, ["channels_last=true", "data.num_workers=2"], "completed", True, speed=25.0)
    job(3, ["channels_last=true", "data.num_workers=0"], "interrupted", True, speed=12.0)
    job(4, ["channels_last=true", "model.name=resnet9x"], None)  # a bad value: no metrics.json
    (tmp_path / "4" / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"channels_last": True, "amp": "auto"}))
    runs = collect(tmp_path)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in markdown_table(runs).splitlines()[2:]}
    assert rows["2"].endswith("| 1.25x |"), rows  # against run 1 (2 workers), not run 0 (2.50x)
    assert rows["3 (interrupted)"].endswith("| - |") and rows["4 (no metrics.json)"].endswith("| - |"), rows
    assert " | channels_last | " in rows["4 (no metrics.json)"], rows  # its config's layout, not "contiguous"
    assert summary(runs) == ("5 runs: 3 completed, 1 interrupted, 1 no metrics.json (not in the speed-ups; a job "
                             "Hydra never started, in a sweep a signal stopped, has no directory).")
    # the overrides that tell the runs apart, beside the run (the layout has its own column)
    assert rows["0"].startswith("| 0 | data.num_workers=0 | resnet50 |"), rows
    assert rows["4 (no metrics.json)"].startswith("| 4 (no metrics.json) | model.name=resnet9x | "), rows


def test_jobs_are_in_their_numbers_order(tmp_path: Path) -> None:
    from cltrain.tools.sweep_report import collect

    for i in (0, 1, 2, 10, 11):  # 0, 1, 10, 11, 2: as text
        (tmp_path / str(i)).mkdir()
        write_metrics(tmp_path / str(i), _run(True, "32-true", 10.0, 50.0))
    assert [run["run"] for run in collect(tmp_path)] == ["0", "1", "2", "10", "11"]


def test_a_run_that_failed_before_its_layout_was_decided_is_no_contiguous_run(tmp_path: Path) -> None:
    from cltrain.tools.sweep_report import collect

    (tmp_path / "0").mkdir()
    write_metrics(tmp_path / "0", {**_run(None, "32-true", 30.0, 50.0), "status": "failed"})  # as results.py writes it
    rows = markdown_table(collect(tmp_path)).splitlines()[2:]
    assert len(rows) == 1 and " | ? | " in rows[0] and "contiguous" not in rows[0], rows


def test_no_baseline_gives_no_speedup() -> None:
    table = markdown_table([{**_run(True, "bf16-mixed", 20.0, 40.0), "run": "0"}])
    assert table.rstrip().endswith("| - |")


def test_report_from_a_real_multirun(tmp_path: Path) -> None:
    root = make_demo_dataset(tmp_path / "demo", **DEMO)
    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    args = [*SMOKE, f"data.root={root}", *(f"data.demo.{k}={v}".replace(" ", "") for k, v in DEMO.items()),
            "device=cpu", "trainer.enable_progress_bar=false", "print_freq=0", f"hydra.sweep.dir={sweep}"]
    result = warm.run([sys.executable, str(REPO / "train.py"), "-m", "channels_last=true,false", "amp=true,false",
                       *args], capture_output=True, text=True, timeout=400, cwd=REPO, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    configs = {(m["channels_last"], m["precision"]) for m in
               (json.loads(p.read_text()) for p in sweep.glob("*/metrics.json"))}
    assert configs == {(True, "bf16-mixed"), (True, "32-true"), (False, "bf16-mixed"), (False, "32-true")}

    report = warm.run([sys.executable, "-m", "cltrain.tools.sweep_report", str(sweep)],
                      capture_output=True, text=True, timeout=120, cwd=REPO)
    assert report.returncode == 0, report.stderr
    table = (sweep / "report.md").read_text()
    assert table.count("| test_resnet |") == 4 and "1.00x" in table
    assert (sweep / "report.png").stat().st_size > 1000

    again = warm.run([sys.executable, str(REPO / "train.py"), "-m", "amp=true", *args],
                     capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert again.returncode == 2 and "hydra.sweep.dir=" in again.stderr  # the sweep is never overwritten
