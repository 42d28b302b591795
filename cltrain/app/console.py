"""The app's console: each log line once, and two library notices left out.

:func:`quiet_console` wraps a run. Lightning gives its top-level ``lightning`` logger a console handler of its own
and also lets records propagate to the root logger, where Hydra's console handler prints them a second time; while
Hydra's handler is there, Lightning's are set aside and every record goes to the root (``train.log`` too). Notices
no run can avoid are dropped by exact text: the LitLogger advert every ``Trainer`` without a LitLogger logs, the
``LeafSpec`` deprecation that Lightning's own ``_pytree`` helper triggers in torch, and where the S3 client found
its credentials and endpoint (said again by every process that opens one). Everything else, warnings included, shows
as before.

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


#: Lightning's loggers with a console handler of their own: ``lightning``'s always, and ``lightning.pytorch``'s and
#: ``lightning.fabric``'s (which then keep their records from the root) where the root had no handler at their import,
#: as when the app's config check imports Lightning before Hydra sets up the root's console and ``train.log``.
_LIGHTNING = ("lightning", "lightning.pytorch", "lightning.fabric")


def _console_handlers(logger: logging.Logger) -> list[logging.Handler]:
    return [h for h in logger.handlers if type(h) is logging.StreamHandler]  # not FileHandler (a subclass)


def _one_line_end(record: logging.LogRecord) -> bool:
    """A captured warning without the newline ``warnings.formatwarning`` ends it with (a blank line after each)."""
    if isinstance(record.msg, str) and not record.args:  # logging logs the formatted text itself (bpo-46557)
        record.msg = record.msg.rstrip("\n")
    return True


@contextlib.contextmanager
def quiet_console() -> Iterator[None]:
    """Within this block: Lightning's records printed once, by the root's handlers (Hydra's console and its
    ``train.log``), :data:`LIBRARY_NOTICES` left out; ``warnings.warn``'s warnings go there too (``py.warnings``)."""
    loggers = [logging.getLogger(name) for name in _LIGHTNING]
    root_prints = bool(_console_handlers(logging.getLogger()))
    set_aside = [(logger, h) for logger in loggers for h in _console_handlers(logger)] if root_prints else []
    propagate = [(logger, logger.propagate) for logger in loggers]
    for logger, handler in set_aside:
        logger.removeHandler(handler)
    if root_prints:  # imported before the root had a handler, lightning.pytorch keeps its records from the root
        for logger in loggers:
            logger.propagate = True
    filters: list[tuple[logging.Logger, logging.Filter]] = []
    for name, start in LIBRARY_NOTICES:
        if name != "warning":
            filters.append((logging.getLogger(name), _DropNotices((start,))))
    for logger, drop in filters:
        logger.addFilter(drop)
    captured = root_prints and warnings.showwarning is not logging._showwarning  # type: ignore[attr-defined]
    if captured:  # printed by the root's handlers, so train.log keeps them
        logging.captureWarnings(True)
        logging.getLogger("py.warnings").addFilter(_one_line_end)
    try:
        with warnings.catch_warnings():
            for name, start in LIBRARY_NOTICES:
                if name == "warning":
                    warnings.filterwarnings("ignore", message=re.escape(start))
            yield
    finally:
        if captured:
            logging.captureWarnings(False)
            logging.getLogger("py.warnings").removeFilter(_one_line_end)
        for logger, drop in filters:
            logger.removeFilter(drop)
        for logger, handler in set_aside:
            logger.addHandler(handler)
        for logger, flag in propagate:
            logger.propagate = flag

