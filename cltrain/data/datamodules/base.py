"""``BatchDataModule``: what every cltrain DataModule shares, once.

A DataModule is made of settings groups (``cltrain.data.settings``): its class lists them
(``settings``), its arguments are their fields, and it holds each group, checked when it is made
(``dm.loading``, ``dm.crop``, ``dm.pixels``, ``dm.bad_file_policy``, ...) and each field by its
name (``dm.batch_size``). Here: the loader (batch size, worker processes, pinning, the opt-in CUDA
prefetch), the device chosen at ``setup``, the normalisation of the uint8 batch on that device in
``on_after_batch_transfer`` (images ``(N, C, H, W)`` channels_last, clips ``(N, C, T, H, W)``
channels_last_3d; contiguous with ``channels_last=False``), and the bad-file policy's list of
skipped samples in the run directory (``bad_files="skip"`` under a Trainer).

A subclass sets ``settings``, sets ``train_set`` / ``val_set`` in its ``setup`` (after
``_join_trainer``), defines ``classes`` and ``input_shape``, and says how a
batch is collated (``_collate``), or how a loader batches altogether (``_batching``).

==========================  =======================================================
``BatchDataModule``         loader, device, normalisation, bad-file list
``ImageDataModule``         + crops, decoding, ``Augmentation``: the image DataModules' base
``ImageFolderDataModule``,  each an ``ImageDataModule`` with its source's own group
``ShardsDataModule``, ...
``ClipFolderDataModule``    + clip sampling, ``RandomCrop``
==========================  =======================================================
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset, IterableDataset, SequentialSampler
from typing_extensions import override

from cltrain.data.bad_samples import SkipsBadSamples
from cltrain.data.datamodules.arguments import bind_settings, signature_of
from cltrain.data.datamodules.class_folders import ClassFolders
from cltrain.data.datamodules.mid_epoch import ResumeMidEpoch
from cltrain.data.datamodules.skipped_files import SKIPPED_FILES_NAME, SkippedFilesReport
from cltrain.data.errors import DataError
from cltrain.data.loader_threads import usable_cores
from cltrain.data.normalize import normalize
from cltrain.data.prefetch import PrefetchDataLoader, ResumableLoader
from cltrain.data.remote import is_url, redact, root_of
from cltrain.data.resume_state import ResumableSampler, is_resumable
from cltrain.data.running_stats import RunningStats
from cltrain.data.shard_sampler import EveryImageOnce
from cltrain.data.stream_place import is_stream

__all__ = ["BatchDataModule"]


class BatchDataModule(L.LightningDataModule):
    """Base of cltrain's DataModules (see the module docstring); not used on its own.

    A DataModule takes ``root`` (where the data is), then the fields of its ``settings`` groups by name
    (``cltrain.data.settings``): its signature is made from them.

    Raises:
        ValueError: a bad argument, quoted (also ``mean``/``std`` in 0-255 units).
        TypeError: an argument it does not take (one line naming it).
    """

    #: The settings groups it is made of (``cltrain.data.settings``): its arguments after ``root``, in order.
    settings: ClassVar[tuple[type, ...]] = ()
    #: Whether ``root`` may be a URL (``s3://...``, ``cltrain.data.remote``).
    takes_urls: ClassVar[bool] = False
    #: What to do instead of a URL root, where ``takes_urls`` is false (``None``: pack the folder, read the pack).
    url_fix: ClassVar[str | None] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__new__(for_loaded_trainers(cls))

    def __reduce_ex__(self, protocol: Any) -> Any:
        reduced = super().__reduce_ex__(protocol)
        base = type(self).__dict__.get("_single_package")
        if base is None:
            return reduced
        return (_remade, (base,), *reduced[2:])  # a process that imported no pytorch_lightning gets the plain class

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" not in cls.__dict__:  # its own function, to carry its own signature
            def __init__(self: Any, *args: Any, **kw: Any) -> None:
                super(cls, self).__init__(*args, **kw)
            __init__.passes_through = True
            cls.__init__ = __init__  # type: ignore[method-assign]
        # what inspect, help and LightningCLI read: the settings' fields, after the names the nearest __init__ of
        # the user's adds before passing the rest on (a user's DataModule with an argument of its own, or its subclass)
        own = cls.__dict__["__init__"]
        own.own_signature = inspect.signature(own)  # its code's, before the one set below
        inits = [c.__dict__["__init__"] for c in cls.__mro__ if "__init__" in c.__dict__]
        written = next(getattr(f, "own_signature", None) or inspect.signature(f)
                       for f in inits if not getattr(f, "passes_through", False))
        own.__signature__ = _with_settings(written, signature_of(cls.settings))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        owner = type(self).__name__
        root, values, groups = bind_settings(owner, self.settings, args, kwargs)
        for key, group in groups.items():
            setattr(self, key, group)
        for name, value in values.items():
            if not hasattr(type(self), name):  # num_classes stays the property
                setattr(self, name, value)
        if self.num_workers == "auto":
            self.num_workers = self._auto_workers()
        if is_url(str(root)) and not self.takes_urls and self.url_fix:
            raise ValueError(f"{owner}: root={redact(str(root))!r} is a URL; {self.url_fix}.")
        if is_url(str(root)) and not self.takes_urls:
            raise ValueError(f"{owner}: root={redact(str(root))!r} is a URL; this DataModule reads local folders. An "
                             "image folder in a bucket would be read one request per image: pack it (cltrain-pack ROOT "
                             "OUT), upload OUT as it is, and read that with ShardsDataModule (data=shards data.root=<URL "
                             "of OUT>).")
        self.root_name = str(root)  # as given: a URL or a Hub id is not a path
        self.root = root_of(root)  # a URL (s3://...) is kept as given: the DataModules that read one say so
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self._classes: list[str] | None = None
        self._pin = False
        self._device: torch.device | None = None
        self._skip_log: Path | None = None
        self.folders: ClassFolders | None = None  # the class folders, where the data is in them

    def _auto_workers(self) -> int:
        """``num_workers="auto"``: a worker process per core."""
        return usable_cores()

    @property
    def classes(self) -> list[str]:
        """Class names, in label order: of the class folders (``folders``), unless the source says otherwise."""
        if self._classes is None:
            if self.folders is None:
                raise NotImplementedError(f"{type(self).__name__} has no class folders: it defines classes itself")
            self._classes = self.folders.classes
        return self._classes

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return len(self.classes)

    def _join_trainer(self) -> None:
        """What ``setup`` does first: choose the device, open the skipped-files list, and have the Trainer's
        checkpoints of a ``max_steps`` stop resume in the stopped epoch (``ResumeMidEpoch``), where this
        DataModule's place in it is saved."""
        self._choose_device()
        self._open_skip_log()
        trainer = self.trainer
        if trainer is not None and not any(isinstance(cb, ResumeMidEpoch) for cb in trainer.callbacks):
            trainer.callbacks.append(ResumeMidEpoch())

    def _choose_device(self) -> torch.device:
        """The trainer's device (CPU without one); pin memory only for a GPU unless ``pin_memory`` says."""
        trainer = self.trainer
        self._device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        self._pin = self._device.type == "cuda" if self.pin_memory is None else bool(self.pin_memory)
        return self._device

    @property
    def skipped_files_path(self) -> Path | None:
        """With ``bad_files="skip"`` under a Trainer: the list the workers append skipped samples to
        (``SkippedFilesReport`` counts and reports them); else ``None``."""
        return self._skip_log

    def _open_skip_log(self) -> None:
        """With ``bad_files="skip"`` under a Trainer: the skipped-files list in the run directory (one per rank)."""
        trainer = self.trainer
        if self.bad_files != "skip" or trainer is None:
            return
        run_dir = Path(trainer.default_root_dir)  # the run directory, not the logger's folder
        run_dir.mkdir(parents=True, exist_ok=True)
        name = SKIPPED_FILES_NAME if trainer.world_size == 1 else f"rank{trainer.global_rank}.{SKIPPED_FILES_NAME}"
        self._skip_log = run_dir / name
        if not any(isinstance(cb, SkippedFilesReport) for cb in trainer.callbacks):
            rank_zero_warn(f"{type(self).__name__}(bad_files='skip'): skipped files are listed in {self._skip_log}; "
                           "add cltrain.data.SkippedFilesReport() to the Trainer's callbacks to count them per epoch.")
        for dataset in (self.train_set, self.val_set):  # built by a setup() called before the Trainer's
            if isinstance(dataset, SkipsBadSamples):
                dataset.list_skips_in(self._skip_log)

    def _collate(self, pin_memory: bool) -> Any:
        """The ``collate_fn`` that builds a batch in the loader."""
        raise NotImplementedError

    def _batching(self, dataset: Dataset, train: bool, drop_last: bool | None) -> dict[str, Any]:
        """How the loader makes batches: shuffled and cut to whole batches for training (unless
        ``drop_last`` says), every sample kept once for validation, test and predict (under DDP too:
        ``EveryImageOnce``)."""
        collate = self._collate(pin_memory=self._pin and self.num_workers == 0)  # workers: the loader pins
        if not train and not drop_last and not isinstance(dataset, IterableDataset):
            return dict(batch_sampler=EveryImageOnce(SequentialSampler(dataset), self.batch_size), collate_fn=collate)
        order: dict[str, Any] = {"shuffle": train}
        if train and not isinstance(dataset, IterableDataset):  # the epoch's order travels in checkpoints
            order = {"sampler": ResumableSampler(len(dataset), num_replicas=getattr(self.trainer, "world_size", 1),
                                                 rank=getattr(self.trainer, "global_rank", 0))}
        return dict(batch_size=self.batch_size, drop_last=train if drop_last is None else drop_last,
                    collate_fn=collate, **order)

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
                # the DataModule held weakly: a cycle through it left a dropped loader's persistent workers to the
                # garbage collector, which closed their queues first (20 s, then the workers left running)
                held = weakref.ref(self)
                loader.unfinished = functools.partial(_unfinished_steps, held)
                loader.epoch_batches = functools.partial(_epoch_batches, held)
            if getattr(self, "_loader_state", None) and isinstance(loader, ResumableLoader):
                loader.load_state_dict(self._loader_state)
                self._loader_state = None
        return loader

    @override
    def state_dict(self) -> dict[str, Any]:
        """Where the training epoch is (``PrefetchDataLoader.state_dict``), also in the DataModule's own entry of
        the checkpoint: Lightning restores it before anything can build the loader (``estimated_stepping_batches``
        in ``configure_optimizers`` builds it before the loop's own loader state is read, and then never reads it)."""
        kept: dict[str, Any] = {"classes": list(self._classes)} if self._classes else {}  # read already, not now
        loader = getattr(self, "_train_loader", None)
        state = loader.state_dict() if isinstance(loader, ResumableLoader) else {}
        if not state:
            return kept
        stats = getattr(self, "_running_stats", None)
        if stats is not None and loader.unfinished():  # a step raised: its forward's statistics are not kept
            return {**kept, "train_loader": state, "running_stats": stats.held()}
        return {**kept, "train_loader": state}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hand ``state_dict``'s place in the epoch to the training loader, now or when it is built; a checkpoint
        whose classes are not this data's (a class folder renamed, added or removed: each label would name another
        class) is a ``DataError``."""
        self._same_classes((state_dict or {}).get("classes"))
        state = (state_dict or {}).get("train_loader")
        self._stats_to_put_back = (state_dict or {}).get("running_stats")  # at the first batch, once all is restored
        loader = getattr(self, "_train_loader", None)
        if state and isinstance(loader, ResumableLoader):
            loader.load_state_dict(state)
        else:
            self._loader_state = state

    def _same_classes(self, saved: list[str] | None) -> None:
        if not saved or saved == self.classes:  # a checkpoint that kept none: an older cltrain's
            return
        here = self.classes
        at = next((i for i, (a, b) in enumerate(zip(saved, here)) if a != b), min(len(saved), len(here)))
        differs = f"label {at} is {saved[at]!r} there and {here[at]!r} here" if at < min(len(saved), len(here)) else \
            f"{len(saved)} classes there, {len(here)} here"
        where = redact(str(getattr(self, "root", type(self).__name__)))
        raise DataError(f"{where}: the checkpoint was trained on other classes ({differs}): its labels would name "
                        "other classes. Give the data it was trained on (the same class names), or start a new run.")

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
            if loader.taken == 0 and not loader.resumed and not loader.refused:
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


def _with_settings(init: inspect.Signature, settings: inspect.Signature) -> inspect.Signature:
    """The ``__init__`` signature ``init``'s own named parameters, then the settings' (keyword-only) that it passes on
    by ``**kwargs``; the settings' signature alone where ``init`` names none (``*args, **kwargs``) or passes nothing
    on."""
    own = list(init.parameters.values())
    named = [p for p in own if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(named) <= 1:  # only self: a pass-through
        return settings
    if not any(p.kind == p.VAR_KEYWORD for p in own):  # it passes nothing on by name
        return init
    names = {p.name for p in named}
    passed = [p.replace(kind=p.KEYWORD_ONLY) for p in settings.parameters.values() if p.name not in names]
    return inspect.Signature([*named, *passed])


def _say_if_resumed_without_state(trainer: Any) -> None:
    """One line where a run resumes in the middle of an epoch from a checkpoint that holds no place in it (one
    written before cltrain kept it, or by another loader): the epoch is read again from its first batch."""
    progress = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "batch_progress", None)
    done = getattr(getattr(progress, "current", None), "completed", 0)
    if getattr(trainer, "ckpt_path", None) and isinstance(done, int) and done > 0:
        warnings.warn(f"cltrain: {trainer.ckpt_path} holds no place in epoch {trainer.current_epoch} for this loader "
                      f"(written before cltrain kept one): the epoch is read again from its first batch, after "
                      f"{done} batches of it were trained on.", stacklevel=2)


def for_loaded_trainers(cls: type) -> type:
    """``cls``, or where the standalone ``pytorch_lightning`` package is imported, ``cls`` made a DataModule of that
    package's too (its ``Trainer`` asks ``isinstance`` of its own ``LightningDataModule`` and raised "Expected a
    parent"): a subclass of both, made once. Its hooks are ``cls``'s, so ``lightning``'s ``Trainer`` sees no change;
    ``pytorch_lightning``'s calls the base hooks cltrain does not override as its own (the same code)."""
    other = sys.modules.get("pytorch_lightning")
    if other is None or issubclass(cls, other.LightningDataModule):
        return cls
    return _both(cls, other.LightningDataModule)


