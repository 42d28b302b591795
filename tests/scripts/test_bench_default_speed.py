"""scripts.bench.default_speed --tiny: the model in a process of its own, both variants fitted in interleaved rounds,
the table and the records written."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import REPO
from tests.helpers import warm


@pytest.mark.slow  # a process of its own, three real fits
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_tiny_fits_the_three_variants_of_each_model_and_writes_the_table(tmp_path, device):
    """On CUDA too: Lightning's teardown leaves the model on the CPU, and the interleaved steps after the fit must
    bring it back to the batch's device."""
    proc = warm.run([sys.executable, "-m", "scripts.bench.default_speed", "--tiny", "--models", "resnet18",
                     "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600, nested=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = json.loads((tmp_path / "default_speed.json").read_text())
    assert [(r["model"], r["precision"], r["size"]) for r in records] == [("resnet18", "32-true", 32)]
    for r in records:
        assert "error" not in r, r
        assert r["device"].startswith(device)
        assert [(f["variant"], f["round"]) for f in r["fits"]] == [("nchw", 0), ("channels_last", 0), ("default", 0)]
        faster = min(r["nchw_step_s"], r["channels_last_step_s"])
        assert r["step_ratio"] == pytest.approx(r["default_step_s"] / faster) and r["verdict"] == "passed"
        assert r["fits"][1]["layout"] == "channels_last" and r["fits"][0]["decision"] is None
        decided = r["decisions"][0]  # 14 tiny steps may not settle the race: then the default keeps channels_last
        assert r["layout"] == (decided["layout"] if decided else "channels_last")
        steady = r["interleaved_s"]  # both layouts timed in alternating blocks after the default's fit
        assert steady.keys() == {"channels_last", "nchw"} and all(t > 0 for t in steady.values())
        kept = "nchw" if r["layout"] == "contiguous" else "channels_last"
        assert r["kept_interleaved_ratio"] == pytest.approx(steady[kept] / min(steady.values()))
    table = (tmp_path / "default_speed.md").read_text()
    assert "| model | precision | px | step NCHW (ms) | step CL (ms) | step default (ms) | default / faster step |" in table
    assert "| interleaved CL / NCHW step | kept / faster, interleaved |" in table
    assert "| resnet18 | 32-true | 32 | " in table and "; flags " in table and table in proc.stdout


def test_a_precision_that_is_not_one_is_refused_in_one_line_before_any_fit(capsys):
    from scripts.bench import default_speed

    with pytest.raises(SystemExit) as exit_:
        default_speed.main(["--models", "resnet18", "--precisions", "bf16-mixed,fp8", "--out", "/nonexistent/x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert err[-1].endswith("--precisions 'fp8': not a precision; expected some of auto, bf16-mixed, 16-mixed, "
                            "32-true, bf16-true, 16-true (space- or comma-separated)"), err


@pytest.mark.parametrize("script, argv", [("default_speed", ["--models", "resnet18,resnet5", "--out", "/nonexistent/x"]),
                                          ("sharded_weights", ["--models", "resnet18", "resnet5"]),
                                          ("models", ["--device", "cpu", "--models", "resnet18,resnet5"])])
def test_a_model_name_that_is_not_one_is_refused_in_one_line_before_any_fit(capsys, script, argv):
    from importlib import import_module

    with pytest.raises(SystemExit) as exit_:
        import_module(f"scripts.bench.{script}").main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert err[-1].split("error: ")[-1].startswith("--models 'resnet5' is not in torchvision.models.list_models() or "
                                                   "timm.list_models(); closest: resnet50"), err


def test_the_race_column_names_the_layout_kept_and_the_one_its_medians_put_ahead():
    from scripts.bench.default_speed import race_kept

    def row(layout, how, cl, nchw):
        return {"decisions": [{"layout": layout, "how": how, "seconds": {"channels_last": cl, "contiguous": nchw},
                               "extra_seconds": 0.5}]}

    assert race_kept(row("channels_last", "timed", 0.2, 0.3)) == "CL 1.50x (timed, 0.50 s)"
    assert race_kept(row("channels_last", "noisy", 0.206, 0.2)) == "CL, NCHW 1.03x faster (noisy, 0.50 s)"
    assert race_kept(row("contiguous", "timed", 0.3, 0.2)) == "NCHW 1.50x (timed, 0.50 s)"
