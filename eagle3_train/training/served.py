"""Training fed by the engine you serve (``eagle3-train source=served``): the target runs in one or
more vLLM or SGLang replicas, with their own parallelism, quantization and kernels, and returns the
hidden states of each micro-batch's samples; nothing is written to disk but the engine's in-flight
state files, each deleted as soon as it is read.

    eagle3-train source=served data=<prepared> target=<hf dir> out=<run> engine.launch=true \
        engine.engine_args='--tensor-parallel-size 8 --quantization fp8'
    eagle3-train source=served data=<prepared> target=<hf dir> out=<run> \
        engine.urls=[http://gpu1:8000,http://gpu2:8000] engine.files_dir=/shared/engine_files

The samples, their order, the splits, the vocab map, the token budget, the epochs, the rank
assignment and the resume position are those of ``source=online`` (:class:`PreparedSource`): only
the states' origin differs. Each micro-batch's samples go out as one request each to the least
busy replica (``engine.concurrency`` requests in flight per trainer rank), ``engine.prefetch``
micro-batches ahead of the draft's step, so states in host memory stay under ``prefetch + 1``
micro-batches. The answers are the served dump's (eagle3_train/engines/vllm.py, sglang.py): each
engine's :class:`~eagle3_train.engines.capture.StateCapture` asks for the trained aux layers and the
last layer, checks the token ids, shape and dtype it returns, and norms ``last_hidden`` with the
checkpoint's final norm, so the target distribution is ``lm_head(last_hidden)`` computed here from
the checkpoint's lm_head, read alone (never the whole model). The engine's own logits are not used:
a [T, V] answer per sample is 30x the [T, H] state for an 8B target's vocabulary; the engine's greedy
next token is checked against the same ``lm_head(last_hidden)`` on the first ``engine.check_samples``
samples instead (a low agreement stops the run: another model, or another last layer).

Faults: a request that fails on something worth retrying (connection, timeout, 5xx, a state file
that never came) is retried ``engine.retries`` times with exponential backoff; a replica that still
fails is dropped and its samples go to the others (logged), so losing one replica slows the run;
losing the last stops it, naming the endpoint and the sample. A hung engine (stopped, stuck in a
kernel) fails no request before its timeouts, so while a replica has requests in flight its
``/health`` is probed every ``engine.health_every_s``; ``engine.health_failures`` failed probes in a
row drop it at once, its samples in flight (those waiting for a state file too) going elsewhere.
An answer that retrying cannot fix (wrong token ids, shape or dtype, non-finite states) stops the
run at once, naming both. The last checkpoint is kept and ``resume=auto`` continues from it at its
exact data position.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import shlex
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3_train.core.dist import DistInfo
from eagle3_train.core.errors import ConfigError, check_numbers
from eagle3_train.core.extras import optional_import
from eagle3_train.core.prepared import prepared_data
from eagle3_train.engines import registry
from eagle3_train.engines.base import Engine
from eagle3_train.engines.capture import CaptureJob, ClientConfig, EngineClient, NextTokenCheck, ServerConfig
from eagle3_train.engines.http import HEALTH_PROBE_S, EngineError, RetriesExhausted, health, retrying, wait_ready
from eagle3_train.engines.launcher import LOG_DIR, EngineCommand, EngineProcesses, command_lines, host_logs
from eagle3_train.engines.launcher import serve as serve_commands
from eagle3_train.targets import Target, load_target, load_target_tensors, resolve_dtype, text_config
from eagle3_train.targets.tiny import is_tiny
from eagle3_train.training.data import Batch
from eagle3_train.training.online import PreparedConfig, PreparedSource, Tokens, capture_indices

if TYPE_CHECKING:
    from eagle3_train.training.config import TrainConfig

logger = logging.getLogger(__name__)

FILES_DIR = "engine_files"  # <out>/engine_files/: vLLM's state files in flight (engine.files_dir: elsewhere)


def release(version: str) -> tuple[int, ...]:
    """``0.5.23`` -> (0, 5, 23); a suffix (``+cu130``, ``rc1``) is ignored."""
    parts = []
    for word in version.split("+")[0].split("."):
        digits = "".join(c for c in word if c.isdigit()) if word[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


# what the record of the engine reads from its flags (the vLLM and SGLang spellings)
PARALLEL_FLAGS = {
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp", "--tp-size", "--tp"),
    "pipeline_parallel_size": ("--pipeline-parallel-size", "-pp", "--pp-size"),
    "data_parallel_size": ("--data-parallel-size", "-dp", "--dp-size", "--dp"),
    "expert_parallel_size": ("--ep-size", "--expert-parallel-size"),
}


@dataclass
class EngineConfig:
    """The engine replicas that serve the target and return its states (``engine.*``, with
    ``source=served``)."""

    name: str = "vllm"  # vllm | sglang: the engine (its hidden-state capture: docs/guide/large-targets.md)
    urls: list[str] = field(default_factory=list)
    """replicas already running (several: each request goes to the least busy); with launch=true, leave empty"""
    final_urls: list[str] = field(
        default_factory=list
    )  # sglang: each replica's final-state server, in the order of urls
    launch: bool = False
    """start the replicas from this command (on each node, its local rank 0), wait for them, stop them at the end"""
    replicas: int = 1  # launch: replicas started on each node
    port: int = 8000  # launch: the first replica's port (the next ones count up)
    devices: list[str] = field(default_factory=list)
    """launch: CUDA_VISIBLE_DEVICES of each replica (empty: the GPUs this process sees)"""
    engine_args: str = ""
    """the engine's own flags, as its command line takes them (--tensor-parallel-size 8 --quantization fp8): launch passes them on; with urls, say how the replicas were started (recorded with the run)"""
    memory_fraction: float | None = 0.45
    """launch: the GPU memory share each replica takes (vLLM --gpu-memory-utilization, SGLang --mem-fraction-static), leaving the rest to the trainer on a shared GPU; null: the engine's default"""
    dtype: str = "auto"  # the dtype the engine computes in (auto: bfloat16); the states arrive in it
    model: str | None = None  # vLLM's served model name (null: the first one /v1/models lists)
    files_dir: str | None = None
    """vLLM: the directory the engine writes state files to, as this process sees it (null: <out>/engine_files; a RAM disk such as /dev/shm/<run> keeps them off the disk)"""
    server_files_dir: str | None = None  # vLLM: the same directory as the engine sees it (null: files_dir)
    prefetch: int = 2  # micro-batches whose states are requested ahead of the draft's step
    concurrency: int = 32  # requests in flight per trainer rank (the engine batches them)
    request_timeout_s: float = 600.0  # one request's time limit (a hung engine counts as failed after it)
    file_timeout_s: float = 600.0  # vLLM: longest wait for a state file once its response came
    retries: int = 3  # further attempts at a request after a transient failure, before its replica is dropped
    backoff_s: float = 1.0  # the first retry's delay; doubled on every further one (at most 60 s)
    health_every_s: float = 30.0  # probe a replica's /health this often while it has requests in flight (0: off)
    health_failures: int = 2  # a replica failing this many probes in a row is dropped at once (a hung engine)
    wait_for_server_s: float = 0.0
    """urls: how long to wait for the replicas' /health (0: one probe, an unreachable URL fails at once)"""
    launch_timeout_s: float = 1800.0  # launch: how long the started replicas may take to load the target
    check_samples: int = 64  # compare the engine's next token with lm_head(last_hidden) on this many samples (0: off)
    keep_files: bool = False  # vLLM: keep the engine's state files after reading them (debugging)
    print_launch: bool = False
    """print the command(s) that start the replicas this run expects (to start them elsewhere: SLURM, another host), and exit"""
    serve: bool = False
    """start this host's replicas (what print_launch prints) and wait on them until one exits or SIGTERM / Ctrl-C stops them; no training (the engine hosts of launch/train_served.sh)"""
    check_args: bool = True
    """refuse engine_args flags the engine's command line (as this project read it) does not take; false passes them unchecked"""

    def __post_init__(self) -> None:
        check_numbers(
            self,
            "engine.",
            positive=(
                "replicas",
                "port",
                "prefetch",
                "concurrency",
                "request_timeout_s",
                "file_timeout_s",
                "health_failures",
            ),
            non_negative=(
                "retries",
                "backoff_s",
                "health_every_s",
                "wait_for_server_s",
                "launch_timeout_s",
                "check_samples",
            ),
        )
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"engine.memory_fraction must be in (0, 1] or null, got {self.memory_fraction}")
        if self.launch and self.urls:
            raise ConfigError(
                "engine.launch=true starts the replicas itself; engine.urls names replicas already running: choose one"
            )
        others = {
            "print_launch": "engine.print_launch=true only prints their commands",
            "launch": "engine.launch=true starts them inside a training run",
            "urls": "engine.urls names replicas already running",
        }
        if self.serve and (asked := [said for k, said in others.items() if getattr(self, k)]):
            raise ConfigError(
                f"engine.serve=true starts this host's replicas for trainers elsewhere; {asked[0]}: choose one"
            )
        if self.devices and len(self.devices) != self.replicas:
            raise ConfigError(
                f"engine.devices lists {len(self.devices)} device sets for engine.replicas={self.replicas}: one per replica"
            )
        try:
            shlex.split(self.engine_args)
        except ValueError as e:
            raise ConfigError(f"engine.engine_args: {e}: {self.engine_args!r}") from None


