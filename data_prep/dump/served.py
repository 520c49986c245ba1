"""The engine backends (``backend=vllm``, ``backend=sglang``, any engine of the registry with a
hidden-state capture): client processes that send one request per sample to a running engine and
check every answer.

    eagle3-dump backend=vllm target=<hf dir> print_launch=true        # the engine command to run
    eagle3-dump backend=vllm target=<hf dir> out=<dump> serve=true    # run it here until stopped
    eagle3-dump backend=vllm target=<hf dir> data=<prepared> out=<dump> server.url=http://gpu1:8000
    eagle3-dump backend=vllm ... client.rank=3 client.world_size=8       # eight client processes

For targets that transformers cannot run at scale (DeepSeek, Kimi, Qwen3-235B), the states come
from the engine the team serves, so they are the engine's own numerics. The shards are those of
``backend=hf`` (docs/concepts/storage.md): everything downstream is unchanged. What each engine offers, and how
its answers become states, is in its own module (eagle3_train/engines/vllm.py, sglang.py: its
:class:`~eagle3_train.engines.capture.StateCapture`); no engine runs on the machines this project
is tested on, so the test suite drives these clients against stand-in servers that follow the same
API surface (tests/standin_engines.py).

Every response is checked by the engine's module: the token ids the engine saw, the shape (layers
x hidden size), the dtype; here: finiteness (a sample with a non-finite state is dropped and
listed, as with ``backend=hf``), and the engine's next token against ``lm_head(last_hidden)`` of
the checkpoint (does the engine serve this target, from these layers?). A failed request is
retried with exponential backoff; one that keeps failing stops the run after writing every sample
already received. Each client process writes its own shards and resumes by sample id; the last
one to finish writes the manifest.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from data_prep.dump import backend
from data_prep.dump.config import DumpConfig, stored_indices
from eagle3_train.core.dist import DistInfo
from eagle3_train.core.errors import ConfigError, Eagle3Error
from eagle3_train.core.extras import optional_import
from eagle3_train.core.fileio import atomic_write_json
from eagle3_train.engines import registry
from eagle3_train.engines.capture import CaptureJob, EngineClient, NextTokenCheck, StateCapture
from eagle3_train.engines.http import retrying
from eagle3_train.engines.launcher import EngineCommand, command_lines
from eagle3_train.targets import Target, load_target, load_target_tensors, resolve_dtype, text_config
from eagle3_train.targets.tiny import is_tiny

if TYPE_CHECKING:
    from data_prep.dump.stage import Dumper

CHECKS_DIR = "next_token_check"  # <out>/next_token_check/<client rank>.json: each client's counts


class Backend(backend.Backend):
    """A client process of ``client.world_size``, asking the running engine ``cfg.backend`` for
    states through its :class:`~eagle3_train.engines.capture.StateCapture`."""

    def __init__(self, cfg: DumpConfig):
        super().__init__(cfg)
        capture = registry.engine(cfg.backend, "dump", "backend").capture
        assert capture is not None, "data_prep.dump.backend picks this backend for engines with a capture"
        self.capture: StateCapture = capture

    def team(self) -> backend.Team:
        c = self.cfg.client
        rank = c.rank if c.rank is not None else int(os.environ.get("RANK", 0))
        world = c.world_size if c.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
        if not 0 <= rank < world:
            raise ConfigError(f"client.rank={rank} must be in [0, client.world_size={world})")
        return backend.Team(DistInfo(rank, world, 0, torch.device("cpu")), group=False)

    def check(self, stage: Dumper) -> None:
        self.capture.layer_ids(stage.stored, stage.identity.model_type, stage.spec.num_hidden_layers, self.cfg.server)

    def job(self, stage: Dumper) -> CaptureJob:
        """What this client process asks the engine for."""
        spec, cfg = stage.spec, self.cfg
        eps = float(getattr(text_config(stage.target.config), "rms_norm_eps", 1e-6))
        return CaptureJob(
            list(stage.stored),
            stage.identity.model_type,
            spec.num_hidden_layers,
            spec.hidden_size,
            eps,
            resolve_dtype(cfg.dtype, "cuda"),
            stage.dist.rank,
            stage.out,
            cfg.server,
            cfg.client,
        )

    def _engine_lines(self) -> tuple[Target, list[int], list[str]]:
        """The target, the HF indices stored, and the engine's launch lines (with comments) for
        exactly the capture ``cfg`` asks for."""
        cfg = self.cfg
        self.resolve_dtype(None)  # the engine's GPUs: what the dump records
        if is_tiny(cfg.target):
            raise ConfigError(
                f"target={cfg.target} exists only inside this process; no engine can serve it (save it "
                "as a directory first: eagle3_train.targets.tiny.save_tiny)"
            )
        target = load_target(
            cfg.target, cache_dir=cfg.cache_dir, load_model=False, trust_remote_code=cfg.trust_remote_code
        )
        n = target.num_hidden_layers
        _, stored = stored_indices(cfg.capture, n)
        lines = self.capture.launch_lines(
            str(target.local_dir or cfg.target), target.identity.model_type, n, stored, cfg.dtype, cfg.server, cfg.out
        )
        return target, stored, lines

    def engine_commands(self, logs: Path) -> list[EngineCommand]:
        """The engine server(s) for this capture (``serve=true``), each with its GPUs
        (``serve_devices``) and its log ``<logs>/engine<i>.log``."""
        commands = command_lines("\n".join(self._engine_lines()[2]))
        devices = self.cfg.serve_devices
        if devices and len(devices) != len(commands):
            raise ConfigError(
                f"serve_devices lists {len(devices)} device sets for the {len(commands)} server(s) backend="
                f"{self.cfg.backend} starts: one per server, in print_launch's order"
            )
        return [
            EngineCommand(c, devices[i] if devices else None, logs / f"engine{i}.log") for i, c in enumerate(commands)
        ]

    def launch_text(self) -> str:
        """The engine command(s) that serve exactly the capture ``cfg`` asks for, and the client
        command that dumps from them (``print_launch=true``)."""
        cfg = self.cfg
        target, stored, engine = self._engine_lines()
        lines = [
            f"# eagle3-dump backend={cfg.backend}: {target.identity.model_type}, N={target.num_hidden_layers}, "
            f"HF indices stored {stored} + last_hidden",
            f"# (engine API as read from {cfg.backend} {self.capture.read_from}; serve=true starts it on this host)",
            *engine,
        ]
        capture = "".join(
            f" capture.{name}=[{','.join(map(str, v))}]"
            for name, v in (("aux_indices", cfg.capture.aux_indices), ("extra_indices", cfg.capture.extra_indices))
            if v
        )
        lines += [
            "# then, once the server is up:",
            f"eagle3-dump backend={cfg.backend} target={shlex.quote(cfg.target)} data={cfg.data or '<prepared>'} "
            f"out={cfg.out or '<dump>'} "
            + " ".join(f"{k}={v}" for k, v in self.capture.servers(cfg.server).items())
            + capture,
        ]
        return "\n".join(lines)

    def dump(self, stage: Dumper, rows: np.ndarray) -> tuple[int, int]:
        mine = rows[stage.sample_ids[rows] % stage.dist.world_size == stage.dist.rank]  # stable across restarts
        self.next_token: NextTokenCheck | None = None
        if not len(mine):
            return 0, 0
        tensors: dict[str, torch.Tensor] = {}
        names = self.capture.tensors + (("head",) if self.cfg.client.check_next_token else ())
        if names:
            cfg = self.cfg
            _, tensors = load_target_tensors(
                cfg.target, names, cache_dir=cfg.cache_dir, trust_remote_code=cfg.trust_remote_code
            )
        if "head" in tensors:
            self.next_token = NextTokenCheck(
                tensors["head"], self.cfg.target, "compare its launch command with print_launch=true"
            )
        written, tokens = asyncio.run(self._fetch_all(stage, self.capture.client(self.job(stage), tensors), mine))
        self._record_agreement(stage)
        return written, tokens

    def run_info(self, stage: Dumper) -> dict[str, Any]:
        counts = [json.loads(p.read_text()) for p in sorted((stage.out / CHECKS_DIR).glob("*.json"))]
        total = {k: sum(c[k] for c in counts) for k in ("checked", "agreed")}
        return {
            "backend": self.cfg.backend,
            "engine_api": f"{self.cfg.backend} {self.capture.read_from}",
            "servers": list(self.capture.servers(self.cfg.server).values()),
            "client_world_size": stage.dist.world_size,
            "next_token_check": total,
        }

    def _record_agreement(self, stage: Dumper) -> None:
        """Add this run's next-token counts to this client's file (summed into the manifest)."""
        path = stage.out / CHECKS_DIR / f"{stage.dist.rank:05d}.json"
        before = json.loads(path.read_text()) if path.is_file() else {"checked": 0, "agreed": 0}
        mine = self.agreement
        atomic_write_json(path, {k: before[k] + mine[k] for k in before})

    @property
    def agreement(self) -> dict[str, int]:
        """This run's next-token counts."""
        return self.next_token.counts if self.next_token else {"checked": 0, "agreed": 0}

    async def _fetch_all(self, stage: Dumper, client: EngineClient, rows: np.ndarray) -> tuple[int, int]:
        """Keep ``client.concurrency`` requests in flight; hand finished samples to the writer.
        On a failure that retries cannot fix, store what arrived, then stop. Returns (bytes, tokens)."""
        aiohttp = optional_import("aiohttp")

        c = self.cfg.client
        writer = stage.writer()
        bar = stage.progress(rows, f"dump client {stage.dist.rank}/{stage.dist.world_size} ({self.cfg.backend})")
        queue = iter(rows.tolist())
        pending: set[asyncio.Task] = set()
        tokens = samples = 0
        failure: BaseException | None = None
        timeout = aiohttp.ClientTimeout(total=c.request_timeout_s)
        try:
            async with aiohttp.ClientSession(
                timeout=timeout, connector=aiohttp.TCPConnector(limit=2 * c.concurrency)
            ) as session:
                await client.start(session)
                while failure is None:
                    while len(pending) < c.concurrency and (row := next(queue, None)) is not None:
                        pending.add(asyncio.create_task(self._sample(stage, client, session, row)))
                    if not pending:
                        break
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        if task.exception() is not None:
                            failure = failure or task.exception()
                            continue
                        piece, n = task.result()
                        writer.add(piece, [n])
                        tokens, samples = tokens + n, samples + 1
                        bar.update(n)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        except BaseException as e:  # Ctrl-C included: what arrived is still written below
            failure = failure or e
        finally:
            bar.close()
            writer.close()  # writes every sample received, so a rerun resumes after them
        if failure is not None:
            if isinstance(failure, Eagle3Error):
                servers = ", ".join(f"{k}={v}" for k, v in self.capture.servers(self.cfg.server).items())
                raise Eagle3Error(
                    f"{self.cfg.backend} ({servers}) stopped client {stage.dist.rank}/{stage.dist.world_size} "
                    f"of the dump: {failure}\n  {samples} samples received before the stop are stored "
                    f"({writer.count} shards written by this run, under {stage.shard_dir}); fix the "
                    f"cause (is the engine still running?) and run the same command again to resume"
                ) from None
            raise failure
        stage.say(f"{samples} samples, {tokens} tokens received; next-token check: {self.agreement}")
        return writer.bytes_written, tokens

    async def _sample(
        self, stage: Dumper, client: EngineClient, session: Any, row: int
    ) -> tuple[dict[str, torch.Tensor], int]:
        """One sample's states and index tensors, retried with exponential backoff."""
        c = self.cfg.client
        record = stage.dataset[row]
        sample_id = int(stage.sample_ids[row])
        prompt = record["input_ids"].astype(np.int64).tolist()
        states, next_token = await retrying(
            lambda attempt: client.fetch(session, sample_id, prompt, attempt),
            c.retries,
            c.backoff_s,
            f"sample {sample_id}",
        )
        finite = all(bool(torch.isfinite(t).all()) for t in states.values())
        if finite and next_token is not None and self.next_token is not None:
            await asyncio.to_thread(self.next_token, states["last_hidden"][-1], int(next_token), sample_id)
        piece = dict(states)
        piece["finite"] = torch.tensor([finite])
        piece["input_ids"] = torch.from_numpy(record["input_ids"].astype(np.int32))
        piece["loss_mask"] = torch.from_numpy(record["loss_mask"].astype(np.uint8))
        piece["sample_ids"] = torch.tensor([sample_id], dtype=torch.int64)
        return piece, len(prompt)
