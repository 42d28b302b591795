"""The first-batch layout check: user code that assumes NCHW keeps training under ChannelsLast, and the
check leaves no trace in the run."""

from __future__ import annotations


import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cltrain import ChannelsLast
from cltrain.check.compare import check_layout
from cltrain.loops import convert_batch, convert_model, verify_layout
from tests.helpers.user_code import (PATTERNS, FirstBatchSnapshot, RawMemory, SpaceToDepth, ViewHead,
                                     assert_trains_like_nchw, run_variants)


# pattern -> (the module the line must name, the fix it must give, how the unchecked run fails)
EXPECTED = {
    "view_head": ("`net`", "torch.flatten(x, 1)", "raises"),
    "raw_memory": ("`net.s2d`", ".contiguous()", "diverges"),
    "backward_view": ("`net.block`", "torch.flatten(x, 1)", "raises"),
    "backward_raw_memory": ("`net.block`", ".contiguous()", "diverges"),
    # the block before it received the bad gradient, and was named ("`net.stem`", in torch's Sequential: nothing to edit)
    "backward_raw_memory_after_a_block": ("`net.block` diverged", ".contiguous()", "diverges"),
    # the bad op is the block's own code after its last child: the block, not the code that took its output
    "backward_raw_memory_in_a_blocks_own_code": ("`net.stem` diverged", ".contiguous()", "diverges"),
    "contiguous_assert": ("`net.block`", ".contiguous()", "raises"),
    "loss_view": ("the step code", "torch.flatten(x, 1)", "raises"),
}


@pytest.mark.parametrize("pattern", sorted(EXPECTED))
def test_user_code_that_assumes_nchw_trains_like_nchw_under_the_callback(pattern: str) -> None:
    assert set(EXPECTED) == set(PATTERNS)
    assert_trains_like_nchw(run_variants(pattern), *EXPECTED[pattern])


class _DropoutNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout2d(0.3),
                                 nn.Conv2d(8, 8, 3, padding=1), nn.Dropout(0.5), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(8, 5))
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g)),
                      batch_size=4)


def test_the_check_leaves_no_trace_and_dropout_does_not_count_as_a_finding() -> None:
    before, after, callback = FirstBatchSnapshot(), FirstBatchSnapshot(), ChannelsLast()
    torch.manual_seed(0)
    module = _DropoutNet()
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[before, callback, after])
    trainer.fit(module, _loader())
    assert callback.layout_checks["train"].verdict == "passed"  # same masks in both layouts: no false finding
    assert callback.layout == "channels_last" and callback.fallbacks == []
    a, b = before.state, after.state
    assert torch.equal(a["rng"], b["rng"])
    for key, value in a["tensors"].items():
        assert torch.equal(value, b["tensors"][key]), key  # BatchNorm statistics and weights
    assert all(g is None for g in b["grads"])
    assert a["optimizer"] == b["optimizer"] and a["logged"] == b["logged"] == {}
    assert a["losses"] == b["losses"] == [] and a["step"] == b["step"] == 0


def test_the_check_runs_once_and_not_with_verify_false() -> None:
    for verify in (True, False):
        callback = ChannelsLast(verify=verify)
        module = _DropoutNet()
        trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
        trainer.fit(module, _loader())
        assert set(callback.layout_checks) == ({"train"} if verify else set())
    with pytest.raises(ValueError, match="verify"):
        ChannelsLast(verify="yes")


class _ViewHeadModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = ViewHead()

    def forward(self, x):
        return self.net(x)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))


def test_validate_alone_checks_the_eval_step() -> None:
    callback = ChannelsLast()
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback])
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g)),
                      batch_size=4)
    trainer.validate(_ViewHeadModule(), data)
    check = callback.layout_checks["eval"]
    assert check.verdict == "fallback" and "`net`" in check.line()


class _StemModule(pl.LightningModule):
    """ResNet's stem (a ReLU in place before a max-pool), trained with AdamW; ``raw_memory``: the model's own forward
    first reads its input's memory as NCHW (the whole model is then kept in NCHW)."""

    def __init__(self, raw_memory: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(12 if raw_memory else 3, 8, 7, 2, 3), nn.BatchNorm2d(8),
                                 nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1), nn.Conv2d(8, 8, 3, padding=1))
        self.raw_memory = raw_memory
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.net(SpaceToDepth()(x) if self.raw_memory else x).mean((2, 3)))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("raw_memory", [False, True], ids=["plain", "raw-memory"])
def test_validate_first_under_inference_mode_then_fit(raw_memory: bool) -> None:
    """Lightning validates inside ``torch.inference_mode``: an in-place ReLU there is no fault (its reference value
    was once kept from before the ReLU), and a model the check puts in NCHW there still trains (restrided inside
    inference mode, its weights were inference tensors: "Inference tensors cannot be saved for backward")."""
    callback = ChannelsLast()
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         callbacks=[callback])
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 5, (8,), generator=g)),
                      batch_size=4)
    module = _StemModule(raw_memory)
    trainer.validate(module, data, verbose=False)
    check = callback.layout_checks["eval"]
    assert check.verdict == ("contiguous" if raw_memory else "passed"), check.line()
    trainer.fit(module, data)
    assert trainer.global_step == 2
    assert not any(p.is_inference() for p in module.parameters())
    assert module.net[0].weight.is_contiguous() == raw_memory
    assert module.net[0].weight.is_contiguous(memory_format=torch.channels_last) != raw_memory