@dataclass
class Replica:
    """One engine replica as a trainer rank talks to it."""

    urls: list[str]  # its server(s): vLLM one, SGLang the aux-state and the final-state server
    client: EngineClient
    in_flight: int = 0
    lost: str | None = None  # why it was dropped
    dead: asyncio.Future = field(init=False, repr=False)  # done once dropped (made on the stream's loop)

    @property
    def name(self) -> str:
        """How messages name it."""
        return " + ".join(self.urls)


def flag_values(engine_args: str) -> dict[str, str | bool]:
    """``--flag value`` / ``--flag=value`` / ``--switch`` words of an engine command line."""
    words, i = shlex.split(engine_args), 0
    out: dict[str, str | bool] = {}
    while i < len(words):
        w = words[i]
        if w.startswith("-"):
            flag, eq, value = w.partition("=")
            if eq:
                out[flag] = value
            elif i + 1 < len(words) and not words[i + 1].startswith("-"):
                out[flag] = words[i + 1]
                i += 1
            else:
                out[flag] = True
        i += 1
    return out


def check_engine_args(engine: Engine, engine_args: str) -> None:
    """Refuse a flag of ``engine_args`` that the engine's command line does not take (as this
    project read it), in seconds, before anything starts."""
    if engine.command is None or not engine_args:
        return
    try:
        engine.command.parse(
            [*engine.command.program, *(["<model>"] * len(engine.command.positional)), *shlex.split(engine_args)]
        )
    except ValueError as e:
        raise ConfigError(
            f"engine.engine_args: {e}; if your {engine.title} takes it, set engine.check_args=false"
        ) from None


