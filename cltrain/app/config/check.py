"""Check a config against the schema: every problem with a key or a value one ``ConfigError`` line.

One pass over what a user can get wrong about keys and values:

* at composition, Hydra and OmegaConf refuse an unknown key (``chanels_last=false``,
  ``optim.lrr=0.1``) or a value of the wrong type (``seed=abc``, ``ema=true``) with a
  multi-line message; ``config_error`` turns each into one line naming the key, the
  value and what is allowed (the closest key names, the field's ``Rule``);
* at composition, Hydra refuses a group option it cannot find (``model=resnet5``,
  ``+logger=cvs``) with a list of every option, and a group chosen twice (``+model=resnet50``);
  ``config_error`` turns each into one line naming the group, the value and what to type
  (the closest options: ``model=resnet50``);
* after composition, ``check`` walks the config against the dataclasses of
  ``cltrain.app.config.schema``: keys added with ``+`` that the schema does not have
  (``+chanels_last=false``), keys removed with ``~``, and every field's rule
  (``ema.decay=1.5``, ``optim.name=lamb``); extra ``trainer.*`` keys must be arguments of
  Lightning's ``Trainer`` (or of ``trainer._target_``), not ones the app sets itself;
* ``cltrain.app.config.compose.check_command_line`` does both for ``python train.py ...`` before
  Hydra starts the run, for every value of a ``-m`` sweep.

Example::

    try:
        cfg = compose("config", overrides=["optim.lrr=0.1"])
    except Exception as exc:
        raise config_error(exc) or exc      # optim.lrr=0.1: unknown key; did you mean optim.lr?
    check(cfg)                              # ranges, choices, keys added with +
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Iterator, Sequence
from functools import cache
from typing import Any, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    OmegaConfBaseException,
)

from cltrain.app.config.errors import ConfigError, env_error
from cltrain.app.config.hints import constructor_arguments, fits_hint, unknown_argument
from cltrain.app.config.schema import (
    APP_SET_TRAINER_KEYS,
    KEYS_ELSEWHERE,
    SCHEMA_NAME,
    TrainConfig,
    TrainerConfig,
)

__all__ = ["check", "check_sweep_launch", "config_error"]

_NONE = type(None)
_UNIONS = (Union, types.UnionType)  # Optional[X] and X | None
LIGHTNING_TRAINER = TrainerConfig._target_  # its arguments pass through under trainer.*


# --- the schema's fields, by dotted key ----------------------------------------------------------
def _subclasses(cls: type) -> list[type]:
    found = [cls]
    for sub in cls.__subclasses__():
        found += _subclasses(sub)
    return found


def _unwrap(tp: Any) -> Any:
    """``Optional[X]`` -> ``X``."""
    if typing.get_origin(tp) in _UNIONS:
        args = [a for a in typing.get_args(tp) if a is not _NONE]
        return args[0] if len(args) == 1 else tp
    return tp


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _field(path: str) -> tuple[type, dataclasses.Field] | None:
    """The schema class and field of a dotted key (``data.scale``; list indices dropped), or None.

    A group typed by a base schema (``data: DataConfig``) is searched in every subclass."""
    cls: Any = TrainConfig
    parts = re.sub(r"\[\d+\]", "", path).split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            return None
        owner = next((c for c in _subclasses(cls) if part in {f.name for f in dataclasses.fields(c)}), None)
        if owner is None:
            return None
        f = next(f for f in dataclasses.fields(owner) if f.name == part)
        if i == len(parts) - 1:
            return owner, f
        cls = _unwrap(_hints(owner)[part])
    return None


def _describe(owner: type, f: dataclasses.Field) -> tuple[str, str | None]:
    """(reason, allowed) for a value that is not what field ``f`` takes: its rule's, else its type's."""
    rule = f.metadata.get("rule")
    if rule is not None:
        return rule.reason, rule.allowed
    tp = _hints(owner)[f.name]
    inner = _unwrap(tp)
    allowed = "true, false" if inner is bool else None
    if inner is not tp:
        allowed = f"{allowed}, or null" if allowed else "or null"
    return f"must be {_type_words(inner)}", allowed


def _type_words(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (list, Sequence):
        return f"a list of {_type_words(typing.get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "a mapping"
    if origin in _UNIONS:
        args = [a for a in typing.get_args(tp) if a is not _NONE and not (a is int and float in typing.get_args(tp))]
        words = " or ".join(_type_words(a) for a in args)
        return f"{words} or null" if _NONE in typing.get_args(tp) else words
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    return {bool: "a boolean", int: "a whole number", float: "a number", str: "a string", _NONE: "null"}.get(
        tp, f"a {getattr(tp, '__name__', tp)}")


def _group_hint(key: str, schema: type) -> str:
    names = [f.name for f in dataclasses.fields(schema)]
    return f"{key}.enabled=true" if "enabled" in names else ", ".join(f"{key}.{n}" for n in names)


def _unknown(key: str, value: Any, known: Sequence[str], prefix: str = "", hint: str | None = None) -> ConfigError:
    close = [KEYS_ELSEWHERE[prefix + key]] if prefix + key in KEYS_ELSEWHERE else [
        prefix + c for c in difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)]
    reason = f"unknown key; did you mean {close[0]}?" if close else "unknown key; see python train.py --help"
    if not close and hint is None and len(known) <= 8:  # a small group: its keys
        hint = ", ".join(prefix + k for k in known)
    return ConfigError(prefix + key, _plain(value), reason, hint)


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=False) if isinstance(value, (DictConfig, ListConfig)) else value


# --- Lightning's Trainer arguments (trainer.* beyond the schema's) -------------------------------
def _check_trainer_extra(node: DictConfig, name: str) -> None:
    key, value = f"trainer.{name}", node.get(name)
    if name in APP_SET_TRAINER_KEYS:
        raise ConfigError(key, _plain(value), "set by the app; do not set it here", f"use {APP_SET_TRAINER_KEYS[name]}")
    arguments = {**constructor_arguments(LIGHTNING_TRAINER), **constructor_arguments(node.get("_target_"))}
    if name not in arguments:
        known = set(arguments) - set(APP_SET_TRAINER_KEYS)
        raise _unknown(name, value, known, "trainer.", "any argument of lightning.pytorch.Trainer")
    if not fits_hint(value, arguments[name]):
        raise ConfigError(key, _plain(value), f"must be {_type_words(arguments[name])} (Lightning's Trainer)")


# --- the walk after composition ------------------------------------------------------------------
def check(cfg: DictConfig) -> None:
    """Check a composed config against ``cltrain.app.config.schema``: keys added that the schema lacks,
    keys removed, values left unset, and every field's rule.

    Raises:
        ConfigError: on the first problem, naming the key, the value and what is allowed.
    """
    if not isinstance(cfg, DictConfig) or not issubclass(OmegaConf.get_type(cfg) or dict, TrainConfig):
        raise ConfigError("defaults", None, "this config does not start from cltrain's schema",
                          f"a config.yaml whose defaults list starts with {SCHEMA_NAME}")
    try:
        _check_node(cfg, "")
    except InterpolationResolutionError as err:  # ${oc.env:NAME} with NAME not set, ${a.key} that is not there
        raise _interpolation_error(err) from None
    for group in _LIST_GROUPS:
        for entry, node in (cfg.get(group) or {}).items():
            if isinstance(node, DictConfig):
                _check_entry_arguments(node, f"{group}.{entry}")


def _check_entry_arguments(node: DictConfig, prefix: str) -> None:
    """Each argument of a callback or logger entry (``callbacks.early_stopping.patience=abc``) of the type its class
    takes, where the class says (names are checked when the override merges: ``unknown_argument``)."""
    arguments = constructor_arguments(node.get("_target_"))
    for name in node:
        if OmegaConf.is_missing(node, name):
            raise ConfigError(f"{prefix}.{name}", "???", "not set", f"{prefix}.{name}=<a value>")
        hint = arguments.get(str(name))
        if hint is None or str(name).startswith("_") or OmegaConf.is_interpolation(node, name):
            continue
        value = node[name]
        if not fits_hint(_plain(value), hint):
            owner = str(node.get("_target_")).rpartition(".")[2]
            raise ConfigError(f"{prefix}.{name}", _plain(value), f"must be {_type_words(hint)} ({owner})")


def check_sweep_launch(cfg: DictConfig) -> None:
    """Refuse more than one process in a run of a Hydra ``-m`` sweep, unless torchrun or SLURM starts them:
    Lightning's DDP launcher starts the other processes by running the command line again, which in a sweep starts
    the whole sweep again.

    Raises:
        ConfigError: ``trainer.devices`` > 1 or ``trainer.num_nodes`` > 1, naming the key.
    """
    from lightning.fabric.plugins.environments import SLURMEnvironment

    devices = cfg.trainer.devices
    many = (len(devices) if isinstance(devices, (list, ListConfig)) else devices if isinstance(devices, int) else 1) > 1
    nodes = cfg.trainer.num_nodes > 1
    if (many or nodes) and "WORLD_SIZE" not in os.environ and not SLURMEnvironment.detect():  # hydra/launcher=slurm
        key, value = ("trainer.devices", devices) if many else ("trainer.num_nodes", cfg.trainer.num_nodes)
        raise ConfigError(key, _plain(value), "more than one process cannot be launched inside a -m sweep",
                          "1 in a sweep; or run each DDP config on its own, or under torchrun/SLURM")


def _check_node(node: DictConfig, prefix: str) -> None:
    schema = OmegaConf.get_type(node)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for name in node:
        if name in fields:
            continue
        if schema is TrainerConfig or issubclass(schema, TrainerConfig):
            _check_trainer_extra(node, str(name))
        else:
            raise _unknown(str(name), node.get(name), list(fields), prefix)
    for name, f in fields.items():
        key = prefix + name
        if OmegaConf.is_missing(node, name):  # before `in`, which is false for a value left unset
            reason, allowed = _describe(schema, f)
            raise ConfigError(key, "???", f"not set; {reason}", allowed)
        if name not in node:
            raise ConfigError(key, None, "removed from the config, but the app needs it", f"leave {key} in (drop ~{key})")
        value = node[name]
        if isinstance(value, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(value)):
            _check_node(value, key + ".")
            continue
        rule = f.metadata.get("rule")
        if rule is not None and not rule.test(value):
            raise ConfigError(key, _plain(value), rule.reason, rule.allowed)


# --- Hydra's and OmegaConf's composition errors, as one line -------------------------------------
def _override(line: str) -> tuple[str, Any]:
    """(key, value) of an override as typed on the command line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        override = OverridesParser.create().parse_override(line)
        return override.key_or_group, override.value()
    except Exception:  # noqa: BLE001 - shown as typed
        key, _, value = line.lstrip("+~").partition("=")
        return key, value


