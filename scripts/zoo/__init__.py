"""The zoo sweep (``python -m scripts.zoo.sweep``): ``models`` (which and how built), ``parity`` (the gradient
verdict), ``pages`` (the pages and files of the sweep, its ``--check-only`` and ``projects``), ``miss_check`` (a MISS row's layer run alone)."""
