"""``eagle3-dump``: run the target over a prepared dataset and store per-layer hidden states.

    eagle3-dump target=embedded data=runs/x/prepared out=runs/x/dump
    torchrun --nproc_per_node 8 -m data_prep.dump target=... data=... out=...
    eagle3-dump backend=vllm ... server.url=http://gpu1:8000    # from a served target: data_prep/served.py

Output (DESIGN §3): ``<out>/shards/*.safetensors`` packing many samples along tokens
(``input_ids``, ``loss_mask``, ``cu_seqlens``, ``sample_ids``, ``hidden.<k>`` for every stored HF
index ``k``, ``last_hidden`` = the post-norm final state), a record ``*.json`` beside each, and
``<out>/manifest.json`` written last by rank 0.

How it stays exact: samples are batched by length with right padding and *no* attention mask.
Attention is causal, so a real token never sees the padding that follows it, and its states are
those of the sample run alone; padded positions are dropped before anything is stored.

How it resumes: the unit of work is the sample. At start, finished shards (those with a record)
are scanned for their sample ids; leftovers of a crash (temp files, shards without a record) are
deleted; the remaining samples are planned into batches again. Started with the same command
after a kill, at any moment, it finishes with every sample stored exactly once.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.core.config_store import ConfigStore
from tqdm.auto import tqdm

from eagle3_train.cli import config_dict, entry_point
from eagle3_train.contract import (
    MANIFEST_NAME,
    CaptureSpec,
    TargetIdentity,
    default_aux_indices,
    differences,
    read_manifest,
    validate_aux_indices,
    write_manifest,
)
from eagle3_train.dist import DistInfo, barrier, close, init_distributed, print0
from eagle3_train.errors import BadInputError, ConfigError, ContractError, Eagle3Error, IncompleteError
from eagle3_train.fileio import atomic_write_json
from eagle3_train.formats import (
    ShardRecord,
    finished_records,
    read_keys,
    remove_unfinished,
    verify_shard,
    write_shard,
)
from eagle3_train.targets import load_target, resolve_dtype, tensor_parallel_kwargs

STAGE = "dump"
REQUEST_NAME = "request.json"
CRASH_ENV = "EAGLE3_DUMP_CRASH_AFTER_SHARDS"  # tests only: hard-exit a rank after N shards


@dataclass
class CaptureConfig:
    """Which hidden states are stored (HF indices, DESIGN §1)."""

    aux_indices: list[int] | None = None  # the aux capture; null: [2, N//2, N-3]
    extra_indices: list[int] = field(default_factory=list)  # more layers kept for later choices


BACKENDS = ("hf", "vllm", "sglang")


@dataclass
class ServerConfig:
    """Where ``backend=vllm|sglang`` finds the engine (see data_prep/served.py)."""

    url: str = "http://127.0.0.1:8000"  # the vLLM server, or SGLang's aux-state server
    final_url: str = "http://127.0.0.1:30001"  # SGLang only: the server that returns the post-norm final state
    model: str | None = None  # vLLM's served model name; null: the first one /v1/models lists
    files_dir: str | None = None  # vLLM: the shared directory the engine writes states to, as this client sees it (null: <out>/engine_files)
    server_files_dir: str | None = None  # vLLM: the same directory as the engine sees it (null: files_dir)
    final_norm: str = "auto"  # vLLM: the target's final norm (auto: from model_type; llama, fp32, gemma)


@dataclass
class ClientConfig:
    """How ``backend=vllm|sglang`` sends requests; each client process takes its share of samples."""

    rank: int | None = None  # this client's index (null: $RANK, else 0)
    world_size: int | None = None  # number of client processes (null: $WORLD_SIZE, else 1)
    concurrency: int = 32  # requests in flight per client process (the engine batches them)
    request_timeout_s: float = 600.0  # one request's time limit
    file_timeout_s: float = 600.0  # vLLM: longest wait for a state file once its response came
    retries: int = 5  # further attempts after a transient failure (connection, 5xx, timeout)
    backoff_s: float = 1.0  # the first retry's delay; doubled on every further one (at most 60 s)
    wait_for_server_s: float = 900.0  # how long to wait at start for the servers' /health
    check_next_token: bool = True  # compare the engine's next token with lm_head(last_hidden)
    keep_files: bool = False  # vLLM: keep the engine's per-request files after reading them


@dataclass
class DumpConfig:
    """Options of ``eagle3-dump`` (``conf/dump.yaml``)."""

    target: str = "embedded"  # the model whose states are dumped (must tokenise like the prepared data)
    data: str | None = None  # the prepared directory (eagle3-prepare's out)
    out: str | None = None  # output directory (shards/ + manifest.json)
    backend: str = "hf"  # hf: run the target in transformers; vllm / sglang: ask a running engine
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    dtype: str = "bfloat16"  # the target runs, and states are stored, in this dtype
    max_tokens_per_batch: int = 16384  # token budget of one forward pass, padding included
    max_batch_size: int = 256  # most samples in one forward pass
    shard_size_mb: float = 512.0  # a shard is written once its states reach this size
    writer_threads: int = 4  # threads packing, checksumming and writing shards in parallel
    tp_size: int = 1  # tensor-parallel degree inside each data-parallel group (transformers tp_plan)
    device: str = "auto"  # auto: cuda:<local_rank> if present, else cpu
    attn_implementation: str | None = None  # passed to transformers (sdpa, flash_attention_2, eager)
    verify: bool = False  # only re-read every shard of out and check it against the manifest
    print_launch: bool = False  # backend=vllm|sglang: only print the engine launch command(s) for this capture
    server: ServerConfig = field(default_factory=ServerConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    cache_dir: str | None = None  # where GGUF targets are converted once
    trust_remote_code: bool = False  # let transformers run the target repository's own code
    dist_timeout_minutes: float = 120.0  # how long ranks wait for each other at the final barrier
    progress: bool = True  # progress bar on rank 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.print_launch:
            if self.backend == "hf":
                raise ConfigError("print_launch=true prints an engine's launch command: add backend=vllm or backend=sglang")
        elif not self.out:
            raise ConfigError("out=<dump directory> is required")
        elif not self.verify and not self.data:
            raise ConfigError("data=<prepared directory> is required (or verify=true to check a dump)")
        for name in ("max_tokens_per_batch", "max_batch_size", "shard_size_mb", "tp_size", "writer_threads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.backend != "hf" and self.tp_size != 1:
            raise ConfigError(f"tp_size={self.tp_size} applies to backend=hf; the {self.backend} engine has its own parallelism")
        c = self.client
        for name in ("concurrency", "request_timeout_s", "file_timeout_s", "wait_for_server_s"):
            if getattr(c, name) <= 0:
                raise ConfigError(f"client.{name} must be positive, got {getattr(c, name)}")
        if c.retries < 0 or c.backoff_s < 0:
            raise ConfigError("client.retries and client.backoff_s must not be negative")


ConfigStore.instance().store(name="dump_schema", node=DumpConfig)


@dataclass
class Batch:
    """Samples (rows of the prepared dataset) run in one forward pass, longest first."""

    rows: list[int]
    lengths: list[int]

    @property
    def padded_tokens(self) -> int:
        return len(self.lengths) * max(self.lengths)


def plan_batches(rows: np.ndarray, lengths: np.ndarray, max_tokens: int, max_batch: int) -> list[Batch]:
    """Length-sorted batches within the token budget (padding included); a sample longer than
    the budget runs alone. Longest first, so an out-of-memory shows at once."""
    order = np.lexsort((rows, -lengths))
    batches: list[Batch] = []
    current = Batch([], [])
    for i in order:
        row, n = int(rows[i]), int(lengths[i])
        # sorted descending: the first sample of a batch is its longest
        if current.rows and ((len(current.lengths) + 1) * current.lengths[0] > max_tokens
                                   or len(current.lengths) >= max_batch):
            batches.append(current)
            current = Batch([], [])
        current.rows.append(row)
        current.lengths.append(n)
    if current.rows:
        batches.append(current)
    return batches


class HostShard:
    """A reusable host buffer one shard is assembled in (pinned when CUDA is present, so the
    GPU copies into it asynchronously and the writer streams it to disk without another copy)."""

    def __init__(self, state_keys: list[str], hidden: int, dtype: torch.dtype, capacity: int, pin: bool):
        self.states = {k: torch.empty((capacity, hidden), dtype=dtype, pin_memory=pin) for k in state_keys}
        self.capacity = capacity
        self.reset()

    def reset(self) -> None:
        self.tokens = 0
        self.small: list[dict[str, torch.Tensor]] = []
        self.lengths: list[int] = []

    def tensors(self) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The shard's tensors without the samples whose states are not finite, and their ids.

        A dropped sample costs one compaction copy of this shard; the common case is a view."""
        lengths = torch.tensor(self.lengths, dtype=torch.int64)
        finite = torch.cat([p["finite"] for p in self.small]) if self.small else torch.ones(0, dtype=torch.bool)
        sample_ids = torch.cat([p["sample_ids"] for p in self.small]) if self.small else torch.zeros(0, dtype=torch.int64)
        out = {k: v[: self.tokens] for k, v in self.states.items()}
        for key, dtype in (("input_ids", torch.int32), ("loss_mask", torch.uint8)):
            out[key] = torch.cat([p[key] for p in self.small]) if self.small else torch.zeros(0, dtype=dtype)
        nonfinite = sample_ids[~finite].tolist()
        if nonfinite:
            keep = torch.repeat_interleave(finite, lengths)
            out = {k: v[keep] for k, v in out.items()}
            lengths, sample_ids = lengths[finite], sample_ids[finite]
        out["sample_ids"] = sample_ids
        out["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        return out, nonfinite


class ShardWriter:
    """Assembles shards in host buffers and writes them on background threads.

    The main thread only launches work: each batch's states are copied from the GPU into the
    current shard's pinned buffer on a side CUDA stream (overlapping the next forward pass). A full
    shard goes to one of ``threads`` writer threads, which wait for its copies, then checksum and
    stream it to disk straight from the buffer. There are ``threads + 1`` buffers: when all are in
    flight the main thread waits, so a slow disk slows the dump instead of filling memory.
    """

    def __init__(self, directory: Path, prefix: str, state_keys: list[str], hidden: int, dtype: torch.dtype,
                 shard_tokens: int, max_batch_tokens: int, threads: int, device: torch.device):
        self.directory, self.prefix, self.shard_tokens = directory, prefix, shard_tokens
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # A shard is submitted when the next batch would overflow it, so one batch always fits.
        capacity = max(shard_tokens, max_batch_tokens)
        self.make = lambda: HostShard(state_keys, hidden, dtype, capacity, self.cuda)
        self.pool: queue.Queue = queue.Queue()
        self.pool.put(None)  # a ticket: the main thread allocates its first buffer itself
        self.write_queue: queue.Queue = queue.Queue()
        self.current: HostShard | None = None
        self.count = 0
        self.bytes_written = 0
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.crash_after = int(os.environ.get(CRASH_ENV, 0))
        self.writers = [threading.Thread(target=self._write, daemon=True) for _ in range(threads)]
        for t in self.writers:
            t.start()

    def add(self, piece: dict[str, torch.Tensor], lengths: list[int], ready: Any = None) -> None:
        """Append one batch: per-token states and per-sample ``finite`` flags (on the model's
        device), ``input_ids``, ``loss_mask``, ``sample_ids`` (host); ``ready`` is a CUDA event
        after which the device tensors are final (None: they already are)."""
        n = sum(lengths)
        if self.current is not None and self.current.tokens + n > self.current.capacity:
            self._submit()
        if self.current is None:
            self.current = self._take()
        shard = self.current
        if shard.tokens + n > shard.capacity:
            raise Eagle3Error(f"a batch of {n} tokens exceeds the shard buffer ({shard.capacity}); raise shard_size_mb")
        small = {k: piece[k] for k in ("input_ids", "loss_mask", "sample_ids")}
        if self.cuda:
            self.stream.wait_event(ready)
            with torch.cuda.stream(self.stream):
                for key, buf in shard.states.items():
                    buf[shard.tokens : shard.tokens + n].copy_(piece[key], non_blocking=True)
                    piece[key].record_stream(self.stream)  # keep it alive until copied
                small["finite"] = torch.empty(len(lengths), dtype=torch.bool, pin_memory=True)
                small["finite"].copy_(piece["finite"], non_blocking=True)
                piece["finite"].record_stream(self.stream)
        else:
            for key, buf in shard.states.items():
                buf[shard.tokens : shard.tokens + n].copy_(piece[key])
            small["finite"] = piece["finite"]
        shard.small.append(small)
        shard.lengths += lengths
        shard.tokens += n
        if shard.tokens >= self.shard_tokens:  # full enough: do not wait for the next batch
            self._submit()

    def close(self) -> None:
        """Write what is buffered and wait for every shard; re-raise a writer's error."""
        if self.current is not None and self.current.small:
            self._submit()
        for _ in self.writers:
            self.write_queue.put(None)
        for t in self.writers:
            t.join()
        self._raise_if_failed()

    def _take(self) -> HostShard:
        while True:  # notices a dead writer instead of blocking forever
            self._raise_if_failed()
            try:
                shard = self.pool.get(timeout=0.5)
                return shard if shard is not None else self.make()
            except queue.Empty:
                continue

    def _submit(self) -> None:
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self.write_queue.put((f"{self.prefix}-{self.count:05d}", self.current, ready))
        self.current, self.count = None, self.count + 1

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _write(self) -> None:
        try:  # each writer allocates one more buffer, off the main thread (pinning is slow)
            self.pool.put(self.make())
        except BaseException as e:
            self.error = e
        while (job := self.write_queue.get()) is not None:
            name, shard, ready = job
            try:
                if self.error is None:
                    if ready is not None:
                        ready.synchronize()
                    tensors, nonfinite = shard.tensors()
                    record = write_shard(self.directory, name, tensors, {"nonfinite_sample_ids": nonfinite})
                    with self.lock:
                        self.bytes_written += record.bytes
                    if self.crash_after and sum(1 for _ in self.directory.glob(f"{self.prefix}-*.json")) >= self.crash_after:
                        os._exit(17)
            except BaseException as e:  # handed to the main thread at its next call
                self.error = e
            shard.reset()
            self.pool.put(shard)


def stored_indices(capture: CaptureConfig, num_hidden_layers: int) -> tuple[tuple[int, ...], list[int]]:
    """The aux capture (HF indices, checked; the default when unset) and every index stored."""
    n = num_hidden_layers
    aux = default_aux_indices(n) if capture.aux_indices is None else validate_aux_indices(list(capture.aux_indices), n)
    extra = validate_aux_indices(sorted(capture.extra_indices), n) if capture.extra_indices else ()
    return aux, sorted(set(aux) | set(extra))


class Dumper:
    """Runs the dump stage on this rank (see the module docstring).

    ``backend=hf`` runs the target here; data_prep/served.py subclasses this for the engines,
    replacing how ranks are found (:meth:`_ranks`), how a rank claims the output (:meth:`_claim`)
    and the :meth:`run` loop, and reusing the rest.
    """

    def __init__(self, cfg: DumpConfig):
        self.cfg = cfg
        self.out = Path(cfg.out).expanduser()
        self.shard_dir = self.out / "shards"
        self.dist: DistInfo = self._ranks()
        self.dp_rank, self.dp_size = self.dist.rank // cfg.tp_size, self.dist.world_size // cfg.tp_size
        if self.dist.world_size % cfg.tp_size:
            raise ConfigError(f"world size {self.dist.world_size} is not a multiple of tp_size={cfg.tp_size}")
        self.writes = self.dist.rank % cfg.tp_size == 0  # one writer per tensor-parallel group
        self.prepared_dir = Path(cfg.data).expanduser()
        self.prepared = read_manifest(self.prepared_dir, "prepare")
        self.dataset = self._load_dataset()
        # config and tokenizer now; the weights only once there is work (see model())
        self.target = load_target(cfg.target, cache_dir=cfg.cache_dir, load_model=False, trust_remote_code=cfg.trust_remote_code)
        self.identity = self._check_target()
        aux, self.stored = stored_indices(cfg.capture, self.target.num_hidden_layers)
        self.spec = CaptureSpec(aux, self.target.num_hidden_layers, self.target.hidden_size, self.target.vocab_size,
                                cfg.dtype, self.identity)
        self.request = {
            "capture": self.spec.to_dict(),
            "stored_indices": self.stored,
            "prepared_fingerprint": self.prepared["fingerprint"],
            "backend": cfg.backend,
        }

    def _ranks(self) -> DistInfo:
        return init_distributed(self.cfg.device, self.cfg.dist_timeout_minutes)

    def _load_dataset(self) -> Any:
        from datasets import load_from_disk

        path = self.prepared_dir / self.prepared.get("dataset", "dataset")
        if not path.is_dir():
            raise IncompleteError(f"prepared directory {self.prepared_dir} has a manifest but no {path.name}/")
        ds = load_from_disk(str(path)).with_format("numpy")
        self.sample_ids = ds["sample_id"][:].astype(np.int64)  # row -> sample id
        if len(np.unique(self.sample_ids)) != len(ds):
            raise BadInputError(f"{path}: sample_id repeats; re-run eagle3-prepare")
        return ds

    def model(self) -> Any:
        """The target with its weights, loaded on first use (a finished dump never loads them)."""
        if self.target.model is None:
            self.target = load_target(
                self.cfg.target,
                cache_dir=self.cfg.cache_dir,
                dtype=self.cfg.dtype,
                device=str(self.dist.device),
                trust_remote_code=self.cfg.trust_remote_code,
                model_kwargs=self._model_kwargs(),
            )
        return self.target.model

    def _model_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.cfg.attn_implementation:
            kwargs["attn_implementation"] = self.cfg.attn_implementation
        if self.cfg.tp_size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.dist.device.type, (self.dp_size, self.cfg.tp_size), mesh_dim_names=("dp", "tp"))
            kwargs |= tensor_parallel_kwargs(mesh["tp"])
        return kwargs

    def _check_target(self) -> TargetIdentity:
        """The prepared ids must mean the same to this target: same tokenizer. The dump records
        the chat template the data was rendered with."""
        have = TargetIdentity.from_dict(self.prepared["target"])
        mine = self.target.identity
        if have.tokenizer_hash != mine.tokenizer_hash:
            raise ContractError(
                f"{self.prepared_dir} was prepared with the tokenizer of {have.path} "
                f"(tokenizer_hash {have.tokenizer_hash[:12]}), but target {self.cfg.target} tokenises "
                f"differently ({mine.tokenizer_hash[:12]}): prepare the data with this target"
            )
        if have.config_hash != mine.config_hash:
            print0(f"note: data prepared with {have.path}, dumping {mine.path} (same tokenizer, other model)")
        return TargetIdentity(mine.path, mine.model_type, mine.config_hash, mine.tokenizer_hash, have.chat_template_hash)

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> dict[str, Any] | None:
        if (manifest := self._finished()) is not None:
            return manifest
        self._claim()
        todo = self._todo()
        batches = plan_batches(todo, self.dataset["num_tokens"][:][todo], self.cfg.max_tokens_per_batch, self.cfg.max_batch_size)
        mine = batches[self.dp_rank :: self.dp_size]  # round-robin: ranks get similar lengths
        start = time.time()
        written = self._dump(mine, len(todo))
        # a tensor-parallel group dumps each token once: only its writer counts it
        totals = _sum_over_ranks([written, sum(sum(b.lengths) for b in mine) if self.writes else 0])
        barrier()
        manifest = None
        if self.dist.is_main:
            manifest = self._finalize(time.time() - start, totals)
        barrier()
        return manifest

    def _finished(self) -> dict[str, Any] | None:
        """The manifest of a finished dump of this very request (another request is refused)."""
        if not (self.out / MANIFEST_NAME).is_file():
            return None
        manifest = read_manifest(self.out, STAGE)
        self._compare(manifest["request"], "the finished dump")
        print0(f"eagle3-dump: {self.out} is already complete with this capture; nothing to do")
        return manifest

    def _compare(self, other: dict, what: str) -> None:
        diffs = differences(other, self.request)
        if diffs:
            raise ContractError(
                f"{self.out} holds {what} made with another capture or data; refusing to mix them "
                f"(use another out=, or delete it):\n  " + "\n  ".join(diffs)
            )

    def _claim(self) -> None:
        """Rank 0 records the request and clears crash leftovers; then every rank proceeds."""
        if self.dist.is_main:
            removed = self._record_request()
            if removed:
                print0(f"removed {len(removed)} unfinished files of an interrupted run")
        barrier()

    def _record_request(self, prefix: str = "") -> list[str]:
        """Record the request (or check it against a partial dump's) and delete the unfinished
        shard files whose names start with ``prefix``; return their names."""
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        request_file = self.out / REQUEST_NAME
        if request_file.is_file():
            self._compare(json.loads(request_file.read_text()), "a partial dump")
        else:
            atomic_write_json(request_file, self.request)
        return remove_unfinished(self.shard_dir, prefix)

    def _todo(self) -> np.ndarray:
        """Rows whose samples are not yet stored (nor recorded as non-finite) by a finished shard."""
        done: set[int] = set()
        for rec in finished_records(self.shard_dir):
            done.update(read_keys(self.shard_dir / f"{rec.name}.safetensors", ("sample_ids",))["sample_ids"].tolist())
            done.update(rec.extra.get("nonfinite_sample_ids", []))
        todo = np.nonzero(~np.isin(self.sample_ids, np.fromiter(done, dtype=np.int64, count=len(done))))[0]
        if done:
            print0(f"resuming: {len(done)} samples already stored, {len(todo)} to go")
        return todo

    def _writer(self) -> ShardWriter:
        """This rank's shard writer; its shards are named ``<rank>-<random>-<count>``."""
        keys = [f"hidden.{k}" for k in self.stored] + ["last_hidden"]
        dtype = resolve_dtype(self.cfg.dtype, "cuda")
        per_token = len(keys) * self.spec.hidden_size * dtype.itemsize
        longest = int(self.dataset["num_tokens"][:].max())
        return ShardWriter(
            self.shard_dir, f"{self.dist.rank:05d}-{secrets.token_hex(4)}", keys, self.spec.hidden_size, dtype,
            shard_tokens=max(1, int(self.cfg.shard_size_mb * 2**20) // per_token),
            max_batch_tokens=max(self.cfg.max_tokens_per_batch, longest),
            threads=self.cfg.writer_threads, device=self.dist.device,
        )

    @torch.no_grad()
    def _dump(self, batches: list[Batch], n_todo: int) -> int:
        writer = self._writer() if self.writes else None
        bar = tqdm(
            total=sum(sum(b.lengths) for b in batches), unit="tok", unit_scale=True, desc=f"dump rank 0/{self.dp_size}",
            disable=not (self.cfg.progress and self.dist.is_main),
        )
        samples = 0
        try:
            for batch in batches:
                piece, lengths, ready = self.capture(batch)
                if writer is not None:
                    writer.add(piece, lengths, ready)
                samples += len(batch.rows)
                bar.update(sum(batch.lengths))
                bar.set_postfix(samples=f"{samples}/{n_todo // self.dp_size}", refresh=False)
            if writer is not None:
                writer.close()
        except OSError as e:
            raise Eagle3Error(f"writing {self.shard_dir} failed: {e}; run the same command again to resume") from None
        finally:
            bar.close()
        return writer.bytes_written if writer is not None else 0

    def capture(self, batch: Batch) -> tuple[dict[str, torch.Tensor], list[int], Any]:
        """One forward pass, launched without waiting for the GPU.

        Returns the real tokens' states (on the model's device), ``finite`` (one flag per sample),
        ``input_ids``, ``loss_mask``, ``sample_ids`` (host), the sample lengths, and a CUDA event
        after which the device tensors are final. Nothing here synchronises with the GPU: dropping
        samples with non-finite states happens in the writer, once the flags reach the host.
        """
        dev = self.dist.device
        rows = [self.dataset[int(i)] for i in batch.rows]
        lengths = torch.tensor(batch.lengths)
        width = int(lengths.max())
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, : len(row["input_ids"])] = torch.from_numpy(row["input_ids"].astype(np.int64))
        valid = (torch.arange(width)[None, :] < lengths[:, None]).reshape(-1)
        token_index = valid.nonzero().squeeze(1)  # [sum(lengths)] positions in [B*W]
        sample_of_token = torch.repeat_interleave(torch.arange(len(rows)), lengths)
        ids, token_index, sample_of_token = (_to_device(t, dev) for t in (ids, token_index, sample_of_token))
        # No attention mask: right padding under causal attention never reaches a real token.
        out = self.model().base_model(input_ids=ids, output_hidden_states=True, use_cache=False)
        states = out.hidden_states  # N+1 tensors [B, W, H]; [N] is post-norm
        keys = {f"hidden.{k}": states[k] for k in self.stored} | {"last_hidden": states[self.spec.num_hidden_layers]}
        piece = {name: s.reshape(-1, s.shape[-1]).index_select(0, token_index) for name, s in keys.items()}
        bad_tokens = torch.zeros(len(token_index), dtype=torch.bool, device=dev)
        for t in piece.values():
            bad_tokens |= ~torch.isfinite(t).all(dim=-1)
        bad = torch.zeros(len(rows), dtype=torch.int32, device=dev).index_add_(0, sample_of_token, bad_tokens.int())
        piece["finite"] = bad == 0
        ready = None
        if dev.type == "cuda":  # the writer's copy stream waits for this
            ready = torch.cuda.Event()
            ready.record()
        piece["input_ids"] = _cat([r["input_ids"] for r in rows], np.int32)
        piece["loss_mask"] = _cat([r["loss_mask"] for r in rows], np.uint8)
        piece["sample_ids"] = torch.from_numpy(self.sample_ids[batch.rows])
        return piece, list(batch.lengths), ready

    def _coverage(self) -> tuple[list[ShardRecord], np.ndarray, list[int], np.ndarray]:
        """The finished shards, the sample ids they store, those dropped as non-finite, and the
        sample ids still missing; a sample stored twice is an error."""
        records = finished_records(self.shard_dir)
        stored: list[np.ndarray] = []
        nonfinite: list[int] = []
        for rec in records:
            stored.append(read_keys(self.shard_dir / f"{rec.name}.safetensors", ("sample_ids",))["sample_ids"].numpy())
            nonfinite += rec.extra.get("nonfinite_sample_ids", [])
        ids = np.concatenate(stored) if stored else np.zeros(0, dtype=np.int64)
        uniq, counts = np.unique(np.concatenate([ids, np.asarray(nonfinite, dtype=np.int64)]), return_counts=True)
        if (counts > 1).any():
            raise Eagle3Error(f"{self.shard_dir}: samples stored twice: {uniq[counts > 1][:10].tolist()}")
        return records, ids, nonfinite, np.setdiff1d(self.sample_ids, uniq)

    def _run_info(self) -> dict[str, Any]:
        return {"world_size": self.dist.world_size, "tp_size": self.cfg.tp_size}

    def _finalize(self, elapsed: float, totals: list[int]) -> dict[str, Any]:
        """After every rank finished: check coverage, then write the manifest."""
        records, ids, nonfinite, missing = self._coverage()
        if len(missing):
            raise IncompleteError(
                f"{self.shard_dir}: {len(missing)} samples are missing (e.g. {missing[:10].tolist()}); "
                f"run the same command again to finish"
            )
        tokens = sum(r.num_tokens for r in records)
        total_bytes = sum(r.bytes for r in records)
        body = {
            "request": self.request,
            "capture": self.spec.to_dict(),
            "stored_indices": self.stored,
            "keys": [f"hidden.{k}" for k in self.stored] + ["last_hidden"],
            "target": self.identity.to_dict(),
            "prepared": {"path": str(self.prepared_dir.resolve()), "fingerprint": self.prepared["fingerprint"]},
            "config": config_dict(self.cfg),
            "shards": [r.to_dict() for r in records],
            "counts": {
                "samples": int(len(ids)),
                "tokens": tokens,
                "bytes": total_bytes,
                "bytes_per_token": total_bytes / max(tokens, 1),
                "nonfinite_samples": len(nonfinite),
            },
            "nonfinite_sample_ids": sorted(nonfinite),
            "run": self._run_info() | {"seconds": round(elapsed, 3), "tokens_this_run": totals[1],
                                       "bytes_this_run": totals[0]},
        }
        write_manifest(self.out, STAGE, body)
        rate = totals[1] / max(elapsed, 1e-9)
        print0(
            f"eagle3-dump: {len(ids)} samples, {tokens} tokens, {total_bytes / 2**30:.2f} GiB in "
            f"{len(records)} shards -> {self.out}\n"
            f"  this run: {totals[1]} tokens in {elapsed:.1f} s ({rate:.0f} tok/s, "
            f"{rate / self.dp_size:.0f} tok/s per data-parallel rank); "
            f"{len(nonfinite)} samples dropped for non-finite states"
        )
        return read_manifest(self.out, STAGE)


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """Host -> device without a stream sync (a copy from pageable memory would wait for the GPU)."""
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def _cat(arrays: list[np.ndarray], dtype: Any) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(arrays).astype(dtype)) if arrays else torch.zeros(0, dtype=getattr(torch, np.dtype(dtype).name))