def _causes(exc: BaseException) -> Iterator[BaseException]:
    while exc is not None:
        yield exc
        exc = exc.__cause__ or (exc.__context__ if not exc.__suppress_context__ else None)


def config_error(exc: BaseException, overrides: Sequence[str] = ()) -> ConfigError | None:
    """The one-line ``ConfigError`` for a Hydra / OmegaConf composition error about a key, a value or a
    group option (``overrides``: the command line's, which name a group added twice with ``+``); None for
    other errors (a syntax error), which Hydra's own message explains."""
    if isinstance(exc, ConfigError):
        return exc
    message = str(exc)
    missing = _missing_option(exc)
    if missing is not None:
        return missing
    twice = re.match(r"Multiple values for (\S+)\.|(\S+) appears more than once in the final defaults list", message)
    group = twice and (twice.group(1) or twice.group(2))
    added = [o for o in overrides if group and o.startswith("+") and o.lstrip("+").partition("=")[0] == group]
    if added:  # +model=resnet50: the defaults list chooses a model already
        value = _override(added[0])[1]
        return ConfigError(group, value, "already chosen in the defaults list; choose it without the +",
                           f"{group}={added[0].partition('=')[2]}")
    if message.startswith("Could not append to config. An item is already at '"):
        key = message.split("'")[1]
        value = _override(message.split("Either remove + prefix: '", 1)[-1].split("'")[0])[1]
        return ConfigError(key, value, "already in the config; set it without the +", f"{key}=...")
    cause = next((c for c in _causes(exc) if isinstance(c, OmegaConfBaseException) and getattr(c, "full_key", None)), None)
    if cause is None:
        return None
    merging = re.match(r"Error merging override (.+)", message)
    line = merging.group(1) if merging else message.split("To append to your config use +", 1)[1].strip() \
        if message.startswith("Could not override '") else None
    key, value = _override(line) if line is not None else (re.sub(r"\[\d+\]$", "", str(cause.full_key)), cause.value)
    parent_type = getattr(cause, "object_type", None)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        parent = getattr(cause, "parent_node", None)
        return _unchosen_entry(key, value, str(cause.full_key)) or \
            unknown_argument(key, value, parent.get("_target_") if isinstance(parent, DictConfig)
                             and key.partition(".")[0] in _LIST_GROUPS else None) or \
            _not_a_key(key, value, parent_type if dataclasses.is_dataclass(parent_type) else None, line)
    name = key.rpartition(".")[2]
    found = (parent_type, next(f for f in dataclasses.fields(parent_type) if f.name == name)) \
        if dataclasses.is_dataclass(parent_type) and name in {f.name for f in dataclasses.fields(parent_type)} \
        else _field(key)
    if found is None:
        return None
    owner, f = found
    schema = _unwrap(_hints(owner)[f.name])
    if dataclasses.is_dataclass(schema):
        return ConfigError(key, value, "is a group of keys, not a value", _group_hint(key, schema))
    reason, allowed = _describe(owner, f)
    return ConfigError(key, value, reason, allowed)


