"""Demo video data: a small clip folder of moving shapes, drawn locally, never downloaded.

A class is a *motion*: by default six of them, a shape moving right, left, down or up, growing
or shrinking. The shape itself (circle, square, triangle, star or cross), its colour, size,
start, speed (with +-15 degrees of jitter in the direction), spin, the background and its grain
are drawn per clip and tell nothing about the class: no single frame does, only the change
across frames does, so a model has to use time. Each clip is one folder of JPEG frames (``root/{train,val}/<class>/<clip>/<frame>.jpg``), the
layout ``ClipFolderDataModule`` reads. Everything is drawn from
``numpy.random.default_rng([seed, split, class, index])``, and the folder is written once and
reused like ``cltrain.data.make_demo_dataset``'s (same marker file, same
temporary-sibling-then-rename).

Labels depend on left/right: train it without horizontal flips (``hflip=0``).

Example::

    >>> from cltrain.data.video import make_demo_videos
    >>> root = make_demo_videos("/tmp/cltrain-video-demo", train_per_class=2, val_per_class=1)
    >>> sorted(p.name for p in (root / "train").iterdir())[:3]
    ['00_right', '01_left', '02_down']
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from cltrain.data.demo import SHAPES, shape_polygon, hsv_to_rgb255, write_once

__all__ = ["MOTIONS", "draw_demo_clip", "make_demo_videos", "video_class_names"]

#: (name, angle of motion in degrees, image y growing downwards; None for a change of size).
MOTIONS: tuple[tuple[str, float | None], ...] = (
    ("right", 0.0), ("left", 180.0), ("down", 90.0), ("up", 270.0), ("grow", None), ("shrink", None))
_SPLITS = {"train": 0, "val": 1}


def video_class_names(num_classes: int) -> list[str]:
    """Folder names of the demo classes, e.g. ``"00_right"``."""
    return [f"{k:02d}_{MOTIONS[k][0]}" for k in range(num_classes)]


def draw_demo_clip(k: int, rng: np.random.Generator, num_frames: int = 16, size: int = 64) -> list[Image.Image]:
    """The RGB frames (``size`` x ``size``) of one clip of class ``k`` (see the module docstring)."""
    motion, angle = MOTIONS[k]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    bg = np.array(hsv_to_rgb255(rng.uniform(0, 360), rng.uniform(0, 0.35), rng.uniform(0.2, 0.8)), np.float32)
    grain = rng.normal(0.0, rng.uniform(4, 12), size=(size, size, 1)).astype(np.float32)
    background = Image.fromarray(np.clip(bg + grain, 0, 255).astype(np.uint8), "RGB")
    fill = hsv_to_rgb255(rng.uniform(0, 360), rng.uniform(0.55, 1.0), rng.uniform(0.6, 1.0))
    if angle is None:  # grow or shrink by 1.8-2.4x, drifting a little in any direction
        r_small = rng.uniform(0.08, 0.11) * size
        r_big = r_small * rng.uniform(1.8, 2.4)
        r0, r1 = (r_small, r_big) if motion == "grow" else (r_big, r_small)
        travel, theta = rng.uniform(0.0, 0.08) * size, rng.uniform(0, 2 * math.pi)
    else:
        r0 = r1 = rng.uniform(0.11, 0.16) * size
        travel, theta = rng.uniform(0.35, 0.55) * size, math.radians(angle + rng.uniform(-15, 15))
    dx, dy = math.cos(theta) * travel, math.sin(theta) * travel  # first to last frame
    # Start where the whole path keeps the shape inside the frame.
    r = max(r0, r1)
    x0 = rng.uniform(r - min(dx, 0), size - r - max(dx, 0))
    y0 = rng.uniform(r - min(dy, 0), size - r - max(dy, 0))
    spin0, spin = rng.uniform(0, 2 * math.pi), rng.uniform(-0.1, 0.1)
    frames = []
    for t in range(num_frames):
        s = t / max(num_frames - 1, 1)
        img = background.copy()
        points = shape_polygon(shape, x0 + s * dx, y0 + s * dy, r0 + s * (r1 - r0), spin0 + t * spin)
        ImageDraw.Draw(img).polygon(points, fill=fill)
        frames.append(img)
    return frames


def make_demo_videos(root: str | os.PathLike, num_classes: int = 6, train_per_class: int = 48, val_per_class: int = 16,
                     num_frames: int = 16, frame_size: int = 64, seed: int = 0) -> Path:
    """Write (once) a demo clip folder ``root/{train,val}/<class>/<clip>/<frame>.jpg`` and return ``Path(root)``.

    Args:
        root: the folder to create; reused as it is when it holds a complete demo folder
            made with the same arguments.
        num_classes: 2 to 6, the first ``num_classes`` of ``MOTIONS`` (right, left, down, up,
            grow, shrink).
        train_per_class: training clips per class (>= 1).
        val_per_class: validation clips per class (>= 1).
        num_frames: frames per clip (>= 1).
        frame_size: width and height of the frames (16 to 256).
        seed: the seed everything is drawn from.

    Raises:
        ValueError: a bad argument.
        FileExistsError: ``root`` exists and is not a video demo folder made with these arguments.
    """
    if not 2 <= num_classes <= len(MOTIONS):
        raise ValueError(f"make_demo_videos: num_classes={num_classes} must be between 2 and {len(MOTIONS)}.")
    if train_per_class < 1 or val_per_class < 1 or num_frames < 1:
        raise ValueError(f"make_demo_videos: train_per_class={train_per_class}, val_per_class={val_per_class} and "
                         f"num_frames={num_frames} must be >= 1.")
    if not 16 <= frame_size <= 256:
        raise ValueError(f"make_demo_videos: frame_size={frame_size} must be between 16 and 256.")
    params = {"kind": "video", "num_classes": num_classes, "train_per_class": train_per_class, "val_per_class": val_per_class,
              "num_frames": num_frames, "frame_size": frame_size, "seed": seed, "version": 2}

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
