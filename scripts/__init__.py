"""Measurements and checks around cltrain, run from the repository root as modules.

Every benchmark builds its cases and says what it compares; ``cltrain.timing`` measures them (one clock, cases run
in interleaved rounds with warm-up and a minimum window, the device synchronised, the machine, the report), and
``scripts.harness`` runs a case in a child process of its own where a crash must be a row, not the end of the run.

* ``scripts.bench``: benchmarks (loaders, models, the training step, the layout check, the auto probe)
  and their shared photo folder;
* ``scripts.repro``: upstream repros and small kernel checks (oneDNN, CPU bf16 Conv3d, CPU BatchNorm);
* ``scripts.zoo``: the sweep over torchvision, timm and Hugging Face models behind ``docs/zoo.md``;
* ``scripts.gpu_check``: the GPU path proved and measured in one command;
* ``scripts.harness``: a case in a child process (its status, its output, what it measured).

Each module's docstring holds its exact command, e.g.::

    python -m scripts.bench.loaders --quick --no-dali
    python -m scripts.zoo.sweep --list

Tests: ``tests/scripts/``.
"""