def _missing_option(exc: BaseException) -> ConfigError | None:
    """``model=resnet5``: the group, the value, the closest options (difflib) and every option, in one line."""
    from hydra.errors import MissingConfigException

    cause = next((c for c in _causes(exc) if isinstance(c, MissingConfigException)), None)
    if cause is None or not cause.missing_cfg_file or "/" not in cause.missing_cfg_file:
        return None  # not a group option (config.yaml itself)
    group, _, value = cause.missing_cfg_file.rpartition("/")
    options = sorted(map(str, cause.options or _group_options(group)))  # a list (logger=[csv,x]): Hydra names none
    if not options:
        return None  # not a group (a file named in a defaults list)
    if group in ("hydra/launcher", "hydra/sweeper") and value in _SWEEP_PLUGINS:  # a plugin not installed
        return ConfigError(group, value, f"{_SWEEP_PLUGINS[value]} is not installed: pip install 'cltrain[sweeps]'",
                           ", ".join(options))
    close = difflib.get_close_matches(value, options, n=3, cutoff=0.5)
    reason = f"no {group} option of that name"
    where = re.match(r"In '([^']+)':", str(cause))
    if where and where.group(1) not in ("config", "hydra/config"):  # named in a file's defaults list, not typed
        reason += f" (named in {where.group(1)}.yaml)"
    if close:
        reason += "; did you mean " + " or ".join(f"{group}={c}" for c in close) + "?"
    return ConfigError(group, value, reason, ", ".join(options))


