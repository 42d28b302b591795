"""Every DataModule acts on every argument it takes, and refuses the others with one line.

For each DataModule and each argument of its signature, two DataModules are built on tiny real
data: one with the probe's base arguments, one with the argument changed; what the probe
observes downstream (a batch as a step receives it, the loader, the set-up outcome, the files
written) must differ. Each argument that some DataModule takes but this one does not must be
refused: a ``TypeError`` naming it.
"""

from __future__ import annotations

import inspect
import random
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from cltrain.data import Augmentation, HFImageDataModule, ImageFolderDataModule, ShardsDataModule
from cltrain.data.pack import pack
from cltrain.data.video import ClipFolderDataModule, make_demo_videos
from tests.helpers.data_fixtures import write_image_folder, write_jpegs

DATAMODULES = {"images": ImageFolderDataModule, "shards": ShardsDataModule, "hf": HFImageDataModule,
               "clips": ClipFolderDataModule}
BASE = {  # small and in-process: every probe loads one batch in the main process
    "images": dict(batch_size=4, num_workers=0, decode_threads=1, image_size=16, val_resize_size=18),
    "shards": dict(batch_size=4, num_workers=0, decode_threads=1, image_size=16, val_resize_size=18),
    "hf": dict(batch_size=4, num_workers=0, decode_threads=1, image_size=16, val_resize_size=18),
    "clips": dict(batch_size=2, num_workers=0, image_size=16, val_resize_size=18, num_frames=3),
}


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("arguments")
    images = write_image_folder(tmp / "images", classes=2, train=4, val=3, size=(64, 48))
    rotated = images / "val" / "c0" / "0_000.jpg"  # the first validation image, turned by its EXIF orientation
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.open(rotated).save(rotated, exif=exif, quality=85)
    bad = Path(shutil.copytree(images, tmp / "bad"))
    (bad / "val" / "c0" / "0_bad.jpg").write_text("not an image\n")
    missing = Path(shutil.copytree(images, tmp / "missing"))
    write_jpegs(missing / "train" / "c2", 4, (64, 48), k=2)
    clips = make_demo_videos(tmp / "clips", num_classes=2, train_per_class=2, val_per_class=2, num_frames=6, frame_size=24)
    bad_clips = Path(shutil.copytree(clips, tmp / "bad_clips"))
    bad_clip = sorted((bad_clips / "val").glob("*/*/"))[0]
    for frame in bad_clip.iterdir():  # the first validation clip: unreadable
        frame.write_text("not an image\n")
    (tmp / "bad.tsv").write_text(f"{bad / 'val' / 'c0' / '0_bad.jpg'}\n{bad_clip}\n")
    return dict(images=images, bad=bad, bad_list=tmp / "bad.tsv", missing=missing, index_cache=tmp / "index",
                shards=pack(images, tmp / "pack", shard_size=3, progress=False).parent, clips=clips, bad_clips=bad_clips,
                bad_shards=pack(bad, tmp / "bad_pack", shard_size=3, progress=False, check="off").parent,
                hf=_hf_dataset(images, tmp / "hf"), bad_hf=_hf_dataset(bad, tmp / "bad_hf"),
                remote=_in_memory(tmp / "pack", tmp.name), cache=tmp / "cache")


def _in_memory(folder: Path, name: str) -> str:
    """The pack at a URL (fsspec's in-process ``memory://`` file system): what a bucket's pack goes through, the
    node's shard cache included, without a server."""
    import fsspec

    fsspec.filesystem("memory").put(str(folder), f"/{name}", recursive=True)
    return f"memory://{name}"


