"""Find the configs, compose the config ``python train.py <overrides>`` runs, and check it before Hydra
starts the run.

``config_dir`` is where the configs are: the package's own (``conf/`` in the source tree, installed as
``cltrain.conf``), found with ``importlib.resources`` and never the current folder;
``$CLTRAIN_CONFIG_DIR`` replaces them with a folder of the user's, and Hydra's ``--config-dir`` adds
one beside them. ``compose_config`` is Hydra's compose API with one-line errors for bad keys,
values and group options (``cltrain.app.config.check.config_error``); ``check_command_line`` composes and
checks (``cltrain.app.config.check.check``) what a command line would run, every value of a
``-m`` sweep included (``-m ema.decay=0.9,1.5``), so that a bad value stops the sweep before its
first job.

Example::

    cfg = compose_config(["experiment=smoke", "ema.enabled=true", "run_dir=/tmp/run1"])
    check_command_line(["-m", "seed=1,2,abc"])   # ConfigError: seed='abc': must be a whole number ...
"""

from __future__ import annotations

import importlib.resources
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig

from cltrain.app.config.check import _override, check, check_sweep_launch, config_error
from cltrain.app.config.errors import ConfigError, env_error
from cltrain.app.config.resolve import check_meanings

__all__ = ["check_command_line", "compose_config", "config_dir"]


def config_dir() -> Path:
    """``$CLTRAIN_CONFIG_DIR`` when set, else the installed ``cltrain.conf`` package's folder.

    Raises:
        ConfigError: ``$CLTRAIN_CONFIG_DIR`` holds no ``config.yaml``.
    """
    env = os.environ.get("CLTRAIN_CONFIG_DIR")
    if env:
        path = Path(env).expanduser()
        if not (path / "config.yaml").is_file():
            raise ConfigError("CLTRAIN_CONFIG_DIR", env, "no config.yaml in that folder",
                              "a folder holding config.yaml and its groups, or unset it to use cltrain's own configs")
        return path.resolve()
    return Path(str(importlib.resources.files("cltrain.conf")))


@contextmanager
def _hydra(folder: str | Path | None) -> Iterator[None]:
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(folder or config_dir()).resolve()), version_base="1.3"):
        yield


def _compose(overrides: Sequence[str], config_name: str = "config") -> DictConfig:
    from hydra import compose

    try:
        return compose(config_name, overrides=list(overrides))
    except Exception as exc:
        error = config_error(exc, overrides) or _under_null(exc, overrides, config_name)
        if error is None:
            raise
        raise error from None


def _under_null(exc: BaseException, overrides: Sequence[str], config_name: str) -> ConfigError | None:
    """``data.demo.train_per_class=10`` with ``data=imagenet``, whose ``data.demo`` is null (or ``data.demo={...}``, or
    after ``data.demo=null``): OmegaConf's assertion or ``AttributeError`` as the key that is null in this run's
    config. The overrides are composed one more at a time: the config before the first that fails shows the null."""
    from hydra import compose
    from omegaconf import OmegaConf

    if not ("Unexpected type for root" in str(exc) or "'NoneType' object has no attribute" in str(exc)):
        return None
    cfg = None
    for count in range(len(overrides) + 1):
        try:
            cfg = compose(config_name, overrides=list(overrides[:count]), return_hydra_config=True)
        except Exception:  # noqa: BLE001 - overrides[count - 1] is the one merged into a null
            break
    else:
        return None
    if cfg is None or count == 0:
        return None
    key, value = _override(overrides[count - 1])
    parts = key.split(".")
    for depth in range(1, len(parts) + 1):
        node = ".".join(parts[:depth])
        if OmegaConf.select(cfg, node, default=0) is None and (depth < len(parts) or isinstance(value, dict)):
            group = parts[0]
            nulled = any(_override(o)[0] == node for o in overrides[:count - 1])
            chosen = (OmegaConf.select(cfg, "hydra.runtime.choices", default=None) or {}).get(group, "...")
            if nulled:
                return ConfigError(key, value, f"{node}=null on this command line: it has no keys",
                                   f"drop {key} or {node}=null")
            return ConfigError(key, value, f"{node} is null with {group}={chosen}: it has no keys",
                               f"drop {key}, or choose a {group} that has {node}")
    return None


