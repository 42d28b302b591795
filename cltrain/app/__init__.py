"""The Hydra training application behind ``train.py`` / ``cltrain-train``; modules, bottom up:

* ``config``: the config's package: schema, checks, composition, and what it means on this machine;
* ``console``: Lightning's console records once, under Hydra's logging;
* ``schedule``: main_amp.py's learning rate (warm-up, steps);
* ``topk``: the top-k accuracy metric;
* ``models``: the classifier by name, pretrained weights, checkpoints read for evaluation;
* ``module``: ``ImageClassifier``, the LightningModule;
* ``datasource``: the DataModule a config names;
* ``progress``: main_amp.py's log line (loss, top-1/5, images/second);
* ``ema``: the EMA weights callback;
* ``finite``: stopping on a non-finite loss;
* ``on_exception``: ``last.ckpt`` on a crash or a signal;
* ``checkpoints``: the best checkpoints' record, carried into a resumed run's directory;
* ``signals``: SIGTERM / SIGINT turned into a clean stop;
* ``launch``: how this process was started (DDP children, nodes);
* ``rundir``: the run directory, never shared or overwritten;
* ``prepare``: the model guarded, compiled and wrapped;
* ``groups``: the ``logger=`` and ``callbacks=`` config groups instantiated;
* ``callbacks``: every callback a run trains with;
* ``metrics_file``: ``metrics.json`` written and read;
* ``results``: the final metrics and the summary line;
* ``train``: ``train(cfg) -> dict`` (``from cltrain.app.train import train``);
* ``cli``: ``main()``, the console script.
"""

from typing import TYPE_CHECKING, Any

from cltrain.app.config.errors import ConfigError

if TYPE_CHECKING:
    from cltrain.app.config import compose_config, resolve_accelerator, resolve_precision, validate
    from cltrain.app.models import build_classifier
    from cltrain.app.module import ImageClassifier
    from cltrain.app.progress import MainAmpProgress, Meter

#: The app's public names -> their module, imported on first use (PEP 562: ``ConfigError`` comes without Hydra).
_MODULES = {
    "compose_config": "config", "resolve_accelerator": "config", "resolve_precision": "config", "validate": "config",
    "build_classifier": "models", "ImageClassifier": "module", "MainAmpProgress": "progress", "Meter": "progress",
}

__all__ = ["ConfigError", "ImageClassifier", "MainAmpProgress", "Meter", "build_classifier", "compose_config",
           "resolve_accelerator", "resolve_precision", "validate"]


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
