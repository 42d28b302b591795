"""Run by test_data_hf.py: a real two-process DDP fit on CPU (gloo) from a Hugging Face dataset, 2 workers per rank.

    python -m tests.helpers.hf_data_ddp_run ROOT OUT_DIR STREAMING [EPOCHS]

Each row of the dataset is its own class, so the targets of a batch are its row ids. Every rank writes
OUT_DIR/rank<N>.json with, per training and validation step, the epoch and the row ids of the batch
(``tests.helpers.shards_ddp_run.Recorder``). Run from the repository's root (``-m``).
"""

import sys
from pathlib import Path

from lightning.pytorch import seed_everything

from cltrain.data import HFImageDataModule
from tests.helpers.shards_ddp_run import Recorder, fit_and_record
from tests.helpers import warm


def main(root: Path, out: Path, streaming: bool, epochs: int) -> None:
    seed_everything(0)
    dm = HFImageDataModule(root, batch_size=3, num_workers=2, image_size=24, val_resize_size=28, streaming=streaming)
    fit_and_record(dm, Recorder(dm.num_classes), out, epochs)


if __name__ == "__main__":
    warm.lightning_ranks_forked()
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]) if len(sys.argv) > 4 else 2)