def test_verify_layout_in_a_plain_loop_keeps_the_raw_memory_op_right() -> None:
    torch.manual_seed(0)
    reference = RawMemory()
    model = convert_model(RawMemory())
    model.load_state_dict(reference.state_dict())
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = verify_layout(model, (x, y), step=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    assert result.verdict == "fallback" and [f.module for f in result.fallbacks] == ["s2d"]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    batch = convert_batch((x.clone(), y))
    torch.testing.assert_close(model(batch[0]), reference(x), rtol=1e-5, atol=1e-6)
    # The negative control: the same model without the check computes something else.
    unchecked = convert_model(RawMemory())
    unchecked.load_state_dict(reference.state_dict())
    assert not torch.allclose(unchecked(batch[0]), reference(x), atol=1e-3)


def test_a_correct_model_passes_without_a_noise_run_and_a_scramble_is_far_above_the_floor() -> None:
    import torchvision

    torch.manual_seed(0)
    model = convert_model(torchvision.models.resnet18(num_classes=5))
    x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 5, (2,))
    xc = x.to(memory_format=torch.channels_last)
    result = check_layout(model, lambda m, layout: F.cross_entropy(m(x if layout == "contiguous" else xc), y))
    assert result.verdict == "passed", result.line()
    assert result.worst is not None and result.worst[0] < 0.02


@torch.jit.script
def _scripted_flatten(x: torch.Tensor) -> torch.Tensor:
    return x.view(x.size(0), -1)


class _SegWithScriptedHead(nn.Module):
    """A dict-output model whose own forward flattens through a TorchScript function."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.cls = nn.Conv2d(8, 4, 1)
        self.aux = nn.Linear(8 * 16 * 16, 2)

    def forward(self, x):
        f = self.enc(x)
        return {"seg": self.cls(f), "aux": self.aux(_scripted_flatten(f))}


def test_verify_layout_on_a_scripted_view_keeps_a_converting_loop_right() -> None:
    torch.manual_seed(0)
    reference = _SegWithScriptedHead()
    model = convert_model(_SegWithScriptedHead())
    model.load_state_dict(reference.state_dict())
    batch = {"image": torch.randn(4, 3, 16, 16), "mask": torch.randint(0, 4, (4, 16, 16)), "y": torch.randint(0, 2, (4,))}

    def step(m, b):
        out = m(b["image"])
        n, c = out["seg"].shape[:2]
        return F.cross_entropy(out["seg"].reshape(n, c, -1), b["mask"].view(n, -1)) + F.cross_entropy(out["aux"], b["y"])

    result = verify_layout(model, batch, step=step)
    assert result.verdict in ("fallback", "contiguous")
    assert "view size is not compatible" in result.line() and "torch.flatten(x, 1)" in result.line()
    converted = convert_batch({k: v.clone() for k, v in batch.items()})  # the loop keeps converting its batches
    torch.testing.assert_close(step(model, converted), step(reference, batch), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(2, 8, 5, 7), (2, 3, 4, 5, 6), (6, 5), (7,)])
def test_the_fingerprint_of_a_tensor_ignores_its_memory_layout_and_sees_a_moved_value(shape):
    from cltrain.check.signature import Vectors, project

    vectors, x = Vectors(), torch.randn(shape, generator=torch.Generator().manual_seed(0))
    others = [x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else None,
              x.contiguous(memory_format=torch.channels_last_3d) if x.dim() == 5 else None,
              x.transpose(0, -1).contiguous().transpose(0, -1), x.expand(2, *shape)[1]]
    for other in (o for o in others if o is not None):
        torch.testing.assert_close(project(other, vectors), project(x, vectors), rtol=1e-5, atol=1e-5)
    moved = x.flatten().roll(1).view(shape)  # the same values, each at another index: the negative control
    assert not torch.allclose(project(moved, vectors), project(x, vectors), rtol=1e-3, atol=1e-3)
