"""The console scripts, every one of them here (``[project.scripts]`` in ``pyproject.toml`` points only into this package):

* ``cltrain-train`` (``cltrain.tools.train``): the training application, as ``python train.py``;
* ``cltrain-audit`` (``cltrain.tools.audit``): which operators of a torchvision or timm model drop channels_last;
* ``cltrain-data-check`` (``cltrain.tools.data_check``): the unreadable files of an image folder, as
  ``python -m cltrain.data.check``;
* ``cltrain-pack`` (``cltrain.tools.pack``): an image folder packed into WebDataset shards, as
  ``python -m cltrain.data.pack``;
* ``cltrain-sweep-report`` (``cltrain.tools.sweep_report``): a sweep's runs as a table and a chart.
"""
