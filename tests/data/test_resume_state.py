"""A stopped run continues exactly: cltrain's DataModules carry where the epoch stopped in the checkpoint
(Lightning's stateful-loader protocol), so a run resumed from any step's checkpoint ends bit for bit where the
uninterrupted run ends: the same samples in the same order with the same augmentation, and the torch RNG."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F

from cltrain import ChannelsLast

# Two fresh runs are equal bit for bit only in one layout (the race of the layouts decides from timings): pinned.
LAYOUT = "channels_last"
from cltrain.data import ImageFolderDataModule, make_demo_dataset
from cltrain.data.resume_state import ResumableSampler, SeededIndex
from tests.helpers import warm

STEPS_PER_EPOCH = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_dataset(tmp_path_factory.mktemp("data") / "demo", num_classes=2, train_per_class=6,
                             val_per_class=1, image_size=(40, 32))


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cltrain.data.video.demo import make_demo_videos

    return make_demo_videos(tmp_path_factory.mktemp("clips") / "demo", num_classes=2, train_per_class=6,
                            val_per_class=1, num_frames=6, frame_size=32)


class Net(pl.LightningModule):
    def __init__(self, video: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        conv, norm, pool = (nn.Conv3d, nn.BatchNorm3d, nn.AdaptiveAvgPool3d) if video else \
            (nn.Conv2d, nn.BatchNorm2d, nn.AdaptiveAvgPool2d)
        self.net = nn.Sequential(conv(3, 8, 3, padding=1), norm(8), nn.ReLU(), nn.Dropout(0.3), pool(1),
                                 nn.Flatten(), nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _run(folder: Path, root: Path, workers: int, ckpt_path: str | None = None, epochs: int = 2, every: int = 0,
         video: bool = False, shards: bool = False, hf: bool = False, lit: bool = False, mds: bool = False,
         val: bool = False, callbacks: tuple = (), limit_train_batches: int | float = 1.0, max_steps: int = -1,
         accumulate: int = 1, **data_options):
    pl.seed_everything(7, verbose=False)
    options = dict(batch_size=4, num_workers=workers, image_size=24, val_resize_size=28, persistent_workers=False)
    options.update(data_options)
    if shards or hf or lit or mds:
        from cltrain.data import HFImageDataModule, ShardsDataModule
        from cltrain.data.datamodules.engines import LitDataModule, MDSModule

        kind = ShardsDataModule if shards else HFImageDataModule if hf else LitDataModule if lit else MDSModule
        module, data = Net(), kind(folder, **options)
    elif video:
        from cltrain.data.video import ClipFolderDataModule

        module, data = Net(video=True), ClipFolderDataModule(folder, num_frames=3, frame_stride=1, **options)
    else:
        module, data = Net(), ImageFolderDataModule(folder, **options)
    saves = [ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, filename="{step}")] if every else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=1.0 if val else 0, num_sanity_val_steps=0,
                             limit_train_batches=limit_train_batches, max_steps=max_steps,
                             accumulate_grad_batches=accumulate,
                             enable_checkpointing=bool(every or callbacks),
                             callbacks=[ChannelsLast(layout=LAYOUT), *saves, *callbacks],
                             default_root_dir=root)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, trainer, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def whole0(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[torch.Tensor], Path]:
    """The uninterrupted run with no workers: its final state, and the folder of its checkpoint after every step."""
    root = tmp_path_factory.mktemp("whole0")
    module, _, _ = _run(folder, root, 0, every=1)
    return _state(module), root


def _state(module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in module.state_dict().values()]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_resumed_from_any_steps_checkpoint_ends_where_the_uninterrupted_run_ends(folder, tmp_path, workers):
    whole, trainer, _ = _run(folder, tmp_path / "whole", workers, every=1)
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    for step in (1, 2, 3, 4):  # mid epoch 0, the end of epoch 0, mid epoch 1
        resumed, again, said = _run(folder, tmp_path / f"from{step}", workers,
                                    ckpt_path=str(tmp_path / "whole" / f"step={step}.ckpt"))
        assert again.global_step == 2 * STEPS_PER_EPOCH
        assert all(torch.equal(a, b) for a, b in zip(_state(whole), _state(resumed))), f"from step {step}"
        assert not [m for m in said if "not resumable" in m]
        assert "verdict of the checkpoint" in again.callbacks[0].layout_checks["train"].line()


def test_a_clip_run_resumed_mid_epoch_ends_where_the_uninterrupted_run_ends(clips, tmp_path):
    # clips draw their segment and crop from the torch RNG: under the sample's own seed in any worker
    whole, _, _ = _run(clips, tmp_path / "whole", 2, every=1, video=True)
    resumed, _, _ = _run(clips, tmp_path / "from4", 2, ckpt_path=str(tmp_path / "whole" / "step=4.ckpt"), video=True)
    assert all(torch.equal(a, b) for a, b in zip(_state(whole), _state(resumed)))


def test_a_shards_run_resumed_mid_epoch_ends_where_the_uninterrupted_run_ends(folder, tmp_path):
    from cltrain.data.pack import pack

    packed = tmp_path / "pack"
    pack(folder, packed, shard_size=5, progress=False)
    whole, _, _ = _run(packed, tmp_path / "whole", 2, every=1, shards=True)
    resumed, _, said = _run(packed, tmp_path / "from4", 2, ckpt_path=str(tmp_path / "whole" / "step=4.ckpt"),
                            shards=True)
    assert all(torch.equal(a, b) for a, b in zip(_state(whole), _state(resumed)))
    assert not [m for m in said if "not resumable" in m]


def test_a_hugging_face_run_resumed_mid_epoch_ends_where_the_uninterrupted_run_ends(tmp_path):
    pytest.importorskip("datasets")
    from tests.helpers.hf_data import image_rows, write_hf_dataset

    saved = write_hf_dataset(tmp_path / "hf", {"train": image_rows(12, 2), "validation": image_rows(2, 2, seed=1)},
                             ["cat", "dog"], parquet_files=1)["saved"]
    whole, _, _ = _run(saved, tmp_path / "whole", 2, every=1, hf=True)
    resumed, _, _ = _run(saved, tmp_path / "from4", 2, ckpt_path=str(tmp_path / "whole" / "step=4.ckpt"), hf=True)
    assert all(torch.equal(a, b) for a, b in zip(_state(whole), _state(resumed)))


@pytest.mark.parametrize("workers,shuffle_buffer,odd", [(0, None, {3: b"<html>"}), (2, 5, {})],
                         ids=["0 workers, a bad row", "2 workers, shuffled"])
def test_a_streamed_hugging_face_run_resumed_mid_epoch_ends_where_the_uninterrupted_run_ends(tmp_path, workers,
                                                                                            shuffle_buffer, odd):
    pytest.importorskip("datasets")
    from tests.helpers.hf_data import image_rows, write_hf_dataset

    # 15 rows: two workers get 8 and 7 (batches from worker 0, 1, 0); one worker, the bad row 3: row 4 stands in for
    # it, the stop after the first batch leaves that copy owed
    rows = image_rows(15, 2, odd=odd)
    saved = write_hf_dataset(tmp_path / "hf", {"train": rows, "validation": image_rows(2, 2, seed=1)},
                             ["cat", "dog"], parquet_files=1)["saved"]
    stream = dict(hf=True, streaming=True, shuffle_buffer=shuffle_buffer, bad_files="skip")
    whole, trainer, _ = _run(saved, tmp_path / "whole", workers, every=1, **stream)
    steps = trainer.global_step
    assert steps == 6
    for step in (1, 2, 3, 5):  # mid epoch 0, after worker 1's last batch, the epoch's end, mid epoch 1
        resumed, again, said = _run(saved, tmp_path / f"from{step}", workers,
                                    ckpt_path=str(tmp_path / "whole" / f"step={step}.ckpt"), **stream)
        assert again.global_step == steps, f"from step {step}"
        assert all(torch.equal(a, b) for a, b in zip(_state(whole), _state(resumed))), f"from step {step}"
        assert not [m for m in said if "resumable" in m or "read again" in m or "does not fit" in m], said
    # another number of workers reads the stopped epoch's parts: one line (each row once: the loader-level test)
    _, again, said = _run(saved, tmp_path / "other", 2 - workers, ckpt_path=str(tmp_path / "whole" / "step=1.ckpt"),
                          **stream)
    lines = [m for m in said if "are read once each" in m]
    assert len(lines) == 1 and f"with {2 - workers} worker(s) on 1 rank(s) from {workers} on 1" in lines[0], said
    assert again.current_epoch == 2 and not [m for m in said if "does not fit" in m]


def test_an_epoch_ended_by_limit_train_batches_resumes_with_the_next_epoch(folder, tmp_path):
    # Lightning ends each epoch after 2 of the loader's 3 batches: a checkpoint at an epoch's end goes on with the
    # next epoch's order, not with the batch the limit left
    whole, trainer, _ = _run(folder, tmp_path / "whole", 0, epochs=3, every=1, limit_train_batches=2)
    assert trainer.global_step == 6
    for step in (1, 2, 4):
        resumed, again, _ = _run(folder, tmp_path / f"from{step}", 0, epochs=3, limit_train_batches=2,
                                 ckpt_path=str(tmp_path / "whole" / f"step={step}.ckpt"))
        assert again.global_step == 6
        assert all(torch.equal(a, b) for a, b in zip(_state(whole), _state(resumed))), f"from step {step}"


def test_a_fit_resumed_with_another_batch_size_trains_on_what_its_epoch_has_left(folder, whole0, tmp_path):
    # 4 of epoch 0's 12 samples were trained on: the 8 left, in batches of 2, then epoch 1's 6 (with one line)
    _, again, said = _run(folder, tmp_path / "from1", 0, ckpt_path=str(whole0[1] / "step=1.ckpt"), batch_size=2)
    assert again.global_step == 1 + 8 // 2 + 12 // 2
    assert [m for m in said if "split over" in m] and not [m for m in said if "no place" in m or "fit" in m], said


def test_resumed_with_another_worker_count_the_epoch_reads_each_remaining_sample_once_with_its_crop(folder, whole0,
                                                                                                   tmp_path):
    resumed, _, _ = _run(folder, tmp_path / "from2", 2, ckpt_path=str(whole0[1] / "step=2.ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(whole0[0], _state(resumed)))  # per-sample seeds: exact too


def test_without_the_loaders_state_the_resumed_run_ends_elsewhere_and_says_so(folder, whole0, tmp_path):
    # the negative control: the same checkpoint with its loader state taken out
    ckpt = torch.load(whole0[1] / "step=2.ckpt", weights_only=False)
    ckpt["loops"]["fit_loop"]["state_dict"].pop("combined_loader")
    ckpt.pop("ImageFolderDataModule")  # the DataModule's copy of it
    torch.save(ckpt, tmp_path / "stripped.ckpt")
    resumed, _, said = _run(folder, tmp_path / "stripped", 0, ckpt_path=str(tmp_path / "stripped.ckpt"))
    assert not all(torch.equal(a, b) for a, b in zip(whole0[0], _state(resumed)))
    # as a checkpoint written before the loader kept its place: it still resumes, and says what it cannot restore
    lines = [m for m in said if "holds no place in epoch 0" in m]
    assert len(lines) == 1 and "read again from its first batch, after 2 batches" in lines[0], said


def test_a_saved_state_that_no_longer_fits_the_data_is_one_line_and_the_epoch_starts_again(folder, whole0,
                                                                                            tmp_path):
    ckpt = torch.load(whole0[1] / "step=2.ckpt", weights_only=False)
    ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["samples"] = 99
    ckpt["ImageFolderDataModule"]["train_loader"]["samples"] = 99
    torch.save(ckpt, tmp_path / "other.ckpt")
    _, trainer, said = _run(folder, tmp_path / "other", 0, ckpt_path=str(tmp_path / "other.ckpt"))
    lines = [m for m in said if "loader state does not fit" in m]
    assert len(lines) == 1 and "samples 99 -> 12" in lines[0] and trainer.global_step >= 2 * STEPS_PER_EPOCH - 1


def test_the_sampler_draws_order_and_seeds_from_the_seed_and_epoch_alone():
    a, b = ResumableSampler(10, seed=5), ResumableSampler(10, seed=5)
    first = list(a)
    assert [(int(i), i.seed) for i in first] == [(int(i), i.seed) for i in b] and sorted(first) == list(range(10))
    a.set_epoch(1)
    assert list(a) != first
    import pickle

    index = pickle.loads(pickle.dumps(SeededIndex(3, 42)))  # as it reaches a worker
    assert index == 3 and index.seed == 42


@pytest.mark.slow
def test_a_ddp_run_in_channels_last_resumed_mid_epoch_ends_where_the_uninterrupted_run_ends_on_every_rank(folder, clips,
                                                                                                    tmp_path):
    # two ranks (gloo), in one launch: a folder, clips, a pack of shards and a stream (2 workers per rank for all but
    # the folder); every rank goes on from rank 0's place (the ranks step together)
    import json
    import os
    import sys

    pytest.importorskip("datasets")
    from cltrain.data.pack import pack
    from tests.helpers import REPO
    from tests.helpers.hf_data import image_rows, write_hf_dataset

    pack(folder, tmp_path / "pack", shard_size=5, progress=False)
    saved = write_hf_dataset(tmp_path / "hf", {"train": image_rows(17, 2), "validation": image_rows(2, 2, seed=1)},
                             ["cat", "dog"], parquet_files=1)["saved"]
    runs = {"folder": (folder, 4), "clips": (clips, 4), "shards": (tmp_path / "pack", 4), "stream": (saved, 3)}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "MASTER_", "WORLD_SIZE"))}
    done = warm.run([sys.executable, "-m", "tests.helpers.resume_ddp_run", str(tmp_path / "out"),
                     *(f"{kind}={source}={step}" for kind, (source, step) in runs.items())],
                    cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    for kind, (_, step) in runs.items():
        where = tmp_path / "out" / kind
        said = json.loads((where / "said.json").read_text())
        state = torch.load(where / "steps" / f"step={step}.ckpt", weights_only=False)
        state = next(v["train_loader"] for k, v in state.items() if k.endswith("DataModule"))
        assert state["ranks"] == 2 and not state["finished"], kind  # stopped mid-epoch
        assert said["steps"][0] == said["steps"][1] > step, kind
        for rank in (0, 1):  # every rank: the weights, the optimizer state and the layout of the run never stopped
            a, b = torch.load(where / f"whole{rank}.pt"), torch.load(where / f"resumed{rank}.pt")
            assert a.keys() == b.keys() and all(
                torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a), (kind, rank)
        assert not [m for m in said["said"] if "resumable" in m or "does not fit" in m or "read again" in m], kind
    folder_state = torch.load(tmp_path / "out" / "folder" / "steps" / "step=4.ckpt", weights_only=False)
    assert folder_state["ImageFolderDataModule"]["train_loader"]["epoch"] == 1  # one batch of epoch 1 on each rank

    # the same checkpoints on one rank: the 8 samples epoch 1 had left are 4 batches of 2 (the 2 ranks read 4)
    from cltrain.data import HFImageDataModule, ShardsDataModule

    common = dict(batch_size=2, num_workers=0, image_size=24, val_resize_size=28)
    for kind, data in (("folder", ImageFolderDataModule(folder, **common)),
                       ("shards", ShardsDataModule(tmp_path / "pack", **common))):
        trainer, said = _fit_on_one_rank(data, tmp_path / "out" / kind / "steps" / "step=4.ckpt", tmp_path)
        assert trainer.global_step == 4 + 4 and len([m for m in said if "8 samples left in epoch 1" in m]) == 1, \
            (kind, said)
    # the stream's checkpoint (step 3 of epoch 0) on one rank: its 2 parts read from their places
    trainer, said = _fit_on_one_rank(HFImageDataModule(saved, streaming=True, shuffle_buffer=4, **common),
                                     tmp_path / "out" / "stream" / "steps" / "step=3.ckpt", tmp_path)
    assert len([m for m in said if "from 2 on 2: the rows left in epoch 0 of the stream's 2 parts" in m]) == 1, said
    # 17 rows in 2 parts of 9 and 8; each rank's 3 steps took 6 whole groups of 2 rows (part 0 to row 8, part 1 to
    # row 4): the 5 rows left are 2 batches of 2 (drop_last), epoch 1 on one rank 8 (the epoch again would be 8 more)
    assert trainer.global_step == 3 + 2 + 8, trainer.global_step


def _fit_on_one_rank(data: pl.LightningDataModule, ckpt: Path, root: Path) -> tuple[pl.Trainer, list[str]]:
    """Two epochs of ``Net`` on ``data`` on one CPU process, resumed from ``ckpt``; the trainer and its warnings."""
    pl.seed_everything(7, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                             enable_checkpointing=False, default_root_dir=root)
        trainer.fit(Net(), datamodule=data, ckpt_path=str(ckpt))
    return trainer, [str(w.message) for w in caught]


class _Batches(pl.Callback):
    """Each training step's batch as it reaches the step (its sum and labels) and the RNG there."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((trainer.global_step, round(float(batch[0].double().sum()), 6), batch[1].tolist(),
                          hash(torch.get_rng_state().numpy().tobytes())))  # a sum misses the position in the state


