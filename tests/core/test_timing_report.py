"""cltrain.timing.machine and cltrain.timing.report: the machine line every figure carries (its CPU, flags, limits,
GPU, versions), and the one report writer (tables, pages, the command, the files written atomically)."""

from __future__ import annotations

import json
import os

import pytest

from cltrain.platform import cpu_model, current_platform
from cltrain.timing.machine import FLAGS, machine, machine_line
from cltrain.timing.report import command_line, page, table, write_report

GPU = {"name": "NVIDIA H200", "capability": "9.0", "driver": "580.1", "cuda": "13.0", "cudnn": 91900,
       "cudnn_benchmark": True, "tf32": False, "matmul_precision": "high"}


def test_the_machine_names_the_cpu_its_flags_and_the_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    m = machine("cpu", packages=("torch", "no-such-package-for-cltrain"))
    flags = current_platform("cpu").cpu_flags or frozenset()
    assert m["cpu"] == cpu_model() and m["flags"] == [f for f in FLAGS if f in flags] and "gpu" not in m
    assert list(m["versions"]) == ["torch"] and m["limits"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    line = machine_line(m)
    assert line.startswith(f"CPU {cpu_model()} ({os.cpu_count()} logical") and "torch " in line
    assert "limited by ONEDNN_MAX_CPU_ISA=AVX2" in line and json.loads(json.dumps(m)) == m


def test_a_gpu_and_an_older_record_read_as_one_line() -> None:
    m = {**machine("cpu", packages=()), "gpu": GPU}
    assert "GPU NVIDIA H200 (compute capability 9.0), driver 580.1, CUDA 13.0, cuDNN 91900; cudnn.benchmark True, " \
           "fp32 convolutions full fp32" in machine_line(m)
    older = {"cpu": "AMD EPYC", "flags": ["avx2"], "logical_cpus": 2, "torch_threads": 2, "capability": "AVX2",
             "native_bf16": False, "onednn": "3.12.0", "versions": {"torch": "2.14.1"}, "emulation": {"X": "1"}}
    assert machine_line(older) == ("CPU AMD EPYC (2 logical, torch threads 2); flags avx2; ATen AVX2; oneDNN 3.12.0; "
                                   "native bf16 no; limited by X=1; torch 2.14.1")


def test_a_table_escapes_its_cells_and_aligns_its_columns() -> None:
    assert table(["a", "b", "c"], [["x|y", 1.5, "two\nlines"]], align="lr").splitlines() == [
        "| a | b | c |", "|---|---:|---|", "| x\\|y | 1.5 | two lines |"]
    assert page("T", ["intro"], {"S": ["- a"]}) == "# T\n\nintro\n\n## S\n\n- a\n"


def test_the_report_files_are_written_whole_and_the_command_quoted(tmp_path) -> None:
    stem = tmp_path / "out" / "bench"
    written = write_report(stem, markdown="# m\n", data={"rows": [1, (2, 3)], "path": tmp_path},
                           csv_rows=[{"model": "a", "img/s": 1.5}])
    assert sorted(p.name for p in written) == ["bench.csv", "bench.json", "bench.md"]
    assert sorted(p.name for p in stem.parent.iterdir()) == ["bench.csv", "bench.json", "bench.md"]  # no temp files
    assert json.loads(stem.with_suffix(".json").read_text()) == {"rows": [1, [2, 3]], "path": str(tmp_path)}
    assert stem.with_suffix(".csv").read_text().splitlines() == ["model,img/s", "a,1.5"]
    assert command_line("scripts.bench.x", ["--models", "a b", "--quick"]) == "python -m scripts.bench.x --models 'a b' --quick"
