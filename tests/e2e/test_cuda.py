"""The CUDA path, proven on a GPU: pinned copies, device normalisation, the side-stream prefetcher,
Lightning's use of it, train.py under each precision and layout, and the audit.

Every test here but the first is marked ``cuda`` and skipped without a CUDA device (conftest.py);
the first checks that the tests *not* marked ``cuda`` are pinned to the CPU (conftest's fixture).

    python -m pytest tests/test_cuda.py -q          # on a GPU machine
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from cltrain import is_channels_last, to_channels_last
from cltrain.data import make_demo_dataset
from cltrain.data.datamodules.image_folder import ImageFolderDataModule
from cltrain.data.normalize import normalize
from cltrain.data.prefetch import PrefetchDataLoader
from tests.helpers.data_fixtures import write_image_folder
from tests.helpers import TINY_DEMO as DEMO

REPO = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()


def test_tests_not_marked_cuda_are_pinned_to_the_cpu() -> None:
    # A CPU test that let Lightning or a train.py subprocess pick the GPU failed its CPU asserts on a GPU machine.
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == "" and os.environ.get("PL_TRAINER_ACCELERATOR") == "cpu"
    trainer = pl.Trainer(devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert trainer.strategy.root_device.type == "cpu"


# --- pinned batches, one pinned host-to-device copy per tensor -----------------------------------------------
def _prefetching_datamodule(root: Path, num_workers: int) -> ImageFolderDataModule:
    # cuda_prefetch is opt-in: without it the loader hands over host batches and Lightning copies them
    return ImageFolderDataModule(root, batch_size=4, num_workers=num_workers, persistent_workers=False,
                                 image_size=32, val_resize_size=36, cuda_prefetch=True)


def _fit_ready_datamodule(root: Path, num_workers: int) -> ImageFolderDataModule:
    dm = _prefetching_datamodule(root, num_workers)
    dm.trainer = pl.Trainer(accelerator="cuda", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False)
    dm.setup("fit")
    return dm


def test_the_pinned_copy_test_gets_the_side_stream_loader(tmp_path: Path) -> None:
    # On CUDA the test below takes the loader's batches as already on the GPU: only the prefetcher makes them so.
    dm = _prefetching_datamodule(write_image_folder(tmp_path / "data", classes=2, train=4, val=1), num_workers=0)
    dm.setup("fit")
    dm._device = torch.device("cuda", 0)  # as _choose_device sets it under a GPU trainer
    assert dm.train_dataloader().prefetch_device == torch.device("cuda", 0)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_are_pinned_and_copied_once_each_from_pinned_memory(tmp_path: Path, num_workers: int) -> None:
    root = write_image_folder(tmp_path / "data", classes=2, train=8, val=2)
    loader = _fit_ready_datamodule(root, num_workers).train_dataloader()
    assert isinstance(loader, PrefetchDataLoader)
    for images, targets in DataLoader.__iter__(loader):  # the host batches, before the prefetcher
        assert images.is_pinned() and targets.is_pinned() and is_channels_last(images)

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        batches = [(images, targets) for images, targets in loader]
        torch.cuda.synchronize()
    assert all(images.is_cuda and targets.is_cuda for images, targets in batches)
    copies = [e.name for e in prof.events() if "Memcpy HtoD" in e.name]
    assert len(copies) == 2 * len(batches), copies  # images and targets, once each
    assert all("Pinned" in name for name in copies), copies


# --- normalize on CUDA equals the CPU ------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format])
@pytest.mark.parametrize("shape", [(3, 3, 10, 12), (3, 1, 10, 12), (1, 3, 10, 12), (1, 1, 5, 7)])
def test_normalize_on_cuda_equals_the_cpu(dtype: torch.dtype, memory_format: torch.memory_format,
                                          shape: tuple[int, int, int, int]) -> None:
    n, c, h, w = shape
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (n, h, w, c), dtype=torch.uint8, generator=gen).permute(0, 3, 1, 2)  # NHWC view
    mean, std = ((0.5,), (0.25,)) if c == 1 else ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    on_cpu = normalize(batch, mean, std, dtype, memory_format=memory_format)
    on_gpu = normalize(batch.cuda(), mean, std, dtype, memory_format=memory_format)
    assert on_gpu.is_cuda and on_gpu.dtype == dtype and on_gpu.shape == batch.shape
    if memory_format is torch.channels_last:
        assert is_channels_last(on_gpu)
    else:
        assert on_gpu.is_contiguous()
    # fp32: FMA on the GPU may differ in the last bit; bf16/fp16: one rounding of the same fp32 value
    torch.testing.assert_close(on_gpu.cpu().float(), on_cpu.float(), rtol=0, atol={
        torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}[dtype])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("memory_format", [torch.channels_last_3d, torch.contiguous_format])
@pytest.mark.parametrize("shape", [(2, 3, 4, 6, 8), (2, 1, 4, 6, 8), (1, 3, 4, 6, 8)])
def test_normalize_clips_on_cuda_equals_the_cpu(dtype: torch.dtype, memory_format: torch.memory_format,
                                                shape: tuple[int, ...]) -> None:
    n, c, t, h, w = shape
    gen = torch.Generator().manual_seed(1)
    clips = torch.randint(0, 256, (n, t, h, w, c), dtype=torch.uint8, generator=gen).permute(0, 4, 1, 2, 3)  # NDHWC view
    mean, std = ((0.5,), (0.25,)) if c == 1 else ((0.43, 0.4, 0.37), (0.23, 0.22, 0.22))
    try:
        on_cpu = normalize(clips, mean, std, dtype, memory_format=memory_format)
    except (TypeError, ValueError) as err:  # a cltrain without 5-D normalize (issue 12)
        pytest.skip(f"normalize has no 5-D support here: {err}")
    on_gpu = normalize(clips.cuda(), mean, std, dtype, memory_format=memory_format)
    assert on_gpu.is_cuda and on_gpu.dtype == dtype and on_gpu.shape == clips.shape
    assert is_channels_last(on_gpu) if memory_format is torch.channels_last_3d else on_gpu.is_contiguous()
    torch.testing.assert_close(on_gpu.cpu().float(), on_cpu.float(), rtol=0, atol={
        torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}[dtype])


# --- the prefetcher under a slow compute stream, allocator churn and the sanitizer ----------------------------
class _Numbered(Dataset):
    """Sample i: a (3, 16, 16) image filled with i % 251 and the target i."""

    def __len__(self) -> int:
        return 200 * 4

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 16, 16), float(i % 251)), i


def _expected(n_batches: int, batch_size: int = 4) -> list[tuple[float, int]]:
    out = []
    for b in range(n_batches):
        idx = range(b * batch_size, (b + 1) * batch_size)
        out.append((float(sum(i % 251 for i in idx) * 3 * 16 * 16), sum(idx)))
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_prefetcher_values_hold_over_200_batches_with_a_slow_compute_stream_and_allocator_churn() -> None:
    loader = PrefetchDataLoader(_Numbered(), batch_size=4, shuffle=False, pin_memory=True, prefetch_device="cuda")
    reserved = []
    for epoch in range(4):
        sums = []
        for images, targets in loader:
            assert images.is_cuda and targets.is_cuda
            torch.cuda._sleep(1_000_000)  # the compute stream lags: the side stream runs ahead of it
            sums.append(torch.stack([images.double().sum(), targets.double().sum()]))
            # Churn: fresh blocks of the batch's size, freed at once, so a batch block released too early is reused.
            junk = [torch.full_like(images, -1.0) for _ in range(4)]
            del junk, images, targets
        got = torch.stack(sums).cpu().tolist()
        assert [(s, int(t)) for s, t in got] == _expected(200), f"epoch {epoch}"
        reserved.append(torch.cuda.memory_reserved())
    # One side stream per loader, not per epoch: a new stream's allocator pool each epoch grows (timm#2781).
    assert reserved[3] == reserved[1], reserved


_SANITIZED = textwrap.dedent("""
    import torch
    from torch.utils.data import Dataset
    from cltrain.data.prefetch import PrefetchDataLoader

    class Numbered(Dataset):
        def __len__(self): return 40 * 4
        def __getitem__(self, i): return torch.full((3, 16, 16), float(i % 251)), i

    loader = PrefetchDataLoader(Numbered(), batch_size=4, pin_memory=True, prefetch_device="cuda")
    total = torch.zeros((), device="cuda", dtype=torch.float64)
    for epoch in range(2):
        for images, targets in loader:
            torch.cuda._sleep(1_000_000)
            total += images.double().sum() + targets.double().sum()
            junk = torch.full_like(images, -1.0)
    print("total", total.item())