def test_a_run_that_crashed_in_a_step_reads_that_batch_again_with_its_augmentation_and_rng(folder, tmp_path):
    # the step of batch 2 raises after its forward and backward (its dropout drew, its BatchNorm updated its running
    # statistics): the exception checkpoint holds the batch as not taken, the RNG and the BatchNorm statistics from
    # before it, and the resumed run ends bit for bit where the uninterrupted one does
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    class Crash(Exception):
        pass

    class CrashInStep(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 2:
                raise Crash

    def fit(*callbacks, ckpt_path=None):
        pl.seed_everything(7, verbose=False)
        data = ImageFolderDataModule(folder, batch_size=4, num_workers=0, image_size=24, val_resize_size=28)
        trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                             enable_checkpointing=ckpt_path is None and len(callbacks) > 1,
                             callbacks=[ChannelsLast(layout=LAYOUT), *callbacks], default_root_dir=tmp_path)
        trainer.fit(Net(), datamodule=data, ckpt_path=ckpt_path)
        return trainer

    whole, crashed, resumed = _Batches(), _Batches(), _Batches()
    ended = fit(whole).lightning_module.state_dict()
    with pytest.raises(Crash):
        fit(crashed, CrashInStep(), OnExceptionCheckpoint(tmp_path, "crashed"))
    trainer = fit(resumed, ckpt_path=str(tmp_path / "crashed.ckpt"))
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    assert resumed.seen == whole.seen[2:] and crashed.seen == whole.seen[:3]
    state = trainer.lightning_module.state_dict()
    assert state.keys() == ended.keys()
    assert [k for k in state if not torch.equal(state[k], ended[k])] == []



