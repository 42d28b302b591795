"""mode="auto"'s timing in a child process (cltrain.timing.probe): a crash, an exception or a hang ends in
"contiguous" and one line, never in the caller's death; a model the child cannot load is timed in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from cltrain import ChannelsLast, is_channels_last
from cltrain.timing.probe import probe_layout
from tests.core.test_guardrails import HERE, case, needs_x86_onednn, run
from tests.helpers import warm


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))

    def forward(self, x):
        return self.body(x)


class RaisesInChannelsLast(Small):
    def forward(self, x):
        if is_channels_last(x):
            raise RuntimeError("planted: no kernel for this layout")
        return self.body(x)


class HangsInChannelsLast(Small):
    def forward(self, x):
        if is_channels_last(x):
            time.sleep(600)
        return self.body(x)


@pytest.mark.probe_starts_python  # the real start the other tests fork
def test_probe_times_both_layouts_in_a_child():
    model = Small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = probe_layout(model, (2, 3, 16, 16), steps=1, warmup=0)
    assert result.failure is None and set(result.timings) == {"channels_last", "contiguous"}
    assert result.layout == min(result.timings, key=result.timings.get) and result.seconds > 0
    assert result.method == "child process"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_model_that_does_not_pickle_is_timed_in_process():
    model = Small()
    model.transform = lambda x: x  # a lambda does not pickle
    result = probe_layout(model, (2, 3, 16, 16), steps=1)
    assert result.failure is None and set(result.timings) == {"channels_last", "contiguous"}
    assert result.method.startswith("in-process (the model could not be loaded in a child process: it does not pickle")


def test_an_exception_while_timing_in_process_keeps_contiguous():
    model = RaisesInChannelsLast()
    model.transform = lambda x: x
    result = probe_layout(model, (2, 3, 16, 16), steps=1, warmup=0)
    assert result.layout == "contiguous" and result.timings is None and result.method.startswith("in-process")
    assert "in-process timing raised while timing a channels_last step" in result.failure
    assert "planted" in result.failure


def test_probe_reports_an_exception_in_the_child():
    result = probe_layout(RaisesInChannelsLast(), (2, 3, 16, 16), steps=1, warmup=0)
    assert result.layout == "contiguous"
    assert "raised while timing a channels_last step" in result.failure and "planted" in result.failure


@pytest.mark.slow
def test_probe_kills_a_hang_and_says_where():
    start = time.perf_counter()
    result = probe_layout(HangsInChannelsLast(), (2, 3, 16, 16), steps=1, warmup=0, timeout=4)
    assert result.layout == "contiguous" and time.perf_counter() - start < 60
    assert "no progress" in result.failure and "channels_last step" in result.failure


def test_probe_rejects_bad_arguments():
    with pytest.raises(ValueError, match="input_shape"):
        probe_layout(Small(), (2, 3))
    with pytest.raises(ValueError, match="timeout"):
        probe_layout(Small(), (2, 3, 8, 8), timeout=0)
    with pytest.raises(ValueError, match="auto_timeout"):
        ChannelsLast(mode="auto", auto_timeout=-1)
    with pytest.raises(ValueError, match="guard"):
        ChannelsLast(guard="yes")


@needs_x86_onednn
def test_auto_survives_a_native_crash_and_keeps_contiguous():
    # guard=False: the probe meets oneDNN #6035 for real (Conv2d(3, 48, 1, stride=2) at 96 px). The fault is a
    # memory corruption: when the child's steps happen to survive it, "auto" keeps channels_last and the unguarded
    # real run may then crash as a plain run would, which is what guard=False asks for.
    try:  # the run's own output up to a hang: where the probe survived, the unguarded real run can hang (#6035)
        proc = warm.run([sys.executable, str(HERE / "guard_cases.py"), "auto", "0"], capture_output=True,
                        text=True, timeout=90, env={**os.environ, "PYTHONWARNINGS": "ignore",
                                                    "PYTHONPATH": str(HERE.parent)})
    except subprocess.TimeoutExpired as hung:
        said = hung.stderr.decode() if isinstance(hung.stderr, bytes) else hung.stderr or ""
        assert "keeping channels_last" in said, f"guard_cases.py auto 0 hung before the probe kept a layout:\n{said}"
        pytest.skip("the unguarded stem did not crash in the timing child this time; the real run then hung")
    if "keeping channels_last" in proc.stderr:
        pytest.skip(f"the unguarded stem did not crash in the timing child this time (exit {proc.returncode})")
    assert proc.returncode == 0, f"guard_cases.py auto 0 exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["failure"] is None:
        pytest.skip(f"the unguarded stem did not crash on this machine: {result['timings']}")
    assert result["layout"] == "contiguous" and result["timings"] is None
    # the fault kills the child (AVX-512) or hangs it (AVX2): either is the probe's verdict
    assert ("crashed (SIG" in result["failure"] or "(a hang)" in result["failure"]) and \
        "channels_last step" in result["failure"], result["failure"]


@needs_x86_onednn
def test_in_process_auto_trial_is_killed_by_the_same_fault():
    # The negative control: the timing of cltrain.timing.layouts run in the caller's process, as mode="auto" did.
    # a hang (the fault on AVX2) is past the probe's own limit of 30 s without progress
    proc = run([str(HERE / "guard_cases.py"), "inprocess_auto"], timeout=60)
    if proc is not None and proc.returncode == 0:
        pytest.skip("the unguarded stem did not crash on this machine")
    assert proc is None or proc.returncode < 0 or proc.returncode >= 128


@pytest.mark.slow
@needs_x86_onednn
def test_auto_with_guardrails_times_the_guarded_model():
    result = case("auto", "1")
    assert result["failure"] is None and set(result["timings"]) == {"channels_last", "contiguous"}
    assert result["layout"] in ("channels_last", "contiguous")
    if result["layout"] == "channels_last":
        assert [r["modules"] for r in result["guardrails"]] == [["stem"]]


def test_probe_without_a_temporary_folder_keeps_contiguous(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))  # as with a TMPDIR that is not there
    result = probe_layout(Small(), (2, 3, 16, 16), steps=1)
    assert result.layout == "contiguous" and "could not be started" in result.failure


SCRIPT = """
import sys
from pathlib import Path

