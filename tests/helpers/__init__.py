"""What the tests share: the repository root, the tiny demo set's sizes, and its Hydra overrides."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

#: The checkout's root (``train.py``, ``scripts/``).
REPO = Path(__file__).resolve().parents[2]

#: The tiny demo set most tests train on: 4 classes, 8 training and 4 validation JPEGs each, 64x48.
TINY_DEMO: dict[str, Any] = {"num_classes": 4, "train_per_class": 8, "val_per_class": 4, "image_size": [64, 48]}


#: The smoke experiment on timm's ``test_resnet`` (a ResNet with BatchNorm, 0.47 M parameters against ResNet-18's 11.7 M,
#: a 5 MB checkpoint against 89 MB): the app's tests exercise the app, and its runs take half the time.
SMOKE: list[str] = ["experiment=smoke", "model=timm", "model.name=test_resnet"]


def demo_overrides(root: Path, demo: dict[str, Any] = TINY_DEMO) -> list[str]:
    """The ``data.root`` / ``data.demo.*`` overrides that point ``train.py`` at a demo set made with ``demo``."""
    return [f"data.root={root}", *(f"data.demo.{k}={v}".replace(" ", "") for k, v in demo.items())]


def shm_entries() -> set[str]:
    """The names in ``/dev/shm`` now (empty where there is none)."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def shm_left_behind(before: set[str], settle: float = 10.0) -> set[str]:
    """The ``/dev/shm`` files made since ``before`` that no live process maps or holds open: what a finished run
    left behind (torch's shared tensors and multiprocessing's semaphores are files). Another test running beside this
    one (pytest-xdist) makes its own entries, which it still maps, or folders (joblib's memory-mapping folder, which
    joblib removes when it pleases); Python's resource tracker unlinks a killed process's semaphores a moment after the
    process ends, so entries get ``settle`` seconds to go."""
    deadline = time.monotonic() + settle
    while True:
        new = shm_entries() - before
        if not new:
            return new
        inodes = {}
        for name in new:
            try:
                st = os.stat(f"/dev/shm/{name}")
            except OSError:  # gone meanwhile
                continue
            if stat.S_ISREG(st.st_mode):
                inodes[st.st_ino] = name
        used: set[str] = set()  # by inode: glibc's sem_open maps its temporary name, since deleted, not the entry's
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                held = {int(line.split()[4]) for line in (proc / "maps").read_text().splitlines() if "/dev/shm/" in line}
                held.update(os.stat(fd).st_ino for fd in (proc / "fd").iterdir() if os.readlink(fd).startswith("/dev/shm/"))
            except OSError:  # the process ended, or is not ours to read
                continue
            used.update(inodes[i] for i in held if i in inodes)
        orphans = (set(inodes.values()) & shm_entries()) - used
        if not orphans or time.monotonic() > deadline:
            return orphans
        time.sleep(0.2)