def served_engine(cfg: EngineConfig) -> Engine:
    """The engine ``engine.name`` names, refused unless it has a hidden-state capture (a server to
    ask), its ``engine.engine_args`` checked against its command line (unless ``check_args``)."""
    engine = registry.engine(cfg.name, "dump", "engine.name")
    if engine.capture is None:  # transformers in this process: no server
        raise ConfigError(f"engine.name={cfg.name} runs in this process: use source=online")
    if cfg.check_args:
        check_engine_args(engine, cfg.engine_args)
    return engine


class EnginePlan:
    """The replicas one run talks to: their URLs and files, the engine ids that capture the trained
    layers (refused here, before anything starts, when the engine cannot capture them), and the
    command lines that start them.

    Args:
        cfg: the ``engine.*`` options.
        engine: the engine (its capture and command line).
        about: the target's config and tokenizer.
        target: the target as named (the engine loads its directory).
        aux: the trained HF indices.
        longest: the longest sample sent, in tokens.
        out: the run directory.
    """

    def __init__(
        self, cfg: EngineConfig, engine: Engine, about: Target, target: str, aux: list[int], longest: int, out: Path
    ):
        assert engine.capture is not None, "served_engine refuses engines without a capture"
        self.cfg, self.capture, self.about = cfg, engine.capture, about
        self.target, self.aux, self.out = target, aux, out
        self.dtype = resolve_dtype(cfg.dtype, "cuda")  # the engine's GPUs
        self.servers = self._servers(longest)
        n = about.num_hidden_layers
        self.layer_ids = self.capture.layer_ids(list(aux), about.identity.model_type, n, self.servers[0])

    def _servers(self, longest: int) -> list[ServerConfig]:
        """One :class:`ServerConfig` per replica: the URLs given, or the ones launched here."""
        e = self.cfg
        files = str(Path(e.files_dir).expanduser()) if e.files_dir else str((self.out / FILES_DIR).resolve())
        base = ServerConfig(
            model=e.model, files_dir=files, server_files_dir=e.server_files_dir, engine_args=self._engine_args(longest)
        )
        if e.urls:
            finals = e.final_urls or [base.final_url] * len(e.urls)
            return [
                replace(base, url=u.rstrip("/"), final_url=f.rstrip("/")) for u, f in zip(e.urls, finals, strict=True)
            ]
        step = 2 if self.capture.final_server else 1  # an aux-state and a final-state server each
        return [
            replace(
                base, url=f"http://127.0.0.1:{e.port + step * i}", final_url=f"http://127.0.0.1:{e.port + step * i + 1}"
            )
            for i in range(e.replicas)
        ]

    def _engine_args(self, longest: int) -> str:
        """``engine.engine_args``, plus, for replicas started by this project (launch or
        print_launch), the memory share and the longest sequence: the longest sample and the one
        token the request generates (no longer than the target's own context, little KV cache)."""
        e = self.cfg
        if e.urls:
            return e.engine_args
        given = flag_values(e.engine_args)
        extra = []
        memory = self.capture.memory_flag
        if e.memory_fraction is not None and memory:
            if memory in given:
                raise ConfigError(
                    f"engine.engine_args sets {memory} and engine.memory_fraction={e.memory_fraction} sets it too: "
                    f"set engine.memory_fraction=null to keep yours"
                )
            extra.append(f"{memory} {e.memory_fraction}")
        length = self.capture.length_flag
        if length and length not in given:
            extra.append(f"{length} {longest + 1}")
        return " ".join([e.engine_args, *extra]).strip()

    def urls(self, server: ServerConfig) -> list[str]:
        """A replica's server URL(s)."""
        return list(self.capture.servers(server).values())

    def text(self, i: int) -> str:
        """Replica ``i``'s launch lines, with the capture's comments."""
        return "\n".join(
            self.capture.launch_lines(
                str(self.about.local_dir or self.target),
                self.about.identity.model_type,
                self.about.num_hidden_layers,
                list(self.aux),
                str(self.dtype).removeprefix("torch."),
                self.servers[i],
                str(self.out),
            )
        )

    def commands(self, logs: Path | None = None) -> list[EngineCommand]:
        """Every replica's server command(s), each with its GPUs and its log under ``logs``
        (None: ``<out>/engine``)."""
        e = self.cfg
        logs = self.out / LOG_DIR if logs is None else logs
        out = []
        for i in range(len(self.servers)):
            for j, line in enumerate(command_lines(self.text(i))):
                out.append(EngineCommand(line, e.devices[i] if e.devices else None, logs / f"replica{i}.{j}.log"))
        return out

    def make_files_dir(self) -> None:
        """Create the directory a replica writes state files into from its first request (vLLM)."""
        if self.capture.writes_files:
            server = self.servers[0]
            Path(server.server_files_dir or server.files_dir or self.out / FILES_DIR).mkdir(parents=True, exist_ok=True)