@functools.cache
def _both(cls: type, other: type) -> type:
    both = type(cls.__name__, (cls, other), {"__module__": cls.__module__, "__doc__": cls.__doc__,
                                            "_single_package": cls})
    both.__qualname__ = cls.__qualname__
    return both


def _remade(cls: type) -> Any:
    """An empty instance of ``cls`` (its state follows), of both packages where ``pytorch_lightning`` is imported."""
    return object.__new__(for_loaded_trainers(cls))


def _unfinished_steps(held: weakref.ref) -> int:
    """Training batches of this epoch that reached the device but whose step did not end (a batch-start hook or the
    step raised): Lightning's progress counts a batch ready before its transfer and processed after its step."""
    loop = getattr(getattr(getattr(held(), "trainer", None), "fit_loop", None), "epoch_loop", None)
    current = getattr(getattr(loop, "batch_progress", None), "current", None)
    ready, processed = getattr(current, "ready", 0), getattr(current, "processed", 0)
    return max(0, ready - processed) if isinstance(ready, int) and isinstance(processed, int) else 0


def _epoch_batches(held: weakref.ref) -> float:
    """The batches Lightning takes from the training loader per epoch (``limit_train_batches`` ends it early)."""
    batches = getattr(getattr(held(), "trainer", None), "num_training_batches", float("inf"))
    return batches if isinstance(batches, (int, float)) and batches > 0 else float("inf")
