"""ChannelsLast converts the model's inputs only: user code on targets, masks and heatmaps keeps working."""

import logging
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from cltrain import ChannelsLast, is_channels_last
from cltrain.layout.batches import map_tensors, model_inputs, restride_batch
from tests.helpers.plain_modules import channels_last_strides

KEYPOINTS = 5


def fit(tmp_path, model, data, callback, **kw):
    kw = {"max_steps": 2, **kw}
    Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[callback], **kw,
    ).fit(model, data)


def contiguous_strides(t):
    return torch.empty(t.shape).stride()


class HeatmapModel(LightningModule):
    """Keypoint heatmaps as a user writes them: the loss flattens the target with ``view``, legal on the
    contiguous tensors its DataLoader yields. The output is flattened with ``reshape``: a channels_last
    model's outputs are channels_last."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, KEYPOINTS, 1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        image, target = (batch["image"], batch["heatmap"]) if isinstance(batch, dict) else batch
        self.seen.append((image.stride(), target.stride()))
        n = image.shape[0]
        out = self.net(image)
        return F.mse_loss(out.reshape(n, -1), target.view(n, -1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def heatmap_loader(kind):
    def collate(items):
        n = len(items)
        image, heatmap = torch.randn(n, 3, 16, 16), torch.rand(n, KEYPOINTS, 16, 16)
        return {"image": image, "heatmap": heatmap} if kind == "dict" else (image, heatmap)

    return DataLoader(range(4), batch_size=2, collate_fn=collate)


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_heatmap_loss_with_view_on_the_target_trains(tmp_path, kind):
    model = HeatmapModel()
    fit(tmp_path, model, heatmap_loader(kind), ChannelsLast())
    assert len(model.seen) == 2
    for image_stride, target_stride in model.seen:
        assert image_stride == channels_last_strides((2, 3, 16, 16))
        assert target_stride == contiguous_strides(torch.empty(2, KEYPOINTS, 16, 16))


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_converting_all_tensors_breaks_the_heatmap_loss(tmp_path, kind):
    # the negative control: restriding the target too makes the user's view() raise (with the first-batch
    # check off; with it on, the check finds the raise and keeps the step's tensors in NCHW)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        fit(tmp_path, HeatmapModel(), heatmap_loader(kind), ChannelsLast(inputs="all", verify=False))


def test_a_channels_last_models_outputs_are_channels_last():
    # what the docs say: flatten a channels_last model's 4-D output with reshape, not view
    net = nn.Conv2d(3, KEYPOINTS, 1).to(memory_format=torch.channels_last)
    out = net(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last))
    assert is_channels_last(out)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        out.view(2, -1)
    assert out.reshape(2, -1).shape == (2, KEYPOINTS * 64)


class Recorder(LightningModule):
    """Records the strides of every tensor of the batch it is given; trains a conv on ``pick(batch)``."""

    def __init__(self, pick):
        super().__init__()
        self.pick = pick
        self.conv = nn.Conv2d(3, 4, 3)
        self.seen = []

    def training_step(self, batch, batch_idx):
        from torch.utils._pytree import tree_flatten_with_path, keystr

        flat, _ = tree_flatten_with_path(batch)
        self.seen.append({keystr(path): t.stride() for path, t in flat if isinstance(t, torch.Tensor)})
        return self.conv(self.pick(batch)).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(tmp_path, make_batch, pick, **callback_kw):
    model = Recorder(pick)
    fit(tmp_path, model, DataLoader(range(4), batch_size=2, collate_fn=lambda items: make_batch(len(items))),
        ChannelsLast(**callback_kw), max_steps=1)
    assert len(model.seen) == 1
    return model.seen[0]


def cl_strides(*shape):
    return channels_last_strides(shape)


def plain_strides(*shape):
    return torch.empty(shape).stride()


def test_segmentation_masks_keep_their_layout(tmp_path):
    # MONAI-style float label maps, one-hot and single-channel, in a dict and in a tuple
    def dict_batch(n):
        return {"image": torch.randn(n, 3, 8, 8), "label": torch.rand(n, 1, 8, 8), "onehot": torch.rand(n, 4, 8, 8)}

    seen = run(tmp_path, dict_batch, lambda b: b["image"])
    assert seen == {"['image']": cl_strides(2, 3, 8, 8), "['label']": plain_strides(2, 1, 8, 8),
                    "['onehot']": plain_strides(2, 4, 8, 8)}
    seen = run(tmp_path, lambda n: (torch.randn(n, 3, 8, 8), torch.rand(n, 4, 8, 8)), lambda b: b[0])
    assert seen == {"[0]": cl_strides(2, 3, 8, 8), "[1]": plain_strides(2, 4, 8, 8)}


def test_nested_batch_converts_every_view_of_the_input_and_no_target(tmp_path):
    # ((view_a, view_b), {"heatmap", "boxes"}): multi-crop views are all inputs; the targets stay
    def batch(n):
        views = (torch.randn(n, 3, 8, 8), torch.randn(n, 3, 12, 12))
        return views, {"heatmap": torch.rand(n, 2, 8, 8), "boxes": torch.rand(n, 3, 4)}

    seen = run(tmp_path, batch, lambda b: b[0][0])
    assert seen == {"[0][0]": cl_strides(2, 3, 8, 8), "[0][1]": cl_strides(2, 3, 12, 12),
                    "[1]['heatmap']": plain_strides(2, 2, 8, 8), "[1]['boxes']": plain_strides(2, 3, 4)}


def test_nested_dict_under_an_image_key_gives_its_own_image_keys(tmp_path):
    def batch(n):
        return {"inputs": {"image": torch.randn(n, 3, 8, 8), "mask": torch.rand(n, 1, 8, 8)},
                "target": torch.rand(n, 3, 8, 8)}

    seen = run(tmp_path, batch, lambda b: b["inputs"]["image"])
    assert seen == {"['inputs']['image']": cl_strides(2, 3, 8, 8), "['inputs']['mask']": plain_strides(2, 1, 8, 8),
                    "['target']": plain_strides(2, 3, 8, 8)}


def test_a_batch_that_is_one_tensor_is_converted(tmp_path):
    seen = run(tmp_path, lambda n: torch.randn(n, 3, 8, 8), lambda b: b)
    assert seen == {"": cl_strides(2, 3, 8, 8)}


def test_named_keys_and_indices_replace_the_default(tmp_path):
    def batch(n):
        return {"rgb": torch.randn(n, 3, 8, 8), "depth": torch.randn(n, 1, 8, 8), "image": torch.randn(n, 3, 8, 8)}

    seen = run(tmp_path, batch, lambda b: b["rgb"], inputs=["rgb", "depth"])
    assert seen == {"['rgb']": cl_strides(2, 3, 8, 8), "['depth']": cl_strides(2, 1, 8, 8),
                    "['image']": plain_strides(2, 3, 8, 8)}
    seen = run(tmp_path, lambda n: (torch.rand(n, 2, 8, 8), torch.randn(n, 3, 8, 8)), lambda b: b[1], inputs=1)
    assert seen == {"[0]": plain_strides(2, 2, 8, 8), "[1]": cl_strides(2, 3, 8, 8)}


def test_a_named_key_the_batch_lacks_is_a_one_line_error(tmp_path):
    batch = lambda n: {"image": torch.randn(n, 3, 8, 8), "label": torch.zeros(n)}  # noqa: E731
    with pytest.raises(ValueError, match=r"inputs='rgb': the batch \(dict\) has no key or field 'rgb' \(its keys: 'image', 'label'\)"):
        run(tmp_path, batch, lambda b: b["image"], inputs="rgb")


def test_a_dict_batch_without_an_image_key_is_left_alone_and_says_so(tmp_path, caplog):
    batch = lambda n: {"data": torch.randn(n, 3, 8, 8), "target": torch.rand(n, 3, 8, 8)}  # noqa: E731
    with caplog.at_level(logging.INFO):
        seen = run(tmp_path, batch, lambda b: b["data"])
    assert seen == {"['data']": plain_strides(2, 3, 8, 8), "['target']": plain_strides(2, 3, 8, 8)}
    assert "no model input found in the batch (dict with keys 'data', 'target')" in caplog.text
    assert "inputs=KEY" in caplog.text and "a list for several" in caplog.text
    # not "no 4-D or 5-D image tensor": the batch holds two (the race's line said so, and was wrong)
    assert "hold no 4-D or 5-D" not in caplog.text and "hold no model input cltrain knows" in caplog.text


# ---- the selection rules without a Trainer --------------------------------------------------------


def test_namedtuple_and_dataclass_batches_select_their_image_fields():
    Sample = namedtuple("Sample", "label img")

    @dataclass
    class Batch:
        pixel_values: torch.Tensor
        labels: torch.Tensor

    x, y = torch.randn(2, 3, 4, 4), torch.rand(2, 3, 4, 4)
    assert [t is x for t in model_inputs(Sample(y, x))] == [True]
    assert [t is x for t in model_inputs(Batch(x, y))] == [True]
    Plain = namedtuple("Plain", "a b")  # no image field: the first element, as a tuple
    assert [t is x for t in model_inputs(Plain(x, y))] == [True]


def test_an_index_on_a_dict_batch_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"inputs=0: .* dict with keys 'image'; name its keys instead"):
        model_inputs({"image": torch.randn(1, 3, 2, 2)}, 0)
    with pytest.raises(ValueError, match=r"inputs=2: the batch has 2 elements"):
        model_inputs((torch.randn(1, 3, 2, 2), torch.zeros(1)), 2)


def test_restride_batch_counts_copies_and_skips_what_is_already_channels_last():
    batch = {"image": torch.randn(2, 3, 4, 4), "label": torch.rand(2, 3, 4, 4)}
    assert restride_batch(batch, "channels_last") == 1
    assert restride_batch(batch, "channels_last") == 0
    assert restride_batch(batch, "contiguous") == 1 and batch["image"].is_contiguous()



def test_map_tensors_rebuilds_each_collection_as_its_own_type_and_leaves_other_objects_alone():
    Pair = namedtuple("Pair", "image label")

    @dataclass
    class Sample:
        pair: Pair
        crops: list
        meta: dict

    @dataclass(frozen=True)
    class Frozen:
        x: torch.Tensor

    class Opaque:  # not a collection: kept as the same object, its tensor not looked into
        def __init__(self):
            self.t = torch.zeros(1)

    opaque = Opaque()
    batch = Sample(Pair(torch.zeros(2), 3), [torch.zeros(1), (torch.zeros(1), "a")],
                   {"id": "x", "mask": torch.zeros(1), "other": opaque, "frozen": Frozen(torch.zeros(1))})
    out = map_tensors(batch, lambda t: t + 1)
    assert type(out) is Sample and out is not batch and type(out.pair) is Pair
    assert out.pair.image.tolist() == [1.0, 1.0] and out.pair.label == 3
    assert type(out.crops) is list and out.crops[0].item() == 1 and type(out.crops[1]) is tuple
    assert out.crops[1][0].item() == 1 and out.crops[1][1] == "a"
    assert type(out.meta) is dict and out.meta["id"] == "x" and out.meta["mask"].item() == 1
    assert out.meta["other"] is opaque and opaque.t.item() == 0
    assert type(out.meta["frozen"]) is Frozen and out.meta["frozen"].x.item() == 1
    assert batch.pair.image.tolist() == [0.0, 0.0]  # the input is not changed

# ---- an input is converted only where its converted layout reaches a convolution ------------------


class StackOrImage(LightningModule):
    """torchgeo-style change detection: a (B, T, C, H, W) image stack flattened to (B*T, C, H, W) before the
    convolutions; or a plain (B, C, H, W) image normalised, then convolved; with ``copies``, the image made
    contiguous (NCHW) by the model's own code before the convolution."""

    def __init__(self, copies: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.copies = copies
        self.seen = []

    def training_step(self, batch, batch_idx):
        x = batch["image"]
        self.seen.append(x.stride())
        if x.dim() == 5:
            return self.conv(x.flatten(0, 1)).mean()
        return self.conv(x.contiguous() if self.copies else (x - 0.5) * 2).mean()

    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _reach_run(tmp_path, caplog, shape, copies=False, **callback_kw):
    model = StackOrImage(copies)
    data = DataLoader(range(6), batch_size=2, collate_fn=lambda items: {"image": torch.randn(len(items), *shape)})
    with caplog.at_level(logging.INFO):
        Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=tmp_path, callbacks=[ChannelsLast(**callback_kw)],
                max_steps=3, limit_val_batches=1, num_sanity_val_steps=0, val_check_interval=2).fit(model, data, data)
    return [model.seen[i] for i in (0, 1, 3)]  # the training steps (the validation batch came third)


