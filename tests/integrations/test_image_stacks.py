"""Stacks of images, (B, T, C, H, W), laid out as the model reads them: each frame channels_last. Hugging Face's
VideoMAE (permutes to a clip for its Conv3d), TimeSformer (reshapes to images) and SmolVLM (views to images, then
copies them contiguous itself), through the Hugging Face hook, the Lightning callback and ``cltrain.loops``."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from cltrain import ChannelsLast
from cltrain.layout import to_channels_last
from cltrain.layout.stacks import channel_dim, is_frames_last
from cltrain.loops import convert_batch

transformers = pytest.importorskip("transformers")


def videomae() -> tuple[nn.Module, dict]:
    config = transformers.VideoMAEConfig(image_size=32, patch_size=8, num_frames=4, tubelet_size=2, hidden_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, num_labels=3)
    return transformers.VideoMAEForVideoClassification(config), {"pixel_values": torch.randn(2, 4, 3, 32, 32),
                                                                 "labels": torch.tensor([0, 1])}


def timesformer() -> tuple[nn.Module, dict]:
    config = transformers.TimesformerConfig(image_size=32, patch_size=8, num_frames=4, hidden_size=32,
                                            num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                            num_labels=3)
    return transformers.TimesformerForVideoClassification(config), {"pixel_values": torch.randn(2, 4, 3, 32, 32),
                                                                    "labels": torch.tensor([0, 1])}


def smolvlm() -> tuple[nn.Module, dict]:
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    text = dict(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.SmolVLMForConditionalGeneration(
        transformers.SmolVLMConfig(vision_config=vision, text_config=text, scale_factor=2, image_token_id=199))
    ids = torch.cat([torch.full((2, 8), 199), torch.randint(0, 150, (2, 6))], 1)  # 4 image tokens per image
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
                   "pixel_values": torch.randn(2, 2, 3, 32, 32)}


MODELS = {f.__name__: f for f in (videomae, timesformer, smolvlm)}


def _first_conv(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d)))


def _watch(model: nn.Module) -> list[tuple[bool, int]]:
    """The first convolution's input on each call: (channels-last in its rank's format, its storage)."""
    seen: list[tuple[bool, int]] = []

    def record(module: nn.Module, args: tuple) -> None:
        x = args[0]
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        seen.append((x.is_contiguous(memory_format=fmt) and not x.is_contiguous(), x.untyped_storage().data_ptr()))

    _first_conv(model).register_forward_pre_hook(record)
    return seen


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_hugging_face_hook_lays_out_image_stacks_as_the_model_reads_them(name: str) -> None:
    from cltrain.integrations.inputs_hook import ChannelsLastInputs

    torch.manual_seed(0)
    model, batch = MODELS[name]()
    to_channels_last(model)
    hook = ChannelsLastInputs().attach(model)
    given: list[int] = []  # the storage of what the hook gave the model
    model.register_forward_pre_hook(lambda m, a, kw: given.append(kw["pixel_values"].untyped_storage().data_ptr()),
                                    with_kwargs=True)
    seen = _watch(model.train())
    model(**batch).loss.backward()
    check = hook.layout_checks["train"]
    assert check.verdict == "passed" and not check.fallbacks, check.line()
    if name == "smolvlm":  # it copies the images contiguous itself: the hook's copy would help nothing
        assert hook.left_as_is == {"pixel_values"} and not seen[-1][0]
        model(**batch)
        assert given[-1] == batch["pixel_values"].untyped_storage().data_ptr()  # left as it arrives: no copy
    else:  # the first convolution reads the hook's stack in channels-last format: no copy in between
        assert seen[-1] == (True, given[-1]) and hook.left_as_is == set()
        model(**batch)
        assert seen[-1] == (True, given[-1])


@pytest.mark.parametrize("name", ["videomae", "timesformer", "smolvlm"])
def test_channels_last_3d_on_a_stack_is_the_wrong_layout(name: str) -> None:
    # The negative control: the 3-D format puts the frames innermost; VideoMAE's Conv3d gets neither layout,
    # TimeSformer's reshape copies, SmolVLM's view raises.
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    seen = _watch(to_channels_last(model))
    batch["pixel_values"] = batch["pixel_values"].contiguous(memory_format=torch.channels_last_3d)
    if name == "smolvlm":
        with pytest.raises(RuntimeError, match="view"):
            model(**batch)
    else:
        model(**batch)
        assert seen[-1][0] is False or seen[-1][1] != batch["pixel_values"].untyped_storage().data_ptr()


class _VideoTask(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = videomae()[0]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        return nn.functional.cross_entropy(self(batch["pixel_values"]), batch["labels"])

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_the_callback_gives_a_stack_the_same_layout() -> None:
    torch.manual_seed(0)
    task = _VideoTask()
    seen = _watch(task)
    callback = ChannelsLast()
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    batch = videomae()[1]
    trainer.fit(task, DataLoader([batch, batch], batch_size=None))
    assert callback.layout_checks["train"].verdict == "passed", callback.layout_checks["train"].line()
    assert callback.session.inputs.trace.left_as_is.get("train") == frozenset() and seen[-1][0]


def test_the_loops_helper_and_the_rule() -> None:
    model = videomae()[0]
    stack, clip = torch.randn(2, 4, 3, 8, 8), torch.randn(2, 3, 8, 8, 8)
    assert channel_dim(stack, model) == 2 and channel_dim(clip) == 1 and channel_dim(torch.randn(2, 8, 3, 8, 8)) == 2
    assert channel_dim(stack) == 1  # 4 frames of 3 channels, no model to tell: a clip, as torchvision's video models
    batch = convert_batch({"pixel_values": stack.clone(), "labels": torch.tensor([0, 1])}, model=model)
    assert is_frames_last(batch["pixel_values"]) and torch.equal(batch["pixel_values"], stack)
    converted = convert_batch((clip.clone(),))[0]
    assert converted.is_contiguous(memory_format=torch.channels_last_3d) and not is_frames_last(converted)


class _Frames(pl.LightningModule):
    """A 2-D network over a stack's frames, written for the contiguous stack: a ``view`` to ``(B*T, C, H, W)``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(8, 4))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        b, t, c, h, w = x.shape
        return F.cross_entropy(self.net(x.view(b * t, c, h, w)).view(b, t, -1).mean(1), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_stack_of_as_many_frames_as_channels_is_a_stack_for_a_2d_network() -> None:
    task, ambiguous = _Frames(), torch.randn(2, 3, 3, 8, 8)
    assert channel_dim(ambiguous, task) == 2 and channel_dim(ambiguous, nn.Conv3d(3, 4, 1)) == 1  # 3-D: a clip
    callback = ChannelsLast()
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(task, DataLoader([(ambiguous, torch.tensor([0, 1]))], batch_size=None))
    assert callback.layout_checks["train"].verdict == "passed", callback.layout_checks["train"].line()


def test_the_hint_for_an_unnamed_image_argument_names_the_image_not_the_mask(caplog) -> None:
    # "images" and a one-channel float "mask": the hint said inputs=['images', 'mask'], converting the mask too
    import logging

    from cltrain.integrations.inputs_hook import ChannelsLastInputs

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, images: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return (self.conv(images) * mask).mean()

    model = Masked()
    hook = ChannelsLastInputs(verify=False).attach(model)
    with caplog.at_level(logging.INFO):
        model(images=torch.randn(2, 3, 8, 8), mask=torch.rand(2, 1, 8, 8))
    hook.detach()
    assert "['images', 'mask'] look like images: name the images among them with inputs='images'" in caplog.text
    # the race's line agrees: the batch holds images, under names the door does not convert
    assert "hold no 4-D or 5-D" not in caplog.text and "hold no model input cltrain knows" in caplog.text
