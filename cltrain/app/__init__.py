"""The Hydra training application behind ``train.py`` / ``cltrain-train``.

Modules, bottom up: ``schema`` (every config key: type, default, allowed values),
``compose`` (composing a config, one-line errors for bad keys and values), ``config``
(the one check of a config, device/precision mapping), ``schedule``
(main_amp.py's learning rate), ``models`` (model factory), ``module`` (the
LightningModule), ``progress`` (main_amp.py's log line, images/second),
``rundir`` (run-directory guard), ``report`` (metrics.json, sweep report),
``train`` (``train(cfg) -> dict``), ``cli`` (``main()``, the console script).
"""

from cltrain.app.errors import ConfigError

__all__ = ["ConfigError"]
