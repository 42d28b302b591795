"""What a config value may be beyond its type: ``Rule`` and the rules ``cltrain.app.config.schema`` uses.

A rule is a test and the words of its error: ``Rule(test, reason, allowed)`` becomes
``ConfigError(key, value, reason, allowed)`` ("ema.decay=1.5: must be a number in [0, 1)
(allowed: 0 <= value < 1)"). ``key`` makes a dataclass field holding a default and its rule.

Example::

    >>> UNIT.test(1.5), UNIT.allowed
    (False, '0 <= value < 1')
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import ListConfig

from cltrain.data.constants import CROP_SCALE

__all__ = ["MODE", "OPTIMIZERS", "Rule", "choices", "key", "optimizer_name"]


@dataclass(frozen=True)
class Rule:
    """What a value must be beyond its type: ``test(value)`` holds, else the error says ``reason`` and ``allowed``."""

    test: Callable[[Any], bool]
    reason: str
    allowed: str | None = None


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _list(v: Any) -> bool:
    return isinstance(v, (list, tuple, ListConfig))


def choices(*values: Any) -> Rule:
    """A rule allowing exactly ``values``."""
    shown = ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in values)
    return Rule(lambda v: any(v is c or (type(v) is type(c) and v == c) for c in values), "unknown value", shown)


#: ``channels_last_mode``: what is converted; its error names ``channels_last_layout``, which chooses the layout.
MODE = Rule(choices("full", "conv").test, "unknown value",
            "full, conv; the layout is channels_last_layout's: auto (races both), channels_last, contiguous")
POSITIVE = Rule(lambda v: _int(v) and v > 0, "must be a whole number > 0")
COUNT = Rule(lambda v: _int(v) and v >= 0, "must be a whole number >= 0")
COUNT_OR_AUTO = Rule(lambda v: v == "auto" or (_int(v) and v >= 0), "must be a whole number >= 0", "or auto")
POSITIVE_OR_AUTO = Rule(lambda v: v == "auto" or (_int(v) and v > 0), "must be a whole number > 0", "or auto")
SEED = Rule(lambda v: _int(v) and 0 <= v < 2**32, "must be a whole number", "0 .. 2**32-1")
STEPS = Rule(lambda v: v is None or (_int(v) and v >= -1), "must be a whole number >= -1", "-1 for no limit, or null")
MAX_STEPS = Rule(lambda v: _int(v) and v >= -1, "must be a whole number >= -1", "-1 for no limit")
OPT_POSITIVE = Rule(lambda v: v is None or (_int(v) and v > 0), "must be a whole number > 0", "or null")
FRACTION_OR_COUNT = Rule(lambda v: v is None or (_int(v) and v >= 0) or (_number(v) and 0.0 <= v <= 1.0),
                         "must be a number of batches or a fraction", "a whole number >= 0, 0.0 .. 1.0, or null")
NON_NEGATIVE = Rule(lambda v: _number(v) and v >= 0, "must be a number >= 0")
OPT_NON_NEGATIVE = Rule(lambda v: v is None or (_number(v) and v >= 0), "must be a number >= 0", "or null")
GT_ZERO = Rule(lambda v: _number(v) and v > 0, "must be a number > 0")
UNIT = Rule(lambda v: _number(v) and 0.0 <= v < 1.0, "must be a number in [0, 1)", "0 <= value < 1")
UNIT_CLOSED = Rule(lambda v: _number(v) and 0.0 <= v <= 1.0, "must be a number in [0, 1]", "0 <= value <= 1")
TEXT = Rule(lambda v: isinstance(v, str) and v != "", "must be a non-empty string")
PATH = Rule(lambda v: isinstance(v, str) and v != "", "must be a path", "a path")
OPT_PATH = Rule(lambda v: v is None or (isinstance(v, str) and v != ""), "must be a path", "a path, or null")
FIELD = Rule(lambda v: (isinstance(v, str) and v != "") or _int(v), "must be a field's name or index")
INDEX_CACHE = Rule(lambda v: isinstance(v, bool) or (isinstance(v, str) and v != ""), "must be true, false or a path")


def _size(v: Any) -> bool:
    from cltrain.data.shard_cache import parse_size

    try:
        parse_size(v)
    except ValueError:
        return False
    return True


SIZE = Rule(_size, "must be a size", "e.g. 200GB, 500GiB, a number of bytes")
TOP_K = Rule(lambda v: _int(v) and v >= -1, "must be a whole number >= -1", "-1 keeps all, 0 none, k the best k")
DEVICES = Rule(lambda v: v == "auto" or (_int(v) and v > 0) or (_list(v) and len(v) > 0 and all(_int(i) and i >= 0 for i in v)),
               "must be a number of devices", "a whole number > 0, auto, or [0, 1, ...]")
MILESTONES = Rule(lambda v: _list(v) and all(_int(i) and i >= 0 for i in v), "must be a list of epochs", "e.g. [30, 60, 80]")
BETAS = Rule(lambda v: _list(v) and len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
             "must be two numbers in [0, 1)", "e.g. [0.9, 0.999]")
SCALE = Rule(lambda v: _list(v) and len(v) == 2 and all(_number(s) for s in v) and 0 < v[0] <= v[1] <= 1,
             "must be two numbers 0 < min <= max <= 1", f"e.g. {list(CROP_SCALE)}")
RATIO = Rule(lambda v: _list(v) and len(v) == 2 and all(_number(s) for s in v) and 0 < v[0] <= v[1],
             "must be two numbers 0 < min <= max", "e.g. [0.75, 1.3333]")
IMAGE_SIZE_WH = Rule(lambda v: _list(v) and len(v) == 2 and all(_int(s) and s > 0 for s in v),
                     "must be two whole numbers > 0", "[width, height]")
# Lightning's val_check_interval: batches, a fraction of the epoch, or a time ('DD:HH:MM:SS', Lightning's format)
VAL_CHECK_INTERVAL = Rule(lambda v: v is None or (_int(v) and v > 0) or (_number(v) and 0.0 < v <= 1.0)
                          or (isinstance(v, str) and re.fullmatch(r"\d+:\d+:\d+:\d+", v) is not None),
                          "must be a number of batches, a fraction of the epoch or a time",
                          "a whole number > 0, 0.0 < fraction <= 1.0, 'DD:HH:MM:SS', or null")
CLIP_ALGORITHM = Rule(lambda v: v is None or v in ("norm", "value"), "unknown value", "norm, value, or null")
#: torch.compile's modes (null: torch's default)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_MODE = Rule(lambda v: v is None or v in COMPILE_MODES, "unknown value", ", ".join(COMPILE_MODES) + ", or null")
#: An autocast dtype ``amp`` can name -> its Lightning precision flag.
AMP_DTYPE_FLAGS: dict[str, str] = {"bf16": "bf16-mixed", "fp16": "16-mixed"}
#: What ``amp`` may be: ``"auto"`` (the device's fastest), true (mixed precision), false (fp32), or a dtype.
AMP_CHOICES: tuple[str | bool, ...] = ("auto", True, False, *AMP_DTYPE_FLAGS)
AMP = choices(*AMP_CHOICES)
DETERMINISTIC = choices(True, False, "warn")
#: The optimizers ``optim.name`` can be (one option of the ``optim`` group each).
OPTIMIZERS = ("sgd", "adamw")


def optimizer_name(name: str) -> Rule:
    """``optim.name`` of an optim option's schema: only its own name (the option picks the optimizer)."""
    return Rule(lambda v: v == name, "the optimizer is chosen by the optim option",
                ", ".join(f"optim={o}" for o in OPTIMIZERS))


def key(default: Any, rule: Rule | None = None) -> Any:
    """A dataclass field holding ``default`` (copied per instance when mutable) and its ``Rule``."""
    metadata = {"rule": rule} if rule is not None else {}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)