""")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_prefetcher_passes_the_cuda_sanitizer() -> None:
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-c", _SANITIZED], capture_output=True, text=True, timeout=300, env=env,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "CSAN" not in result.stderr and "data race" not in result.stderr.lower(), result.stderr[-4000:]
    per_epoch = sum(s + t for s, t in _expected(40))
    assert f"total {float(2 * per_epoch)}" in result.stdout


# --- Lightning routes the batches through the prefetcher -----------------------------------------------------
class _SeesBatches(pl.LightningModule):
    """A plain LightningModule (no cltrain) that notes where each batch is before Lightning's own transfer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
        self.before_transfer: list[tuple[str, str]] = []
        self.in_step: list[tuple[str, torch.dtype, bool]] = []

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.before_transfer.append((batch[0].device.type, batch[1].device.type))
        return batch

    def training_step(self, batch, batch_idx):
        images, targets = batch
        self.in_step.append((images.device.type, images.dtype, is_channels_last(images)))
        return nn.functional.cross_entropy(self.net(images), targets)

    def validation_step(self, batch, batch_idx):
        self.in_step.append((batch[0].device.type, batch[0].dtype, is_channels_last(batch[0])))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("cuda_prefetch", [True, False])
def test_lightning_gets_batches_already_on_the_gpu_from_the_prefetcher(tmp_path: Path, cuda_prefetch: bool) -> None:
    root = write_image_folder(tmp_path / "data", classes=2, train=4, val=2)  # 8 + 4 images: 2 + 1 batches of 4
    dm = ImageFolderDataModule(root, batch_size=4, num_workers=0, image_size=32, val_resize_size=36,
                               cuda_prefetch=cuda_prefetch)
    module = to_channels_last(_SeesBatches())
    pl.Trainer(accelerator="cuda", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
               default_root_dir=tmp_path).fit(module, datamodule=dm)
    where = "cuda" if cuda_prefetch else "cpu"
    assert len(module.before_transfer) == 2 + 1
    assert all(seen == (where, where) for seen in module.before_transfer), module.before_transfer
    assert all(seen == ("cuda", torch.float32, True) for seen in module.in_step), module.in_step