#: The Hydra keys of the sweeper's and the launcher's own settings (``hydra.sweeper.n_trials=20``), which the docs
#: have users type: checked as every other key (the rest of ``hydra.*`` is Hydra's own to check).
_PLUGIN_KEYS = ("hydra.sweeper.", "hydra.launcher.")


def _check_plugin_keys(overrides: Sequence[str], plugin_keys: Sequence[str], config_name: str) -> None:
    """Each of ``plugin_keys`` is a setting of the chosen sweeper or launcher, of its type, and a value Optuna takes.

    Raises:
        ConfigError: the first that is not.
    """
    import difflib

    from hydra import compose

    for override in plugin_keys:
        key, _, value = override.lstrip("+~").partition("=")
        try:
            hydra = compose(config_name, overrides=[*overrides, override], return_hydra_config=True).hydra
        except Exception as exc:  # noqa: BLE001 - Hydra's "Could not override" / "Error merging override"
            node_key, _, name = key.rpartition(".")
            try:
                node = compose(config_name, overrides=list(overrides), return_hydra_config=True).hydra
                known = list(node[node_key.split(".", 1)[1]].keys())
            except Exception:  # noqa: BLE001 - the group itself did not compose: Hydra says why
                return
            if name not in known:
                near = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {node_key}.{near[0]}?" if near else f" (its settings: {', '.join(known)})"
                raise ConfigError(key, value, f"not a setting of this {node_key.split('.')[1]}{hint}") from None
            cause = exc.__cause__ or exc
            raise ConfigError(key, value, str(cause).splitlines()[0]) from None
        if key == "hydra.sweeper.direction" and "optuna" in str(hydra.sweeper.get("_target_", "")).lower():
            directions = hydra.sweeper.direction
            for direction in directions if not isinstance(directions, str) else [directions]:
                if str(direction).lower() not in ("minimize", "maximize"):
                    raise ConfigError(key, value, "Optuna takes minimize or maximize", "minimize, maximize")
        if key == "hydra.sweeper.storage" and hydra.sweeper.get("storage") is not None:
            raise ConfigError(key, value, "a shared Optuna study needs Optuna's database storage, which optuna 2.10 "
                              "(the newest hydra-optuna-sweeper 1.3 takes) cannot open with SQLAlchemy 2",
                              "null: each sweep's own study")


def _launched_here(overrides: Sequence[str], config_name: str) -> bool:
    """Whether Hydra's own launcher runs the sweep's jobs in this process (not a scheduler's, ``hydra/launcher=slurm``,
    whose jobs start their ranks themselves)."""
    from hydra import compose

    hydra = compose(config_name, overrides=list(overrides), return_hydra_config=True).hydra
    return str(hydra.launcher.get("_target_", "")).endswith(".BasicLauncher")


def compose_config(overrides: Sequence[str] = (), config_dir: str | Path | None = None) -> DictConfig:
    """The config ``python train.py <overrides>`` would run, composed with Hydra's compose API
    (no run directory, so set ``run_dir=...`` before calling ``train``).

    Raises:
        ConfigError: an unknown key or a value of the wrong type, in one line.
    """
    with _hydra(config_dir):
        return _compose(overrides)