def engine_plan(cfg: TrainConfig) -> tuple[Engine, Target, EnginePlan]:
    """The replicas the run ``cfg`` expects on each engine host (the port, files and flags of
    ``engine.*``): what ``engine.print_launch`` prints and ``engine.serve`` starts."""
    e = cfg.engine
    about = load_target(cfg.target, cache_dir=cfg.cache_dir, load_model=False)
    prepared = prepared_data(cfg.data, cfg.prepared.extra_data)
    prepared.identity_for(about, cfg.target)  # data of another tokenizer is refused here too
    aux = capture_indices(cfg.prepared.aux_indices, about.num_hidden_layers)
    longest = int(min(cfg.loop.max_tokens_per_batch, prepared.num_tokens.max()))
    engine = served_engine(e)
    plan = EnginePlan(
        replace(e, urls=[], final_urls=[]), engine, about, cfg.target, aux, longest, Path(cfg.out).expanduser()
    )
    return engine, about, plan


def launch_text(cfg: TrainConfig) -> str:
    """``engine.print_launch=true``: the command(s) that start the replicas the run ``cfg`` expects,
    for each engine host."""
    engine, about, plan = engine_plan(cfg)
    lines = [
        f"# eagle3-train source=served: {engine.title} replica(s) for {about.identity.model_type}, N={about.num_hidden_layers}, "
        f"HF indices {plan.aux} + the last layer (engine ids {plan.layer_ids}); run on each engine host "
        f"(or eagle3-train engine.serve=true there):"
    ]
    for i in range(len(plan.servers)):
        lines.append(plan.text(i))
    lines.append("# then the trainer, with engine.urls=[http://<engine host>:<port>,...] and the same engine.files_dir")
    return "\n".join(lines)


