"""The cases of ``python -m scripts.zoo.projects``: third-party Lightning libraries' own tasks, built tiny in the
case's child process (the libraries imported inside the builders only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

SIZE = 64  # pixels: small enough for a 2-core CPU, large enough for a resnet18's last stage


@dataclass(frozen=True)
class Case:
    """One library task: run twice by the sweep, with and without ``ChannelsLast()``.

    Attributes:
        key: ``library:task``, the row's name and ``--only``'s argument.
        library: the distribution to import and report the version of (``None``: nothing beyond torch).
        task: what runs, in a few words.
        build: ``"module:function"``; the function takes ``(tmp: Path)`` and returns a ``Built``.
    """

    key: str
    library: str | None
    task: str
    build: str


@dataclass
class Built:
    """What a builder returns: the module, its data (a datamodule or loaders), ``Trainer`` overrides and the
    Lightning package whose ``Trainer`` fits the module (``pytorch_lightning`` for a library built on it)."""

    module: Any
    datamodule: Any = None
    train_dataloaders: Any = None
    val_dataloaders: Any = None
    trainer: dict[str, Any] = field(default_factory=dict)
    package: str = "lightning.pytorch"


def smooth_images(n: int, seed: int, size: int = SIZE, channels: int = 3) -> np.ndarray:
    """``n`` uint8 HWC images of smooth random structure (bilinearly upsampled 8x8 noise), reproducible."""
    low = torch.from_numpy(np.random.default_rng(seed).random((n, channels, 8, 8), dtype=np.float32))
    up = torch.nn.functional.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)
    return (up * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


# ---- anomalib: its models with its Folder datamodule over generated PNGs ---------------------------------


def _anomalib_folder(tmp: Path):
    from anomalib.data import Folder
    from PIL import Image

    root = tmp / "anomalib"
    for sub, images in (("good", smooth_images(10, seed=1)), ("bad", smooth_images(4, seed=2))):
        (root / sub).mkdir(parents=True, exist_ok=True)
        for i, img in enumerate(images):
            if sub == "bad":
                img = img.copy()
                img[20:36, 20:36] = 255  # the anomaly: a white square
            Image.fromarray(img).save(root / sub / f"{i}.png")
    # 10 normal images: 8 train (2 steps of 4), 2 go to the test split with the 4 anomalous ones (half to val)
    return Folder(name="generated", root=root, normal_dir="good", abnormal_dir="bad", train_batch_size=4,
                  eval_batch_size=4, num_workers=0, seed=0)


def _anomalib(model: str, tmp: Path) -> Built:
    import anomalib.models

    model_class = getattr(anomalib.models, model)
    module = model_class(backbone="resnet18", pre_trained=False, visualizer=False,
                         pre_processor=model_class.configure_pre_processor((SIZE, SIZE)))
    # anomalib's own trainer_arguments (one epoch: memory-bank models fit at its end, then validate)
    overrides = {k: v for k, v in module.trainer_arguments.items() if k in ("gradient_clip_val", "max_epochs")}
    return Built(module, datamodule=_anomalib_folder(tmp), trainer={"max_epochs": 1, **overrides})


anomalib_padim = partial(_anomalib, "Padim")
anomalib_patchcore = partial(_anomalib, "Patchcore")
anomalib_reverse_distillation = partial(_anomalib, "ReverseDistillation")


# ---- lightly: SimCLR as in its examples/pytorch_lightning/simclr.py; MoCo as in its CIFAR-10 benchmark --------


class _PILImages(Dataset):
    """Generated PIL images with labels, as torchvision's CIFAR10 gives them to lightly's examples."""

    def __init__(self, n: int, seed: int) -> None:
        self.images, self.labels = smooth_images(n, seed), [i % 2 for i in range(n)]
        self.transform = None  # lightly's LightlyDataset.from_torch_dataset sets it

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        from PIL import Image

        image = Image.fromarray(self.images[index])
        return (self.transform(image) if self.transform else image), self.labels[index]


def _lightly_data(transform: Any, n: int, seed: int):
    from lightly.data import LightlyDataset

    return LightlyDataset.from_torch_dataset(_PILImages(n, seed), transform=transform)


def lightly_simclr(tmp: Path) -> Built:
    import torchvision
    from lightly.loss import NTXentLoss
    from lightly.models.modules import SimCLRProjectionHead
    from lightly.transforms import SimCLRTransform
    from lightning.pytorch import LightningModule

    class SimCLR(LightningModule):  # lightly's examples/pytorch_lightning/simclr.py
        def __init__(self):
            super().__init__()
            resnet = torchvision.models.resnet18(weights=None)
            self.backbone = nn.Sequential(*list(resnet.children())[:-1])
            self.projection_head = SimCLRProjectionHead(512, 2048, 2048)
            self.criterion = NTXentLoss()

        def forward(self, x):
            x = self.backbone(x).flatten(start_dim=1)
            return self.projection_head(x)

        def training_step(self, batch, batch_index):
            (x0, x1) = batch[0]
            return self.criterion(self.forward(x0), self.forward(x1))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.06)

    data = _lightly_data(SimCLRTransform(input_size=SIZE, gaussian_blur=0.0), 16, seed=3)
    return Built(SimCLR(), train_dataloaders=DataLoader(data, batch_size=8, shuffle=True, drop_last=True))


def lightly_moco(tmp: Path) -> Built:
    import copy

    from lightly.loss import NTXentLoss
    from lightly.models import ResNetGenerator
    from lightly.models.modules import MoCoProjectionHead
    from lightly.models.utils import deactivate_requires_grad, update_momentum
    from lightly.transforms import MoCoV2Transform
    from lightly.transforms.utils import IMAGENET_NORMALIZE
    from lightly.utils.benchmarking import BenchmarkModule
    from torchvision import transforms as T

    plain = T.Compose([T.ToTensor(), T.Normalize(IMAGENET_NORMALIZE["mean"], IMAGENET_NORMALIZE["std"])])
    bank = DataLoader(_lightly_data(plain, 8, seed=5), batch_size=8)  # the kNN feature bank's images

    # lightly's benchmarks/cifar10_benchmark.py MocoModel (SplitBatchNorm simulates 4 GPUs) on lightly's own
    # BenchmarkModule, a pytorch_lightning module: fitted by pytorch_lightning's Trainer
    class MocoModel(BenchmarkModule):
        def __init__(self):
            super().__init__(bank, num_classes=2, knn_k=4)
            resnet = ResNetGenerator("resnet-18", 1, num_splits=4)
            self.backbone = nn.Sequential(*list(resnet.children())[:-1], nn.AdaptiveAvgPool2d(1))
            self.projection_head = MoCoProjectionHead(512, 512, 128)
            self.backbone_momentum = copy.deepcopy(self.backbone)
            self.projection_head_momentum = copy.deepcopy(self.projection_head)
            deactivate_requires_grad(self.backbone_momentum)
            deactivate_requires_grad(self.projection_head_momentum)
            self.criterion = NTXentLoss(temperature=0.1, memory_bank_size=(256, 128))

        def training_step(self, batch, batch_idx):
            (x0, x1), _, _ = batch
            update_momentum(self.backbone, self.backbone_momentum, 0.99)
            update_momentum(self.projection_head, self.projection_head_momentum, 0.99)
            query = self.projection_head(self.backbone(x0).flatten(start_dim=1))
            key = self.projection_head_momentum(self.backbone_momentum(x1).flatten(start_dim=1)).detach()
            return self.criterion(query, key)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.06, momentum=0.9, weight_decay=5e-4)

    train = _lightly_data(MoCoV2Transform(input_size=SIZE, gaussian_blur=0.0), 16, seed=4)
    test = DataLoader(_lightly_data(plain, 8, seed=6), batch_size=8)
    return Built(MocoModel(),
                 train_dataloaders=DataLoader(train, batch_size=8, shuffle=True, drop_last=True),
                 val_dataloaders=test, trainer={"max_epochs": 1}, package="pytorch_lightning")


# ---- torchgeo: its tasks with a NonGeoDataModule over a generated NonGeoDataset ---------------------------


def _torchgeo_datamodule(kind: str):
    from torchgeo.datamodules import NonGeoDataModule
    from torchgeo.datasets import NonGeoDataset

    class Generated(NonGeoDataset):
        """Images as torchgeo's datasets give them (float, 0-255) with a label, a mask, or a pair and a change mask."""

        def __init__(self, split: str = "train") -> None:
            n, seed = (16, 7) if split == "train" else (8, 8)
            frames = 2 if kind == "change" else 1
            images = torch.from_numpy(smooth_images(n * frames, seed)).permute(0, 3, 1, 2).float()
            self.images = images.reshape(n, frames, 3, SIZE, SIZE) if frames == 2 else images

        def __len__(self) -> int:
            return len(self.images)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            image = self.images[index]
            if kind == "classification":
                return {"image": image, "label": torch.tensor(index % 2)}
            if kind == "segmentation":
                return {"image": image, "mask": (image[0] > 127).long()}
            return {"image": image, "mask": ((image[1, 0] - image[0, 0]).abs() > 64).long()[None]}

    class GeneratedDataModule(NonGeoDataModule):
        def __init__(self) -> None:
            super().__init__(Generated, batch_size=8, num_workers=0)
            if kind == "change":  # OSCDDataModule's VideoSequential aug rejects its 1-frame mask (kornia 0.9)
                self.aug = lambda batch: {**batch, "image": batch["image"] / 255}

    return GeneratedDataModule()