import torch
from torch import nn

from cltrain.timing.probe import probe_layout

Path(sys.argv[1]).open("a").write("top level ran\\n")


class InMain(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.conv(x)


{call}
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_a_model_defined_in_the_running_script(tmp_path, guarded):
    call = ("result = probe_layout(InMain(), (2, 3, 8, 8), steps=1, warmup=0)\n"
            "print(result.failure)\nprint(result.method)")
    if guarded:
        call = "if __name__ == '__main__':\n    " + call.replace("\n", "\n    ")
    script, ran = tmp_path / "train.py", tmp_path / "ran.txt"
    script.write_text(SCRIPT.format(call=call))
    proc = run([str(script), str(ran)], timeout=300)
    assert proc is not None and proc.returncode == 0, proc.stderr[-2000:] if proc else "hung"
    failure, method = proc.stdout.strip().splitlines()[-2:]
    assert failure == "None"
    if guarded:  # the child ran the top level (a second line), not the guarded block, and timed the model
        assert method == "child process" and ran.read_text().count("top level ran") == 2
    else:  # running the script again would run the training again: timed in this process instead
        assert method.startswith("in-process") and "no `if __name__ == '__main__':` guard" in method
        assert ran.read_text().count("top level ran") == 1


TRAIN_WITHOUT_GUARD = """
import json
import logging

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cltrain import ChannelsLast

logging.basicConfig(level=logging.INFO)


class TopLevelNet(LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


data = DataLoader(TensorDataset(torch.randn(4, 3, 16, 16), torch.randint(0, 2, (4,))), batch_size=2)
callback = ChannelsLast(mode="auto", input_shape=(2, 3, 16, 16), auto_steps=1)
Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[callback]).fit(TopLevelNet(), data)
print(json.dumps({"timings": callback.timings, "auto_failure": callback.auto_failure}))
"""


@pytest.mark.parametrize("how, reason", [("script", "no `if __name__ == '__main__':` guard"),
                                         ("-c", "no file to import them from")])
def test_auto_times_a_model_from_an_unimportable_main_in_process(tmp_path, how, reason):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_WITHOUT_GUARD)
    args = [str(script)] if how == "script" else ["-c", TRAIN_WITHOUT_GUARD]
    proc = warm.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["timings"]) == {"channels_last", "contiguous"} and result["auto_failure"] is None
    probe_line = next(line for line in proc.stderr.splitlines() if "auto layout probe" in line)
    assert "auto layout probe, in-process (the model could not be loaded in a child process: " in probe_line
    assert reason in probe_line


PROBE_ONLY = """
import torch
from torch import nn

from cltrain.timing.probe import probe_layout

model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
print(probe_layout(model, (2, 3, 8, 8), steps=1, warmup=0).method)
"""


def test_a_probe_leaves_no_file_open_in_either_process():
    # PYTHONWARNINGS reaches the child too; its stderr is the caller's
    env = {**os.environ, "PYTHONWARNINGS": "always::ResourceWarning"}
    proc = warm.run([sys.executable, "-c", PROBE_ONLY], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "child process"
    assert "ResourceWarning" not in proc.stderr, proc.stderr[-3000:]
