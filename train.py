"""Train an image classifier, channels_last by default: a thin wrapper over ``cltrain.app``.

    python train.py                                    # ResNet-50 on the demo data (generated on first use)
    python train.py model=resnet50 channels_last=true amp=true device=auto
    python train.py channels_last=false amp=false      # the contiguous fp32 baseline on the same data
    python train.py experiment=main_amp data.root=/data/imagenet trainer.devices=8
    python train.py ckpt_path=outputs/<date>/<time>/checkpoints/last.ckpt           # resume
    python train.py evaluate_only=true ckpt_path=.../best-epoch005.ckpt             # validate only
    python train.py -m channels_last=true,false amp=true,false                      # a sweep
    python train.py --help                                                          # every option

The options live in conf/ beside this file (see conf/config.yaml: a copy of train.py with its conf/ reads that one;
without one, cltrain's own); the logic in cltrain/app/train.py.
"""

import os
from pathlib import Path

from cltrain.app.cli import main

if __name__ == "__main__":
    beside = Path(__file__).resolve().parent / "conf"
    if (beside / "config.yaml").is_file():  # the configs a user edits here, not the installed package's copy
        os.environ.setdefault("CLTRAIN_CONFIG_DIR", str(beside))
    main()
