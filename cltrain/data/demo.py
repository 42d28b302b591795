"""Demo data: a small ImageNet-layout folder of real JPEG files, drawn locally, never downloaded.

Ten classes by default. A class is one *shape* in one *colour family*, and every
colour family is shared by two classes while every shape is shared by two
classes, so colour alone gets a model to 50 % quickly (5x chance with ten
classes) and only the shape tells the last two apart. Backgrounds are noisy
two-colour gradients with a few grey distractor blobs; position, size,
rotation, hue, saturation, brightness and JPEG quality (75-95) vary per image.
Everything is drawn from ``numpy.random.default_rng([seed, split, class, index])``,
so a folder is the same byte for byte on every machine with the same Pillow.

The folder is written to a temporary sibling and renamed into place when
complete, with a marker file holding the parameters; a later call with the same
parameters reuses it, and an existing folder that is not such a demo folder is
never touched.

Example::

    >>> from cltrain.data import make_demo_dataset
    >>> root = make_demo_dataset("/tmp/cltrain-demo", train_per_class=4, val_per_class=2)
    >>> sorted(p.name for p in root.iterdir())
    ['.cltrain_demo.json', 'train', 'val']
"""

from __future__ import annotations

import colorsys
import json
import math
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from cltrain.atomic import is_this_machine, pid_running, this_machine

__all__ = ["MARKER", "NotADemoFolder", "draw_demo_folder", "hsv_to_rgb255", "make_demo_dataset", "shape_polygon", "write_once"]

#: Written last into a complete demo folder; holds the parameters it was made with.
MARKER = ".cltrain_demo.json"

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross")
#: Colour families as (name, hue in degrees).
COLOURS: tuple[tuple[str, float], ...] = (("red", 0.0), ("yellow", 55.0), ("green", 125.0), ("blue", 225.0), ("magenta", 300.0))
_SPLITS = {"train": 0, "val": 1}
_STALE_AFTER_S = 24 * 3600  # a temporary folder of another host untouched this long is a dead writer's


class NotADemoFolder(FileExistsError):
    """A demo's root holds a folder the demo did not write (the user's own images, maybe): left untouched."""


