"""``RunCheckpoint``: Lightning's ``ModelCheckpoint``, continued by a run resumed into a new directory.

Lightning reloads a ``ModelCheckpoint``'s record of the best checkpoints only where the checkpoint was written to the
same folder; elsewhere it warns ("The dirpath has changed ...") and forgets them, so a resumed run's best was the best
of its own epochs. A ``train.py`` run resumes into a new run directory: here the record comes back, and the earlier
run's best checkpoints are linked into the new folder when training starts (a hard link; a copy where the folders are
on different disks). The new run directory then holds the files the uninterrupted run's holds; nothing in the earlier
run's directory is changed or removed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from cltrain.atomic import atomic_open

__all__ = ["RunCheckpoint"]


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose record of the best checkpoints carries over to a new ``dirpath`` (see the module
    docstring). Takes ``ModelCheckpoint``'s arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._links: dict[str, str] = {}  # a path in this folder -> the earlier run's file it stands for

    @property
    @override
    def state_key(self) -> str:
        """``ModelCheckpoint``'s key: checkpoints written with either load with either."""
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        earlier = state_dict.get("dirpath")
        if self.dirpath is None or earlier is None or earlier == self.dirpath:
            super().load_state_dict(state_dict)
            return

        def here(path: str | None) -> str | None:
            return str(Path(self.dirpath) / Path(path).name) if path else path

        best_first = sorted(((p, s) for p, s in (state_dict.get("best_k_models") or {}).items() if Path(p).is_file()),
                            key=lambda item: float(item[1]), reverse=self.mode == "max")
        kept = best_first if self.save_top_k < 0 else best_first[:self.save_top_k]
        self._links = {here(p): p for p, _ in kept}
        state = {**state_dict, "dirpath": self.dirpath, "best_k_models": {here(p): s for p, s in kept},
                 "best_model_path": here(state_dict.get("best_model_path")),
                 "last_model_path": here(state_dict.get("last_model_path"))}
        if self.monitor is not None:  # the record as the kept files give it (a file removed since is left out)
            state.update(best_model_path=here(kept[0][0]) if kept else "",
                         best_model_score=kept[0][1] if kept else None,
                         kth_best_model_path=here(kept[-1][0]) if kept else "",
                         kth_value=kept[-1][1] if kept else self.kth_value)
        super().load_state_dict(state)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        links, self._links = self._links, {}
        if not trainer.is_global_zero:
            return
        for path, earlier in links.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            try:
                _link_or_copy(earlier, path)
            except OSError as err:
                rank_zero_warn(f"{earlier} could not be linked or copied into {self.dirpath} ({err}): the run's record "
                               "of its best checkpoints names it, but this run's folder does not hold it.")


def _link_or_copy(source: str, target: str) -> None:
    """``target`` the same file as ``source``: a hard link, else an atomic copy (another disk, a filesystem that
    links nothing)."""
    if os.path.exists(target):
        return
    try:
        os.link(source, target)
    except OSError:
        with open(source, "rb") as src, atomic_open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
