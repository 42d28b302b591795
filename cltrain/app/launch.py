"""How this process was started: as a child of Lightning's DDP launcher, by a scheduler, inside a ``-m`` sweep.

``is_launched_child`` tells the processes Lightning's DDP launcher starts (and nodes > 0) from the one
that claims the run directory; ``check_launch`` refuses a multi-process run inside a Hydra ``-m`` sweep,
where Lightning's launcher would start the whole sweep again.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, ListConfig

from cltrain.app.config.errors import ConfigError

__all__ = ["check_launch", "is_launched_child", "launcher"]


def is_launched_child() -> bool:
    """True in the processes Lightning's DDP launcher or torchrun starts (LOCAL_RANK > 0), on nodes > 0, and in the
    SLURM tasks other than task 0 where Lightning takes its ranks from SLURM (``srun``: each task runs this command)."""
    if any(os.environ.get(var, "0") not in ("", "0") for var in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK")):
        return True
    return os.environ.get("SLURM_PROCID", "0") not in ("", "0") and _slurm_ranks()


def launcher() -> str | None:
    """What started this run's ranks where it was not this command: ``"torchrun"``, ``"srun"`` (several SLURM tasks
    whose ranks Lightning takes), else ``None``."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    tasks = os.environ.get("SLURM_NTASKS", "1")
    return "srun" if tasks.isdigit() and int(tasks) > 1 and _slurm_ranks() else None


def _slurm_ranks() -> bool:
    """Whether Lightning takes the ranks from SLURM's variables (``SLURMEnvironment.detect``)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def check_launch(cfg: DictConfig) -> None:
    """Refuse more than one process inside a Hydra ``-m`` sweep, unless torchrun or SLURM starts them.

    Lightning's DDP launcher starts the other processes by re-running this command line, which
    in a ``-m`` sweep would start the whole sweep again; torchrun and SLURM start them themselves.

    Raises:
        ConfigError: ``trainer.devices`` > 1 or ``trainer.num_nodes`` > 1 in a ``-m`` sweep.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from lightning.fabric.plugins.environments import SLURMEnvironment

    devices = cfg.trainer.devices
    many = (len(devices) if isinstance(devices, (list, ListConfig)) else devices if isinstance(devices, int) else 1) > 1
    started_by_scheduler = "WORLD_SIZE" in os.environ or SLURMEnvironment.detect()  # hydra/launcher=slurm
    if (many or cfg.trainer.num_nodes > 1) and not started_by_scheduler and HydraConfig.initialized() \
            and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise ConfigError("trainer.devices", devices, "more than one process cannot be launched inside a -m sweep",
                          "1 in a sweep; or run each DDP config on its own, or under torchrun/SLURM")
