"""The console of every command: one logging setup (rank 0 by default, the level from
``logging.level``), warnings routed through it, and progress that is a bar on a terminal and a
periodic log line elsewhere (a SLURM log, a pipe); there, other libraries' bars (datasets,
transformers, the hub) are turned off.

Library modules log through their own ``logging.getLogger(__name__)``; only a command's entry
point (:func:`eagle3_train.core.cli.entry_point`) calls :func:`setup_logging`. Messages at INFO and
below go to stdout, warnings and errors to stderr, each as its text alone (no level, time or
source path: the messages name their command and what they are about).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from eagle3_train.core.errors import ConfigError

# the loggers whose level logging.level sets ("__main__": a module run as ``python -m``/``torchrun -m``)
PACKAGES = ("eagle3_train", "data_prep", "__main__")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
EVERY_RANK = {"every_rank": True}  # extra= of a message every rank shows (an independent client names itself)


@dataclass
class LogConfig:
    """The console of a command (``logging.*``): how much it says, from which ranks, how progress shows."""

    level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR: the least severe message shown (this package's; other libraries show WARNING and above)
    all_ranks: bool = False  # every rank shows its messages, each prefixed [rank N] (otherwise ranks other than 0 show only warnings and errors)
    progress_every_s: float = 60.0  # without a terminal (progress=null), one progress line per bar every this many seconds instead of a redrawn bar

    def __post_init__(self) -> None:
        if self.level.upper() not in LEVELS:
            raise ConfigError(f"logging.level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        if not self.progress_every_s > 0:
            raise ConfigError(f"logging.progress_every_s must be > 0, got {self.progress_every_s}")


class ConsoleHandler(logging.Handler):
    """Writes each record's text to stdout (below WARNING) or stderr, around any live tqdm bar;
    on a rank other than 0 only warnings and errors (unless ``all_ranks``, or a record logged with
    ``extra=EVERY_RANK``). The streams are looked up at each write, so a redirected ``sys.stdout``
    (a test's capture) is followed."""

    def __init__(self, rank: int, all_ranks: bool):
        super().__init__()
        self.rank, self.all_ranks = rank, all_ranks
        self.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s" if all_ranks else "%(message)s"))

    def filter(self, record: logging.LogRecord) -> bool:
        shown = (
            record.levelno >= logging.WARNING
            or self.rank == 0
            or self.all_ranks
            or getattr(record, "every_rank", False)
        )
        return shown and bool(super().filter(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            tqdm.write(self.format(record), file=stream)  # clears a live bar, writes, redraws it
            stream.flush()
        except Exception:
            self.handleError(record)


_progress_every_s = LogConfig.progress_every_s


def setup_logging(config: LogConfig | None = None, rank: int | None = None) -> None:
    """Send this process's log records to the console as ``config`` says; called once by each
    command's entry point (a second call replaces the first's handler). ``rank``: this process's
    global rank (default: ``$RANK``, which torchrun sets; 0 outside it). Warnings raised with
    :func:`warnings.warn` (other libraries') become log records of the ``py.warnings`` logger."""
    global _progress_every_s
    config = config if config is not None else LogConfig()
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, ConsoleHandler)]:
        root.removeHandler(old)
    root.addHandler(ConsoleHandler(rank, config.all_ranks))
    for name in PACKAGES:
        logging.getLogger(name).setLevel(config.level.upper())
    _progress_every_s = config.progress_every_s
    warnings.showwarning = _show_warning
    if not sys.stderr.isatty():
        _quiet_library_bars()


# (module, its function that turns its progress bars off, the variable that has priority over it)
LIBRARY_BARS = (
    ("datasets", "disable_progress_bars", "HF_DATASETS_DISABLE_PROGRESS_BARS"),  # map, filter, save_to_disk
    ("transformers.utils.logging", "disable_progress_bar", "HF_HUB_DISABLE_PROGRESS_BARS"),  # checkpoint shards
    ("huggingface_hub.utils", "disable_progress_bars", "HF_HUB_DISABLE_PROGRESS_BARS"),  # downloads
)


def _quiet_library_bars() -> None:
    """Other libraries' progress bars off where stderr is not a terminal (their frames would fill a
    SLURM log): by their variables for those not imported yet, by their switches for the others. A
    variable the user set (``...=0``: bars wanted) is left as it is, and wins."""
    for module, switch, variable in LIBRARY_BARS:
        if os.environ.setdefault(variable, "1").lower() not in ("1", "true", "yes", "on"):
            continue
        if module in sys.modules:
            getattr(sys.modules[module], switch)()


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """:func:`warnings.showwarning` as a log record: ``Category: message`` (where it was raised only
    at DEBUG, for whoever reports it upstream)."""
    log = logging.getLogger("py.warnings")
    where = f" ({filename}:{lineno})" if log.isEnabledFor(logging.DEBUG) else ""
    log.warning("%s: %s%s", category.__name__, message, where)


def progress_bar(
    iterable: Iterable | None = None,
    *,
    show: bool | None,
    total: float | None = None,
    desc: str = "",
    unit: str = "it",
    every_rank: bool = False,
    **kwargs: Any,
) -> tqdm:
    """A tqdm over ``iterable`` (or advanced by ``update``). ``show`` is a command's ``progress``
    option: True, a redrawn bar on stderr; None, the bar on a terminal and otherwise one INFO log
    line every ``logging.progress_every_s`` seconds (and one at the end); False, nothing.
    ``every_rank``: its log lines are shown on every rank (an independent client's bar)."""
    if show is None and not sys.stderr.isatty():
        known = total is not None or hasattr(iterable, "__len__")
        return tqdm(
            iterable,
            total=total,
            desc=desc,
            unit=unit,
            file=_LogLines(every_rank),
            ascii=True,
            miniters=1,
            mininterval=_progress_every_s,
            maxinterval=_progress_every_s,
            bar_format=_LINE if known else _LINE_NO_TOTAL,
            **kwargs,
        )
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=show is False, **kwargs)


# a progress log line: "train: 120/1000 step (12%) [00:40<04:53, 3.00step/s, loss=1.234]"
_LINE = "{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
_LINE_NO_TOTAL = "{desc}: {n_fmt} {unit} [{elapsed}, {rate_fmt}{postfix}]"


class _LogLines:
    """The file a log-line tqdm writes to: each frame it prints becomes one INFO record (tqdm
    writes ``\\r`` + frame, then a newline when the bar closes)."""

    def __init__(self, every_rank: bool) -> None:
        self.extra = EVERY_RANK if every_rank else None
        self.last = ""

    def write(self, text: str) -> None:
        frame = text.strip("\r\n ")
        count = frame.rpartition(" [")[0] or frame  # the frame less its times: the closing frame repeats the last
        if frame and count != self.last:
            self.last = count
            logging.getLogger(__name__).info(frame, extra=self.extra)

    def flush(self) -> None:
        pass
