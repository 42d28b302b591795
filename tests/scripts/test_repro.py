"""scripts.repro: the small kernel checks run and count what they document (whether an upstream bug still shows is
the repro's own output, not a test's)."""

from __future__ import annotations

import re
import sys

import pytest

from tests.helpers import REPO
from tests.helpers import warm


def test_cpu_bf16_conv3d_counts_each_dtype_and_layout() -> None:
    out = warm.run([sys.executable, "-m", "scripts.repro.cpu_bf16_conv3d_grad", "--count", "--calls", "3",
                    "--shape", "2", "8", "2", "4", "4"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(r"^(bfloat16|float32) (contiguous|channels_last_3d): (\d) of 3 calls non-finite", out.stdout, re.M)
    assert [r[:2] for r in rows] == [("bfloat16", "contiguous"), ("bfloat16", "channels_last_3d"), ("float32", "contiguous")]
    assert rows[2][2] == "0" and "Machine:" in out.stdout  # fp32 is finite


@pytest.mark.parametrize("rebuild", [False, True], ids=["buckets-kept", "buckets-rebuilt"])
def test_ddp_restrided_grads_gives_each_steps_error_on_two_processes(rebuild: bool) -> None:
    out = warm.run([sys.executable, "-m", "scripts.repro.ddp_restrided_grads", "--steps", "4", "--switch", "2",
                    *(["--rebuild"] * rebuild)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(r"^step (\d): (NCHW|channels_last) parameters, .* by (\S+) \(relative\)", out.stdout, re.M)
    assert [layout for _, layout, _ in rows] == ["channels_last"] * 2 + ["NCHW"] * 2, out.stdout
    assert float(rows[0][2]) < 1e-5  # before the switch DDP's gradient is the ranks' average
    # after it: permuted (relative error ~1) under the buckets built in channels_last; right once built again
    assert all((float(error) < 1e-5) == rebuild for _, _, error in rows[2:]), out.stdout


def test_prune_channels_last_names_each_case_and_exits_1_while_one_shows() -> None:
    out = warm.run([sys.executable, "-m", "scripts.repro.prune_channels_last"], cwd=REPO, capture_output=True,
                   text=True, timeout=300)
    rows = dict(re.findall(r"^(l1_unstructured|global_unstructured|vector_to_parameters|random_unstructured) +(.+)$",
                           out.stdout, re.M))
    assert list(rows) == ["l1_unstructured", "global_unstructured", "vector_to_parameters", "random_unstructured"]
    assert out.returncode == (0 if all(v == "as on an NCHW weight" for v in rows.values()) else 1), out.stderr[-2000:]


def test_onednn_1x1_boundary_runs_each_case_in_a_process_and_prints_its_table() -> None:
    out = warm.run([sys.executable, "-m", "scripts.repro.onednn_1x1_boundary", "--sweeps", "padding", "--isas", "AVX2",
                    "--repeats", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("Machine:") and "### padding" in out.stdout
    rows = re.findall(r"^\| (ic\d+ oc32 k1 s2 p1 \S+ .*?) \| (.+?) \|$", out.stdout, re.M)
    assert [r[0].split()[0] for r in rows] == ["ic3", "ic8", "ic15"], out.stdout
    assert all(re.fullmatch(r"ok|WRONG \([wx] \S+\)|NON-FINITE|CRASH \(\S+\)|HANG", cell) for _, cell in rows), rows


def test_litdata_ranged_bytes_reads_each_way_from_a_real_s3_server() -> None:
    pytest.importorskip("litdata")
    out = warm.run([sys.executable, "-m", "scripts.repro.litdata_ranged_bytes"], cwd=REPO, capture_output=True,
                   text=True, timeout=300)
    rows = dict(re.findall(r"^(ranged|whole chunks) +(.+)$", out.stdout, re.M))
    assert list(rows) == ["ranged", "whole chunks"] and rows["whole chunks"] == "1024 bytes, as written", out.stdout
    assert out.returncode == (1 if rows["ranged"].startswith("FAILS") else 0), out.stderr[-2000:]
