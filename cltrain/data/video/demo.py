"""Demo video data: a small clip folder of moving shapes, drawn locally, never downloaded.

A class is one *shape* moving in one *direction*: with the default six classes,
three shapes (circle, square, triangle) each move right or left, so a single
frame tells the shape (50 % of the way, 3x chance) and only the motion across
frames tells the rest: a model has to use time. Twelve classes add up and down.
The colour, size, start, speed (with +-15 degrees of jitter in the direction),
spin, the background and its grain vary per clip; each clip is one folder of
JPEG frames (``root/{train,val}/<class>/<clip>/<frame>.jpg``), the layout
:class:`~cltrain.data.video.ClipFolderDataModule` reads. Everything is drawn from
``numpy.random.default_rng([seed, split, class, index])``, and the folder is
written once and reused like :func:`cltrain.data.make_demo_dataset`'s (same
marker file, same temporary-sibling-then-rename).

Labels depend on left/right: train it without horizontal flips (``hflip=0``).

Example::

    >>> from cltrain.data.video import make_demo_videos
    >>> root = make_demo_videos("/tmp/cltrain-video-demo", train_per_class=2, val_per_class=1)
    >>> sorted(p.name for p in (root / "train").iterdir())[:2]
    ['00_circle_right', '01_square_right']
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from cltrain.data.demo import _polygon, _rgb, write_once

__all__ = ["DIRECTIONS", "VIDEO_SHAPES", "draw_demo_clip", "make_demo_videos", "video_class_names"]

VIDEO_SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
#: (name, angle of motion in degrees; image y grows downwards).
DIRECTIONS: tuple[tuple[str, float], ...] = (("right", 0.0), ("left", 180.0), ("down", 90.0), ("up", 270.0))
_SPLITS = {"train": 0, "val": 1}


def _class_spec(k: int) -> tuple[str, str, float]:
    """(shape, direction name, direction angle) of class ``k``: shapes vary fastest."""
    name, angle = DIRECTIONS[k // len(VIDEO_SHAPES)]
    return VIDEO_SHAPES[k % len(VIDEO_SHAPES)], name, angle


def video_class_names(num_classes: int) -> list[str]:
    """Folder names of the demo classes, e.g. ``"00_circle_right"``."""
    return [f"{k:02d}_{_class_spec(k)[0]}_{_class_spec(k)[1]}" for k in range(num_classes)]


def draw_demo_clip(k: int, rng: np.random.Generator, num_frames: int = 16, size: int = 64) -> list[Image.Image]:
    """The RGB frames (``size`` x ``size``) of one clip of class ``k`` (see the module docstring)."""
    shape, _, angle = _class_spec(k)
    bg = np.array(_rgb(rng.uniform(0, 360), rng.uniform(0, 0.35), rng.uniform(0.2, 0.8)), np.float32)
    grain = rng.normal(0.0, rng.uniform(4, 12), size=(size, size, 1)).astype(np.float32)
    background = Image.fromarray(np.clip(bg + grain, 0, 255).astype(np.uint8), "RGB")
    fill = _rgb(rng.uniform(0, 360), rng.uniform(0.55, 1.0), rng.uniform(0.6, 1.0))
    r = rng.uniform(0.10, 0.16) * size
    travel = rng.uniform(0.35, 0.55) * size  # first to last frame
    theta = math.radians(angle + rng.uniform(-15, 15))
    dx, dy = math.cos(theta) * travel, math.sin(theta) * travel
    # Start where the whole path keeps the shape inside the frame.
    x0 = rng.uniform(r - min(dx, 0), size - r - max(dx, 0))
    y0 = rng.uniform(r - min(dy, 0), size - r - max(dy, 0))
    spin0, spin = rng.uniform(0, 2 * math.pi), rng.uniform(-0.1, 0.1)
    frames = []
    for t in range(num_frames):
        s = t / max(num_frames - 1, 1)
        img = background.copy()
        ImageDraw.Draw(img).polygon(_polygon(shape, x0 + s * dx, y0 + s * dy, r, spin0 + t * spin), fill=fill)
        frames.append(img)
    return frames


def make_demo_videos(root: str | os.PathLike, num_classes: int = 6, train_per_class: int = 60, val_per_class: int = 20,
                     num_frames: int = 16, frame_size: int = 64, seed: int = 0) -> Path:
    """Write (once) a demo clip folder ``root/{train,val}/<class>/<clip>/<frame>.jpg`` and return ``Path(root)``.

    Args:
        root: the folder to create; reused as it is when it holds a complete demo folder
            made with the same arguments.
        num_classes: 2 to 12 (3 shapes x 4 directions; 6: right and left only).
        train_per_class, val_per_class: clips per class in each split (>= 1).
        num_frames: frames per clip (>= 1).
        frame_size: width and height of the frames (16 to 256).
        seed: the seed everything is drawn from.

    Raises:
        ValueError: a bad argument.
        FileExistsError: ``root`` exists and is not a video demo folder made with these arguments.
    """
    if not 2 <= num_classes <= len(VIDEO_SHAPES) * len(DIRECTIONS):
        raise ValueError(f"make_demo_videos: num_classes={num_classes} must be between 2 and {len(VIDEO_SHAPES) * len(DIRECTIONS)}.")
    if train_per_class < 1 or val_per_class < 1 or num_frames < 1:
        raise ValueError(f"make_demo_videos: train_per_class={train_per_class}, val_per_class={val_per_class} and "
                         f"num_frames={num_frames} must be >= 1.")
    if not 16 <= frame_size <= 256:
        raise ValueError(f"make_demo_videos: frame_size={frame_size} must be between 16 and 256.")
    params = {"kind": "video", "num_classes": num_classes, "train_per_class": train_per_class, "val_per_class": val_per_class,
              "num_frames": num_frames, "frame_size": frame_size, "seed": seed, "version": 1}

    def fill(tmp: Path) -> None:
        for split, per_class in (("train", train_per_class), ("val", val_per_class)):
            for k, name in enumerate(video_class_names(num_classes)):
                for i in range(per_class):
                    folder = tmp / split / name / f"{i:05d}"
                    folder.mkdir(parents=True)
                    rng = np.random.default_rng([seed, _SPLITS[split], k, i])
                    for t, frame in enumerate(draw_demo_clip(k, rng, num_frames, frame_size)):
                        frame.save(folder / f"{t:03d}.jpg", quality=90)

    return write_once(root, params, fill, "make_demo_videos")
