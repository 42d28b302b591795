"""``BatchDataModule``: what every cltrain DataModule shares, once.

The loader (batch size, worker processes, pinning, the opt-in CUDA prefetch), the device
chosen at ``setup``, and the normalisation of the uint8 batch on that device in
``on_after_batch_transfer`` (images ``(N, C, H, W)`` channels_last, clips ``(N, C, T, H, W)``
channels_last_3d; contiguous with ``channels_last=False``). The arguments are checked here,
in the constructor, for every DataModule.

A subclass sets ``train_set`` / ``val_set`` in its ``setup`` (after ``_choose_device``),
defines ``classes`` and ``input_shape``, and says how a batch is collated (``_collate``), or
how a loader batches altogether (``_batching``).

========================  ===============================================
``BatchDataModule``       loader, device, normalisation
``ImageDataModule``       + image crops, ``Augmentation``, ``decode_threads``
``ShardsDataModule``      + a pack of shards (``seed``, ``shuffle_window``)
``ImageFolderDataModule`` + class folders, ``bad_files``, the folder checks
``ClipFolderDataModule``  + class folders, ``bad_files``, clip sampling
========================  ===============================================

A subclass that only adds arguments writes them alone: ``takes_arguments_of(Base)`` gives its
``__init__(self, *args, <its own keyword-only arguments>, **kwargs)`` the signature of ``Base``
followed by its own, the one that ``inspect``, ``help``, Hydra's users and LightningCLI read.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import lightning as L
import torch
from torch.utils.data import Dataset, IterableDataset
from typing_extensions import override

from cltrain.data.loader_threads import usable_cores
from cltrain.data.normalize import NORMALIZE_DTYPES, check_statistics, normalize
from cltrain.data.prefetch import PrefetchDataLoader, ResumableLoader
from cltrain.data.remote import is_url, redact, root_of
from cltrain.data.resume_state import ResumableSampler, is_resumable
from cltrain.data.running_stats import RunningStats
from cltrain.data.stream_place import is_stream

__all__ = ["BatchDataModule", "takes_arguments_of"]

Init = TypeVar("Init", bound=Callable[..., None])


def takes_arguments_of(base: type) -> Callable[[Init], Init]:
    """Decorator of ``__init__(self, *args, <own keyword-only arguments>, **kwargs)`` that hands ``*args,
    **kwargs`` on to ``base``: its signature becomes ``base``'s arguments, then its own, so shared arguments
    are written once (in ``base``) and still named in every subclass's signature; an argument neither
    takes is a one-line ``TypeError`` naming the subclass.

    Example::

        class ShardsDataModule(ImageDataModule):
            @takes_arguments_of(ImageDataModule)
            def __init__(self, *args: Any, seed: int = 0, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.seed = seed
    """
    def decorate(init: Init) -> Init:
        inherited = list(inspect.signature(base.__init__, eval_str=True).parameters.values())
        own = [p for p in inspect.signature(init, eval_str=True).parameters.values() if p.kind is p.KEYWORD_ONLY]
        signature = inspect.Signature([*inherited, *own])

        @functools.wraps(init)
        def checked(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                signature.bind(self, *args, **kwargs)
            except TypeError as err:  # Python's message names the base's __init__: name the class called
                raise TypeError(f"{type(self).__name__}: {err}") from None
            init(self, *args, **kwargs)

        checked.__signature__ = signature  # type: ignore[attr-defined]
        return checked  # type: ignore[return-value]
    return decorate


class BatchDataModule(L.LightningDataModule):
    """Base of cltrain's DataModules (see the module docstring); not used on its own.

    Args:
        root: where the data is.
        batch_size: samples per batch.
        num_workers: DataLoader worker processes (0: load in the main process).
        persistent_workers: keep workers between epochs (when ``num_workers > 0``).
        pin_memory: ``None`` pins only when the trainer runs on a GPU.
        channels: 3 (RGB) or 1 (grayscale).
        mean: per-channel normalisation mean (0-1 units).
        std: per-channel normalisation standard deviation (0-1 units).
        dtype: dtype of the normalised batch (float32, bfloat16 or float16).
        channels_last: ``False`` gives contiguous batches (the baseline).
        cuda_prefetch: on a CUDA device, copy the next batch on a side stream
            (``PrefetchDataLoader``); off: Lightning copies each batch when its step starts.

    Raises:
        ValueError: a bad argument, quoted (also ``mean``/``std`` in 0-255 units).
    """

    #: Whether ``root`` may be a URL (``s3://...``, ``cltrain.data.remote``).
    takes_urls: bool = False

    def __init__(self, root: str | os.PathLike, *, batch_size: int, num_workers: int | str, persistent_workers: bool,
                 pin_memory: bool | None, channels: int, mean: Sequence[float], std: Sequence[float], dtype: torch.dtype,
                 channels_last: bool, cuda_prefetch: bool) -> None:
        super().__init__()
        owner = type(self).__name__
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"{owner}: batch_size={batch_size!r} must be an int >= 1.")
        if num_workers == "auto":
            num_workers = usable_cores()  # a worker process per core (the image DataModules plan threads too)
        if not (isinstance(num_workers, int) and num_workers >= 0):
            raise ValueError(f"{owner}: num_workers={num_workers!r} must be an int >= 0 or 'auto'.")
        if channels not in (1, 3):
            raise ValueError(f"{owner}: channels={channels!r} must be 1 (grayscale) or 3 (RGB).")
        if dtype not in NORMALIZE_DTYPES:
            raise ValueError(f"{owner}: dtype={dtype!r} must be one of {NORMALIZE_DTYPES}.")
        if len(mean) not in (1, channels) or len(std) not in (1, channels):
            raise ValueError(f"{owner}: mean={tuple(mean)} and std={tuple(std)} need 1 or {channels} values each.")
        check_statistics(mean, std, owner)
        if is_url(str(root)) and not self.takes_urls:
            raise ValueError(f"{owner}: root={redact(str(root))!r} is a URL; this DataModule reads local folders. An "
                             "image folder in a bucket would be read one request per image: pack it (cltrain-pack ROOT "
                             "OUT), upload OUT as it is, and read that with ShardsDataModule (data=shards data.root=<URL "
                             "of OUT>).")
        self.root = root_of(root)  # a URL (s3://...) is kept as given: the DataModules that read one say so
        self.batch_size, self.num_workers = batch_size, num_workers
        self.persistent_workers, self.pin_memory = persistent_workers, pin_memory
        self.channels, self.mean, self.std, self.dtype = channels, tuple(mean), tuple(std), dtype
        self.channels_last, self.cuda_prefetch = channels_last, cuda_prefetch
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self._classes: list[str] | None = None
        self._pin = False
        self._device: torch.device | None = None

    @property
    def classes(self) -> list[str]:
        """Class names, in label order."""
        raise NotImplementedError

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return len(self.classes)

    def _choose_device(self) -> torch.device:
        """The trainer's device (CPU without one); pin memory only for a GPU unless ``pin_memory`` says."""
        trainer = self.trainer
        self._device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        self._pin = self._device.type == "cuda" if self.pin_memory is None else bool(self.pin_memory)
        return self._device

    def _collate(self, pin_memory: bool) -> Any:
        """The ``collate_fn`` that builds a batch in the loader."""
        raise NotImplementedError

    def _batching(self, dataset: Dataset, train: bool, drop_last: bool | None) -> dict[str, Any]:
        """How the loader makes batches: shuffled and cut to whole batches for training (unless
        ``drop_last`` says), every sample kept for validation, test and predict."""
        order: dict[str, Any] = {"shuffle": train}
        if train and not isinstance(dataset, IterableDataset):  # the epoch's order travels in checkpoints
            order = {"sampler": ResumableSampler(len(dataset), num_replicas=getattr(self.trainer, "world_size", 1),
                                                 rank=getattr(self.trainer, "global_rank", 0))}
        return dict(batch_size=self.batch_size, drop_last=train if drop_last is None else drop_last,
                    collate_fn=self._collate(pin_memory=self._pin and self.num_workers == 0),  # workers: the loader pins
                    **order)

    def _loader(self, dataset: Dataset | None, train: bool, drop_last: bool | None = None) -> PrefetchDataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() (the Trainer does) before asking for a dataloader.")
        workers = self.num_workers
        cuda = self.cuda_prefetch and self._device is not None and self._device.type == "cuda"
        batching = self._batching(dataset, train, drop_last)
        resumable = is_resumable(batching.get("sampler")) or is_stream(dataset)
        kind = ResumableLoader if train and resumable else PrefetchDataLoader
        loader = kind(dataset, num_workers=workers, pin_memory=self._pin and workers > 0,
                      persistent_workers=self.persistent_workers and workers > 0,
                      prefetch_device=self._device if cuda else None, **batching)
        if train:
            self._train_loader = loader  # counts the batches its training steps take (on_after_batch_transfer)
            if isinstance(loader, ResumableLoader):
                loader.unfinished = functools.partial(_unfinished_steps, self)
                loader.epoch_batches = functools.partial(_epoch_batches, self)
            if getattr(self, "_loader_state", None) and isinstance(loader, ResumableLoader):
                loader.load_state_dict(self._loader_state)
                self._loader_state = None
        return loader

    @override
    def state_dict(self) -> dict[str, Any]:
        """Where the training epoch is (``PrefetchDataLoader.state_dict``), also in the DataModule's own entry of
        the checkpoint: Lightning restores it before anything can build the loader (``estimated_stepping_batches``
        in ``configure_optimizers`` builds it before the loop's own loader state is read, and then never reads it)."""
        loader = getattr(self, "_train_loader", None)
        state = loader.state_dict() if isinstance(loader, ResumableLoader) else {}
        if not state:
            return {}
        stats = getattr(self, "_running_stats", None)
        if stats is not None and loader.unfinished():  # a step raised: its forward's statistics are not kept
            return {"train_loader": state, "running_stats": stats.held()}
        return {"train_loader": state}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hand ``state_dict``'s place in the epoch to the training loader, now or when it is built."""
        state = (state_dict or {}).get("train_loader")
        self._stats_to_put_back = (state_dict or {}).get("running_stats")  # at the first batch, once all is restored
        loader = getattr(self, "_train_loader", None)
        if state and isinstance(loader, ResumableLoader):
            loader.load_state_dict(state)
        else:
            self._loader_state = state

    @override
    def train_dataloader(self) -> PrefetchDataLoader:
        return self._loader(self.train_set, train=True)

    @override
    def val_dataloader(self) -> PrefetchDataLoader:
        return self._loader(self.val_set, train=False)

    @override
    def test_dataloader(self) -> PrefetchDataLoader:
        return self._loader(self.val_set, train=False)

    @override
    def predict_dataloader(self) -> PrefetchDataLoader:
        return self._loader(self.val_set, train=False)

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Normalise the uint8 images (or clips) of ``(images, targets, ...)`` on their device; a training batch is
        counted as taken (``PrefetchDataLoader.note_taken``: where a resumed epoch goes on)."""
        trainer = self.trainer
        loader = getattr(self, "_train_loader", None)
        if isinstance(loader, ResumableLoader) and getattr(trainer, "training", False):
            if loader.taken == 0 and not loader.resumed:
                _say_if_resumed_without_state(trainer)
            loader.note_taken()
            model = getattr(trainer, "lightning_module", None)
            if isinstance(model, torch.nn.Module):
                self._hold_running_stats(model)
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor) and batch[0].dim() in (4, 5):
            images = batch[0]
            if images.dtype == torch.uint8:
                layout = torch.channels_last if images.dim() == 4 else torch.channels_last_3d
                fmt = layout if self.channels_last else torch.contiguous_format
                images = normalize(images, self.mean, self.std, self.dtype, memory_format=fmt)
                return self._replace_head(batch, images)
        return batch

    def _hold_running_stats(self, model: torch.nn.Module) -> None:
        """Put back the statistics a checkpoint saved in an unfinished step, then copy them before this step."""
        held = getattr(self, "_stats_to_put_back", None)
        if held:
            RunningStats.put_back(model, held)
            self._stats_to_put_back = None
        if getattr(self, "_running_stats", None) is None:
            self._running_stats = RunningStats()
        self._running_stats.hold(model)

    @staticmethod
    def _replace_head(batch: tuple | list, *head: Any) -> tuple | list:
        """``batch`` with its first fields replaced by ``head``, of the same type."""
        fields = [*head, *batch[len(head):]]
        return tuple(fields) if isinstance(batch, tuple) else fields


def _say_if_resumed_without_state(trainer: Any) -> None:
    """One line where a run resumes in the middle of an epoch from a checkpoint that holds no place in it (one
    written before cltrain kept it, or by another loader): the epoch is read again from its first batch."""
    progress = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "batch_progress", None)
    done = getattr(getattr(progress, "current", None), "completed", 0)
    if getattr(trainer, "ckpt_path", None) and isinstance(done, int) and done > 0:
        warnings.warn(f"cltrain: {trainer.ckpt_path} holds no place in epoch {trainer.current_epoch} for this loader "
                      f"(written before cltrain kept one): the epoch is read again from its first batch, after "
                      f"{done} batches of it were trained on.", stacklevel=2)


def _unfinished_steps(datamodule: Any) -> int:
    """Training batches of this epoch that reached the device but whose step did not end (a batch-start hook or the
    step raised): Lightning's progress counts a batch ready before its transfer and processed after its step."""
    loop = getattr(getattr(datamodule.trainer, "fit_loop", None), "epoch_loop", None)
    current = getattr(getattr(loop, "batch_progress", None), "current", None)
    ready, processed = getattr(current, "ready", 0), getattr(current, "processed", 0)
    return max(0, ready - processed) if isinstance(ready, int) and isinstance(processed, int) else 0


def _epoch_batches(datamodule: Any) -> float:
    """The batches Lightning takes from the training loader per epoch (``limit_train_batches`` ends it early)."""
    batches = getattr(getattr(datamodule, "trainer", None), "num_training_batches", float("inf"))
    return batches if isinstance(batches, (int, float)) and batches > 0 else float("inf")