def serve(cfg: TrainConfig) -> int:
    """``engine.serve=true``: start this host's replicas (those ``engine.print_launch`` prints), each
    logging under ``<out>/engine/<host>/``, and wait on them until one exits (its status) or SIGTERM
    / Ctrl-C stops them all (0): the engine hosts of a run whose trainers name them in
    ``engine.urls``."""
    _, _, plan = engine_plan(cfg)
    plan.make_files_dir()
    return serve_commands(plan.commands(host_logs(plan.out)), "eagle3-train engine.serve")


class ServedSource(PreparedSource):
    """The states of each micro-batch from the engine replicas of ``engine.*``.

    Args:
        data: the prepared directory (eagle3-prepare's out).
        target: the target's directory (its config, tokenizer and final norm / lm_head are read here).
        cache_dir: where GGUF targets are converted once.
        cfg: the ``online.*`` options (the data's: aux indices, vocab, split).
        engine: the ``engine.*`` options.
        max_length: samples are cut at this many tokens (the token budget of a micro-batch).
        out: the run directory.
        dist: this rank; the states are moved to its device.
        dtype: the training dtype the states are handed over in.
    """

    def __init__(
        self,
        data: str,
        target: str,
        cache_dir: str | None,
        cfg: PreparedConfig,
        engine: EngineConfig,
        max_length: int,
        out: Path,
        dist: DistInfo,
        dtype: torch.dtype,
    ):
        self.engine_cfg, self.device, self.dtype, self.dist = engine, dist.device, dtype, dist
        self.target_name, self.cache_dir = target, cache_dir
        self.engine = served_engine(engine)
        assert self.engine.capture is not None  # served_engine refuses the others
        self.capture = self.engine.capture
        if not engine.launch and not engine.urls:
            raise ConfigError("source=served needs engine.urls=[...] (replicas already running) or engine.launch=true")
        if engine.final_urls and not self.capture.final_server:
            raise ConfigError(f"engine.final_urls are final-state servers; {self.engine.title} needs none")
        if self.capture.final_server and not engine.launch and len(engine.final_urls) != len(engine.urls):
            raise ConfigError(
                f"{self.engine.title} returns the aux states and the post-norm final state from two servers: engine.final_urls "
                f"needs one URL per engine.urls entry ({len(engine.urls)}), got {len(engine.final_urls)}"
            )
        if engine.launch and is_tiny(target):
            raise ConfigError(f"target={target} exists only inside this process; no engine can serve it")
        about = load_target(target, cache_dir=cache_dir, load_model=False)
        super().__init__(data, target, cfg, about, dist)
        self.out = out
        longest = int(min(max_length, self.prepared.num_tokens.max()))
        # what the engine cannot capture or serve is refused here, before anything starts
        self.plan = EnginePlan(engine, self.engine, about, target, list(self.aux), longest, out)
        self.processes = self._launch() if engine.launch and dist.local_rank == 0 else None
        split = lambda: self._split(str(self.plan.dtype).removeprefix("torch."), max_length, out, dist)  # noqa: E731
        try:
            if engine.launch:  # the vocab is counted while the engines load
                split()
            names = tuple(dict.fromkeys((*self.capture.tensors, "head")))
            _, tensors = load_target_tensors(target, names, cache_dir=cache_dir)
            self.check = (
                NextTokenCheck(
                    tensors["head"], target, "compare the engine's launch command with eagle3-dump print_launch=true"
                )
                if engine.check_samples
                else None
            )
            job = self._job(about, dist.rank)
            replicas = [
                Replica(
                    self.plan.urls(s),
                    self.capture.client(replace(job, server=s, rank=dist.rank * len(self.plan.servers) + i), tensors),
                )
                for i, s in enumerate(self.plan.servers)
            ]
            self.stream = StateStream(replicas, engine, self._alive, self.check, pin=dist.device.type == "cuda")
            if not engine.launch:  # replicas given by URL answered first: a wrong URL fails before any counting
                split()
            self.states_from = self._record()
        except BaseException:
            self.close()
            raise
        logger.info(
            f"source=served: {len(replicas)} {self.engine.title} replica(s) ({', '.join(r.name for r in replicas)}), "
            f"{self.states_from.get('version') or 'version unknown'}; engine ids {self.plan.layer_ids} for HF indices "
            f"{list(self.aux)} + the last layer"
        )

    def _launch(self) -> EngineProcesses:
        """Start every replica of this node with the command lines the capture prints."""
        self.plan.make_files_dir()
        return EngineProcesses(self.plan.commands())

    def _job(self, about: Target, rank: int) -> CaptureJob:
        e = self.engine_cfg
        client = ClientConfig(
            concurrency=e.concurrency,
            request_timeout_s=e.request_timeout_s,
            file_timeout_s=e.file_timeout_s,
            retries=e.retries,
            backoff_s=e.backoff_s,
            wait_for_server_s=1.0,  # the stream has waited for /health already (StateStream._start)
            check_next_token=bool(e.check_samples),
            keep_files=e.keep_files,
        )
        eps = float(getattr(text_config(about.config), "rms_norm_eps", 1e-6))
        return CaptureJob(
            list(self.aux),
            about.identity.model_type,
            about.num_hidden_layers,
            about.hidden_size,
            eps,
            self.plan.dtype,
            rank,
            self.out,
            self.plan.servers[0],
            client,
        )

    def _alive(self) -> None:
        if self.processes is not None:
            self.processes.check_alive()

    def _record(self) -> dict[str, Any]:
        """What fed this run, as the checkpoint, the export and eagle3-check carry it."""
        e = self.engine_cfg
        flags = flag_values(e.engine_args)
        record: dict[str, Any] = {
            "engine": e.name,
            "version": self.stream.version,
            "dtype": str(self.plan.dtype).removeprefix("torch."),
            "quantization": flags.get("--quantization") or flags.get("-q"),
            "kv_cache_dtype": flags.get("--kv-cache-dtype"),
            "layer_ids": list(self.plan.layer_ids),
            "aux_indices": list(self.aux),
            "replicas": len(self.plan.servers),
            "launched": e.launch,
            "engine_args": e.engine_args,
        }
        for name, spellings in PARALLEL_FLAGS.items():
            value = next((flags[s] for s in spellings if s in flags), None)
            record[name] = int(value) if isinstance(value, str) and value.isdigit() else 1
        record["expert_parallel"] = bool(flags.get("--enable-expert-parallel")) or record["expert_parallel_size"] > 1
        return record

    # -- the Source interface ----------------------------------------------------------------------

    def target_tensors(self, names: tuple[str, ...]) -> tuple[Any, dict[str, torch.Tensor]]:
        """Read from the target's safetensors files alone (the engine holds the model)."""
        return load_target_tensors(self.target_name, names, cache_dir=self.cache_dir)

    def device_batches(self, batches: Iterator[Tokens]) -> Iterator[Batch]:
        """Each micro-batch's states, requested ``engine.prefetch`` micro-batches ahead."""
        pending: deque[concurrent.futures.Future] = deque()
        try:
            for tokens in batches:
                pending.append(self.stream.submit(tokens))
                if len(pending) > self.engine_cfg.prefetch:
                    yield self._ready(pending.popleft())
            while pending:
                yield self._ready(pending.popleft())
        finally:  # a consumer that stops early (the last step, an evaluation's end) cancels what is left
            for f in pending:
                f.cancel()

    def _ready(self, future: concurrent.futures.Future) -> Batch:
        return future.result().to(self.device, self.dtype)  # pinned already on a GPU

    def close(self) -> None:
        stream = getattr(self, "stream", None)
        if stream is not None:
            stream.close()
        processes = getattr(self, "processes", None)
        if processes is not None:
            processes.close()


