"""``python -m scripts.gpu_check --tiny`` on the CPU: one Markdown table with every part's rows and columns, the parts that
need CUDA skipped with the reason, and the runs this CPU can make trained with finite losses and no host sync."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers import warm
COLUMNS = ["part", "configuration", "status", "precision", "img/s", "step (ms)", "finite losses", "host syncs/step",
           "notes"]
E2E = {"`channels_last=true amp=fp16`": "16-mixed", "`channels_last=false amp=fp16`": "16-mixed",
       "`channels_last=true amp=bf16`": "bf16-mixed", "`channels_last=false amp=bf16`": "bf16-mixed",
       "`channels_last=true amp=false`": "32-true", "`channels_last=false amp=false`": "32-true",
       "`channels_last=true amp=auto compile.enabled=true`": None}


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


@pytest.mark.long  # train.py and the main_amp matrix end to end (about 40 s): run it before a GPU session
def test_tiny_gpu_check_writes_one_table_with_every_part(tmp_path: Path) -> None:
    # conftest hides the GPU from this subprocess: what needs CUDA must be a "skipped" row, not a failure
    result = warm.run([sys.executable, "-m", "scripts.gpu_check", "--tiny", "--out", str(tmp_path)], cwd=REPO,
                      capture_output=True, text=True, timeout=600, nested=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = (tmp_path / "gpu_check.md").read_text()
    assert text in result.stdout
    lines = text.splitlines()
    assert all(line.startswith("| ") or line.startswith("|---") for line in lines)  # the table and nothing else
    assert _cells(lines[0]) == COLUMNS and all(len(_cells(line)) == len(COLUMNS) for line in lines[2:])
    rows = [dict(zip(COLUMNS, _cells(line))) for line in lines[2:]]
    assert [r["part"] for r in rows] == ["machine", "command", "data", "cuda tests", "default train.py",
                                         *["main_amp e2e"] * len(E2E)]
    machine, command, _, cuda_tests, newcomer, *e2e = rows
    assert machine["configuration"] == "no CUDA device" and machine["notes"].startswith("CPU ")
    assert "logical" in machine["notes"] and "torch " in machine["notes"]
    assert "python -m scripts.gpu_check --tiny --out" in command["configuration"]
    assert cuda_tests["status"] == "skipped: no CUDA"

    assert newcomer["status"] == "completed" and newcomer["configuration"].startswith("`python train.py")
    finite, logged = re.fullmatch(r"(\d+)/(\d+) logged", newcomer["finite losses"]).groups()
    assert finite == logged != "0"

    assert [r["configuration"] for r in e2e] == list(E2E)
    trained = 0
    for r in e2e:
        precision = E2E[r["configuration"]]
        if precision == "16-mixed":
            assert r["status"] == "skipped: no CUDA"
        elif precision is None:
            assert r["status"].startswith("skipped: --tiny")
        elif r["status"] != "skipped: no bf16 on this CPU":
            assert r["status"] == "completed" and r["precision"] == precision, r
            assert r["finite losses"] == "3/3" and r["host syncs/step"] == "0", r
            assert float(r["img/s"].replace(",", "")) > 0 and float(r["step (ms)"].replace(",", "")) > 0
            trained += 1
    assert trained >= 2  # fp32 in both layouts, everywhere
    runs = (tmp_path / "runs.metrics.jsonl").read_text().splitlines()  # each run's, one line beside the table
    assert (tmp_path / "default_train.metrics.json").is_file() and len(runs) == trained
    assert all(json.loads(line)["status"] == "completed" for line in runs)


# --- --mark: the configurations toward the MLPerf per-GPU rate (scripts/bench/mark.py) -------------------------
@pytest.mark.slow  # two models' three fits each, in processes of their own
def test_the_default_part_races_each_model_and_says_what_it_kept_and_what_the_check_cost(tmp_path: Path) -> None:
    result = warm.run([sys.executable, "-m", "scripts.gpu_check", "--tiny", "--parts", "default", "--out",
                       str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600, nested=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [dict(zip(COLUMNS, _cells(line))) for line in (tmp_path / "gpu_check.md").read_text().splitlines()[2:]]
    assert [(r["part"], r["status"]) for r in rows[3:6]] == [
        ("cuda tests", "skipped: --parts"), ("default train.py", "skipped: --parts"), ("main_amp e2e", "skipped: --parts")]
    models = rows[6:]
    assert [r["configuration"] for r in models] == ["`resnet18` 32 px", "`mobilenet_v3_small` 32 px"]
    records = json.loads((tmp_path / "default_speed" / "default_speed.json").read_text())
    for r, record in zip(models, records):
        assert r["part"] == "layout default" and r["status"] == "completed" and r["precision"] == "32-true", r
        assert r["step (ms)"] == f"{1000 * record['default_step_s']:.1f}"
        assert re.search(r"race: (CL|NCHW) [\d.]+x \(\w+, [\d.]+ s\)|race: not decided", r["notes"]), r
        assert f"check passed, {record['check_s']:.2f} s (" in r["notes"], r


def test_the_largest_batch_is_found_by_doubling_then_halving_the_interval() -> None:
    from scripts.bench.mark import largest_batch

    limit = 1000  # what "memory" holds
    assert largest_batch(lambda n: n <= limit, 256, 4096, 64) == (960, {256: True, 512: True, 1024: False, 768: True,
                                                                        896: True, 960: True})
    assert largest_batch(lambda n: n <= 100, 256, 4096, 64)[0] == 64  # 256 does not fit: halving down from it
    assert largest_batch(lambda n: True, 256, 2048, 64) == (2048, {256: True, 512: True, 1024: True, 2048: True})
    assert largest_batch(lambda n: False, 4, 16, 4) == (None, {4: False})


def test_the_mark_repeats_its_key_configurations_in_interleaved_rounds_and_runs_max_autotune_last() -> None:
    from scripts.bench.mark import CONFIGS, KEY, tasks

    order = tasks(tiny=False)
    assert order[0] == {"kind": "amp"} and order[-1]["name"].endswith("max-autotune-no-cudagraphs")
    e2e = [t for t in order if t["kind"] == "e2e" and t["name"] in KEY]
    rounds = [[t["name"] for t in e2e if t["round"] == r] for r in range(3)]
    assert rounds == [KEY, KEY[1:] + KEY[:1], KEY[2:] + KEY[:2]]  # each first in turn, as every interleaved case
    assert {t["name"] for t in order if t["kind"] == "e2e"} == set(CONFIGS)
    kinds = [t["kind"] for t in order]
    assert kinds.index("largest_batch") < [t.get("name", "") for t in order].index(
        "channels_last fp16 compile, largest batch")


def _e2e(name: str, r: int, img_s: float, precision: str = "16-mixed", batch: int = 256, **more) -> dict:
    return {"kind": "e2e", "name": name, "round": r, "status": "completed", "precision": precision, "batch": batch,
            "images_per_second": img_s, "step_time_s": batch / img_s, "finite": 68, "steps": 68, **more}


def test_the_mark_table_gives_medians_and_each_rounds_ratio_to_its_contiguous_run() -> None:
    from scripts.bench.mark import mark_markdown

    profile = {"wall_ms": 50.0, "kinds": {"convolution forward": 10.0, "data wait": 5.0}}
    records = [
        {"kind": "amp", "name": "amp", "round": 0, "status": "completed", "batch": 256, "rounds": 3,
         "trials": [{"flag": "bf16-mixed", "seconds_per_step": 0.064, "finite": True, "steps": 17, "error": ""},
                    {"flag": "16-mixed", "seconds_per_step": 0.051, "finite": True, "steps": 17, "error": ""}],
         "choice": {"flag": "16-mixed", "reason": "measured: fp16 + loss scaling, 1.25x faster"},
         "auto": {"flag": "bf16-mixed", "reason": "compute capability 9.0"}},
        *[_e2e("contiguous fp16", r, v) for r, v in enumerate((1000, 1200, 900))],
        *[_e2e("channels_last fp16", r, v, **({"profile": profile} if r == 0 else {}))
          for r, v in enumerate((2000, 2100, 2000))],  # ratios 2.0, 1.75, 2.22: median 2.0
        {"kind": "e2e", "name": "channels_last fp16 compile", "round": 0, "status": "failed",
         "error": "OutOfMemoryError: CUDA out of memory"},
        {"kind": "largest_batch", "name": "largest_batch", "round": 0, "status": "completed", "largest": 768,
         "precision": "16-mixed", "cap": 2048, "tried": [[256, True], [512, True], [1024, False], [768, True]]},
        _e2e("channels_last fp16 compile, largest batch", 0, 2860.0, batch=768),
        {"kind": "loader", "name": "loader", "round": 0, "status": "completed", "batch": 256, "rates": [
            {"workers": 14, "threads": 1, "asked": [14, "auto"], "img_s": 6000.0},
            {"workers": 14, "threads": 1, "asked": [14, "auto"], "img_s": 7000.0}]},
        {"kind": "e2e", "name": "channels_last fp16 compile max-autotune-no-cudagraphs", "round": 0,
         "status": "not run: 12 s of the budget left, it needs about 300 s"},
    ]
    text = mark_markdown(records, {"gpu": "NVIDIA H100 80GB HBM3", "machine": "CPU x; GPU NVIDIA H100 80GB HBM3",
                                   "command": "c"})
    assert text.startswith("Machine: CPU x; GPU NVIDIA H100 80GB HBM3\n\n`c`")
    rows = {cells[0]: cells for cells in (_cells(line) for line in text.splitlines() if line.startswith("| "))}
    assert rows["contiguous fp16"][3:8] == ["1,000.0", "900-1,200", "3", "1.00x", "256.0"]
    assert rows["channels_last fp16"][3:7] == ["2,000.0", "2,000-2,100", "3", "2.00x (3 rounds)"]
    assert rows["channels_last fp16 compile"][5] == "0" and "OutOfMemoryError" in rows["channels_last fp16 compile"][9]
    largest = rows["channels_last fp16 compile, largest batch"]
    assert largest[2] == "768" and largest[6] == "2.86x" and "baseline at batch 256" in largest[9]
    assert "not run: 12 s of the budget left" in rows["channels_last fp16 compile max-autotune-no-cudagraphs"][9]
    step = rows["recipe step only, channels_last fp16 (synthetic batch)"]
    assert step[3] == "5,019.6" and step[5] == "3" and step[7] == "51.0"  # 256 images / 51 ms, median of 3 rounds
    assert "would pick `16-mixed`: measured: fp16 + loss scaling, 1.25x faster. `amp=auto` picks `bf16-mixed`" in text
    assert ("**Largest batch** (eager 16-mixed step, synthetic): 768; tried 256 fits, 512 fits, 1024 out of memory"
            in text)
    assert "channels_last fp16 compile, largest batch at 2,860.0 img/s, is 40% of MLPerf" in text
    assert "**Data wait** in channels_last fp16: 10.0% of the step (above 5%: decoding on the GPU" in text
    assert rows["14 x 1 (14, auto)"][1:] == ["6,500.0", "6,000-7,000", "2"]
    assert rows["data wait (host, apart)"] == ["data wait (host, apart)", "5.0 ms (10%)"]


def _mark(tmp_path: Path, *only: str) -> tuple[subprocess.CompletedProcess, str, dict[str, list[str]]]:
    result = warm.run([sys.executable, "-m", "scripts.gpu_check", "--tiny", "--mark", "--parts", "e2e",
                       "--out", str(tmp_path), *(["--mark-only", *only] if only else [])], cwd=REPO,
                      capture_output=True, text=True, timeout=900, nested=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = (tmp_path / "mark.md").read_text()
    return result, text, {c[0]: c for c in (_cells(line) for line in text.splitlines() if line.startswith("| "))}


@pytest.mark.slow  # two processes and five builds of the recipe's step (about 20 s)
def test_tiny_mark_measures_the_precisions_the_largest_batch_and_the_loader(tmp_path: Path) -> None:
    result, text, rows = _mark(tmp_path, "amp", "largest_batch", "loader")
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| mark | `--mark` | completed: 3 of 3 tasks completed |" in table and table in result.stdout
    assert "| cuda tests |  | skipped: --parts |" in table
    assert "| main_amp e2e | `channels_last=true amp=false` | skipped: --mark-only |" in table
    for flag, short in (("bf16-mixed", "bf16"), ("32-true", "fp32")):  # a CPU chooses between bf16 and fp32
        step = rows[f"recipe step only, channels_last {short} (synthetic batch)"]
        assert step[1] == flag and step[2] == "4" and float(step[3].replace(",", "")) > 0 and step[5] == "2"
    picked = re.search(r"would pick `([\w-]+)`: measured: (bf16|fp32), ([\d.]+x faster|within 3%)", text)
    assert picked and {"bf16-mixed": "bf16", "32-true": "fp32"}[picked.group(1)] == picked.group(2), text
    assert "finite losses over 3 steps" in text and "`amp=auto` picks `" in text
    assert "**Largest batch** (eager 32-true step, synthetic): 8 (the search stops at 8); tried 4 fits, 8 fits." in text
    for split in ("0 x 1 (0, 1)", "1 x 1 (1, 1)"):  # in this process, and one worker process
        assert float(rows[split][1].replace(",", "")) > 0 and rows[split][3] == "2"


@pytest.mark.long  # every task of the mark at CI sizes (about a minute): run it before a GPU session
def test_tiny_mark_runs_every_task_and_profiles_the_channels_last_runs(tmp_path: Path) -> None:
    from scripts.bench.mark import CONFIGS, KEY_CPU

    _, text, rows = _mark(tmp_path)
    for name in CONFIGS:
        r = rows[name]
        if name in KEY_CPU:  # three interleaved rounds, each against the contiguous run of its round
            assert r[1] == "32-true" and r[5] == "3" and r[8] == "9/9", r
            assert r[6] == "1.00x" if name.startswith("contiguous") else r[6].endswith("x (3 rounds)"), r
        elif "fp16" in name:
            assert r[5] == "0" and r[9] == "skipped: no CUDA", r
        elif "compile" in name:
            assert r[9].startswith("skipped: --tiny"), r
        else:  # bf16 where this CPU has it
            assert r[9] == "skipped: no bf16 on this CPU" or (r[1] == "bf16-mixed" and r[5] == "1"), r
    kinds = [line for line in text.splitlines() if line.startswith("| ") and line.count("|") == 3]
    assert _cells(kinds[0]) == ["kind", "channels_last fp32"] and len(kinds) == 1 + 9
    assert re.search(r"\*\*Data wait\*\* in channels_last fp32: [\d.]+% of the step", text)
    assert "Not completed" not in text
    table = (tmp_path / "gpu_check.md").read_text()
    assert re.search(r"\| main_amp e2e \| `channels_last=true amp=false` \| completed \| 32-true \|.*\| 3/3 \| 0 \|",
                     table)