#: Hydra's launchers and sweepers the ``sweeps`` extra installs -> their package.
_SWEEP_PLUGINS = {"joblib": "hydra-joblib-launcher", "submitit_local": "hydra-submitit-launcher",
                  "submitit_slurm": "hydra-submitit-launcher", "optuna": "hydra-optuna-sweeper"}


def _group_options(group: str) -> list[str]:
    """The options of config group ``group`` in the config being composed (none outside a composition)."""
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():
        return []
    return list(GlobalHydra.instance().config_loader().get_group_options(group))


#: The list groups (several options at once) and the option each run has by default.
_LIST_GROUPS = {"callbacks": "default", "logger": "csv"}


def _unchosen_entry(key: str, value: Any, missing: str) -> ConfigError | None:
    """``callbacks.early_stopping.patience=3`` where the run's callbacks do not include ``early_stopping``: choose
    the option first (adding the key with ``+`` led to "needs a _target_" next)."""
    group, _, rest = key.partition(".")
    entry = rest.partition(".")[0]
    if group not in _LIST_GROUPS or missing != f"{group}.{entry}" or entry not in _group_options(group):
        return None
    return ConfigError(key, value, f"{group}.{entry} is not among this run's {group}: choose it first",
                       f"{group}=[{_LIST_GROUPS[group]},{entry}] {key}={value}")


def _not_a_key(key: str, value: Any, schema: type | None, line: str | None) -> ConfigError:
    """The error for a key its group does not have: the closest keys, or where it goes instead."""
    parent, _, name = key.rpartition(".")
    if schema is None:
        owner = _field(parent) if parent else None
        schema = TrainConfig if not parent else _unwrap(_hints(owner[0])[owner[1].name]) if owner else None
    if schema is None or not dataclasses.is_dataclass(schema):  # a free-form mapping (model.kwargs, logger.csv)
        return ConfigError(key, value, f"not in {parent}; add a key there with +", f"+{key}={_show_override(line)}")
    if issubclass(schema, TrainerConfig):
        if name in APP_SET_TRAINER_KEYS:
            return ConfigError(key, value, "set by the app; do not set it here", f"use {APP_SET_TRAINER_KEYS[name]}")
        if name in constructor_arguments(LIGHTNING_TRAINER):
            return ConfigError(key, value, "a Lightning Trainer argument the app leaves at Lightning's default; "
                               "add it with +", f"+{key}={_show_override(line)}")
    return _unknown(name, value, [f.name for f in dataclasses.fields(schema)], f"{parent}." if parent else "")


def _show_override(line: str | None) -> str:
    return "..." if line is None else line.partition("=")[2]


def _interpolation_error(err: InterpolationResolutionError) -> ConfigError:
    """An interpolation that cannot be resolved, as the key, what it says and the fix."""
    key, parent = str(err.full_key or "?"), err.parent_node
    value = OmegaConf.to_container(parent, resolve=False).get(err.key) if isinstance(parent, DictConfig) else None
    missing = re.search(r"Environment variable '([^']+)' not found", str(err))
    if missing:
        return env_error(key, value, missing.group(1))
    return ConfigError(key, value, f"cannot be resolved ({str(err).splitlines()[0]})")