@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_stopped_during_validation_ends_where_the_uninterrupted_run_ends(folder, tmp_path, workers):
    # stopped inside epoch 0's validation (its checkpoint is saved there): the next epoch reads its samples with the
    # augmentation and RNG of the run that was never stopped (Lightning does not run that validation again)
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    class Stop(Exception):
        pass

    class StopInValidation(pl.Callback):
        def on_validation_batch_end(self, trainer, *args, **kwargs):
            if trainer.current_epoch == 0:
                raise Stop

    whole, _, _ = _run(folder, tmp_path / "whole", workers, val=True)
    with pytest.raises(Stop):
        _run(folder, tmp_path / "stopped", workers, val=True,
             callbacks=(StopInValidation(), OnExceptionCheckpoint(tmp_path, "stopped")))
    resumed, trainer, said = _run(folder, tmp_path / "resumed", workers, val=True,
                                  ckpt_path=str(tmp_path / "stopped.ckpt"))
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    assert all(torch.equal(a, b) for a, b in zip(_state(whole), _state(resumed)))
    assert not [m for m in said if "not resumable" in m or "read again" in m], said


class _Ids(torch.utils.data.Dataset):
    """Each sample is its index and its seed, as the sampler hands them over."""

    def __len__(self) -> int:
        return 23

    def __getitem__(self, index):
        return torch.tensor([int(index), index.seed % 1_000_003])


