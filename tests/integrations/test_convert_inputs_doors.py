"""``convert_inputs=False`` at every door: the model is converted, its inputs stay as they come, and the first-batch
check runs the step on them as they are (the Lightning callback's: tests/core/test_callback.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from cltrain.check.copies import checking
from cltrain.layout import is_channels_last

SIZE, CLASSES = 8, 3


class ViewsItsInput(nn.Module):
    """A model whose forward reads its input with ``view`` (an autoencoder's reconstruction term): a channels_last
    input raises there, an NCHW one does not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, CLASSES)
        self.seen: list[bool] = []  # the real steps' inputs: channels_last or not

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None):
        if not checking():
            self.seen.append(is_channels_last(pixel_values))
        flat = pixel_values.view(len(pixel_values), -1)
        logits = self.fc(torch.relu(self.conv(pixel_values)).mean((2, 3))) + 0 * flat.mean()
        return logits if labels is None else {"loss": F.cross_entropy(logits, labels), "logits": logits}


def _images(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(3, SIZE, SIZE, generator=g), torch.tensor(i % CLASSES)) for i in range(n)]


def _loop(model: nn.Module, fabric: bool) -> object:
    from cltrain.loops import ChannelsLastRun

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = ChannelsLastRun(model, optimizer, step=lambda m, b: F.cross_entropy(m(b[0]), b[1]), layout="channels_last",
                          convert_inputs=False)
    loader = DataLoader(_images(), batch_size=2)
    if fabric:
        from lightning.fabric import Fabric

        runner = Fabric(accelerator="cpu", devices=1)
        model_, optimizer = runner.setup(model, optimizer)
        loader = runner.setup_dataloaders(loader)
    else:
        model_ = model
    for x, y in run.batches(loader):
        F.cross_entropy(model_(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    run.end()
    return run


def _hf(model: nn.Module, tmp_path) -> object:
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from cltrain.integrations.transformers import ChannelsLastCallback

    callback = ChannelsLastCallback(layout="channels_last", convert_inputs=False)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, report_to="none",
                             use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    rows = [{"pixel_values": x, "labels": y} for x, y in _images()]
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback]).train()
    assert callback.state()["args"]["convert_inputs"] is False  # what a resume that rebuilds the callback takes
    return callback


def _accelerate(model: nn.Module) -> object:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from cltrain.integrations.accelerate import prepare_channels_last
    from cltrain.integrations.inputs_hook import ChannelsLastInputs

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    prepare_channels_last(model, accelerator, layout="channels_last", convert_inputs=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapped, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(_images(), batch_size=2))
    for x, y in loader:
        accelerator.backward(F.cross_entropy(wrapped(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return ChannelsLastInputs.of(model).session


@pytest.mark.parametrize("door", ["plain", "fabric", "hf", "accelerate"])
def test_convert_inputs_false_converts_the_model_alone_and_checks_the_step_on_the_inputs_as_they_come(door, tmp_path):
    # the check converted its copies' inputs all the same: the forward's view raised in channels_last only, and the
    # model went to NCHW for a fault the run never meets
    model = ViewsItsInput()
    door_run = {"plain": lambda: _loop(model, False), "fabric": lambda: _loop(model, True),
                "hf": lambda: _hf(model, tmp_path), "accelerate": lambda: _accelerate(model)}[door]()
    assert door_run.layout_checks["train"].verdict == "passed", door_run.layout_checks["train"].line()
    assert is_channels_last(model.conv.weight) and not door_run.fallbacks
    assert model.seen and not any(model.seen)  # every real step got its input as the loader built it


@pytest.mark.parametrize("make", ["ChannelsLastRun", "ChannelsLastCallback", "prepare_channels_last"])
def test_a_convert_inputs_that_is_not_a_bool_is_refused_with_its_value(make):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from cltrain.integrations.accelerate import prepare_channels_last
    from cltrain.integrations.transformers import ChannelsLastCallback
    from cltrain.loops import ChannelsLastRun

    build = {"ChannelsLastRun": lambda: ChannelsLastRun(ViewsItsInput(), convert_inputs="no"),
             "ChannelsLastCallback": lambda: ChannelsLastCallback(convert_inputs="no"),
             "prepare_channels_last": lambda: prepare_channels_last(ViewsItsInput(), Accelerator(cpu=True),
                                                                    convert_inputs="no")}[make]
    with pytest.raises(ValueError, match="convert_inputs='no'"):
        build()
