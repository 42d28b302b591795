"""The zoo sweep (``python -m scripts.zoo.sweep``): ``models`` (which and how built), ``parity`` (the gradient
verdict), ``report`` (the table and files), ``miss_check`` (a MISS row's layer run alone)."""