def _loaders(ranks: int, drop_last: bool = False, batch: int = 3):
    from cltrain.data.prefetch import ResumableLoader

    return [ResumableLoader(_Ids(), batch_size=batch, drop_last=drop_last,
                            sampler=ResumableSampler(23, seed=11, num_replicas=ranks, rank=r)) for r in range(ranks)]


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (2, 3), (3, 3)])
def test_resumed_on_another_rank_count_each_remaining_sample_is_read_once_with_its_seed(before, after):
    epoch = {int(i): i.seed % 1_000_003 for i in ResumableSampler(23, seed=11)}  # the epoch's samples and seeds
    taken = []
    for loader in _loaders(before):  # two steps on every rank, then the stop (the ranks' states are alike)
        it = iter(loader)
        for _ in range(2):
            taken += [tuple(row) for row in next(it).tolist()]
            loader.note_taken()
    state = loader.state_dict()
    rest = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for loader in _loaders(after):
            loader.load_state_dict(state)
            rest += [tuple(row) for batch in loader for row in batch.tolist()]
    said = [str(w.message) for w in caught]
    left = set(epoch.items()) - set(taken)
    assert len(taken) == len(set(taken)) == 6 * before and set(taken) <= set(epoch.items())  # seeds: the epoch's
    # each remaining sample once with its seed; the split padded to a multiple of the ranks with the epoch's first
    assert set(rest) - set(taken) == left and len(rest) - len(left) == (-len(left)) % after
    assert len([r for r in rest if r in left]) == len(left)
    assert len([m for m in said if "split over" in m]) == (after if before != after else 0), said


