"""How this process was started: as a child of Lightning's DDP launcher, by a scheduler, inside a ``-m`` sweep.

``is_launched_child`` tells the processes Lightning's DDP launcher starts (and nodes > 0) from the one
that claims the run directory; ``check_launch`` refuses a multi-process run inside a Hydra ``-m`` sweep,
where Lightning's launcher would start the whole sweep again.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

from cltrain.app.config.check import check_sweep_launch

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
    """Inside a Hydra ``-m`` sweep, refuse more than one process unless torchrun or SLURM starts them
    (``cltrain.app.config.check.check_sweep_launch``; the command line's check refuses it before Hydra starts).

    Raises:
        ConfigError: ``trainer.devices`` > 1 or ``trainer.num_nodes`` > 1 in a ``-m`` sweep.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        check_sweep_launch(cfg)
