"""Measurements and checks around cltrain, run from the repository root as modules.

* ``scripts.bench``: benchmarks (loaders, models, the training step, the layout check, the auto probe)
  and their shared photo folder;
* ``scripts.repro``: upstream repros and small kernel checks (oneDNN, CPU bf16 Conv3d, CPU BatchNorm);
* ``scripts.zoo``: the sweep over torchvision, timm and Hugging Face models behind ``docs/zoo.md``;
* ``scripts.gpu_check``: the GPU path proved and measured in one command;
* ``scripts.machine``: the machine a figure was taken on.

Each module's docstring holds its exact command, e.g.::

    python -m scripts.bench.loader --photos /tmp/cltrain-photos
    python -m scripts.zoo.sweep --list

Tests: ``tests/scripts/``.
"""
