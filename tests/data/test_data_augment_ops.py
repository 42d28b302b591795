"""Augmentations on the NHWC path: HWC policies in the workers, erasing and mixup/cutmix on the
channels_last batch (layout kept, no layout copies, timm's semantics)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from cltrain.audit import _Recorder
from cltrain.data import train_transform
from cltrain.data.augment_ops import HWCAugment, MixupCutmix, RandomErasing
from tests.helpers.data_fixtures import write_jpegs

pytest.importorskip("timm")


def _hwc(seed=0, shape=(40, 48, 3)):
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _batch(n=8, c=3, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, size, size, generator=g).to(memory_format=torch.channels_last)


@pytest.mark.parametrize("policy", ["trivialaugment", "randaugment"])
@pytest.mark.parametrize("channels", [3, 1])
def test_hwc_policy_equals_torchvision_on_a_contiguous_chw_copy(policy, channels):
    aug = HWCAugment(policy)
    changed = 0
    for seed in range(25):
        img = _hwc(seed, (40, 48, channels))
        torch.manual_seed(seed)
        out = aug(img)
        torch.manual_seed(seed)
        ref = aug.op(torch.from_numpy(img).permute(2, 0, 1).contiguous()).permute(1, 2, 0).numpy()
        assert out.shape == img.shape and out.dtype == np.uint8 and out.flags["C_CONTIGUOUS"]
        np.testing.assert_array_equal(out, ref)
        changed += not np.array_equal(out, img)
    assert changed >= 15  # the policy really acts


def test_train_transform_runs_the_policy_after_the_crop(tmp_path):
    path = write_jpegs(tmp_path, 1, size=(96, 72))[0]
    plain = train_transform(32, hflip=0.0)
    augmented = train_transform(32, hflip=0.0, augment="trivialaugment")
    outs = []
    for seed in range(6):
        torch.manual_seed(seed)
        a = plain(path)
        torch.manual_seed(seed)
        outs.append(not np.array_equal(a, augmented(path)))
        assert augmented(path).shape == (32, 32, 3)
    assert sum(outs) >= 3
    with pytest.raises(ValueError, match="policy='autoaugment'"):
        train_transform(32, augment="autoaugment")


def _no_layout_loss(fn, *args):
    with _Recorder(lambda: ("augment", "forward")) as rec:
        out = fn(*args)
    assert not rec.lost, list(rec.lost.values())
    assert not rec.copies, list(rec.copies.values())
    return out


def test_random_erasing_keeps_channels_last_in_place_per_image():
    x = _batch(64)
    before, ptr = x.clone(), x.data_ptr()
    import random
    random.seed(0)
    out = _no_layout_loss(RandomErasing(0.5, mode="pixel"), x)
    assert out.data_ptr() == ptr and out.is_contiguous(memory_format=torch.channels_last)
    erased = (out != before).flatten(1).any(1)
    assert 16 < int(erased.sum()) < 48  # about half the images, each decided on its own
    fractions = (out != before).all(1).flatten(1).float().mean(1)[erased]
    assert float(fractions.min()) >= 0.015 and float(fractions.max()) <= 1 / 3 + 0.02  # timm's area range
    x = _batch(4)
    assert torch.equal(RandomErasing(0.0)(x.clone()), x)
    with pytest.raises(ValueError, match="mode='noise'"):
        RandomErasing(0.5, mode="noise")


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_mixup_cutmix_semantics_and_layout(kind):
    n, classes = 8, 10
    x = _batch(n, size=32)
    orig = x.clone()
    targets = torch.arange(n) % classes
    mix = MixupCutmix(classes, mixup_alpha=1.0 if kind == "mixup" else 0.0, cutmix_alpha=1.0 if kind == "cutmix" else 0.0)
    np.random.seed(3)
    out, soft = _no_layout_loss(mix, x, targets)
    assert out.is_contiguous(memory_format=torch.channels_last) and out.data_ptr() == x.data_ptr()
    assert soft.shape == (n, classes) and torch.allclose(soft.sum(1), torch.ones(n))
    lam = float(soft[0, targets[0]])  # timm pairs image i with image n-1-i, weight lam on its own label
    assert torch.allclose(soft[0, targets[n - 1]], torch.tensor(1 - lam))
    if kind == "mixup":
        torch.testing.assert_close(out, lam * orig + (1 - lam) * orig.flip(0))
    else:  # pixels come from the image itself or its partner; lam is the share of its own pixels
        own = (out == orig).all(1).float().mean((1, 2))
        partner = (out == orig.flip(0)).all(1)
        assert torch.all((out == orig).all(1) | partner)
        assert abs(float(own[0]) - lam) < 1e-6


def test_mixed_targets_into_loss_and_accuracy():
    """What the module does with them: CrossEntropyLoss takes probabilities; accuracy uses the dominant label."""
    logits = torch.randn(4, 5)
    hard = torch.tensor([0, 1, 2, 3])
    soft = torch.nn.functional.one_hot(hard, 5).float()
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)
    torch.testing.assert_close(ce(logits, soft), ce(logits, hard))  # same loss for one-hot probabilities
    mixed = 0.7 * soft + 0.3 * soft.flip(0)
    assert torch.equal(mixed.argmax(1), hard)


def test_odd_batch_mixes_all_but_the_last_image():
    torch.manual_seed(0)
    batch = _batch(5)
    orig = batch.clone()
    targets = torch.tensor([0, 1, 2, 3, 4])
    out, soft = MixupCutmix(10, mixup_alpha=1.0, cutmix_alpha=0.0)(batch, targets)
    assert out.data_ptr() == batch.data_ptr() and out.is_contiguous(memory_format=torch.channels_last)
    assert soft.shape == (5, 10)
    torch.testing.assert_close(soft.sum(1), torch.ones(5))
    assert torch.equal(out[4], orig[4]) and torch.equal(soft[4], torch.nn.functional.one_hot(targets[4], 10).float())
    assert not torch.equal(out[:4], orig[:4])  # the first four were mixed (pairs 0-3, 1-2)
    lam = float(soft[0, 0])
    torch.testing.assert_close(out[:4], lam * orig[:4] + (1 - lam) * orig[:4].flip(0))


def test_mixing_needs_an_alpha():
    with pytest.raises(ValueError, match="at least one"):
        MixupCutmix(10, mixup_alpha=0.0, cutmix_alpha=0.0)


class _Recording(__import__("lightning").LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
        self.seen = []

    def training_step(self, batch, batch_idx):
        images, targets = batch
        self.seen.append((images.is_contiguous(memory_format=torch.channels_last), images.dtype, targets.shape))
        return nn.functional.cross_entropy(self.net(images), targets)

    def validation_step(self, batch, batch_idx):
        self.seen.append(("val", batch[1].shape))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_datamodule_augments_training_batches_only(tmp_path):
    import lightning as L

    from cltrain.data import ImageFolderDataModule
    from tests.helpers.data_fixtures import write_image_folder

    root = write_image_folder(tmp_path / "data", classes=2, train=4, val=2, size=(64, 48))
    dm = ImageFolderDataModule(root, batch_size=4, num_workers=0, image_size=32, val_resize_size=36,
                               augment="randaugment", random_erasing=0.5, mixup_alpha=0.8, cutmix_alpha=1.0,
                               scale=(0.5, 1.0), ratio=(0.8, 1.25), interpolation="bicubic")
    assert dm.train_transform.scale == (0.5, 1.0) and dm.train_transform.interpolation == "bicubic"
    model = _Recording()
    L.Trainer(max_steps=2, limit_val_batches=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path).fit(model, dm)
    train = [s for s in model.seen if s[0] != "val"]
    assert train and all(s == (True, torch.float32, torch.Size([4, 2])) for s in train)  # soft targets, NHWC
    assert ("val", torch.Size([4])) in model.seen  # validation keeps its labels
    with pytest.raises(ValueError, match="random_erasing=1.5"):
        ImageFolderDataModule(root, random_erasing=1.5)
    with pytest.raises(ValueError, match="policy='auto'"):
        ImageFolderDataModule(root, augment="auto")