class StateStream:
    """The requests of one trainer rank: an asyncio loop on a thread of its own, one HTTP session,
    ``engine.concurrency`` requests in flight over the replicas, micro-batches handed back as
    futures of host :class:`Batch` es.

    Args:
        replicas: the replicas' clients.
        cfg: the ``engine.*`` options.
        alive: raises when engine processes started by this run have died (None: none started).
        check: the next-token check of the first ``cfg.check_samples`` samples (None: off).
        pin: build the micro-batches in page-locked memory (the trainer is on a GPU).
    """

    def __init__(
        self, replicas: list[Replica], cfg: EngineConfig, alive: Any, check: NextTokenCheck | None, pin: bool = False
    ):
        self.replicas, self.cfg, self.alive, self.check, self.pin = replicas, cfg, alive, check, pin
        self.version: str | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="served-states", daemon=True)
        self.thread.start()
        self.session: Any = None
        self.probes: Any = None  # the watchdog's own session: a full request pool must not delay a probe
        self.watchdogs: list[asyncio.Task] = []
        try:
            self._call(self._start())
        except BaseException:
            self.close()
            raise

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def _start(self) -> None:
        """Open the session; wait for every replica (launched ones: until they load or die); read
        their version (replicas of different versions are refused)."""
        aiohttp = optional_import("aiohttp")

        c = self.cfg
        self.gate = asyncio.Semaphore(c.concurrency)
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=c.request_timeout_s),
            connector=aiohttp.TCPConnector(limit=2 * c.concurrency),
        )
        self.probes = aiohttp.ClientSession()
        for r in self.replicas:
            r.dead = self.loop.create_future()
        hint = "start it, or let eagle3-train start it with engine.launch=true"
        for r in self.replicas:
            wait = c.launch_timeout_s if c.launch else c.wait_for_server_s
            await wait_ready(self.session, r.urls, wait, "eagle3-train source=served", hint, self.alive)
            await r.client.start(self.session)
        versions = {r.name: await self._version(r.urls[0]) for r in self.replicas}
        known = {v for v in versions.values() if v is not None}
        if len(known) > 1:
            raise ConfigError(
                f"the replicas run different {c.name} versions ({versions}): the states of one run come from one engine"
            )
        self.version = known.pop() if known else None
        capture = registry.ENGINES[c.name].capture
        if self.version is not None and capture is not None and capture.oldest is not None:
            oldest, why = capture.oldest
            if release(self.version) < release(oldest):
                raise ConfigError(
                    f"the replicas run {c.name} {self.version}; training from {c.name} needs {oldest} or later: {why}"
                )
        if c.health_every_s:
            self.watchdogs = [self.loop.create_task(self._watch(r)) for r in self.replicas]

    async def _watch(self, replica: Replica) -> None:
        """Probe the replica's ``/health`` (each of its servers) every ``health_every_s`` while it
        has requests in flight; ``health_failures`` failed probes in a row drop it. A stopped or
        stuck engine answers nothing, and its requests would otherwise wait out their timeouts and
        retries; a slow engine still answers ``/health`` and is left alone."""
        c = self.cfg
        limit = min(HEALTH_PROBE_S, c.health_every_s)
        failed, since, due = 0, 0.0, time.monotonic() + c.health_every_s
        while replica.lost is None:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            start = due = time.monotonic()
            due += c.health_every_s  # probes start on a fixed cadence, however long one takes
            if not replica.in_flight:
                failed = 0
                continue
            answers = await asyncio.gather(*(health(self.probes, u, limit) for u in replica.urls))
            problems = [f"{u}/health: {p}" for u, p in zip(replica.urls, answers, strict=True) if p is not None]
            if not problems:
                failed = 0
                continue
            if not failed:
                since = start
                logger.warning(
                    f"source=served: {replica.name} did not answer /health ({problems[0]}); "
                    f"dropped if {c.health_failures} probes in a row fail"
                )
            failed += 1
            if failed >= c.health_failures:
                self._drop(
                    replica,
                    f"no answer to /health for {time.monotonic() - since:.0f} s ({failed} probes; the last: {problems[0]})",
                )

    async def _version(self, url: str) -> str | None:
        """The version the replica reports (None: it does not say)."""
        route = registry.ENGINES[self.cfg.name].version_route
        if route is None:
            return None
        try:
            async with self.session.get(f"{url}{route[0]}") as resp:
                return str((await resp.json()).get(route[1])) if resp.status == 200 else None
        except Exception:  # an engine without the route: the record says unknown
            return None

    def submit(self, tokens: Tokens) -> concurrent.futures.Future:
        """Ask for the states of one micro-batch; the future holds its host :class:`Batch`.
        Cancelling the future cancels its requests."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(self._spawn, tokens, future)
        return future

    def _spawn(self, tokens: Tokens, future: concurrent.futures.Future) -> None:
        """(on the loop) The micro-batch's task, tied to ``future`` both ways."""
        if future.cancelled():
            return
        task = self.loop.create_task(self._batch(tokens))

        def settle(t: asyncio.Task) -> None:
            if t.cancelled() or future.cancelled():
                return
            if (error := t.exception()) is not None:
                future.set_exception(error)
            else:
                future.set_result(t.result())

        task.add_done_callback(settle)
        future.add_done_callback(lambda f: f.cancelled() and self.loop.call_soon_threadsafe(task.cancel))

    async def _batch(self, tokens: Tokens) -> Batch:
        """The micro-batch's samples, asked for at once; the first failure cancels the rest."""
        lengths = tokens.lengths.tolist()
        ids = [tokens.input_ids[r, :n].tolist() for r, n in enumerate(lengths)]
        tasks = [
            asyncio.ensure_future(self._sample(int(s), p)) for s, p in zip(tokens.sample_ids.tolist(), ids, strict=True)
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
        if failed:
            raise failed[0]
        return await asyncio.to_thread(self._pad, tokens, results)  # type: ignore[arg-type]  # none failed

    def _pad(self, tokens: Tokens, rows: list[dict[str, torch.Tensor]]) -> Batch:
        """Right-pad the samples' states as shards are padded (zeros past each row's end), each
        layer copied once into place; in page-locked memory when the trainer is on a GPU."""
        b, t = tokens.input_ids.shape
        keys = sorted((k for k in rows[0] if k.startswith("hidden.")), key=lambda k: int(k.split(".")[1]))
        h = rows[0]["last_hidden"].shape[-1]
        dtype = rows[0]["last_hidden"].dtype
        aux = torch.zeros(b, t, len(keys) * h, dtype=dtype, pin_memory=self.pin)  # [B, T, n_aux*H], ascending k
        last = torch.zeros(b, t, h, dtype=dtype, pin_memory=self.pin)  # [B, T, H]
        for r, states in enumerate(rows):
            n = len(states["last_hidden"])
            for i, k in enumerate(keys):
                aux[r, :n, i * h : (i + 1) * h] = states[k]
            last[r, :n] = states["last_hidden"]
        return Batch(aux, last, tokens.input_ids, tokens.loss_mask, tokens.lengths, tokens.sample_ids)

    async def _sample(self, sample_id: int, prompt: list[int]) -> dict[str, torch.Tensor]:
        """One sample's states ({``hidden.<k>``, ``last_hidden``: [T, H]}) from the least busy live
        replica; a replica whose retries run out is dropped and the sample asked of another, as is
        one dropped while the sample waits on it."""
        async with self.gate:
            while True:
                replica = self._pick(sample_id)
                fetch = functools.partial(replica.client.fetch, self.session, sample_id, prompt)  # (attempt)
                attempt = asyncio.ensure_future(
                    retrying(fetch, self.cfg.retries, self.cfg.backoff_s, f"sample {sample_id} from {replica.name}")
                )
                replica.in_flight += 1
                try:  # until it is answered or the replica is dropped (the watchdog, another sample's retries)
                    await asyncio.wait((attempt, replica.dead), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    replica.in_flight -= 1
                    attempt.cancel()  # dropped, or this sample cancelled: no retry on it (no-op once done)
                if not attempt.done():  # dropped while asked: another replica, or none is left
                    continue
                try:
                    states, next_token = attempt.result()
                except RetriesExhausted as e:
                    self._drop(replica, str(e))
                    continue
                except EngineError as e:
                    raise EngineError(f"{replica.name} answered sample {sample_id} wrongly: {e}") from None
                break
        await asyncio.to_thread(self._checked, states, next_token, sample_id, replica.name)
        return states

    def _checked(self, states: dict[str, torch.Tensor], next_token: int | None, sample_id: int, where: str) -> None:
        """(on a worker thread: [T, K, H] passes the event loop must not wait for) Finite states,
        and the next-token check on the first ``check_samples`` samples."""
        if not all(bool(torch.isfinite(v).all()) for v in states.values()):
            raise EngineError(f"{where} returned non-finite states for sample {sample_id}")
        check = self.check
        if check is not None and next_token is not None and check.counts["checked"] < self.cfg.check_samples:
            check(states["last_hidden"][-1], int(next_token), sample_id)

    def _pick(self, sample_id: int) -> Replica:
        live = [r for r in self.replicas if r.lost is None]
        if not live:
            lost = "; ".join(f"{r.name}: {r.lost}" for r in self.replicas)
            raise EngineError(f"no engine replica is left to answer sample {sample_id}: {lost}")
        return min(live, key=lambda r: r.in_flight)

    def _drop(self, replica: Replica, why: str) -> None:
        if replica.lost is None:
            replica.lost = why
            replica.dead.set_result(None)  # its samples in flight, even those waiting for a file, go elsewhere
            left = sum(r.lost is None for r in self.replicas)
            logger.warning(f"source=served: dropped replica {replica.name} ({why}); {left} left")

    async def _stop(self) -> None:
        for w in self.watchdogs:
            w.cancel()
        await asyncio.gather(*self.watchdogs, return_exceptions=True)
        for session in (self.session, self.probes):
            if session is not None:
                await session.close()

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self._call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()
