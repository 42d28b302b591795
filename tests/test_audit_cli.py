"""``python -m cltrain.audit``: checked arguments, one-line errors with exit status 2, never a download."""

import os
import subprocess
import sys

import pytest

from cltrain.audit import AuditReport
from cltrain.audit_cli import main


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cltrain.audit", *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, **env},
    )


def test_unknown_model_is_one_line_with_close_names_and_exit_2():
    proc = run_cli("model=resnt50")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "model='resnt50'" in lines[0] and "resnet50" in lines[0]
    assert proc.stdout == ""


def test_batch_size_zero_is_refused_by_a_real_process():
    proc = run_cli("model=resnet18", "batch_size=0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["cltrain.audit: batch_size=0 must be >= 1, e.g. batch_size=2."]


@pytest.mark.slow
def test_segmentation_model_runs_without_downloading_backbone_weights(tmp_path):
    # fcn_resnet50's default weights_backbone is ImageNet: a download into $TORCH_HOME if not refused
    proc = run_cli("model=fcn_resnet50", "batch_size=2", "image_size=32", TORCH_HOME=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "Layout audit of FCN" in proc.stdout
    assert list(tmp_path.rglob("*")) == []


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["model=resnet18", "batch_size=0"], "batch_size=0 must be >= 1"),
        (["model=resnet18", "batch_size=-3"], "batch_size=-3 must be >= 1"),
        (["model=resnet18", "batch_size=2.5"], "batch_size='2.5' is not an integer"),
        (["model=resnet18", "image_size=abc"], "image_size='abc' is not an integer"),
        (["model=resnet18", "image_size=0"], "image_size=0 must be >= 1"),
        (["model=r3d_18", "frames=0"], "frames=0 must be >= 1"),
        (["model=resnet18", "dtype=fp64"], "dtype='fp64' is not one of"),
        (["model=resnet18", "mode=auto"], "mode='auto' is not one of full, conv"),
        (["model=resnet18", "source=hub"], "source='hub' is not one of"),
        (["model=resnet18", "device=tpu9"], "device='tpu9'"),
        (["model=resnet18", "dtyp=bf16"], "bad argument 'dtyp=bf16' (did you mean dtype=?)"),
        (["resnet18"], "bad argument 'resnet18'"),
        (["batch_size=2"], "model=NAME is required"),
        (["model=efficientnet_b9"], "closest: efficientnet_b"),
        (["model=resnet50", "source=timm", "image_size=0"], "image_size=0 must be >= 1"),
        (["model=squeezenet1_1", "source=timm"], "model='squeezenet1_1' is not in timm.list_models()"),
        (["model=fasterrcnn_resnet50_fpn"], "is a torchvision detection model"),
        (["model=raft_small"], "is a torchvision optical_flow model"),
        (["model=quantized_resnet18"], "is a torchvision quantization model"),
        (["model=vit_b_16", "image_size=30"], "could not run one step on input (2, 3, 30, 30)"),
        (["model=inception_v3", "batch_size=1", "image_size=16"], "try a larger image_size"),
    ],
)
def test_every_mistake_is_one_line_and_exit_2(capsys, args, expected):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cltrain.audit: "), err
    assert expected in err, err


def test_cuda_device_without_cuda_is_refused(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit) as exit_info:
        main(["model=resnet18", "device=cuda"])
    assert exit_info.value.code == 2 and "CUDA is not available" in capsys.readouterr().err


def test_prints_the_report(capsys):
    report = main(["model=squeezenet1_1", "batch_size=1", "image_size=64", "dtype=bf16"])
    out = capsys.readouterr().out
    assert "model=squeezenet1_1" in out and "Layout audit of SqueezeNet" in out and "autocast bfloat16" in out
    assert isinstance(report, AuditReport)


def test_video_model_gets_a_5d_clip(capsys):
    report = main(["model=r3d_18", "batch_size=2", "image_size=16", "frames=4"])
    assert report.input_shapes == ((2, 3, 4, 16, 16),) and report.rows == []
    assert report.parameter_layouts.get("channels_last_3d", 0) > 0


def test_timm_model_by_name(capsys):
    pytest.importorskip("timm")
    report = main(["model=resnet10t", "source=timm", "batch_size=2", "image_size=32"])
    assert report.model_name == "ResNet" and report.rows == []


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "python -m cltrain.audit model=" in capsys.readouterr().out