# --- train.py on CUDA: every precision, both layouts, compile, conv mode ------------------------------------
@pytest.fixture(scope="module")
def demo_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    root = tmp_path_factory.mktemp("data") / "demo"
    make_demo_dataset(root, **DEMO)
    return [f"data.root={root}", *(f"data.demo.{k}={v}".replace(" ", "") for k, v in DEMO.items())]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("overrides,precision", [
    (["amp=fp16"], "16-mixed"),
    (["amp=bf16"], "bf16-mixed"),
    (["amp=false"], "32-true"),
    (["channels_last=false", "amp=fp16"], "16-mixed"),
    (["channels_last=false", "amp=false"], "32-true"),
    (["channels_last_mode=conv"], "amp-auto"),
    ([], "amp-auto"),
    pytest.param(["compile.enabled=true"], "amp-auto", marks=pytest.mark.slow),
], ids=["fp16", "bf16", "fp32", "nchw-fp16", "nchw-fp32", "conv", "default", "compile"])
def test_train_py_runs_on_cuda(demo_args: list[str], tmp_path: Path, overrides: list[str], precision: str) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "experiment=smoke", *demo_args, "device=cuda",
         "trainer.enable_progress_bar=false", *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=540, cwd=REPO, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    if precision == "amp-auto":  # bf16 on compute capability 8.0+, fp16 with loss scaling before
        from cltrain.precision import auto_precision

        precision = auto_precision(torch.device("cuda")).flag
    assert (metrics["device"], metrics["precision"]) == ("cuda", precision)
    assert metrics["global_step"] > 0 and metrics["images_per_second"] > 0
    assert metrics["val_top1"] is not None and 0 <= metrics["val_top1"] <= 100
    channels_last = "channels_last=false" not in overrides
    assert metrics["config"]["channels_last"] is channels_last
    state = torch.load(metrics["last_checkpoint"], map_location="cpu", weights_only=True)["state_dict"]
    weight = state["model.layer1.0.conv1.weight"]
    assert is_channels_last(weight) if channels_last else weight.is_contiguous()
    if "channels_last_mode=conv" in overrides:
        log = run_dir / "train.log"
        text = result.stdout + result.stderr + (log.read_text() if log.is_file() else "")
        assert "ChannelsLast(mode='conv')" in text


