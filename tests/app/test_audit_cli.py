"""``cltrain-audit``: checked arguments, one-line errors with exit status 2, never a download."""

import os
import subprocess
import sys

import pytest

from cltrain.audit import AuditReport
from cltrain.tools.audit import audit
from tests.helpers import warm


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return warm.run([sys.executable, "-m", "cltrain.tools.audit", *args], capture_output=True, text=True,
                    timeout=300, env={**os.environ, **env})


def test_unknown_model_is_one_line_with_close_names_and_exit_2():
    proc = run_cli("resnt50")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "'resnt50'" in lines[0] and "resnet50" in lines[0]
    assert proc.stdout == ""


def test_the_console_script_exits_0_and_prints_the_report_once():
    # what the installed cltrain-audit runs: sys.exit(main())
    proc = warm.run([sys.executable, "-c", "import sys; from cltrain.tools.audit import main; sys.exit(main())",
                     "resnet18", "--image-size", "32", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert proc.stdout.count("Layout audit of") == 1, proc.stdout


def test_batch_size_zero_is_refused_by_a_real_process():
    proc = run_cli("resnet18", "--batch-size", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "cltrain-audit: error: argument --batch-size: 0 must be >= 1 (see cltrain-audit --help)"]


@pytest.mark.slow
def test_segmentation_model_runs_without_downloading_backbone_weights(tmp_path):
    # fcn_resnet50's default weights_backbone is ImageNet: a download into $TORCH_HOME if not refused
    proc = run_cli("fcn_resnet50", "--batch-size", "2", "--image-size", "32", "--device", "cpu", TORCH_HOME=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "Layout audit of FCN" in proc.stdout
    assert list(tmp_path.rglob("*")) == []


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["resnet18", "--batch-size", "0"], "--batch-size: 0 must be >= 1"),
        (["resnet18", "--batch-size", "-3"], "--batch-size: -3 must be >= 1"),
        (["resnet18", "--batch-size", "2.5"], "--batch-size: '2.5' is not a whole number"),
        (["resnet18", "--image-size", "abc"], "--image-size: 'abc' is not a whole number"),
        (["r3d_18", "--frames", "0"], "--frames: 0 must be >= 1"),
        (["resnet18", "--dtype", "fp64"], "argument --dtype: invalid choice: 'fp64'"),
        (["resnet18", "--mode", "auto"], "argument --mode: invalid choice: 'auto'"),
        (["resnet18", "--source", "hub"], "argument --source: invalid choice: 'hub'"),
        (["resnet18", "--device", "tpu9"], "--device tpu9: unknown device (allowed: auto, cpu, cuda, cuda:N, mps)"),
        (["resnet18", "--dtyp", "bf16"], "unrecognized arguments: --dtyp"),
        (["--batch-size", "2"], "the following arguments are required: model"),
        (["efficientnet_b9"], "closest: efficientnet_b"),
        (["squeezenet1_1", "--source", "timm"], "'squeezenet1_1' is not in timm.list_models()"),
        (["fasterrcnn_resnet50_fpn"], "is a torchvision detection model"),
        (["raft_small"], "is a torchvision optical_flow model"),
        (["quantized_resnet18"], "is a torchvision quantization model"),
        (["vit_b_16", "--image-size", "30", "--device", "cpu"], "could not run one step on input (2, 3, 30, 30)"),
        (["inception_v3", "--batch-size", "1", "--image-size", "16", "--device", "cpu"], "try a larger --image-size"),
    ],
)
def test_every_mistake_is_one_line_and_exit_2(capsys, args, expected):
    with pytest.raises(SystemExit) as exit_info:
        audit(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cltrain-audit: error: "), err
    assert expected in err, err


def test_cuda_device_without_cuda_is_refused(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit) as exit_info:
        audit(["resnet18", "--device", "cuda"])
    assert exit_info.value.code == 2 and "no CUDA device on this machine" in capsys.readouterr().err


def test_prints_the_report(capsys):
    report = audit(["squeezenet1_1", "--batch-size", "1", "--image-size", "64", "--dtype", "bf16", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "model=squeezenet1_1" in out and "Layout audit of SqueezeNet" in out and "autocast bfloat16" in out
    assert isinstance(report, AuditReport)


def test_video_model_gets_a_5d_clip(capsys):
    report = audit(["r3d_18", "--batch-size", "2", "--image-size", "16", "--frames", "4", "--device", "cpu"])
    assert report.input_shapes == ((2, 3, 4, 16, 16),) and report.rows == []
    assert report.parameter_layouts.get("channels_last_3d", 0) > 0


def test_timm_model_by_name(capsys):
    pytest.importorskip("timm")
    report = audit(["resnet10t", "--source", "timm", "--batch-size", "2", "--image-size", "32", "--device", "cpu"])
    assert report.model_name == "ResNet" and report.rows == []


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        audit(["--help"])
    assert exit_info.value.code == 0 and "cltrain-audit resnet50" in capsys.readouterr().out


@pytest.mark.parametrize("source", ["torchvision", "auto"])
def test_a_missing_model_library_is_named_with_its_install(monkeypatch, source):
    import sys

    from cltrain.model_names import UnknownModelError

    monkeypatch.setitem(sys.modules, "torchvision", None)  # the plain `pip install cltrain`: torch alone
    monkeypatch.setitem(sys.modules, "timm", None)
    said = str(UnknownModelError("resnet50", source, [], []))
    assert said.startswith("'resnet50': no library to build it from: torchvision is not installed (pip install "
                           "'cltrain[data]')"), said
    assert ("timm is not installed (pip install timm)" in said) == (source == "auto") and "e.g. resnet50" not in said


def test_a_model_library_that_does_not_import_is_named(monkeypatch, tmp_path):
    import sys

    from cltrain.model_names import UnknownModelError

    (tmp_path / "timm").mkdir()
    (tmp_path / "timm" / "__init__.py").write_text("raise ImportError('built for another torch')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "timm", raising=False)
    said = str(UnknownModelError("vit_tiny_patch16_224", "timm", [], []))
    assert said == ("'vit_tiny_patch16_224': no library to build it from: timm is installed but does not import "
                    "(python -c 'import timm' says why)"), said
