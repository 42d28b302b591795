"""The check leaves no trace in the real model, also for code that holds references to it: a ``forward`` replaced by
a closure over the original or a module-level name holding it, a ``functools.partial`` over it, a wrapper taking
the original's method as a default argument, a method rebound as an instance attribute, hooks closing over it. Each
pattern is checked on true copies (a layout fault inside the wrapped module is found, so the copies ran their own
module); what cannot be pointed at the copy is not checked, and says why; and what reaches the real model anyway is
put back and named."""

from __future__ import annotations

import functools
import logging
import types

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cltrain import ChannelsLast
from cltrain.loops import convert_model, verify_layout


class Encoder(nn.Module):
    def __init__(self, faulty: bool = False) -> None:
        super().__init__()
        self.conv, self.bn, self.faulty = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), faulty

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.conv(x)))
        return y.view(y.size(0), -1) if self.faulty else torch.flatten(y, 1)  # view: NCHW only


class Net(nn.Module):
    def __init__(self, faulty: bool = False) -> None:
        super().__init__()
        self.encoder, self.head = Encoder(faulty), nn.Linear(8 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _keep_tokens(output: torch.Tensor) -> torch.Tensor:
    return output * 1.0


def closure(net: Net) -> None:  # a toolkit filtering its backbone's outputs
    original = net.encoder.forward
    net.encoder.forward = lambda x: _keep_tokens(original(x))


def partial(net: Net) -> None:
    net.encoder.forward = functools.partial(lambda module, x: _keep_tokens(type(module).forward(module, x)),
                                            net.encoder)


def default_argument(net: Net) -> None:  # a probe callback's style: new_forward(self, ..., fn=fn)
    def new_forward(self: nn.Module, x: torch.Tensor, fn=net.encoder.forward) -> torch.Tensor:  # noqa: B008
        return _keep_tokens(fn(x))

    net.encoder.forward = types.MethodType(new_forward, net.encoder)


def rebound_method(net: Net) -> None:
    net.encoder.forward = types.MethodType(lambda self, x: _keep_tokens(Encoder.forward(self, x)), net.encoder)


def hook(net: Net) -> None:  # a hook reading the original module's parameters
    encoder = net.encoder
    encoder.register_forward_hook(lambda module, args, output: output + 0 * encoder.bn.bias.sum())


def wrapped(net: Net) -> None:  # functools.wraps: __wrapped__ is the original's bound method
    original = net.encoder.forward

    @functools.wraps(original)
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _keep_tokens(original(x))

    net.encoder.forward = forward


def global_name(net: Net) -> None:  # a notebook cell: `original = net.encoder.forward` at the top level
    global _original
    _original = net.encoder.forward
    net.encoder.forward = lambda x: _keep_tokens(_original(x))


def _recurse(x: torch.Tensor, n: int = 1) -> torch.Tensor:  # calls itself by its module-level name
    return _recurse(x, n - 1) if n else _keep_tokens(_original(x))


def global_recursive(net: Net) -> None:
    global _original
    _original = net.encoder.forward
    net.encoder.forward = _recurse


PATTERNS = {f.__name__: f for f in (closure, partial, default_argument, rebound_method, hook, wrapped, global_name,
                                    global_recursive)}


def _state(model: nn.Module) -> dict:
    return {"tensors": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            "rng": torch.get_rng_state().clone()}


def _assert_same(a: dict, b: dict) -> None:
    assert a["tensors"].keys() == b["tensors"].keys()
    for key, value in a["tensors"].items():  # weights and BatchNorm statistics, num_batches_tracked too
        assert torch.equal(value, b["tensors"][key]), key
    assert all((g is None) == (b["grads"][n] is None) for n, g in a["grads"].items()), "a gradient appeared"
    assert torch.equal(a["rng"], b["rng"])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)


