"""One configuration of train.py run in this process, with the probe that counts its finite losses and host syncs:
each end-to-end task of ``scripts.bench.mark`` (``scripts.gpu_check``'s matrix and its ``--mark``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback

from cltrain.check.budget import free_memory
from cltrain.timing.host_syncs import SyncOps

__all__ = ["StepProbe", "run_config", "skip_reason"]


class StepProbe(Callback):
    """Keeps every training step's loss on the device and counts host-sync ops over ``count_steps`` steps; writes
    ``{"finite", "steps", "counted", "sync_ops"}`` to ``path`` as JSON when training ends or fails."""

    def __init__(self, path: str, count_from: int, count_steps: int) -> None:
        self.path, self.first, self.stop = Path(path), count_from, count_from + count_steps
        self.losses: list[torch.Tensor] = []
        self.mode: SyncOps | None = None
        self.ops: Counter = Counter()

    def _close(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.ops, self.mode = sum(self.mode.counts.values(), Counter()), None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if len(self.losses) == self.stop:
            self._close()
        if len(self.losses) == self.first:
            self.mode = SyncOps().__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append((outputs["loss"] if isinstance(outputs, dict) else outputs).detach())  # no sync

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()
        finite = int(torch.stack(self.losses).float().isfinite().sum()) if self.losses else 0
        counted = max(0, min(self.stop, len(self.losses)) - self.first)
        self.path.write_text(json.dumps({"finite": finite, "steps": len(self.losses), "counted": counted,
                                         "sync_ops": self.ops}))

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)


def run_config(spec: dict, name: str, overrides: list[str], slug: str, extra: list[str] | tuple = ()) -> dict:
    """One configuration through ``train(cfg)`` in this process: ``train``'s metrics with the ``StepProbe``'s counts
    (``status`` "failed" and the error's first line when it raised), the run in ``spec["runs"]/slug``."""
    from cltrain.app import compose_config
    from cltrain.app.train import train

    runs, (first, count) = Path(spec["runs"]), spec["count"]
    probe, record = runs / f"{slug}.probe.json", {"name": name}
    print(f"gpu_check: {name}: {' '.join([*overrides, *extra])}", flush=True)
    try:
        record.update(train(compose_config([
            *spec["common"], *overrides, f"run_dir={runs / slug}",
            "+callbacks.probe._target_=scripts.bench.config_run.StepProbe", f"+callbacks.probe.path={probe}",
            f"+callbacks.probe.count_from={first}", f"+callbacks.probe.count_steps={count}", *extra])))
    except Exception as err:  # noqa: BLE001 - one configuration failing must not stop the others
        record.update(status="failed", error=f"{type(err).__name__}: {err}".splitlines()[0])
    record.update(json.loads(probe.read_text()) if probe.is_file() else {})
    record.pop("config", None)
    free_memory()  # the finished run's loader workers and tensors, before the next run starts
    return record


def skip_reason(overrides: list[str], tiny: bool) -> str | None:
    """Why the configuration ``overrides`` cannot run on this machine ("skipped: ..."), or ``None``: fp16 needs
    CUDA, bf16 a device that has it, and ``--tiny`` (``tiny``) leaves out compiling."""
    from cltrain.platform import cpu_bf16_support

    cuda = torch.cuda.is_available()
    if "amp=fp16" in overrides and not cuda:
        return "skipped: no CUDA"
    if "amp=bf16" in overrides and not (torch.cuda.is_bf16_supported() if cuda else cpu_bf16_support()[0]):
        return f"skipped: no bf16 on this {'GPU' if cuda else 'CPU'}"
    if tiny and "compile.enabled=true" in overrides:
        return "skipped: --tiny (compiling takes minutes on a CPU)"
    return None