class _ShardIds(torch.utils.data.Dataset):
    """A pack's stand-in: each index list is a batch of (index, seed) rows, as ``ShardsDataset`` reads a batch."""

    def __len__(self) -> int:
        return 23

    def __getitem__(self, indices):
        return torch.tensor([[int(i), i.seed % 1_000_003] for i in indices])


def _shard_loaders(ranks: int, batch: int = 3):
    from cltrain.data.prefetch import ResumableLoader
    from cltrain.data.shard_sampler import ShardBatchSampler

    return [ResumableLoader(_ShardIds(), batch_size=None, sampler=ShardBatchSampler(_ShardIds(), batch, ranks, r,
                                                                                    seed=11)) for r in range(ranks)]


@pytest.mark.parametrize("loaders", [_loaders, _shard_loaders], ids=["folder", "shards"])
@pytest.mark.parametrize("ranks,batch", [(2, 2), (2, 4), (1, 4)])
def test_resumed_with_another_batch_size_each_remaining_sample_is_read_once(loaders, ranks, batch):
    # the state did not fit ("batch size 3 -> 2"): the epoch was read again from its first batch while Lightning's
    # loop counted on from the stop, so the epoch ended short, and a second line said the checkpoint held no place
    epoch = set(_take(loaders(1), None)[0])
    rows, state, _ = _take(loaders(2), 2)  # two steps of 3 on each of 2 ranks, then a stop
    rest, _, said = _take(loaders(ranks, batch=batch), None, state)
    left = epoch - set(rows)
    assert len(rows) == 12 and set(rest) - set(rows) == left  # each sample left, with its seed
    assert 0 <= len(rest) - len(left) < ranks  # once, padded at most as the ranks need
    lines = [m for m in said if "split over" in m]
    assert len(lines) == ranks and f"batch size {batch} from a run with " in lines[0], said
    assert not [m for m in said if "does not fit" in m], said


def _take(loaders, steps: int | None, state: dict | None = None) -> tuple[list[tuple], dict, list[str]]:
    """``steps`` batches on every rank (all of them: None) from ``state``; the rows, the last rank's state, the
    warnings."""
    rows = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
            for k, batch in enumerate(loader):
                if steps is not None and k == steps:
                    break
                rows += [tuple(row) for row in batch.tolist()]
                loader.note_taken()
    return rows, loader.state_dict(), [str(w.message) for w in caught]


@pytest.mark.parametrize("counts", [(2, 1), (1, 2), (2, 3), (3, 2), (3, 3), (2, 3, 1), (2, 1, 2)])
def test_shards_resumed_on_another_rank_count_read_each_remaining_sample_once_with_its_seed(counts):
    from cltrain.data.shard_sampler import ShardBatchSampler

    epoch = {(int(i), i.seed % 1_000_003) for batch in ShardBatchSampler(_ShardIds(), 23, seed=11) for i in batch}
    rows, state, said = _take(_shard_loaders(counts[0]), 2)  # two steps on every rank, then a stop
    for before, after in zip(counts[:-1], counts[1:-1]):  # resumed on another count, stopped again after a step
        more, state, told = _take(_shard_loaders(after), 1, state)
        rows, said = rows + more, said + told
    rest, _, told = _take(_shard_loaders(counts[-1]), None, state)
    said += told
    assert len(rows) == len(set(rows)) and set(rows) <= epoch  # the stopped runs read each sample once, with its seed
    left = epoch - set(rows)
    # every remaining sample once with its seed (padded with the first ones where fewer are left than ranks)
    assert set(rest) == left and len(rest) == len(left)
    # one line on each rank of each resume on another count
    assert len([m for m in said if "split over" in m]) == sum(b for a, b in zip(counts[:-1], counts[1:]) if a != b), said


