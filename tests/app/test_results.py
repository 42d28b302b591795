"""What a run reports: the resume line a stopped run prints (the run itself: tests/app/test_signals.py)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from cltrain.app.results import resume_line


def _resume_line(monkeypatch: pytest.MonkeyPatch, argv0: str, run_dir: Path, *overrides: str) -> str:
    """The resume line of a run started as ``argv0 *overrides`` (Hydra's record of them, as a run has it)."""
    monkeypatch.setattr(HydraConfig.instance(), "cfg", OmegaConf.create({"hydra": {"overrides": {"task": overrides}}}))
    monkeypatch.setattr(sys, "argv", [argv0, *overrides])
    return resume_line(run_dir)


def test_the_resume_line_leaves_the_secrets_out_and_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    line = _resume_line(monkeypatch, "train.py", tmp_path, "data=shards",
                        "data.root='http://127.0.0.1:8765/pack?sv=2024&sig=TOPSECRETSIG123'",
                        "logger.mlflow.tracking_uri=https://bob:PASSWORD@host/")
    assert "TOPSECRETSIG123" not in line and "PASSWORD" not in line, line
    assert line.startswith("the secrets shown as *** are left out of this command: put them back, then resume with: ")
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[3:5] == ["data.root='http://127.0.0.1:8765/pack?sv=***&sig=***'",
                            "logger.mlflow.tracking_uri=https://***@host/"]
    # the control: without a secret, the command alone
    assert _resume_line(monkeypatch, "train.py", tmp_path, "seed=1") == \
        f"resume with: python train.py seed=1 ckpt_path={tmp_path}/checkpoints/last.ckpt"


def test_the_resume_line_of_ranks_started_by_torchrun_or_srun_says_to_start_them_so(monkeypatch, tmp_path) -> None:
    # the command alone, run as printed, started one rank that waited for the others for ever
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    line = _resume_line(monkeypatch, "train.py", tmp_path, "trainer=ddp")
    assert line == ("start the ranks with torchrun as before, on every node, each to resume with: python train.py "
                    f"trainer=ddp ckpt_path={tmp_path}/checkpoints/last.ckpt"), line
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert _resume_line(monkeypatch, "train.py", tmp_path, "trainer=ddp").startswith("start the ranks with srun ")
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # Lightning does not take its ranks from SLURM then
    assert _resume_line(monkeypatch, "train.py", tmp_path, "trainer=ddp").startswith("resume with: ")


@pytest.mark.parametrize("argv0,script", [("/venv/bin/cltrain-train", ["cltrain-train"]),
                                          ("/repo/train.py", ["python", "/repo/train.py"])])
def test_the_resume_command_runs_as_printed_from_a_folder_with_spaces_unicode_and_parentheses(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv0: str, script: list[str]) -> None:
    run_dir = tmp_path / "dir ü 数据 (1),x'y\\z\"" / "run"
    line = _resume_line(monkeypatch, argv0, run_dir, "seed=1", "data.root='/data/my images'")
    command = shlex.split(line.split("resume with: ", 1)[1])  # as the shell reads it
    assert command[:len(script)] == script  # the wheel has no train.py: its console script
    parsed = OverridesParser.create().parse_overrides(command[len(script):])  # as Hydra reads it
    values = {o.key_or_group: o.value() for o in parsed}
    assert values == {"seed": 1, "data.root": "/data/my images", "ckpt_path": str(run_dir / "checkpoints" / "last.ckpt")}
