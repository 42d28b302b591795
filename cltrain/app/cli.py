"""``main()``: the command line (``python train.py ...`` and the ``cltrain-train`` console script).

Hydra composes ``conf/config.yaml`` with the command-line overrides and calls
``cltrain.app.train.train``. The overrides are composed and checked against
the schema first (``cltrain.app.config.check_command_line``, every value of
a ``-m`` sweep): an unknown key, a bad value or an unknown group option (``model=resnet5``:
``did you mean model=resnet50?``) ends the run with one line on stderr and exit status 2 before
anything starts.
A problem with the data found once the run has started (an empty class folder, an unreadable
image under ``data.bad_files=raise``, in ``setup`` or in a DataLoader worker: a
``cltrain.data.DataError``) ends it with one line naming the file or folder and the fix, exit status 2.

The configs are cltrain's own (``cltrain.app.config.config_dir``), or ``$CLTRAIN_CONFIG_DIR``;
Hydra's ``--config-dir`` adds a folder of the user's beside them.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from cltrain.app.config import ConfigError, check_command_line, compose_config, config_dir

__all__ = ["CONFIG_DIR", "compose_config", "main"]

#: The folder Hydra composes from (``cltrain.app.config.config_dir``).
CONFIG_DIR = config_dir()


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="config")
def _run(cfg: DictConfig) -> float | None:
    """One run; returns validation top-1 (%), the value Hydra's sweepers (Optuna) maximise."""
    from cltrain.app.finite import NonFiniteLossError
    from cltrain.app.train import train  # after Hydra has parsed the command line: `--help` stays fast
    from cltrain.atomic import DiskFullError
    from cltrain.checkpoint_io import CheckpointLoadError
    from cltrain.data.errors import DataError, error_line

    try:
        return train(cfg).get("val_top1")
    except ConfigError as err:
        print(f"cltrain: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None  # not an Exception: Hydra lets it through instead of printing a traceback
    except DataError as err:  # raised in setup or a worker: its own line, without the worker's traceback
        print(f"cltrain: error: {error_line(err)}", file=sys.stderr)
        raise SystemExit(2) from None
    except (NonFiniteLossError, DiskFullError, CheckpointLoadError) as err:  # a diverged run, a full disk, a bad
        print(f"cltrain: error: {err}", file=sys.stderr)  # checkpoint: metrics.json says "failed"; one line
        raise SystemExit(1) from None


def main() -> None:
    """Entry point of ``train.py`` and ``cltrain-train``."""
    try:
        check_command_line(sys.argv[1:])
    except ConfigError as err:
        print(f"cltrain: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    _run()