def _check_syntax(overrides: Sequence[str], multirun: bool = False) -> None:
    """Each override as Hydra's grammar reads it; one that it cannot read is a ``ConfigError`` saying how to quote
    it (a path with a space, a non-ASCII letter, a parenthesis or a comma is a lexer error unquoted)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for override in overrides:
        key, _, value = override.partition("=")
        quote = '"' if "'" in value else "'"  # Hydra's own quotes: the kind the value does not hold
        fix = f"quote it for Hydra inside the shell's quotes: \"{key}=\\\"{value}\\\"\"" if quote == '"' else \
            f"quote it for Hydra inside the shell's quotes: \"{key}='{value}'\""
        try:
            parsed = parser.parse_overrides([override])
        except OverrideParseException as err:
            where = str(err).splitlines()[0].split(":", 1)[0]  # LexerNoViableAltException, ...
            if value[:1] in "[{'\"":
                fix = "check its brackets and quotes (Hydra's override grammar)"
            raise ConfigError(key, value, f"Hydra cannot read this value ({where}); {fix}") from None
        if not multirun and parsed and parsed[0].is_sweep_override() and \
                key.lstrip("+~").endswith(("root", "dir", "path", "_files")):
            # a path with a comma reads as a sweep; Hydra's own answer is three lines and a trace hint
            raise ConfigError(key, value, f"Hydra reads the comma as a list of values; {fix}")


def _variants(overrides: Sequence[str]) -> list[list[str]]:
    """The override lists to check for ``-m``: the first value of every sweep, then each other value
    of each sweep in turn (not their product). Continuous sweeps (``interval(...)``) are left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    base: list[str] = []
    sweeps: list[tuple[int, list[str]]] = []
    for override in parsed:
        if not override.is_sweep_override():
            base.append(str(override.input_line))
        elif override.is_discrete_sweep():
            values = [f"{override.get_key_element()}={v}" for v in override.sweep_string_iterator()]
            sweeps.append((len(base), values))
            base.append(values[0])
    variants = [base]
    for index, values in sweeps:
        variants += [[*base[:index], value, *base[index + 1:]] for value in values[1:]]
    return variants


def _check_hydra_dirs(overrides: Sequence[str]) -> None:
    """``hydra.run.dir=outputs/${oc.env:SLURM_JOB_ID}`` where that variable is not set: one line (Hydra's own keys are
    not composed here, and Hydra fails on it while it makes the run directory, with a traceback)."""
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if key in ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir"):
            for name in re.findall(r"\$\{oc\.env:([^,}]+)\}", value):  # no default given
                if name.strip() not in os.environ:
                    raise env_error(key, value, name.strip())


def check_command_line(argv: Sequence[str]) -> None:
    """Compose and ``check`` what ``python train.py <argv>`` would run (every value of a ``-m``
    sweep) before Hydra starts: a bad key, value or group option (``model=resnet5``) raises one
    ``ConfigError``, and so does an override Hydra's grammar cannot read (saying how to quote it).

    Raises:
        ConfigError: the first bad key or value.
    """
    from hydra._internal.utils import get_args_parser

    try:
        args, _ = get_args_parser().parse_known_args(list(argv))
    except SystemExit:  # --version, or arguments Hydra refuses: Hydra answers them itself
        return
    if args.hydra_help or args.shell_completion or args.info or args.experimental_rerun or args.config_path:
        return  # --config-path is relative to cli.py: Hydra composes that one itself
    # Hydra's own keys (hydra.run.dir=...) are Hydra's to check; its groups (hydra/launcher=slurm) compose here
    overrides = [o for o in args.overrides if not o.lstrip("+~").startswith("hydra") or o.lstrip("+~").startswith("hydra/")]
    _check_syntax(overrides, args.multirun)
    _check_hydra_dirs(args.overrides)
    folder, name = None, args.config_name or "config"
    if args.config_dir:  # searched after cltrain's own, as Hydra's run does: a primary config cltrain has no twin of
        user, stem = Path(args.config_dir).resolve(), name.removesuffix(".yaml")
        if (user / f"{stem}.yaml").is_file() and (config_dir() / f"{stem}.yaml").is_file():
            # Hydra searches the app's own folder before --config-dir: this file would never be read
            raise ConfigError("--config-dir", str(user / f"{stem}.yaml"),
                              f"is not read: Hydra finds cltrain's own {stem}.yaml first",
                              "rename it (mine.yaml) and pass --config-name mine")
        folder = user if (user / f"{stem}.yaml").is_file() else None
        overrides.append(f"hydra.searchpath=[file://{config_dir().resolve() if folder else user}]")
    try:
        variants = _variants(overrides) if args.multirun else [overrides]
    except Exception:  # noqa: BLE001 - a syntax error: Hydra's message shows where
        return
    try:
        with _hydra(folder):
            for variant in variants:
                cfg = _compose(variant, name)
                check(cfg)
                check_meanings(cfg)
                if args.multirun and _launched_here(variant, name):
                    check_sweep_launch(cfg)
            plugin_keys = [o for o in args.overrides if o.lstrip("+~").startswith(_PLUGIN_KEYS)]
            if plugin_keys:
                _check_plugin_keys(variants[0], plugin_keys, name)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - not about a key or a value: Hydra reports it when it composes
        return
