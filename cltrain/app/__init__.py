"""The Hydra training application behind ``train.py`` / ``cltrain-train``.

Modules, bottom up: ``config`` (the config's package: schema, checks, composition, and what it
means on this machine: device, precision), ``schedule`` (main_amp.py's learning rate), ``models``
(model factory), ``module`` (the LightningModule), ``progress`` (main_amp.py's log line,
images/second), ``launch`` (how this process was started), ``rundir`` (run-directory guard),
``prepare`` (the model guarded, compiled and wrapped), ``run_callbacks`` (the callbacks a run
trains with), ``results`` (the final metrics and summary line), ``report`` (metrics.json),
``train`` (``train(cfg) -> dict``), ``cli`` (``main()``, the console script).
"""

from cltrain.app.config.errors import ConfigError

__all__ = ["ConfigError"]
