"""The ``eagle3-dump`` command: compose the config, pick the backend, run the stage (or verify a
dump, or print an engine's launch command, or serve the engine on this host)."""

from __future__ import annotations

import logging
from pathlib import Path

from data_prep.dump.backend import make_backend
from data_prep.dump.config import DumpConfig
from data_prep.dump.stage import Dumper, verify
from eagle3_train.core.cli import entry_point
from eagle3_train.engines.launcher import host_logs, serve

logger = logging.getLogger(__name__)


def launch_text(cfg: DumpConfig) -> str:
    """What ``print_launch=true`` prints: the engine command(s) for this capture, and the client's."""
    return make_backend(cfg).launch_text()


def _run(cfg: DumpConfig) -> int:
    """``verify=true`` checks a finished dump; ``print_launch=true`` prints the engine command;
    ``serve=true`` runs it here until stopped; otherwise this process dumps its share."""
    if cfg.verify:
        assert cfg.out is not None  # DumpConfig requires out= but for print_launch
        problems = verify(cfg.out, cfg.progress)
        for p in problems:
            logger.error(f"eagle3-dump verify: {p}")
        logger.info(f"eagle3-dump verify: {'OK' if not problems else f'{len(problems)} problems'} ({cfg.out})")
        return 1 if problems else 0
    if cfg.print_launch:
        print(launch_text(cfg))  # the command's output, to copy or pipe: not a log message
        return 0
    if cfg.serve:
        assert cfg.out is not None  # DumpConfig requires out= for serve
        return serve(make_backend(cfg).engine_commands(host_logs(Path(cfg.out))), "eagle3-dump serve")
    backend = make_backend(cfg)
    try:
        Dumper(cfg, backend).run()
    finally:
        backend.close()
    return 0


main = entry_point("dump", DumpConfig, _run)
