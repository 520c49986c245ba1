"""The one interface between the dump stage (data_prep/dump/stage.py) and the ways of running a
target: ``hf`` (transformers, here: data_prep/dump/hf.py) and every engine of the registry with a
hidden-state capture (a running engine, over HTTP: data_prep/dump/served.py).

The stage owns everything a backend does not: the prepared data, the capture it is asked for,
claiming the output directory, resuming, the shard writer, coverage and the manifest. A backend
says how this process stands among the dump's processes (:meth:`Backend.team`), refuses what it
cannot capture before any work (:meth:`Backend.check`), produces the states of its share of the
samples (:meth:`Backend.dump`), and adds its own facts to the manifest (:meth:`Backend.run_info`).
An engine backend also prints the command that launches its engine (:meth:`Backend.launch_text`)
and hands the same commands to ``serve=true`` (:meth:`Backend.engine_commands`).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from data_prep.dump.config import DumpConfig
from eagle3_train.core.dist import DistInfo
from eagle3_train.core.errors import ConfigError
from eagle3_train.engines import registry
from eagle3_train.targets import resolve_dtype

if TYPE_CHECKING:
    from data_prep.dump.stage import Dumper
    from eagle3_train.engines.launcher import EngineCommand


@dataclass(frozen=True)
class Team:
    """How this process shares the dump with the others.

    Args:
        dist: this process: rank, world size, device.
        group: True: the processes form one ``torch.distributed`` group started together
            (torchrun): rank 0 claims the output for all, and writes the manifest after a barrier.
            False: independent clients, started at any time: each claims only its own files, and
            the one that finds every sample stored writes the manifest.
    """

    dist: DistInfo
    group: bool


class Backend(ABC):
    """One way of producing a dump's hidden states (see the module docstring).

    Args:
        cfg: the dump's options.
    """

    def __init__(self, cfg: DumpConfig):
        self.cfg = cfg

    @abstractmethod
    def team(self) -> Team:
        """This process's place among the dump's processes (joins a process group if there is one)."""

    def device(self, dist: DistInfo | None) -> str:
        """Where the target computes, which decides what ``dtype=auto`` means (default: an engine's GPU)."""
        return "cuda"

    def resolve_dtype(self, dist: DistInfo | None) -> None:
        """Turn ``cfg.dtype=auto`` into the dtype the target computes in here (float32 on a CPU,
        bfloat16 on a GPU, as prepare and eval), so the manifest and the launch command record it."""
        self.cfg.dtype = str(resolve_dtype(self.cfg.dtype, self.device(dist))).removeprefix("torch.")

    def check(self, stage: Dumper) -> None:
        """Refuse, before any work, a capture this backend cannot produce (default: none)."""

    @abstractmethod
    def dump(self, stage: Dumper, rows: np.ndarray) -> tuple[int, int]:
        """Produce the states of this process's share of ``rows`` (rows of the prepared dataset
        still to do, the same on every process) into ``stage.writer()``; return (bytes written,
        tokens stored) by this process."""

    def run_info(self, stage: Dumper) -> dict[str, Any]:
        """What the manifest records about how the states were produced."""
        return {}

    def launch_text(self) -> str:
        """The command(s) that start the engine for this capture (``print_launch=true``)."""
        raise ConfigError(f"backend={self.cfg.backend} runs no engine, so it has no launch command")

    def engine_commands(self, logs: Path) -> list[EngineCommand]:
        """The engine server(s) for this capture (``serve=true``), logging under ``logs``."""
        raise ConfigError(f"backend={self.cfg.backend} runs no engine, so it has none to serve")

    def close(self) -> None:
        """Release what the backend holds (a process group)."""


def make_backend(cfg: DumpConfig) -> Backend:
    """The backend for the engine ``cfg.backend`` names (:mod:`eagle3_train.engines.registry`):
    transformers here for an in-process one, else a client of the running engine."""
    engine = registry.engine(cfg.backend, "dump", "backend")
    # imported when picked (backend=hf never imports the HTTP clients), by name (both modules import this one)
    return importlib.import_module("data_prep.dump.hf" if engine.in_process else "data_prep.dump.served").Backend(cfg)