def _hf_dataset(folder: Path, out: Path) -> Path:
    """The folder's files as a Hugging Face dataset written by ``save_to_disk`` (the rows hold the files' bytes),
    with a second image column (mirrored) and a second ClassLabel (one class) for the column arguments."""
    datasets = pytest.importorskip("datasets")
    import io

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["c0", "c1"]),
                                  "mirrored": datasets.Image(), "coarse": datasets.ClassLabel(names=["any"])})
    splits = {}
    for split, name in (("train", "train"), ("val", "validation")):
        files = sorted((folder / split).glob("*/*.jpg"))
        mirrored = []
        for f in files:
            buf = io.BytesIO()
            try:
                with Image.open(f) as img:
                    img.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(buf, format="JPEG", quality=85)
            except OSError:  # the bad folder's unreadable file: unreadable in both columns
                buf.write(f.read_bytes())
            mirrored.append({"bytes": buf.getvalue(), "path": None})
        images = [{"bytes": f.read_bytes(), "path": f.name} for f in files]
        labels = [int(f.parent.name[1]) for f in files]
        splits[name] = datasets.Dataset.from_dict(
            {"image": images, "label": labels, "mirrored": mirrored, "coarse": [0] * len(files)}, features=features)
    datasets.DatasetDict(splits).save_to_disk(str(out))
    return out


# --- what a probe observes -------------------------------------------------------------------------

def _fingerprint(batch: Any) -> tuple:
    """A batch as comparable values: each tensor's dtype, shape, layout and contents."""
    out = []
    for t in batch:
        layout = t.is_contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
        out.append((t.dtype, tuple(t.shape), layout, t.float().contiguous().numpy().tobytes()))
    return tuple(out)


def val_batch(dm: Any) -> tuple:
    """The first validation batch as a validation step receives it."""
    dm.setup("fit")
    return _fingerprint(dm.on_after_batch_transfer(next(iter(dm.val_dataloader())), 0))


def train_batch(dm: Any) -> tuple:
    """The first training batch as a training step receives it (same seeds for both DataModules)."""
    dm.setup("fit")
    dm.trainer = SimpleNamespace(training=True)  # device-side augmentation runs on training batches only
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    return _fingerprint(dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0))


def loader(attribute: str, device: str = "cpu") -> Callable[[Any], Any]:
    """An attribute of the validation loader built for ``device``."""
    def probe(dm: Any) -> Any:
        dm.setup("fit")
        dm._device = torch.device(device)
        return getattr(dm.val_dataloader(), attribute)
    return probe


def outcome(dm: Any) -> str:
    """Where a set-up and a validation pass stop, and why."""
    try:
        dm.setup("fit")
    except Exception as err:
        return f"setup: {type(err).__name__}"
    try:
        for _ in dm.val_dataloader():
            pass
    except Exception as err:
        return f"loading: {type(err).__name__}"
    return "ok"


def decode_threads_used(dm: Any) -> bool:
    """Whether the validation images were decoded on the decode pool's threads."""
    inner, names = dm.eval_transform, set()

    class Recording:
        takes_paths = getattr(inner, "takes_paths", False)

        def __call__(self, image: Any) -> Any:
            names.add(threading.current_thread().name.startswith("cltrain-decode"))
            return inner(image)

    dm.eval_transform = Recording()
    val_batch(dm)
    return True in names


def dataset_kind(dm: Any) -> str:
    """The class of the validation Dataset set-up builds."""
    dm.setup("fit")
    return type(dm.val_set).__name__


def index_written(roots: dict[str, Path]) -> Callable[[Any], bool]:
    def probe(dm: Any) -> bool:
        dm.setup("fit")
        return roots["index_cache"].is_dir() and any(roots["index_cache"].iterdir())
    return probe


def cached_shards(roots: dict[str, Path]) -> Callable[[Any], tuple[str, ...]]:
    """The shard files a validation batch left in the cache folder of ``roots``."""
    def probe(dm: Any) -> tuple[str, ...]:
        shutil.rmtree(roots["cache"], ignore_errors=True)
        val_batch(dm)
        return tuple(sorted(p.name for p in roots["cache"].rglob("*.tar")))
    return probe