def frames_strides(b, t, c, h, w):
    """A (B, T, C, H, W) stack with each frame channels_last."""
    return (t * h * w * c, h * w * c, 1, w * c, c)


def test_an_image_stack_flattened_before_the_convolutions_gets_each_frame_channels_last(tmp_path, caplog):
    seen = _reach_run(tmp_path, caplog, (2, 3, 8, 8))
    assert seen == [frames_strides(2, 2, 3, 8, 8)] * 3  # the flatten is a view, channels_last: no copy
    assert "reaches no convolution" not in caplog.text


def test_an_input_the_model_makes_contiguous_first_is_left_as_it_arrives_after_the_first_batch(tmp_path, caplog):
    seen = _reach_run(tmp_path, caplog, (3, 8, 8), copies=True)
    assert seen == [cl_strides(2, 3, 8, 8)] + [plain_strides(2, 3, 8, 8)] * 2
    assert caplog.text.count("reaches no convolution") == 1, caplog.text  # train and validation: one line
    assert "converting 1 tensor(s) per batch" not in caplog.text


def test_an_image_that_reaches_a_convolution_stays_converted(tmp_path, caplog):
    seen = _reach_run(tmp_path, caplog, (3, 8, 8))
    assert seen == [cl_strides(2, 3, 8, 8)] * 3
    assert "reaches no convolution" not in caplog.text


