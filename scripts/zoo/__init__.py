"""The zoo sweep (``python -m scripts.zoo.sweep``): ``models`` (which and how built), ``sweep_child`` (what a model's
process measures), ``parity`` (the gradient verdict), ``projects`` (the libraries' own tasks), ``miss_check`` (a MISS
row's layer run alone); ``pages`` renders each page from its record (docs/zoo.md, docs/zoo_check.md,
docs/projects.md)."""