def test_shards_resumed_on_the_same_rank_count_serve_the_stopped_runs_batches():
    whole = [[tuple(r) for r in b.tolist()] for loader in _shard_loaders(2) for b in loader]
    _, state, _ = _take(_shard_loaders(2), 2)
    rest = []
    for loader in _shard_loaders(2):
        loader.load_state_dict(state)
        rest += [[tuple(r) for r in b.tolist()] for b in loader]
    per_rank = len(whole) // 2
    assert rest == whole[2:per_rank] + whole[per_rank + 2:]  # each rank's own batches from its third on


def test_shards_with_fewer_samples_left_than_ranks_pad_as_distributed_sampler_pads():
    rows, state, _ = _take(_shard_loaders(1), 7)  # 21 of 23 read: 2 left for 3 ranks
    rest, _, said = _take(_shard_loaders(3), None, state)
    assert len(rows) == 21 and len(rest) == 3 and len(set(rest)) == 2 and not set(rest) & set(rows)
    assert len([m for m in said if "split over" in m]) == 3


def _row_hashes(samples: list) -> torch.Tensor:
    """A batch as each sample's pixel hash (its row and its crop) and label."""
    import hashlib

    return torch.tensor([[int(hashlib.sha1(bytes(memoryview(image))).hexdigest()[:15], 16), int(label)]
                         for image, label in samples])


def _stream_loaders(saved: Path, workers: int, ranks: int, bad_files: str = "raise", shuffle_buffer: int | None = 5):
    from cltrain.data import train_transform
    from cltrain.data.hf_dataset import HFStreamingDataset
    from cltrain.data.hf_source import open_dataset
    from cltrain.data.prefetch import ResumableLoader

    split = open_dataset(saved, streaming=True)["train"]
    loaders = [ResumableLoader(HFStreamingDataset(split, train_transform(16), rank=r, world_size=ranks, equal=True,
                                               shuffle_buffer=shuffle_buffer, seed=3, bad_files=bad_files),
                               batch_size=2, num_workers=workers, collate_fn=_row_hashes) for r in range(ranks)]
    for loader in loaders:  # as seed_everything gives every rank: the seed of each sample's randomness
        loader.dataset.sample_seed = 7
    return loaders


