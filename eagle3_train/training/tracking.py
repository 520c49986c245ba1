"""Metrics trackers besides ``metrics.jsonl`` (``logging=wandb|tensorboard``), opened on rank 0.

wandb: a setting left null in ``logging.*`` is read from its ``WANDB_*`` variable, and one set in
the config wins over the variable (``WANDB_MODE=disabled`` opens no run and writes nothing). The
run's id is kept in ``<out>/tracker.json``, so ``resume=auto`` continues the same wandb run; a run
directory started afresh (no checkpoint) gets a new one. TensorBoard: event files under
``<out>/tensorboard``; a resumed run replaces the events logged after its checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from eagle3_train.core.extras import optional_import
from eagle3_train.core.fileio import atomic_write_json

logger = logging.getLogger(__name__)

TRACKER_FILE = "tracker.json"  # in the run directory: the wandb run id that resume=auto continues
TRACKERS = ("none", "wandb", "tensorboard")  # logging.tracker's values (conf/logging/<name>.yaml)
PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard"}  # tracker -> the package it imports


class Tracker(Protocol):
    """What :class:`~eagle3_train.training.metrics.MetricsLog` writes to."""

    def log(self, data: dict[str, Any], step: int) -> None: ...

    def finish(self) -> None: ...


def check_tracker(tracker: str) -> None:
    """Refuse a tracker whose package is not installed, naming the extra that installs it
    (:func:`eagle3_train.core.extras.optional_import`)."""
    if tracker in PACKAGES:
        optional_import(PACKAGES[tracker])


def open_tracker(cfg: Any, out: Path, config: dict[str, Any], step: int, is_main: bool) -> Tracker | None:
    """The tracker ``cfg.tracker`` names (``cfg``: a ``LoggingConfig``) on the main rank, else None.
    ``step``: the step the run starts (or resumes) at; ``config``: the run's options, recorded."""
    if not is_main or cfg.tracker == "none":
        return None
    check_tracker(cfg.tracker)
    if cfg.tracker == "tensorboard":
        return TensorBoardTracker(out / "tensorboard", step)
    return wandb_run(cfg, out, config)


def wandb_settings(cfg: Any, out: Path, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The arguments of ``wandb.init``: each setting from ``cfg`` when set there, else from its
    ``WANDB_*`` variable, else our default (mode offline, project eagle3_train, the run directory's
    name, wandb's files under ``out``)."""
    disabled = env.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes")
    return {
        "mode": cfg.wandb_mode or env.get("WANDB_MODE") or ("disabled" if disabled else "offline"),
        "project": cfg.wandb_project or env.get("WANDB_PROJECT") or "eagle3_train",
        "entity": cfg.wandb_entity or env.get("WANDB_ENTITY"),
        "name": cfg.run_name or env.get("WANDB_NAME") or out.name,
        "dir": env.get("WANDB_DIR") or str(out),
    }


def wandb_run_id(out: Path, new_id: Callable[[], str] = lambda: secrets.token_hex(4)) -> str:
    """The wandb run id of the run directory ``out``: the one ``tracker.json`` holds, else
    ``new_id()`` (8 hex digits, a valid wandb id), recorded there."""
    path = out / TRACKER_FILE
    if path.is_file():
        run_id = json.loads(path.read_text()).get("wandb_run_id")
        if run_id:
            return str(run_id)
    run_id = str(new_id())
    atomic_write_json(path, {"wandb_run_id": run_id})
    return run_id


def wandb_run(cfg: Any, out: Path, config: dict[str, Any]) -> Tracker | None:
    """A wandb run continuing the run directory's (None when the mode is ``disabled``)."""
    settings = wandb_settings(cfg, out)
    if settings["mode"] == "disabled":
        return None
    wandb = optional_import("wandb")
    run_id = wandb_run_id(out)
    logger.info(f"wandb run {run_id} ({settings['mode']}, project {settings['project']})")
    return wandb.init(id=run_id, resume="allow", config=config, **settings)


class TensorBoardTracker:
    """Scalars as TensorBoard events under ``log_dir``; resumed from the checkpoint of ``step``, it
    drops the events an earlier run logged after that step (they are logged again).

    Args:
        log_dir: the directory of the event files.
        step: the step the run starts at (0: a new run).
    """

    def __init__(self, log_dir: Path, step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=step + 1 if step else None)

    def log(self, data: dict[str, Any], step: int) -> None:
        for name, value in data.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "step":
                self.writer.add_scalar(name, value, global_step=step)

    def finish(self) -> None:
        self.writer.close()
