"""cltrain under FSDP2 (``fully_shard``): two gloo processes on the CPU per engine (a plain loop, Fabric's and
Lightning's ``ModelParallelStrategy``), each against the same engine's NCHW run; and which engine
``cltrain.sharding`` names for a model or a strategy."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cltrain.loops import convert_model
from cltrain.sharding import sharded_line, sharding_of
from tests.helpers import REPO
from tests.helpers import warm

#: What every step of a sharded cltrain run gives the first convolution: channels_last input, the contiguous
#: (all-gathered, plain) weight the line promises, and an NHWC output (the NHWC kernel ran).
NHWC_WITH_NCHW_WEIGHTS = {"input_cl": True, "weight_contiguous": True, "weight_plain": True, "output_cl": True}
NCHW = {"input_cl": False, "weight_contiguous": True, "weight_plain": True, "output_cl": False}
LINE = sharded_line("FSDP2")


def run_engine(tmp_path: Path, engine: str) -> list[dict[str, Any]]:
    proc = warm.run([sys.executable, "-m", "tests.helpers.torchrun", "--standalone", "--nproc_per_node", "2",
                     "-m", "tests.helpers.fsdp_run", str(tmp_path), engine],
                    cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def assert_nhwc_with_the_nchw_losses(rank: dict[str, Any]) -> None:
    assert rank["nchw"]["first_conv"] == [NCHW] * 3  # the control: without cltrain nothing runs NHWC
    assert rank["cltrain"]["first_conv"] == [NHWC_WITH_NCHW_WEIGHTS] * 3
    torch.testing.assert_close(rank["cltrain"]["losses"], rank["nchw"]["losses"], rtol=1e-5, atol=1e-6)


def test_plain_loop_fully_shard_after_convert_model_sharded(tmp_path):
    ranks = run_engine(tmp_path, "loop")
    for rank in ranks:
        # The old order crashes: convert_model without sharded=True, then fully_shard.
        assert rank["old_order"].startswith("FSDP does not support non-contiguous parameters yet")
        assert rank["check_before"] == "passed"
        assert_nhwc_with_the_nchw_losses(rank)
        assert rank["check_after"]["verdict"] == "not checked"
        assert "sharded by FSDP2" in rank["check_after"]["reason"] and "verify_layout(" in rank["check_after"]["reason"]
        assert rank["after_convert"] == [NHWC_WITH_NCHW_WEIGHTS]  # convert_model on a sharded model changes nothing
        assert rank["copy"].startswith("contiguous_copy: the model is sharded by FSDP2")
        assert rank["run_check"]["verdict"] == "not checked" and rank["run_check"]["sharding"] == "FSDP2"
        assert rank["run_check"]["reason"].startswith("the model is sharded by FSDP2, which cannot be copied")
    # the old order's convert_model saw an unsharded model; nothing after it claims channels_last weights. Rank 0
    # says each line for every rank.
    lines = ranks[0]["lines"]
    assert lines[0].startswith("convert_model(mode='full'): model layout is channels_last;") and not ranks[1]["lines"]
    assert not any("channels_last;" in line or "failed" in line for line in lines[1:]), lines
    assert lines[-1] == f"convert_model(mode='full'): {LINE}"
    assert ranks[0]["nchw"]["losses"] != ranks[1]["nchw"]["losses"]  # each rank trains on its own batches


def test_fabric_model_parallel_strategy(tmp_path):
    for rank in run_engine(tmp_path, "fabric"):
        assert rank["check_before"] == "passed"
        assert_nhwc_with_the_nchw_losses(rank)


def test_lightning_model_parallel_strategy_one_line_and_the_check_says_how(tmp_path):
    ranks = run_engine(tmp_path, "lightning")
    for rank in ranks:
        assert rank["sharding"] == "FSDP2"
        assert_nhwc_with_the_nchw_losses(rank)
        assert rank["arrived_cl"]["first_conv"] == [NHWC_WITH_NCHW_WEIGHTS] * 3
        torch.testing.assert_close(rank["arrived_cl"]["losses"], rank["nchw"]["losses"], rtol=1e-5, atol=1e-6)
        check = rank["check"]["train"]
        assert check["verdict"] == "not checked" and "cltrain.loops.verify_layout(" in check["reason"]
        assert not [w for w in rank["warnings"] if "ChannelsLast" in w], rank["warnings"]
        assert rank["auto"]["layout"] == "channels_last" and rank["auto"]["timings"] is None
        assert rank["auto"]["check"] == "not checked"
    assert [w.split(",")[0] for w in ranks[0]["auto"]["warnings"]] == [
        "ChannelsLast(audit=True): not audited"]
    lines = [line for line in ranks[0]["lines"] if line.startswith("ChannelsLast")]
    assert lines.count(f"ChannelsLast(mode='full'): {LINE}") == 2 and not any("faster here" in line for line in lines)
    assert not any("model layout is" in line or "check itself failed" in line for line in lines), lines
    assert not [line for line in ranks[1]["lines"] if line.startswith("ChannelsLast")]  # rank zero only


def tiny() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))


def test_convert_model_sharded_keeps_the_weights_nchw(caplog):
    model = tiny().to(memory_format=torch.channels_last)  # arrived channels_last: made what FSDP2 accepts
    with caplog.at_level("INFO", logger="cltrain.loops"):
        assert convert_model(model, sharded=True) is model
    assert model[0].weight.is_contiguous() and sharding_of(model) is None
    assert caplog.messages[-1] == f"convert_model(mode='full'): {sharded_line(None)}"
    assert not convert_model(tiny())[0].weight.is_contiguous()  # the control: unsharded, channels_last
    with pytest.raises(ValueError, match=r"convert_model\(sharded='yes'\)"):
        convert_model(tiny(), sharded="yes")


def test_sharding_of_names_the_strategies_engine():
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    assert sharding_of(tiny(), ModelParallelStrategy()) == "FSDP2"
    assert sharding_of(None, FabricModelParallel(lambda m, mesh: m)) == "FSDP2"
    assert sharding_of(None, FSDPStrategy()) == "FSDP"
    assert sharding_of(tiny(), DDPStrategy()) is None and sharding_of(tiny()) is None


def test_the_line_says_nothing_runs_nhwc_when_the_inputs_are_not_converted():
    assert "the inputs and activations are channels_last" in sharded_line("FSDP")
    unconverted = sharded_line("FSDP", inputs=False)
    assert "no convolution runs an NHWC kernel" in unconverted and "activations are channels_last" not in unconverted