@pytest.fixture(scope="module")
def stream15(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("datasets")
    from tests.helpers.hf_data import image_rows, write_hf_dataset

    return write_hf_dataset(tmp_path_factory.mktemp("stream"), {"train": image_rows(15, 3)}, ["a", "b", "c"],
                            parquet_files=1)["saved"]


@pytest.mark.parametrize("before,after,steps", [((2, 1), (0, 1), 2), ((0, 1), (2, 1), 2), ((2, 2), (0, 1), 2),
                                                ((2, 1), (3, 3), 2), ((2, 3), (2, 2), 1)],
                         ids=["2 workers to 0", "0 workers to 2", "2 ranks to 1", "1 rank to 3, 3 workers",
                              "3 ranks to 2"])
def test_a_stream_resumed_with_other_workers_or_ranks_reads_each_remaining_row_once_with_its_crop(stream15, before,
                                                                                                  after, steps):
    # (workers, ranks). Every row with its crop: the stopped run's parts read on one rank (a row's crop comes from
    # its part and place, whatever rank reads it)
    every, _, _ = _take(_stream_loaders(stream15, before[0], 1), None)
    whole, _, _ = _take(_stream_loaders(stream15, *before), None)  # the uninterrupted run
    taken, state, _ = _take(_stream_loaders(stream15, *before), steps)  # steps on every rank, then the stop
    assert not state["finished"]
    rest, _, said = _take(_stream_loaders(stream15, *after), None, state)
    assert len(every) == 15 and len(set(every)) == 15 and set(whole) <= set(every)
    assert len(taken) == 2 * steps * before[1] and set(taken) <= set(whole)
    read = taken + rest
    assert len(set(read)) == len(read) and set(read) <= set(every)  # each row at most once, with its own crop
    if before[1] == after[1]:  # the same ranks: the uninterrupted run's samples exactly
        assert sorted(read) == sorted(whole)
    else:  # another rank count leaves out only the incomplete last group of rows of each part
        parts = min(max(before[0], 1), 15)
        assert len(every) - len(read) <= parts * (after[1] - 1), (len(every), len(read))
    assert len([m for m in said if "are read once each" in m]) == after[1], said


def test_a_stream_stopped_again_after_a_resume_on_other_ranks_still_reads_each_row_once(stream15):
    every, _, _ = _take(_stream_loaders(stream15, 2, 1), None)
    taken, state, _ = _take(_stream_loaders(stream15, 2, 2), 1)
    more, state, _ = _take(_stream_loaders(stream15, 2, 3), 1, state)  # resumed on 3 ranks, stopped after a step
    assert state["split_from"] and not state["finished"]
    rest, _, said = _take(_stream_loaders(stream15, 0, 1), None, state)
    read = taken + more + rest
    assert len(set(read)) == len(read) and set(read) <= set(every) and len(every) - len(read) <= 2 * 2
    assert len(read) > len(taken) + len(more) and len([m for m in said if "are read once each" in m]) == 1


def test_a_stream_state_saved_before_parts_existed_is_one_line_and_the_epoch_starts_again(stream15):
    whole, _, _ = _take(_stream_loaders(stream15, 2, 1), None)
    _, state, _ = _take(_stream_loaders(stream15, 2, 1), 2)
    state.pop("parts")
    rest, _, said = _take(_stream_loaders(stream15, 2, 1), None, state)
    assert sorted(rest) == sorted(whole)  # the whole epoch again, with its crops
    lines = [m for m in said if "does not fit this stream" in m]
    assert len(lines) == 1 and "written before a stream's epoch was split into parts" in lines[0], said


def _rank_batches(loaders, steps: int | None = None, state: dict | None = None) -> tuple[list[list], dict]:
    """Each rank's batches (``steps`` of them, or all) from ``state``, and rank 0's state after them."""
    batches, saved = [], None
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
        mine = []
        for k, batch in enumerate(loader):
            if k == steps:
                break
            mine.append([tuple(row) for row in batch.tolist()])
            loader.note_taken()
        batches.append(mine)
        saved = saved or loader.state_dict()  # rank 0's: the checkpoint's
    return batches, saved


@pytest.mark.parametrize("ranks,workers,odd", [(2, 0, (2,)), (2, 0, (3,)), (2, 0, (2, 3)), (2, 0, (2, 5)),
                                               (3, 0, (5, 7)), (2, 0, (12, 13)), (3, 2, (4,))])
def test_a_ddp_stream_with_bad_rows_resumes_every_rank_exactly_from_rank_0s_place(tmp_path, ranks, workers, odd):
    # a bad row's stand-in (the rank's next readable row) can be owed across the stop on one rank only: every rank
    # goes on from rank 0's place and still serves the batches of the uninterrupted run (in stream order: the rows
    # named are where the stops fall)
    pytest.importorskip("datasets")
    from tests.helpers.hf_data import image_rows, write_hf_dataset

    saved = write_hf_dataset(tmp_path / "hf", {"train": image_rows(15, 3, odd={i: b"<html>" for i in odd})},
                             ["a", "b", "c"], parquet_files=1)["saved"]

    def loaders():
        return _stream_loaders(saved, workers, ranks, bad_files="skip", shuffle_buffer=None)

    whole, _ = _rank_batches(loaders())
    assert sum(len(b) for b in whole[0]) < 15 // ranks + 1 and len({len(b) for b in whole}) == 1
    for stop in range(1, len(whole[0])):
        _, state = _rank_batches(loaders(), stop)
        rest, _ = _rank_batches(loaders(), None, state)
        assert rest == [mine[stop:] for mine in whole], f"stopped after {stop} steps"


def test_a_part_read_to_its_end_before_a_stop_on_other_ranks_is_not_read_again(stream15, monkeypatch):
    from cltrain.data.hf_dataset import HFStreamingDataset
    from cltrain.data.stream_place import READ_TO_END

    opened = []
    rows = HFStreamingDataset._rows
    monkeypatch.setattr(HFStreamingDataset, "_rows", lambda self, part, *a: opened.append(part) or rows(self, part, *a))
    dataset = _stream_loaders(stream15, 0, 1)[0].dataset
    dataset.resume_parts, dataset.split_from = 2, {0: READ_TO_END, 1: 6}
    rest = list(dataset)
    assert opened == [1] and len(rest) == 7 - 6  # part 1 (7 rows of 15) from its row 6; part 0 never opened
    dataset.split_from = {1: 6}  # the control: part 0 from its first row
    assert len(list(dataset)) == 8 + 1 and opened == [1, 0, 1]


@pytest.mark.parametrize("top_k", [1, 0])
def test_a_max_steps_stop_mid_epoch_saved_by_model_checkpoint_resumes_there(folder, whole0, tmp_path, top_k):
    # After max_steps stopped the fit at batch 1 of epoch 1, Lightning saves last.ckpt from the epoch's end hooks
    # (top_k=1) or at the fit's end (top_k=0), counting the epoch as processed or completed: the DataModule has the
    # resumed run finish that epoch, as the uninterrupted run did
    last = ModelCheckpoint(dirpath=tmp_path / "stopped", save_last=True, save_top_k=top_k)
    _, stopped, _ = _run(folder, tmp_path / "stopped", 0, max_steps=STEPS_PER_EPOCH + 1, callbacks=(last,))
    assert stopped.global_step == STEPS_PER_EPOCH + 1
    resumed, again, _ = _run(folder, tmp_path / "resumed", 0, ckpt_path=str(tmp_path / "stopped" / "last.ckpt"))
    assert again.global_step == 2 * STEPS_PER_EPOCH
    assert all(torch.equal(a, b) for a, b in zip(whole0[0], _state(resumed)))


@pytest.mark.parametrize("top_k", [1, 0])
@pytest.mark.parametrize("max_steps", [2 * STEPS_PER_EPOCH, -1])
def test_a_max_steps_stop_at_an_epochs_end_resumes_with_the_next_epoch(folder, whole0, tmp_path, top_k, max_steps):
    # Lightning counts such an epoch completed at resume only without max_steps (Lightning #19617): with it, the
    # stopped epoch went on with a batch of the next epoch's order
    last = ModelCheckpoint(dirpath=tmp_path / "stopped", save_last=True, save_top_k=top_k)
    _run(folder, tmp_path / "stopped", 0, max_steps=STEPS_PER_EPOCH, callbacks=(last,))
    resumed, again, _ = _run(folder, tmp_path / "resumed", 0, max_steps=max_steps,
                             ckpt_path=str(tmp_path / "stopped" / "last.ckpt"))
    assert (again.global_step, again.current_epoch) == (2 * STEPS_PER_EPOCH, 2)
    assert again.fit_loop.epoch_loop._batches_that_stepped == 2 * STEPS_PER_EPOCH  # the step the loggers log at
    assert all(torch.equal(a, b) for a, b in zip(whole0[0], _state(resumed)))


def test_a_run_resumed_twice_from_step_checkpoints_ends_where_the_uninterrupted_run_ends(folder, whole0, tmp_path):
    # resumed from the last batch's checkpoint of epoch 0, Lightning counts that epoch completed but not processed, and
    # the resumed run's own checkpoints carry it: resumed again from one of them, the run trained a whole extra epoch
    _run(folder, tmp_path / "first", 0, every=1, ckpt_path=str(whole0[1] / f"step={STEPS_PER_EPOCH}.ckpt"))
    resumed, again, _ = _run(folder, tmp_path / "second", 0,
                             ckpt_path=str(tmp_path / "first" / f"step={STEPS_PER_EPOCH + 1}.ckpt"))
    assert again.global_step == 2 * STEPS_PER_EPOCH
    assert all(torch.equal(a, b) for a, b in zip(whole0[0], _state(resumed)))


def test_an_accumulation_schedule_holds_in_an_epoch_resumed_in_its_middle(folder, tmp_path):
    # Lightning calls no on_train_epoch_start in such an epoch, where GradientAccumulationScheduler sets its count: the
    # resumed run accumulated 1 batch where the schedule says 2
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    whole, _, _ = _run(folder, tmp_path / "whole", 0, every=1, callbacks=(GradientAccumulationScheduler({1: 2}),))
    steps = STEPS_PER_EPOCH + 1  # epoch 1's first window
    resumed, again, _ = _run(folder, tmp_path / "resumed", 0, ckpt_path=str(tmp_path / "whole" / f"step={steps}.ckpt"),
                             callbacks=(GradientAccumulationScheduler({1: 2}),))
    assert again.accumulate_grad_batches == 2
    assert all(torch.equal(a, b) for a, b in zip(_state(whole), _state(resumed)))


def test_a_checkpoint_inside_an_accumulation_window_says_the_resumed_run_is_not_exact(folder, tmp_path):
    # Lightning saves no accumulated gradient: a resume between micro-batches cannot be bit for bit, and says so
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    class Crash(Exception):
        pass

    class CrashAtTheSecondMicroBatch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:
                raise Crash

    with pytest.raises(Crash):
        _run(folder, tmp_path / "crashed", 0, accumulate=2,
             callbacks=(CrashAtTheSecondMicroBatch(), OnExceptionCheckpoint(tmp_path, "crashed")))
    _, _, said = _run(folder, tmp_path / "resumed", 0, accumulate=2, ckpt_path=str(tmp_path / "crashed.ckpt"))
    assert [m for m in said if "was saved after 1 of the 2 micro-batches of an accumulate_grad_batches window" in m]
    _run(folder, tmp_path / "steps", 0, accumulate=2, every=1, epochs=1)  # saved at each optimizer step's end
    _, _, said = _run(folder, tmp_path / "exact", 0, accumulate=2, ckpt_path=str(tmp_path / "steps" / "step=1.ckpt"))
    assert not [m for m in said if "accumulate_grad_batches" in m]


def test_a_max_steps_stop_at_an_epochs_end_with_validation_resumes_at_the_loggers_step(folder, tmp_path):
    # restarting under max_steps, Lightning's loop counts a batch that skips the epoch's validation into the step the
    # loggers log at: each chunk of a run trained in max_steps chunks logged one step later
    last = ModelCheckpoint(dirpath=tmp_path / "stopped", save_last=True)
    _run(folder, tmp_path / "stopped", 0, max_steps=STEPS_PER_EPOCH, val=True, callbacks=(last,))
    _, again, _ = _run(folder, tmp_path / "resumed", 0, max_steps=2 * STEPS_PER_EPOCH, val=True,
                       ckpt_path=str(tmp_path / "stopped" / "last.ckpt"))
    assert again.fit_loop.epoch_loop._batches_that_stepped == again.global_step == 2 * STEPS_PER_EPOCH
