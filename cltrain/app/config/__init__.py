"""The training application's config: its schema, its checks, composing it, and what it means on this machine.

Modules, bottom up:

* ``errors``: ``ConfigError``, the one-line ``key=value: reason (allowed: ...)`` error;
* ``rules``: ``Rule`` (what a value may be beyond its type) and the rules the schema uses;
* ``data_schema``, ``schema``: every key, its type, its default and its rule (Hydra structured configs);
* ``check``: a composed config against the schema, and Hydra's composition errors as one line;
* ``compose``: where the configs are (``config_dir``), composing them, checking a command line;
* ``paths``: what the config's paths must name on this machine;
* ``resolve``: ``validate``, the one check of a config, and the device / precision it resolves to.

The names the rest of the app uses are importable from here; each module is imported on first use,
so that ``ConfigError`` comes without Hydra.

Example::

    from cltrain.app.config import compose_config, validate

    cfg = compose_config(["experiment=smoke", "device=cpu", "run_dir=/tmp/run1"])
    resolved = validate(cfg)      # Resolved(accelerator='cpu', precision='bf16-mixed' or '32-true', ...)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cltrain.app.config.compose import check_command_line, compose_config, config_dir
    from cltrain.app.config.data_schema import demo_home
    from cltrain.app.config.errors import ConfigError, show
    from cltrain.app.config.resolve import Resolved, resolve_accelerator, resolve_precision, validate

__all__ = ["ConfigError", "Resolved", "check_command_line", "compose_config", "config_dir", "demo_home",
           "resolve_accelerator", "resolve_precision", "show", "validate"]

_MODULES = {
    "ConfigError": "errors", "show": "errors",
    "check_command_line": "compose", "compose_config": "compose", "config_dir": "compose",
    "demo_home": "data_schema",
    "Resolved": "resolve", "resolve_accelerator": "resolve", "resolve_precision": "resolve", "validate": "resolve",
}


def _public(name: str) -> Any:
    return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return _public(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULES])