def _class_spec(k: int) -> tuple[str, int]:
    """(shape, colour index) of class ``k``: shape ``k % 5``; colour = shape for the first
    five classes, shifted by two for the next five, and so on."""
    shape = k % len(SHAPES)
    colour = (shape + 2 * (k // len(SHAPES))) % len(COLOURS)
    return SHAPES[shape], colour


def class_names(num_classes: int) -> list[str]:
    """Folder names of the demo classes, e.g. ``"00_red_circle"``."""
    return [f"{k:02d}_{COLOURS[_class_spec(k)[1]][0]}_{_class_spec(k)[0]}" for k in range(num_classes)]


def shape_polygon(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    """The vertices of ``shape`` (circle, square, triangle, ...) of radius ``r`` at (``cx``, ``cy``), turned by ``angle``."""
    if shape == "circle":
        radii, n = [r], 48
    elif shape == "square":
        radii, n = [r], 4
    elif shape == "triangle":
        radii, n = [r * 1.15], 3
    elif shape == "star":
        radii, n = [r * 1.15, r * 0.45], 10
    else:  # cross: 12 corners of a plus sign, alternating outer and inner radius
        a = math.atan2(0.3, 1.0)
        pts = []
        for q in range(4):
            base = angle + q * math.pi / 2
            for da, rr in ((-a, r), (a, r), (math.pi / 4, r * 0.3 * math.sqrt(2))):
                pts.append((cx + rr * math.cos(base + da), cy + rr * math.sin(base + da)))
        return pts
    return [
        (cx + radii[i % len(radii)] * math.cos(angle + 2 * math.pi * i / n),
         cy + radii[i % len(radii)] * math.sin(angle + 2 * math.pi * i / n))
        for i in range(n)
    ]


def hsv_to_rgb255(hue_deg: float, sat: float, val: float) -> tuple[int, int, int]:
    """An HSV colour (hue in degrees, saturation and value in 0-1) as 0-255 RGB."""
    r, g, b = colorsys.hsv_to_rgb((hue_deg % 360.0) / 360.0, sat, val)
    return int(r * 255), int(g * 255), int(b * 255)


def draw_demo_image(k: int, rng: np.random.Generator, size: tuple[int, int] = (500, 375)) -> Image.Image:
    """One RGB image of class ``k`` (see the module docstring), ``size`` = (width, height)."""
    w, h = size
    # Background: a gradient between two dull colours, plus grain.
    c0, c1 = (np.array(hsv_to_rgb255(rng.uniform(0, 360), rng.uniform(0, 0.35), rng.uniform(0.25, 0.9)), np.float32) for _ in range(2))
    theta = rng.uniform(0, 2 * math.pi)
    t = (np.cos(theta) * np.linspace(0, 1, w, dtype=np.float32)[None, :]
         + np.sin(theta) * np.linspace(0, 1, h, dtype=np.float32)[:, None])
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    bg = c0 + t[..., None] * (c1 - c0)
    bg += rng.normal(0.0, rng.uniform(4, 14), size=(h, w, 1)).astype(np.float32)
    img = Image.fromarray(np.clip(bg, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    short = min(w, h)
    for _ in range(int(rng.integers(0, 4))):  # grey distractors
        r = rng.uniform(0.04, 0.12) * short
        x, y = rng.uniform(0, w), rng.uniform(0, h)
        g = int(rng.uniform(40, 220))
        draw.ellipse((x - r, y - r * rng.uniform(0.5, 1.5), x + r, y + r), fill=(g, g, g))
    shape, colour = _class_spec(k)
    r = rng.uniform(0.15, 0.32) * short
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    fill = hsv_to_rgb255(COLOURS[colour][1] + rng.uniform(-12, 12), rng.uniform(0.55, 1.0), rng.uniform(0.55, 1.0))
    draw.polygon(shape_polygon(shape, cx, cy, r, rng.uniform(0, 2 * math.pi)), fill=fill)
    return img


def _params(num_classes: int, train_per_class: int, val_per_class: int, image_size: tuple[int, int], seed: int) -> dict:
    return {"num_classes": num_classes, "train_per_class": train_per_class, "val_per_class": val_per_class,
            "image_size": list(image_size), "seed": seed, "version": 1}


def make_demo_dataset(root: str | os.PathLike, num_classes: int = 10, train_per_class: int = 100,
                      val_per_class: int = 20, image_size: tuple[int, int] = (500, 375), seed: int = 0) -> Path:
    """Write (once) a demo folder ``root/{train,val}/<class>/<n>.jpg`` and return ``Path(root)``.

    Args:
        root: the folder to create. Reused as it is when it holds a complete demo
            folder made with the same arguments.
        num_classes: number of classes, 1 to 25 (5 shapes x 5 colour families).
        train_per_class: training images per class (>= 1).
        val_per_class: validation images per class (>= 1).
        image_size: (width, height) of every image.
        seed: the seed everything is drawn from.

    Raises:
        ValueError: a bad argument.
        FileExistsError: ``root`` exists and is not a demo folder made with these arguments
            (it is left untouched; pass another root or delete it).
    """
    if not 1 <= num_classes <= len(SHAPES) * len(COLOURS):
        raise ValueError(f"make_demo_dataset: num_classes={num_classes} must be between 1 and {len(SHAPES) * len(COLOURS)}.")
    if train_per_class < 1 or val_per_class < 1:
        raise ValueError(f"make_demo_dataset: train_per_class={train_per_class} and val_per_class={val_per_class} must be >= 1.")
    if len(image_size) != 2 or min(image_size) < 16:
        raise ValueError(f"make_demo_dataset: image_size={image_size!r} must be (width, height), each >= 16.")
    params = _params(num_classes, train_per_class, val_per_class, tuple(image_size), seed)

    return write_once(root, params, lambda tmp: draw_demo_folder(tmp, num_classes, train_per_class, val_per_class,
                                                                 tuple(image_size), seed), "make_demo_dataset")


def _draw_into(job: tuple[Path, int, list[int], tuple[int, int]]) -> None:
    path, k, seed, size = job
    rng = np.random.default_rng(seed)
    draw_demo_image(k, rng, size).save(path, quality=int(rng.integers(75, 96)))


def draw_demo_folder(folder: Path, num_classes: int, train_per_class: int, val_per_class: int,
                     image_size: tuple[int, int], seed: int = 0, workers: int = 0) -> None:
    """Draw the files of :func:`make_demo_dataset` into ``folder`` (not checked, not written once), in ``workers``
    forked processes (0: in this one; fork before CUDA is initialised): the same files either way."""
    jobs = []
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for k, name in enumerate(class_names(num_classes)):
            (folder / split / name).mkdir(parents=True)
            jobs += [(folder / split / name / f"{i:05d}.jpg", k, [seed, _SPLITS[split], k, i], tuple(image_size))
                     for i in range(per_class)]
    if workers > 0:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            pool.map(_draw_into, jobs, chunksize=16)
    else:
        for job in jobs:
            _draw_into(job)


def _remove_stale_tmp(root: Path) -> list[Path]:
    """Delete the temporary folders that killed generations of ``root`` left behind.

    A folder ``.<name>.tmp-<host>-<pid>`` is stale when its process is gone: on this host (``this_machine``), a
    pid that is not alive; from another host or container (a shared filesystem), untouched for a day.
    A live writer's folder is never touched.
    """
    removed = []
    for tmp in root.parent.glob(f".{root.name}.tmp-*"):
        owner, _, pid = tmp.name[len(f".{root.name}.tmp-"):].rpartition("-")
        if not pid.isdigit():
            continue
        if is_this_machine(owner) or not owner:  # "" : the older .<name>.tmp-<pid> form, written on this host
            stale = not pid_running(int(pid))
        else:
            try:
                stale = time.time() - tmp.stat().st_mtime > _STALE_AFTER_S
            except OSError:
                continue
        if stale:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


def write_once(root: str | os.PathLike, params: dict, fill: Callable[[Path], None], owner: str) -> Path:
    """Make the folder ``root`` once: ``fill`` writes into a temporary sibling, the ``MARKER``
    file (holding ``params``) is written last, then the folder is renamed into place. A
    complete folder made with the same ``params`` is reused as it is; any other existing
    ``root`` is left untouched (``FileExistsError``, prefixed by ``owner``)."""
    root = Path(root)
    if root.exists():
        marker = root / MARKER
        if marker.is_file() and json.loads(marker.read_text()) == params:
            return root
        if marker.is_file():
            raise FileExistsError(f"{owner}: {root} exists and is a demo folder made with other arguments "
                                  f"({marker.read_text().strip()}); it is left untouched. Pass another root, or delete "
                                  "it to have it written again.")
        raise NotADemoFolder(f"{owner}: {root} exists and is not a cltrain demo folder; it is left untouched. To "
                             "train on the images in it, read it as an image folder (data=imagenet "
                             f"data.root={root} in the app, ImageFolderDataModule in code); for the demo, pass a root "
                             "that does not exist yet.")
    _remove_stale_tmp(root)
    tmp = root.parent / f".{root.name}.tmp-{this_machine()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        fill(tmp)
        (tmp / MARKER).write_text(json.dumps(params))
        try:
            tmp.rename(root)
        except OSError:
            if not (root / MARKER).is_file():  # not a concurrent writer that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root