def _check(net: nn.Module, optimizer: torch.optim.Optimizer):  # noqa: ANN202
    return verify_layout(net, _batch(), lambda m, b: F.cross_entropy(m(b[0]), b[1]), optimizer=optimizer,
                         report=False)


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_code_holding_the_real_module_is_checked_on_true_copies_and_leaves_no_trace(pattern: str) -> None:
    torch.manual_seed(0)
    net = convert_model(Net())
    PATTERNS[pattern](net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    before = _state(net)
    result = _check(net, optimizer)
    assert result.verdict == "passed", result.line()
    _assert_same(before, _state(net))
    assert optimizer.state == {}
    # The copies ran their own encoder: a view inside the wrapped encoder is found (with the real encoder in both
    # runs, channels_last against itself, it could not be).
    torch.manual_seed(0)
    faulty = convert_model(Net(faulty=True))
    PATTERNS[pattern](faulty)
    before = _state(faulty)
    result = _check(faulty, torch.optim.AdamW(faulty.parameters(), lr=1e-3))
    assert result.verdict in ("fallback", "contiguous") and "encoder" in result.line(), result.line()
    _assert_same(before, _state(faulty))


def test_a_reference_the_copy_cannot_take_over_is_named_and_not_checked() -> None:
    torch.manual_seed(0)
    net = convert_model(Net())
    held = [net.encoder]  # a list in a closure: not the copy's to rewrite
    net.encoder.forward = lambda x: Encoder.forward(held[0], x)
    before = _state(net)
    result = _check(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert result.verdict == "not checked" and "would run the real one" in result.line(), result.line()
    assert "encoder.forward" in result.line() and "item 0" in result.line(), result.line()
    _assert_same(before, _state(net))


_REGISTRY: dict[str, nn.Module] = {}


def _keeps_last(x: torch.Tensor) -> torch.Tensor:
    global _last_output  # written at module level: a copy of the globals would hide it from the step that reads it
    _last_output = _original(x)
    return _last_output


def test_a_function_writing_a_module_level_name_keeps_the_modules_names_and_is_not_checked() -> None:
    global _original
    torch.manual_seed(0)
    net = convert_model(Net())
    _original = net.encoder.forward
    net.encoder.forward = _keeps_last
    before = _state(net)
    result = verify_layout(net, _batch(), lambda m, b: F.cross_entropy(m(b[0]), b[1]) + 0 * _last_output.sum(),
                           optimizer=torch.optim.SGD(net.parameters(), lr=0.1), report=False)
    assert result.verdict == "not checked" and "changed the real model" in result.line(), result.line()
    _assert_same(before, _state(net))


def test_the_real_model_reached_some_other_way_is_put_back_and_named_in_a_warning(caplog) -> None:
    torch.manual_seed(0)
    net = convert_model(Net())
    _REGISTRY["encoder"] = net.encoder  # a global registry: no path from the copy that a scan could follow
    net.encoder.forward = lambda x: Encoder.forward(_REGISTRY["encoder"], x)
    before = _state(net)
    with caplog.at_level(logging.INFO, logger="cltrain"):  # said at INFO, as a check skipped for a copy's limit
        result = verify_layout(net, _batch(), lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                               optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    assert result.verdict == "not checked" and "changed the real model" in result.line(), result.line()
    assert "encoder.bn.running_mean" in result.line() and "put back" in result.line(), result.line()
    assert [r.levelno for r in caplog.records if "changed the real model" in r.getMessage()] == [logging.WARNING]
    _assert_same(before, _state(net))
    # The negative control: the same forward outside the check moves the real statistics.
    net(_batch()[0].contiguous(memory_format=torch.channels_last))
    assert not torch.equal(before["tensors"]["encoder.bn.running_mean"], net.encoder.bn.running_mean)


class _Task(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class _WrapsForward(Callback):
    """A probe callback that wraps the backbone's forward at setup, as self-supervised libraries' do."""

    def setup(self, trainer, pl_module, stage):  # noqa: ANN001, ANN201
        default_argument(pl_module.model)


class _Snapshot(Callback):
    def __init__(self) -> None:
        self.state: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001, ANN201
        if self.state is None:
            self.state = _state(pl_module)


def test_a_callback_wrapping_forward_leaves_the_real_module_untouched_under_the_callback() -> None:
    before, after, callback = _Snapshot(), _Snapshot(), ChannelsLast()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[_WrapsForward(), before, callback, after])
    trainer.fit(_Task(), DataLoader(data, batch_size=4))
    assert callback.layout_checks["train"].verdict == "passed", callback.layout_checks["train"].line()
    _assert_same(before.state, after.state)