def _sum_over_ranks(values: list[int]) -> list[int]:
    from eagle3_train.dist import all_gather_objects

    return [sum(v) for v in zip(*all_gather_objects(values))]


def verify(out: str | os.PathLike) -> list[str]:
    """Re-read every shard of a finished dump; return the problems found, by shard name."""
    out = Path(out).expanduser()
    manifest = read_manifest(out, STAGE)
    problems: list[str] = []
    records = [ShardRecord.from_dict(r) for r in manifest["shards"]]
    for rec in tqdm(records, desc="verify", unit="shard"):
        problems += verify_shard(out / "shards", rec)
    listed = {f"{r.name}.safetensors" for r in records}
    for extra in sorted(p.name for p in (out / "shards").glob("*.safetensors")):
        if extra not in listed:
            problems.append(f"{extra}: not listed in the manifest")
    return problems


def _run(cfg: DumpConfig) -> int:
    """``verify=true`` checks a finished dump; ``backend=vllm|sglang`` asks an engine
    (data_prep/served.py); otherwise dump on this rank."""
    if cfg.verify:
        problems = verify(cfg.out)
        for p in problems:
            print(f"eagle3-dump verify: {p}")
        print(f"eagle3-dump verify: {'OK' if not problems else f'{len(problems)} problems'} ({cfg.out})")
        return 1 if problems else 0
    if cfg.backend != "hf":
        from data_prep import served

        if cfg.print_launch:
            print(served.launch_text(cfg))
            return 0
        served.ServedDumper(cfg).run()
        return 0
    try:
        Dumper(cfg).run()
    finally:
        close()
    return 0


main = entry_point("dump", DumpConfig, _run)

if __name__ == "__main__":
    main()
