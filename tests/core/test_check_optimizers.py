"""The first-batch check is exact with the optimizers users have: a healthy model passes with every one of them
(the updates are compared on identical gradients), a layout-sensitive optimizer is still caught, the check
compares in full float32 whatever the user's TF32 settings, and a copied optimizer's state follows its
parameter's strides (a fused kernel requires it)."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader

from cltrain import ChannelsLast
from cltrain.loops import convert_batch, convert_model, verify_layout
from cltrain.precision import zero_momentum_buffers

smp = pytest.importorskip("segmentation_models_pytorch")

OPTIMIZERS = {
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "AdamW fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    "Adam foreach, amsgrad": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True, amsgrad=True),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "SGD nesterov": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4),
}


def _unetplusplus() -> nn.Module:
    # UNet++ on a resnet18 encoder: a decoder of conv -> BatchNorm blocks whose biases get near-zero gradients,
    # which Adam's first step turns into full steps of either sign
    torch.manual_seed(0)
    return smp.UnetPlusPlus(encoder_name="resnet18", encoder_weights=None, classes=1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, 64, 64, generator=g), (torch.rand(4, 1, 64, 64, generator=g) > 0.5).float()


_dice = None


def _seg_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    global _dice
    _dice = _dice or smp.losses.DiceLoss("binary")
    out = model(batch[0])
    return _dice(out, batch[1]) + F.binary_cross_entropy_with_logits(out, batch[1])


def _small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def _cls_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _cls_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 5, (8,), generator=g)


def _user_subclass(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same optimizer as a user's subclass of it: the check re-runs its step on the copies."""
    optimizer.__class__ = type(f"My{type(optimizer).__name__}", (type(optimizer),), {})
    return optimizer


@pytest.mark.parametrize("subclass", [False, True], ids=["torch's", "a subclass"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_passes_and_its_state_is_untouched(name: str, subclass: bool) -> None:
    model = convert_model(_small())
    optimizer = OPTIMIZERS[name](model.parameters())
    if subclass:
        _user_subclass(optimizer)
    torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=10, cycle_momentum=False)
    _cls_loss(model, convert_batch(_cls_batch())).backward()
    optimizer.step()  # a state already filled, as on a resumed run
    model.zero_grad(set_to_none=True)
    state = copy.deepcopy(optimizer.state_dict())
    result = verify_layout(model, _cls_batch(), _cls_loss, optimizer=optimizer, report=False)
    assert result.verdict == "passed", result.line()
    after = optimizer.state_dict()
    assert after["param_groups"] == state["param_groups"] and after["state"].keys() == state["state"].keys()
    assert all(torch.equal(v, state["state"][k][n]) for k, s in after["state"].items() for n, v in s.items())
    assert all(p.grad is None for p in model.parameters())


def test_a_segmentation_model_with_adam_passes() -> None:
    model = convert_model(_unetplusplus())
    optimizer = _user_subclass(torch.optim.Adam(model.parameters(), lr=1e-3))  # re-run on the copies
    result = verify_layout(model, _batch(), _seg_loss, optimizer=optimizer, report=False)
    assert result.verdict == "passed", result.line()


def test_without_identical_gradients_adam_turns_rounding_into_a_false_alarm(monkeypatch: pytest.MonkeyPatch) -> None:
    # The negative control of the test above: each layout's optimizer fed its own backward's gradients, and the
    # modules on their own values (rounding at a kink reaches the gradients, and Adam makes it a full step).
    from cltrain.check import compare, gradient_tape, record

    class OwnGradients(gradient_tape.GradientTape):
        def hooks(self, model: nn.Module, recorder: record.Recorder) -> list:
            return []

    monkeypatch.setattr(compare, "GradientTape", OwnGradients)
    monkeypatch.setattr(compare, "_ISOLATE", False)
    model = convert_model(_unetplusplus())
    optimizer = _user_subclass(torch.optim.Adam(model.parameters(), lr=1e-3))
    result = verify_layout(model, _batch(), _seg_loss, optimizer=optimizer, report=False)
    assert result.verdict == "contiguous" and result.findings[0].phase == "update", result.line()


def _losses(model: nn.Module, layout: str, steps: int = 4) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, m = _batch()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = _seg_loss(model, (convert_batch(x.clone()) if layout == "channels_last" else x, m))
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def test_the_pass_with_adam_is_confirmed_against_a_nudged_nchw_run() -> None:
    # channels_last trained without the check differs from NCHW no more than NCHW with its weights nudged by
    # 1e-7 does (rounding, amplified by Adam): the check's "passed" is right. One nudge's drift ranges over 10x with
    # its draw (8e-5 to 1.4e-3 here): the reference is the largest of three seeded draws.
    base = _unetplusplus()
    nchw = _losses(copy.deepcopy(base), "contiguous")
    noise = 0.0
    for seed in range(3):
        nudged_model, gen = copy.deepcopy(base), torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in nudged_model.parameters():
                p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=gen))
        nudged = _losses(nudged_model, "contiguous")
        noise = max(noise, *(abs(a - b) / abs(b) for a, b in zip(nudged, nchw)))
    cl = _losses(convert_model(copy.deepcopy(base)), "channels_last")
    gap = max(abs(a - b) / abs(b) for a, b in zip(cl, nchw))
    assert gap <= 10 * max(noise, 1e-6), (gap, noise)


class RawMemoryAdam(torch.optim.Adam):
    """An Adam that reads each gradient's memory as if it were NCHW (as an extension op that skips
    ``.contiguous()`` does)."""

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.dim() == 4:
                    g = p.grad
                    p.grad = torch.as_strided(g, g.shape, torch.empty(g.shape).stride()).clone()
        return super().step(closure)


