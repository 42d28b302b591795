"""Measurements and checks around cltrain, run from the repository root as modules (``python -m scripts.X``; each
module's docstring gives its commands, docs/benchmarks.md its method). ``cltrain.timing`` measures (the clock, the
rounds, the machine, the report); ``scripts.harness`` runs a case in a child process of its own.

* ``scripts.bench``: benchmarks; ``scripts.repro``: upstream repros and small kernel checks; ``scripts.zoo``: the
  sweep over torchvision, timm and Hugging Face models behind docs/zoo.md; ``scripts.gpu_check``: the GPU path.

    python -m scripts.bench.loaders --quick --no-dali
    python -m scripts.zoo.sweep --list
"""
