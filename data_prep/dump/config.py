"""The options of ``eagle3-dump`` (``conf/dump.yaml``) and the backend registry."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from eagle3_train.core.contract import check_dtype, check_storage, default_aux_indices, validate_aux_indices
from eagle3_train.core.errors import ConfigError, check_numbers

# The backends: name -> the module that holds its ``Backend`` class (imported when picked, so
# ``backend=hf`` never imports the HTTP clients). Adding a backend is one module and one line here.
BACKENDS = {
    "hf": "data_prep.dump.hf",
    "vllm": "data_prep.dump.vllm",
    "sglang": "data_prep.dump.sglang",
}


@dataclass
class CaptureConfig:
    """Which hidden states are stored (HF indices, docs/concepts/hf-index.md)."""

    aux_indices: list[int] | None = None  # the aux capture; null: [2, N//2, N-3]
    extra_indices: list[int] = field(default_factory=list)  # more layers kept for later choices


@dataclass
class ServerConfig:
    """Where ``backend=vllm|sglang`` finds the engine (data_prep/dump/vllm.py, sglang.py)."""

    url: str = "http://127.0.0.1:8000"  # the vLLM server, or SGLang's aux-state server
    final_url: str = "http://127.0.0.1:30001"  # SGLang only: the server that returns the post-norm final state
    model: str | None = None  # vLLM's served model name; null: the first one /v1/models lists
    files_dir: str | None = None  # vLLM: the shared directory the engine writes states to, as this client sees it (null: <out>/engine_files)
    server_files_dir: str | None = None  # vLLM: the same directory as the engine sees it (null: files_dir)
    engine_args: str = ""  # extra engine flags (parallelism: --tp-size 4) for the printed launch commands; checked against what the dump needs


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

    def __post_init__(self) -> None:
        check_numbers(self, "client.", positive=("world_size", "concurrency", "request_timeout_s", "file_timeout_s",
                                                  "wait_for_server_s"), non_negative=("rank", "retries", "backoff_s"))


@dataclass
class DumpConfig:
    """Options of ``eagle3-dump`` (``conf/dump.yaml``)."""

    target: str = "embedded"  # the model whose states are dumped (must tokenise like the prepared data)
    data: str | None = None  # the prepared directory (eagle3-prepare's out)
    out: str | None = None  # output directory (shards/ + manifest.json)
    backend: str = "hf"  # hf: run the target in transformers; vllm / sglang: ask a running engine
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    dtype: str = "auto"  # auto: float32 on a CPU, bfloat16 on a GPU (recorded as what it became); the target runs in this dtype (and states are stored in it with storage=dtype)
    storage: str = "dtype"  # dtype: states as computed; fp8: e4m3 with a float32 scale per token and layer, half of bf16's bytes (README: Compact storage)
    compile: bool = False  # backend=hf: torch.compile each decoder layer (dynamic shapes; the first batch compiles); states equal the eager forward's within the dtype's tolerance
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
        check_numbers(self, positive=("max_tokens_per_batch", "max_batch_size", "shard_size_mb", "tp_size",
                                      "writer_threads", "dist_timeout_minutes"))
        check_dtype(self.dtype, auto=True)
        check_storage(self.storage)
        if self.compile and self.backend != "hf":
            raise ConfigError(f"compile=true compiles the target run here (backend=hf); the {self.backend} engine runs its own")
        if self.backend != "hf" and self.tp_size != 1:
            raise ConfigError(f"tp_size={self.tp_size} applies to backend=hf; the {self.backend} engine has its own parallelism")


ConfigStore.instance().store(name="dump_schema", node=DumpConfig)


def stored_indices(capture: CaptureConfig, num_hidden_layers: int) -> tuple[tuple[int, ...], list[int]]:
    """The aux capture (HF indices, checked; the default when unset) and every index stored."""
    n = num_hidden_layers
    aux = default_aux_indices(n) if capture.aux_indices is None else validate_aux_indices(list(capture.aux_indices), n)
    extra = validate_aux_indices(sorted(capture.extra_indices), n) if capture.extra_indices else ()
    return aux, sorted(set(aux) | set(extra))
