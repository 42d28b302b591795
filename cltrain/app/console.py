"""The app's console: each log line once, and two library notices left out.

:func:`quiet_console` wraps a run. Lightning gives its top-level ``lightning`` logger a
console handler of its own and also lets records propagate to the root logger, where
Hydra's console handler prints them a second time; while Hydra's handler is there,
Lightning's is set aside. Notices no run can avoid are dropped by exact text: the
LitLogger advert every ``Trainer`` without a LitLogger logs, the ``LeafSpec``
deprecation that Lightning's own ``_pytree`` helper triggers in torch, and where the S3
client found its credentials and endpoint (said again by every process that opens one). Everything else,
warnings included, shows as before.

Example::

    with quiet_console():
        trainer.fit(module, datamodule=datamodule)
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator

__all__ = ["LIBRARY_NOTICES", "quiet_console"]

#: The beginnings of the log records and warnings left out (logger or warning, text).
LIBRARY_NOTICES: tuple[tuple[str, str], ...] = (
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip: For seamless cloud logging"),
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip: For seamless cloud uploads"),  # said where no checkpoint is saved
    ("warning", "`isinstance(treespec, LeafSpec)` is deprecated"),
    # said at every evaluation under DDP: EveryImageOnce takes that sampler's ranks, not its padded order
    ("warning", "Using `DistributedSampler` with the dataloaders. During `trainer."),
    # said by every S3 client each process opens (data.root=s3://...: the workers' too)
    ("botocore.credentials", "Found credentials in"),
    ("aiobotocore.credentials", "Found credentials in"),
    ("botocore.configprovider", "Found endpoint for"),
)


class _DropNotices(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def _console_handlers(logger: logging.Logger) -> list[logging.Handler]:
    return [h for h in logger.handlers if type(h) is logging.StreamHandler]  # not FileHandler (a subclass)


@contextlib.contextmanager
def quiet_console() -> Iterator[None]:
    """Within this block: Lightning's records printed once, :data:`LIBRARY_NOTICES` left out."""
    lightning = logging.getLogger("lightning")
    set_aside = _console_handlers(lightning) if _console_handlers(logging.getLogger()) else []
    for handler in set_aside:
        lightning.removeHandler(handler)
    filters: list[tuple[logging.Logger, logging.Filter]] = []
    for name, start in LIBRARY_NOTICES:
        if name != "warning":
            filters.append((logging.getLogger(name), _DropNotices((start,))))
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            for name, start in LIBRARY_NOTICES:
                if name == "warning":
                    warnings.filterwarnings("ignore", message=re.escape(start))
            yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)
        for handler in set_aside:
            lightning.addHandler(handler)

