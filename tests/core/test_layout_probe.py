"""mode="auto"'s timing in a child process (cltrain.layout_probe): a crash, an exception, a hang or a model that
cannot be sent ends in "contiguous" and one line, never in the caller's death."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from cltrain import ChannelsLast, is_channels_last
from cltrain.layout_probe import probe_layout
from tests.core.test_guardrails import HERE, case, needs_x86_onednn, run


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


def test_probe_times_both_layouts_in_a_child():
    model = Small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = probe_layout(model, (2, 3, 16, 16), steps=1, warmup=0)
    assert result.failure is None and set(result.timings) == {"channels_last", "contiguous"}
    assert result.layout == min(result.timings, key=result.timings.get) and result.seconds > 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_probe_says_why_when_the_model_cannot_be_sent():
    model = Small()
    model.transform = lambda x: x  # a lambda does not pickle
    result = probe_layout(model, (2, 3, 16, 16), steps=1)
    assert result.layout == "contiguous" and result.timings is None
    assert "could not be sent" in result.failure and "mode='full'" in result.failure


def test_probe_reports_an_exception_in_the_child():
    result = probe_layout(RaisesInChannelsLast(), (2, 3, 16, 16), steps=1, warmup=0)
    assert result.layout == "contiguous"
    assert "raised while timing a channels_last step" in result.failure and "planted" in result.failure


@pytest.mark.slow
def test_probe_kills_a_hang_and_says_where():
    start = time.perf_counter()
    result = probe_layout(HangsInChannelsLast(), (2, 3, 16, 16), steps=1, warmup=0, timeout=20)
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
    # guard=False: the probe meets oneDNN #6035 for real (Conv2d(3, 48, 1, stride=2) at 96 px)
    result = case("auto", "0")
    if result["failure"] is None:
        pytest.skip(f"the unguarded stem did not crash on this machine: {result['timings']}")
    assert result["layout"] == "contiguous" and result["timings"] is None
    assert "crashed (SIG" in result["failure"] and "channels_last step" in result["failure"]


@needs_x86_onednn
def test_in_process_auto_trial_is_killed_by_the_same_fault():
    # The negative control: the timing of cltrain.autolayout run in the caller's process, as mode="auto" did.
    proc = run([str(HERE / "guard_cases.py"), "inprocess_auto"], timeout=120)
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

from cltrain.layout_probe import probe_layout

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
    call = "result = probe_layout(InMain(), (2, 3, 8, 8), steps=1, warmup=0)\nprint(result.failure)"
    if guarded:
        call = "if __name__ == '__main__':\n    " + call.replace("\n", "\n    ")
    script, ran = tmp_path / "train.py", tmp_path / "ran.txt"
    script.write_text(SCRIPT.format(call=call))
    proc = run([str(script), str(ran)], timeout=300)
    assert proc is not None and proc.returncode == 0, proc.stderr[-2000:] if proc else "hung"
    failure = proc.stdout.strip().splitlines()[-1]
    if guarded:  # the child ran the top level (a second line), not the guarded block, and timed the model
        assert failure == "None" and ran.read_text().count("top level ran") == 2
    else:  # running the script again would run the training again: the probe says so instead
        assert "no `if __name__ == '__main__':` guard" in failure and ran.read_text().count("top level ran") == 1
