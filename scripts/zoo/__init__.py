"""The zoo sweep (``python -m scripts.zoo.sweep``): ``models`` (which and how built), ``sweep_child`` (what a model's
process measures), ``parity`` (the gradient verdict), ``sweep_page`` and ``check_page`` (its pages, docs/zoo.md and
its ``--check-only``'s), ``projects`` and ``projects_page`` (the libraries' own tasks, docs/projects.md),
``miss_check`` (a MISS row's layer run alone)."""
