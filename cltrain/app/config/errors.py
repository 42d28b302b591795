"""``ConfigError``: the one error type the training application shows as one line (exit status 2).

A module of its own, with no imports at load time: every module that raises it (the config checks, ``models``,
``datasource``, ``rundir``) imports it without importing Hydra or each other.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConfigError", "env_error", "show"]


def show(value: Any) -> str:
    """A value as it is written on the command line (true, null, 'text', 3)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return repr(value) if isinstance(value, str) else str(value)


class ConfigError(ValueError):
    """A bad configuration value: ``key=value: reason (allowed: ...)``.

    Example::

        >>> str(ConfigError("seed", "abc", "must be a whole number"))
        "seed='abc': must be a whole number"
        >>> str(ConfigError("model.pretrained", "https://u:pw@host/w.pth", "no such file"))
        "model.pretrained='https://***@host/w.pth': no such file"
    """

    def __init__(self, key: str, value: Any, reason: str, allowed: str | None = None) -> None:
        from cltrain.data.remote import redact  # here: a value may be a URL with its password, and errors are printed

        self.key, self.value, self.reason, self.allowed = key, value, reason, allowed
        message = f"{key}={show(value)}: {reason}"
        if allowed:
            message += f" (allowed: {allowed})"
        super().__init__(redact(message))


def env_error(key: str, value: Any, name: str) -> ConfigError:
    """``key=${oc.env:NAME}`` where the environment variable ``NAME`` is not set."""
    return ConfigError(key, value, f"the environment variable {name} is not set",
                       f"export {name}=..., or a default: ${{oc.env:{name},<default>}}")
