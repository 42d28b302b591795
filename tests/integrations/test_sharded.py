"""The Hugging Face callback and ``prepare_channels_last`` under FSDP2, which Accelerate runs on GPUs only.

On the CPU Accelerate gives an FSDP configuration DDP (``MULTI_CPU``), so these tests hand the callback the state
Accelerate sets up on a GPU (``distributed_type`` FSDP and a real ``FullyShardedDataParallelPlugin``), and each
has the control without it.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from transformers import TrainerControl, TrainerState, TrainingArguments  # noqa: E402

from cltrain.integrations import transformers as hf  # noqa: E402
from cltrain.integrations.accelerate import prepare_channels_last  # noqa: E402
from cltrain.integrations.inputs_hook import ChannelsLastInputs  # noqa: E402
from cltrain.sharding import sharded_line  # noqa: E402
from tests.helpers.hf_models import build  # noqa: E402
from tests.helpers.hf_trainer_run import Probe, conv_weights  # noqa: E402


def fsdp2_state() -> SimpleNamespace:
    """What ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))`` sets up on a GPU."""
    return SimpleNamespace(distributed_type=DistributedType.FSDP,
                           fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # another test may have asked for another precision


@pytest.fixture
def trainer_log():
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("transformers.trainer")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def init_end(model: torch.nn.Module) -> hf.ChannelsLastCallback:
    callback = hf.ChannelsLastCallback(verify=False)
    args = TrainingArguments("unused", use_cpu=True, report_to="none")
    callback.on_init_end(args, TrainerState(), TrainerControl(), model=model)
    return callback


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "control"])
def test_hf_callback_keeps_the_weights_nchw_for_fsdp2_and_the_inputs_channels_last(fsdp, monkeypatch, trainer_log):
    if fsdp:
        monkeypatch.setattr(hf, "_accelerator_state", fsdp2_state)
    model = build("resnet").to(memory_format=torch.channels_last)  # the usual advice: fully_shard would refuse it
    probe = Probe(model)
    callback = init_end(model)
    with torch.no_grad():
        model.eval()(pixel_values=torch.randn(2, 3, 32, 32))
    assert probe.first_conv_input == [True]
    if fsdp:
        assert callback.sharding == "FSDP2" and not any(conv_weights(model).values())
        assert f"ChannelsLastCallback(mode='full'): {sharded_line('FSDP2')}" in trainer_log
    else:
        assert callback.sharding is None and all(conv_weights(model).values())
        assert not any("shards" in line for line in trainer_log)


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "control"])
def test_prepare_channels_last_keeps_the_weights_nchw_for_fsdp2(fsdp):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    if fsdp:  # the Accelerator as it is on a GPU with FSDP2: its device and precision stay this machine's
        accelerator = type("Accelerator", (SimpleNamespace,), {"__hash__": object.__hash__})(  # as the real one
            device=accelerator.device, mixed_precision="no", log=accelerator.log,
            register_save_state_pre_hook=accelerator.register_save_state_pre_hook,
            register_load_state_pre_hook=accelerator.register_load_state_pre_hook, **vars(fsdp2_state()))
    model = prepare_channels_last(build("resnet"), accelerator)
    probe = Probe(model)
    with torch.no_grad():
        model.eval()(torch.randn(2, 3, 32, 32))
    assert probe.first_conv_input == [True] and ChannelsLastInputs.of(model) is not None
    weights = conv_weights(model).values()
    assert not any(weights) if fsdp else all(weights)


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "control"])
def test_a_model_init_model_sharded_before_train_begins_is_not_an_error(fsdp, monkeypatch):
    # Trainer(model_init=...) builds the model inside train(), and FSDP2 shards it before any callback sees it.
    if fsdp:
        monkeypatch.setattr(hf, "_accelerator_state", fsdp2_state)
    callback, model = hf.ChannelsLastCallback(verify=False), build("resnet")
    args = SimpleNamespace(world_size=2, bf16=False, fp16=False, device=torch.device("cpu"))  # two processes' arguments
    callback.on_init_end(args, TrainerState(), TrainerControl(), model=None)  # given to Trainer(callbacks=...)
    if not fsdp:  # DDP wrapped an NCHW model: too late, and said so
        with pytest.raises(ValueError, match="model_init"):
            callback.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
        return
    callback.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    assert callback.sharding == "FSDP2" and ChannelsLastInputs.of(model) is callback.inputs_hook