class TwoBackwards(LightningModule):
    """A GAN's step under manual optimization: a backward through the generator's loss first, then the discriminator
    on the real images (the batch's input) and its own backward."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.gen, self.disc = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
        self.seen = []
        self.disc.register_forward_pre_hook(lambda module, args: self.seen.append(args[0].stride()))

    def training_step(self, batch, batch_idx):
        x = batch["image"]
        g, d = self.optimizers()
        self.manual_backward(self.disc(self.gen(torch.randn(x.shape))).mean())  # noise of the input's shape
        g.step()
        g.zero_grad()
        self.manual_backward(self.disc(x).mean())  # the real images reach a convolution after the first backward
        d.step()
        d.zero_grad()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.gen.parameters()), torch.optim.Adam(self.disc.parameters())


def test_a_manual_step_that_convolves_its_input_after_a_backward_keeps_it_converted(tmp_path, caplog):
    # the trace ended at the first backward: "reaches no convolution", and the real images went NCHW from then on
    model = TwoBackwards()
    data = DataLoader(range(8), batch_size=2, collate_fn=lambda items: {"image": torch.randn(len(items), 3, 8, 8)})
    with caplog.at_level(logging.INFO):
        Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, default_root_dir=tmp_path, callbacks=[ChannelsLast(layout="channels_last")],
                max_steps=8).fit(model, data)
    assert "reaches no convolution" not in caplog.text
    assert model.seen[-6:] == [cl_strides(2, 3, 8, 8)] * 6  # the generator's output and the real images alike


def test_inputs_all_converts_on_every_batch(tmp_path, caplog):
    # The negative control: every tensor converted, untraced, where the user asks for all of them.
    seen = _reach_run(tmp_path, caplog, (3, 8, 8), copies=True, inputs="all")
    assert seen == [cl_strides(2, 3, 8, 8)] * 3
    assert "reaches no convolution" not in caplog.text


class _Cached:
    """A loader that hands out the same tensor objects every step (a cached batch, a dataset on the device)."""

    def __init__(self, batch, steps):
        self.batch, self.steps = batch, steps

    def __iter__(self):
        return iter([self.batch] * self.steps)

    def __len__(self):
        return self.steps


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_the_loaders_own_tensors_keep_their_layout_after_each_step(tmp_path, kind):
    # the step sees its input channels_last; the tensor objects the loader holds are as it made them between
    # steps and after the fit, so a later NCHW run of the same batch is NCHW (without restore_batch: channels_last)
    image, heatmap = torch.randn(2, 3, 16, 16), torch.rand(2, KEYPOINTS, 16, 16)
    batch = {"image": image, "heatmap": heatmap} if kind == "dict" else (image, heatmap)
    model, between = HeatmapModel(), []

    class Between(Callback):  # runs after ChannelsLast's batch end
        def on_train_batch_end(self, *args):
            between.append(image.stride())

    Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path, max_steps=3,
            callbacks=[ChannelsLast(), Between()]).fit(model, _Cached(batch, 3))
    assert [s[0] for s in model.seen] == [channels_last_strides(image.shape)] * 3
    assert between == [contiguous_strides(image)] * 3 and image.is_contiguous() and heatmap.is_contiguous()


def test_the_copy_line_points_at_the_nhwc_collate_only_where_it_can_serve():
    # a Hugging Face image processor's batch (CHW floats under pixel_values) cannot come from cltrain's NHWC collate;
    # a stack of frames (B, T, C, H, W) is made channels_last frame by frame, not channels_last_3d
    from cltrain.batch_inputs import BatchInputs

    image, clip, labels = (2, 3, 8, 8), (2, 3, 4, 8, 8), torch.zeros(2)  # each batch new: convert restrides in place
    for model, batch, hint, named in (
            (nn.Conv2d(3, 4, 3), {"pixel_values": torch.randn(image), "labels": labels}, "", "channels_last"),
            (nn.Conv2d(3, 4, 3), (torch.randn(image), labels), "cltrain.data's NHWC collate", "channels_last"),
            (nn.Conv3d(3, 4, 3), (torch.randn(clip), labels), "cltrain.data.video's NDHWCCollate", "channels_last_3d"),
            (nn.Conv2d(3, 4, 3), (torch.randn(2, 4, 3, 8, 8), labels), "", "channels_last per frame")):
        said = []
        BatchInputs(lambda line, warn=False: said.append(line), inputs="all").convert(batch, "train", model,
                                                                                    "channels_last")
        assert len(said) == 1 and f"converting 1 tensor(s) per batch to {named} on the device." in said[0], said
        assert ("collate" in said[0].lower()) == bool(hint) and hint in said[0], said