# --- the audit on CUDA ---------------------------------------------------------------------------------------
class _LosesLayout(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous() * 2


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_audit_finds_a_planted_layout_loss_on_a_cuda_model(dtype: torch.dtype | None) -> None:
    from cltrain.audit import audit_model

    body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
    body.add_module("planted", _LosesLayout())
    model = to_channels_last(nn.Sequential(nn.Conv2d(3, 3, 1), body, nn.Conv2d(8, 4, 3)).cuda())
    report = audit_model(model, torch.randn(2, 3, 16, 16, device="cuda"), autocast_dtype=dtype)
    assert ("aten.clone", "1.planted", "forward", "copy") in [(r.op, r.module_path, r.phase, r.kind) for r in report.rows]
    assert {r.module_path for r in report.rows} == {"1.planted"}, str(report)
    assert all(p.is_cuda and is_channels_last(p) for p in model.parameters() if p.dim() == 4)  # left as it was


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_audit_command_line_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from cltrain.audit import AuditReport
    from cltrain.tools.audit import audit

    report = audit(["resnet18", "--batch-size", "2", "--image-size", "64", "--dtype", "fp16", "--device", "cuda"])
    out = capsys.readouterr().out
    assert "device=cuda" in out and "Layout audit of ResNet" in out and isinstance(report, AuditReport)


class _LossesOf(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().float())


class _Noise(Dataset):
    def __len__(self) -> int:
        return 30 * 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, 64, 64, generator=g), i % 10


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_thirty_fp16_steps_of_resnet50_with_momentum_stay_finite() -> None:
    """A raw fused SGD under loss scaling trains to NaN within a few steps; the app's fused SGD starts its
    momentum buffers at zero and stays finite."""
    import torchvision

    from cltrain import ChannelsLast
    from cltrain.app.module import ImageClassifier

    torch.manual_seed(0)
    module = ImageClassifier(torchvision.models.resnet50(num_classes=10), 10, lr=0.1, momentum=0.9, warmup_epochs=0)
    losses = _LossesOf()
    trainer = pl.Trainer(accelerator="cuda", devices=1, precision="16-mixed", max_steps=30, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=[ChannelsLast(), losses])
    trainer.fit(module, DataLoader(_Noise(), batch_size=32, shuffle=True))
    assert trainer.global_step == 30 and len(losses.losses) == 30
    assert bool(torch.isfinite(torch.stack(losses.losses)).all()), torch.stack(losses.losses).tolist()
    assert trainer.optimizers[0].defaults["fused"] and not module.optimizer_note