def warned(dm: Any) -> list[str]:
    """What a set-up warns about."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm.setup("fit")
    return [str(w.message).split(":")[0] for w in caught]


@dataclass
class Probe:
    """Change an argument to ``value`` on top of ``base`` and observe it with ``observe``."""

    value: Any
    observe: Callable[[Any], Any]
    base: dict[str, Any] = field(default_factory=dict)
    root: str | None = None  # another folder of ``roots`` than the DataModule's own


def probes(roots: dict[str, Path]) -> dict[str, Probe]:
    """One probe per argument name that any DataModule takes."""
    mixing = dict(mixup_alpha=1.0, cutmix_alpha=1.0)
    return {
        "batch_size": Probe(1, val_batch),
        "num_workers": Probe(1, loader("num_workers")),
        "persistent_workers": Probe(False, loader("persistent_workers"), dict(num_workers=1)),
        "pin_memory": Probe(True, loader("pin_memory"), dict(num_workers=1)),
        "image_size": Probe(12, val_batch),
        "val_resize_size": Probe(None, val_batch),
        "channels": Probe(1, val_batch, dict(mean=(0.5,), std=(0.25,))),
        "mean": Probe((0.1, 0.2, 0.3), val_batch),
        "std": Probe((0.1, 0.2, 0.3), val_batch),
        "dtype": Probe(torch.bfloat16, val_batch),
        "channels_last": Probe(False, val_batch),
        "cuda_prefetch": Probe(True, loader("prefetch_device", "cuda")),
        "interpolation": Probe("bicubic", val_batch),
        "exif_transpose": Probe(True, val_batch),
        "decode_threads": Probe(2, decode_threads_used),
        "decoder": Probe("pillow", train_batch),  # Pillow crops the float box, the JPEG path whole pixels
        "val_reduce": Probe(True, val_batch),  # 48 px high, resized to 18: decoded at 1/2
        "augmentation": Probe(Augmentation(scale=(1.0, 1.0), hflip=0.0), train_batch),
        "scale": Probe((1.0, 1.0), train_batch),
        "ratio": Probe((0.5, 0.5), train_batch),
        "hflip": Probe(1.0, train_batch, dict(hflip=0.0)),
        "augment": Probe("randaugment", train_batch),
        "random_erasing": Probe(1.0, train_batch),
        "mixup_alpha": Probe(1.0, train_batch),
        "cutmix_alpha": Probe(1.0, train_batch),
        "mixup_prob": Probe(0.0, train_batch, mixing),
        "mixup_switch_prob": Probe(1.0, train_batch, {**mixing, "mixup_switch_prob": 0.0}),
        "bad_files": Probe("skip", outcome, root="bad"),
        "check_val": Probe("off", outcome, root="bad"),
        "exclude_files": Probe(roots["bad_list"], outcome, root="bad"),
        "allow_missing_val_classes": Probe(True, outcome, root="missing"),
        "index_cache": Probe(roots["index_cache"], index_written(roots)),
        "seed": Probe(1, train_batch),
        "shuffle_window": Probe(1, train_batch),
        "num_frames": Probe(2, val_batch),
        "frame_stride": Probe(2, val_batch),
        "val_temporal": Probe("uniform", val_batch),
        "streaming": Probe(True, dataset_kind),
        "train_split": Probe("validation", train_batch),
        "val_split": Probe("train", val_batch),
        "image_column": Probe("mirrored", val_batch),
        "label_column": Probe("coarse", val_batch),
        "shuffle_buffer": Probe(1, train_batch, dict(streaming=True)),
        "shuffle_seed": Probe(1, train_batch, dict(streaming=True)),
        # a pack at a URL: its node-local shard cache
        "cache_dir": Probe(roots["cache"].parent / "elsewhere", cached_shards(roots), dict(cache_dir=roots["cache"]),
                           root="remote"),
        "fetch": Probe("ranges", cached_shards(roots), dict(cache_dir=roots["cache"]), root="remote"),
        "cache_limit": Probe(10, warned, dict(cache_dir=roots["cache"]), root="remote"),
    }


# each DataModule's counterpart of a folder with a bad file (a pack made without the check holds it)
BAD_ROOTS = {"clips": {"bad": "bad_clips"}, "shards": {"bad": "bad_shards"}, "hf": {"bad": "bad_hf"}}
ALL_NAMES = sorted({p.name for cls in DATAMODULES.values() for p in inspect.signature(cls).parameters.values()
                    if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"root"})
CASES = [(kind, name) for kind in DATAMODULES for name in ALL_NAMES]


@pytest.mark.parametrize(("kind", "name"), CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_each_argument_is_acted_on_or_refused_in_one_line(kind: str, name: str, roots: dict[str, Path]) -> None:
    cls, probe = DATAMODULES[kind], probes(roots)[name]
    root = roots[BAD_ROOTS.get(kind, {}).get(probe.root, probe.root) or kind]
    base = {**BASE[kind], **probe.base}
    if name not in inspect.signature(cls).parameters:
        try:
            cls(roots[kind], **BASE[kind], **{name: probe.value})
        except (TypeError, ValueError) as err:
            assert name in str(err) and "\n" not in str(err)
            return
    value = probe.value
    if isinstance(value, bool) and inspect.signature(cls).parameters[name].default is value:
        value = not value  # a flag on by default here (exif_transpose of a Hugging Face dataset): turned off
    before = probe.observe(cls(root, **base))  # taken (by name or by **kwargs): it must change something
    after = probe.observe(cls(root, **{**base, name: value}))
    assert before != after, f"{cls.__name__}({name}={value!r}) changed nothing that {probe.observe.__name__} sees"


@pytest.mark.parametrize("cls", DATAMODULES.values(), ids=DATAMODULES.keys())
def test_signatures_name_every_argument(cls: type) -> None:
    var = [p.name for p in inspect.signature(cls).parameters.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert not var, f"{cls.__name__} takes {var}: what it does with them is not in its signature"


OWN_FLAG = {ImageFolderDataModule: ("check_val", "off", "off"), ShardsDataModule: ("seed", "3", 3),
            HFImageDataModule: ("streaming", "true", True)}


@pytest.mark.parametrize("cls", list(OWN_FLAG), ids=["images", "shards", "hf"])
def test_lightning_cli_reads_every_argument_with_its_type(cls: type) -> None:
    jsonargparse = pytest.importorskip("jsonargparse")  # what LightningCLI reads a DataModule's arguments with
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "data")
    assert set(vars(parser.get_defaults().data)) == set(inspect.signature(cls).parameters)
    name, text, value = OWN_FLAG[cls]
    flags = ["--data.root=/x", "--data.batch_size=8", "--data.scale=[0.5, 1.0]", f"--data.{name}={text}"]
    data = parser.parse_args(flags).data
    assert (data.batch_size, data.scale, getattr(data, name)) == (8, [0.5, 1.0], value)
    with pytest.raises(jsonargparse.ArgumentError):
        parser.parse_args(["--data.root=/x", "--data.batch_size=eight"])


def test_every_argument_has_a_probe(roots: dict[str, Path]) -> None:
    assert not set(ALL_NAMES) - set(probes(roots))


def test_augmentation_is_one_group_given_whole_or_as_keywords(roots: dict[str, Path]) -> None:
    group = Augmentation(hflip=0.0, augment="trivialaugment", mixup_alpha=0.8)
    for cls in (ImageFolderDataModule, ShardsDataModule):
        root = roots["images" if cls is ImageFolderDataModule else "shards"]
        assert cls(root, augmentation=group).augmentation == group
        assert cls(root, hflip=0.0, augment="trivialaugment", mixup_alpha=0.8).augmentation == group
        with pytest.raises(ValueError, match="pass hflip inside augmentation=Augmentation"):
            cls(root, augmentation=group, hflip=1.0)
    with pytest.raises(ValueError, match="mixup_prob=1.5"):
        Augmentation(mixup_prob=1.5)
    with pytest.raises(ValueError, match="cutmix_alpha=-1"):
        ImageFolderDataModule(roots["images"], cutmix_alpha=-1)


def test_decoder_is_checked_once_in_the_constructor_and_reaches_both_transforms(roots: dict[str, Path]) -> None:
    for cls in (ImageFolderDataModule, ShardsDataModule):
        root = roots["images" if cls is ImageFolderDataModule else "shards"]
        with pytest.raises(ValueError, match=rf"^{cls.__name__}: decoder='libjpeg' is not a decoder") as err:
            cls(root, decoder="libjpeg")
        assert "\n" not in str(err.value)
        dm = cls(root, **BASE["images"], decoder="pillow")
        dm.setup("fit")
        assert dm.train_set.transform.decoder == dm.val_set.transform.decoder == "pillow"


@pytest.mark.parametrize("kind", ["images", "shards"])
def test_auto_workers_and_threads_follow_the_loading_plan(roots, kind):
    from cltrain.data.loader_threads import loading_plan

    cls = DATAMODULES[kind]
    base = {k: v for k, v in BASE[kind].items() if k not in ("num_workers", "decode_threads")}
    dm = cls(roots[kind], **base)  # both "auto" by default
    assert (dm.num_workers, dm.decode_threads) == loading_plan()
    dm = cls(roots[kind], **base, num_workers=3)  # threads for each of 3 processes
    assert (dm.num_workers, dm.decode_threads) == loading_plan(3)
    with pytest.raises(ValueError, match="decode_threads='many'"):
        cls(roots[kind], **base, decode_threads="many")


def test_the_loading_plan_splits_the_cores():
    from cltrain.data.loader_threads import loading_plan

    assert [loading_plan(cores=c) for c in (1, 2, 4, 8, 16)] == [(0, 1), (0, 2), (0, 4), (2, 4), (4, 4)]
    assert loading_plan(2, cores=8) == (2, 4) and loading_plan(4, cores=2) == (4, 1)


def test_one_channel_with_the_rgb_statistics_says_which_to_pass(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^ImageFolderDataModule: channels=1 takes one mean and one std value, not "
                                         r"mean=\(0\.485, 0\.456, 0\.406\).*pass mean=\(0\.449,\), std=\(0\.226,\)") as info:
        ImageFolderDataModule(tmp_path, channels=1)
    assert "\n" not in str(info.value)
    assert ImageFolderDataModule(tmp_path, channels=1, mean=(0.449,), std=(0.226,)).pixels.mean == (0.449,)


class _Noisy(ImageFolderDataModule):
    """A user's DataModule with an argument of its own, passing the rest on."""

    def __init__(self, root: str, extra_noise: float = 0.0, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.extra_noise = extra_noise


class _NoisyFolders(_Noisy):
    """Its subclass, with no ``__init__`` of its own."""


def test_a_subclass_with_an_argument_of_its_own_keeps_it_beside_the_settings(tmp_path: Path) -> None:
    names = list(inspect.signature(_Noisy).parameters)
    assert names[:3] == ["root", "extra_noise", "batch_size"]
    assert list(inspect.signature(_NoisyFolders).parameters) == names  # inherited by a subclass that adds none
    assert set(inspect.signature(ImageFolderDataModule).parameters) <= set(names)
    jsonargparse = pytest.importorskip("jsonargparse")  # as LightningCLI reads it
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(_Noisy, "data")
    data = parser.parse_args(["--data.root=/x", "--data.extra_noise=0.5", "--data.batch_size=8"]).data
    assert (data.extra_noise, data.batch_size) == (0.5, 8)
    made = _Noisy(tmp_path, extra_noise=0.5, batch_size=8)
    assert (made.extra_noise, made.batch_size) == (0.5, 8)


@pytest.mark.parametrize("cls, kwargs, instead", [
    (ShardsDataModule, {"check_val": "full"}, ": an option of ImageFolderDataModule, not of ShardsDataModule"),
    (ImageFolderDataModule, {"shuffle_window": 64}, ": an option of ShardsDataModule, not of ImageFolderDataModule"),
    (ImageFolderDataModule, {"image_key": "jpg"}, ": an option of LitDataModule, MDSModule, not of "
                                                  "ImageFolderDataModule"),
    (ShardsDataModule, {"batchsize": 8}, "; did you mean batch_size?"),
    (ImageFolderDataModule, {"frobnicate": 1}, ""),
])
def test_an_argument_a_datamodule_does_not_take_says_which_takes_it(cls, kwargs, instead, tmp_path: Path) -> None:
    # the folder-only options were a bare "unexpected keyword argument" where the guide says the pack refuses them
    (name,) = kwargs
    with pytest.raises(TypeError) as refused:
        cls(tmp_path, **kwargs)
    assert str(refused.value) == f"{cls.__name__}: got an unexpected keyword argument '{name}'{instead}"