def _torchgeo(trainer_task: str, kind: str, tmp: Path, **kwargs: Any) -> Built:
    import torchgeo.trainers

    task = getattr(torchgeo.trainers, trainer_task)(weights=None, in_channels=3, **kwargs)
    return Built(task, datamodule=_torchgeo_datamodule(kind))


torchgeo_classification = partial(_torchgeo, "ClassificationTask", "classification", model="resnet18", num_classes=2)
torchgeo_segmentation = partial(_torchgeo, "SemanticSegmentationTask", "segmentation", model="unet",
                                backbone="resnet18", num_classes=2)
torchgeo_change = partial(_torchgeo, "ChangeDetectionTask", "change", model="unet", backbone="resnet18", task="binary")


def _case(key: str, task: str) -> Case:
    """A case of this module: its library is the key's first part, its builder the key with ``_`` for ``:``."""
    return Case(key, key.split(":")[0], task, f"{__name__}:{key.replace(':', '_')}")


CASES = [
    _case("anomalib:reverse_distillation", "ReverseDistillation, resnet18 encoder, Folder datamodule"),
    _case("anomalib:padim", "Padim, resnet18, Folder datamodule"),
    _case("anomalib:patchcore", "Patchcore, resnet18, Folder datamodule"),
    _case("lightly:simclr", "SimCLR (examples/pytorch_lightning), torchvision resnet18"),
    _case("lightly:moco", "MoCo (benchmarks' MocoModel on lightly's BenchmarkModule, pytorch_lightning's Trainer), "
          "ResNetGenerator with SplitBatchNorm"),
    _case("torchgeo:classification", "ClassificationTask, timm resnet18"),
    _case("torchgeo:segmentation", "SemanticSegmentationTask, smp U-Net resnet18"),
    _case("torchgeo:change", "ChangeDetectionTask, U-Net resnet18 on image pairs"),
]

#: What the page says about the cases beside the table.
NOTES = [
    "lightly's own LightningModules (`lightly.utils.benchmarking.BenchmarkModule`, ...) subclass "
    "`pytorch_lightning.LightningModule`: the MoCo case is lightly's MocoModel on that base class, fitted by "
    "`pytorch_lightning.Trainer` with the same `ChannelsLast()`.",
    "torchgeo 0.8.1 imports `requests` (`torchgeo.datasets.openstreetmap`), declared only in its `[datasets]` extra; "
    "the `projects` extra adds it. The augmentation of its OSCDDataModule (kornia `VideoSequential`), copied here, "
    "rejected the one-frame change mask beside the two-frame image (kornia 0.9): the generated datamodule scales the "
    "images itself.",
    "anomalib's Padim and Patchcore train no weights (their loss is a constant 0): the metrics column compares their "
    "validation outputs (anomaly maps and scores) after the memory bank is fitted.",
]