def test_a_layout_sensitive_adam_is_still_caught_and_diverges_without_the_check() -> None:
    model = convert_model(_small())
    result = verify_layout(model, _cls_batch(), _cls_loss, optimizer=RawMemoryAdam(model.parameters(), lr=1e-3),
                           report=False)
    assert result.verdict in ("fallback", "contiguous") and result.findings[0].phase == "update", result.line()
    # the negative control: trained channels_last without the check, its first update differs from NCHW's
    runs = {}
    for layout in ("contiguous", "channels_last"):
        net = convert_model(_small()) if layout == "channels_last" else _small()
        optimizer = RawMemoryAdam(net.parameters(), lr=1e-3)
        x, y = _cls_batch()
        _cls_loss(net, (convert_batch(x) if layout == "channels_last" else x, y)).backward()
        optimizer.step()
        runs[layout] = net[0].weight.detach().contiguous()
    assert not torch.allclose(runs["contiguous"], runs["channels_last"], rtol=1e-3, atol=1e-6)


class StrideStrictSGD(torch.optim.SGD):
    """SGD that refuses a momentum buffer whose strides differ from its parameter's, as CUDA's fused and foreach
    kernels do (``check_fast_path_restrictions``): the CUDA fault, on the CPU."""

    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state.get(p, {}).get("momentum_buffer")
                if buf is not None and buf.stride() != p.stride():
                    raise RuntimeError("Expected at::native::check_fast_path_restrictions(...) to be true")
        return super().step(closure)


def test_a_copied_optimizers_state_takes_its_parameters_strides(monkeypatch: pytest.MonkeyPatch) -> None:
    # The app's fused SGD under loss scaling starts its momentum buffers at zero, channels_last, before step 0:
    # the NCHW copy's kernel must get NCHW buffers.
    model = convert_model(_small())
    optimizer = StrideStrictSGD(model.parameters(), lr=0.1, momentum=0.9)
    zero_momentum_buffers(optimizer)
    assert optimizer.state[model[0].weight]["momentum_buffer"].is_contiguous(memory_format=torch.channels_last)
    result = verify_layout(model, _cls_batch(), _cls_loss, optimizer=optimizer, report=False)
    assert result.verdict == "passed", result.line()
    # the real optimizer's buffers are untouched: still channels_last
    assert optimizer.state[model[0].weight]["momentum_buffer"].is_contiguous(memory_format=torch.channels_last)
    # the negative control: copies whose state keeps the real strides, and the step "raises without channels_last"
    from cltrain.check import record

    monkeypatch.setattr(record, "state_in_param_strides",
                        lambda params: register_optimizer_step_pre_hook(lambda *a: None))
    result = verify_layout(model, _cls_batch(), _cls_loss, optimizer=optimizer, report=False)
    assert result.step_raised is not None and "check_fast_path_restrictions" in result.line(), result.line()
    assert "the model alone, on the batch's image tensor: the step raised" in result.line()  # as the Lightning door


def test_the_check_computes_in_full_float32_and_gives_back_the_users_settings() -> None:
    seen: list[tuple[str, str]] = []
    backends = (torch.backends.cudnn.conv, torch.backends.mkldnn.conv, torch.backends.mkldnn.matmul,
                torch.backends.cuda.matmul)
    saved = [b.fp32_precision for b in backends]
    torch.backends.mkldnn.conv.fp32_precision = "bf16"  # the user's choice: fp32 convolutions in bf16 (AMX)
    torch.backends.mkldnn.matmul.fp32_precision = "tf32"
    try:
        user = [b.fp32_precision for b in backends]

        def step(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            seen.append(tuple(x.fp32_precision for x in backends))
            return F.cross_entropy(m(b[0]), b[1])

        model = convert_model(_small())
        verify_layout(model, (torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))), step, report=False)
        assert seen and all(s == ("ieee",) * 4 for s in seen), seen
        assert [b.fp32_precision for b in backends] == user

        def raising(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            raise ValueError("the user's step")

        verify_layout(model, (torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))), raising, report=False)
        assert [b.fp32_precision for b in backends] == user
    finally:
        for b, value in zip(backends, saved):
            b.fp32_precision = value


class SegmentationTask(pl.LightningModule):
    """A LightningModule in segmentation_models_pytorch's own example style: Dice + BCE, Adam, a scheduler."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _unetplusplus()
        self.dice = smp.losses.DiceLoss("binary", from_logits=True)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        image, mask = batch
        logits = self(image)
        loss = self.dice(logits, mask) + F.binary_cross_entropy_with_logits(logits, mask)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.Adam(self.parameters(), lr=2e-4)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 10)}


def test_a_segmentation_task_with_adam_keeps_channels_last_under_the_callback() -> None:
    x, m = _batch()
    callback = ChannelsLast()
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(SegmentationTask(), DataLoader([(x, m)] * 2, batch_size=None))
    check = callback.layout_checks["train"]
    assert check.verdict == "passed" and callback.layout == "channels_last", check.line()
    assert callback.fallbacks == []


def test_torchs_elementwise_optimizers_are_not_re_run_and_others_are(monkeypatch: pytest.MonkeyPatch) -> None:
    stepped: list[str] = []

    def counting_step(self, closure=None):  # noqa: ANN001, ANN202
        stepped.append(type(self).__name__)

    model = convert_model(_small())
    for optimizer in (torch.optim.AdamW(model.parameters()), _user_subclass(torch.optim.AdamW(model.parameters())),
                      torch.optim.LBFGS(model.parameters())):
        monkeypatch.setattr(type(optimizer), "step", counting_step)
        verify_layout(model, _cls_batch(), _cls_loss, optimizer=optimizer, report=False)
    assert "AdamW" not in stepped and "MyAdamW" in stepped and "LBFGS" in stepped, stepped
