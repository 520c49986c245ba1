"""Where a training run's states come from (``source=``): one function the trainer asks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle3_train.core.dist import DistInfo
from eagle3_train.core.errors import ConfigError
from eagle3_train.targets import Target
from eagle3_train.training.data import OfflineSource, Source
from eagle3_train.training.online import OnlineSource
from eagle3_train.training.served import ServedSource


def open_source(cfg: Any, out: Path, dist: DistInfo, dtype: torch.dtype, target: Target | None = None) -> Source:
    """The source ``cfg`` (a ``TrainConfig``) asks for: the target in this process
    (``source=online``; ``target``: an already loaded one, a benchmark's random weights), a serving
    engine (``source=served``) or the standardized dump (``source=offline``)."""
    if target is not None and cfg.source != "online":
        raise ConfigError("a loaded target runs in this process: set source=online")
    max_length = cfg.loop.max_tokens_per_batch
    if cfg.source == "online":
        return OnlineSource(
            cfg.data, cfg.target, cfg.cache_dir, cfg.prepared, cfg.online, max_length, out, dist, dtype, target
        )
    if cfg.source == "served":
        return ServedSource(cfg.data, cfg.target, cfg.cache_dir, cfg.prepared, cfg.engine, max_length, out, dist, dtype)
    return OfflineSource(cfg.data, cfg.target, cfg.cache_dir, max_length, dist.device, dtype)
