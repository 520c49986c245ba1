"""The options of ``eagle3-dump`` (``conf/dump.yaml``); the backends are the engines of
:mod:`eagle3_train.engines.registry` that produce hidden states (``hf`` runs the target here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

from eagle3_train.core.contract import check_dtype, check_storage, default_aux_indices, validate_aux_indices
from eagle3_train.core.errors import ConfigError, check_numbers
from eagle3_train.core.log import LogConfig
from eagle3_train.engines import registry
from eagle3_train.engines.capture import ClientConfig, ServerConfig


@dataclass
class CaptureConfig:
    """Which hidden states are stored (HF indices, docs/concepts/hf-index.md)."""

    aux_indices: list[int] | None = None  # the aux capture; null: [2, N//2, N-3]
    extra_indices: list[int] = field(default_factory=list)  # more layers kept for later choices


@dataclass
class DumpConfig:
    """Options of ``eagle3-dump`` (``conf/dump.yaml``)."""

    target: str = "embedded"  # the model whose states are dumped (must tokenise like the prepared data)
    data: str | None = None  # the prepared directory (eagle3-prepare's out)
    out: str | None = None  # output directory (shards/ + manifest.json)
    backend: str = "hf"  # hf: run the target in transformers; an engine (vllm | sglang): ask it, running
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
    serve: bool = False
    """backend=vllm|sglang: only start the engine server(s) for this capture on this host (what print_launch prints), logging under <out>/engine/<host>/, and wait on them until one exits or SIGTERM / Ctrl-C stops them; the clients run as separate eagle3-dump processes"""
    serve_devices: list[str] = field(default_factory=list)
    """serve: CUDA_VISIBLE_DEVICES of each engine server, in print_launch's order (SGLang: the aux-state server, then the final-state one, which must not share GPUs); empty: the GPUs this process sees"""
    server: ServerConfig = field(default_factory=ServerConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    cache_dir: str | None = None  # where GGUF targets are converted once
    trust_remote_code: bool = False  # let transformers run the target repository's own code
    dist_timeout_minutes: float = 120.0  # how long ranks wait for each other at the final barrier
    progress: bool | None = None
    """null: a bar on a terminal, else a progress line every logging.progress_every_s seconds; true: a bar always; false: neither"""
    logging: LogConfig = field(default_factory=LogConfig)
    """the console (logging.level, logging.all_ranks, logging.progress_every_s)"""

    def __post_init__(self) -> None:
        engine = registry.engine(self.backend, "dump", "backend")
        here = " or ".join(f"backend={n}" for n in registry.names("dump") if registry.ENGINES[n].in_process)
        if len(modes := [f"{k}=true" for k in ("verify", "print_launch", "serve") if getattr(self, k)]) > 1:
            raise ConfigError(f"{' and '.join(modes)} each do one thing: choose one")
        if (self.print_launch or self.serve) and engine.in_process:
            served = [n for n in registry.names("dump") if not registry.ENGINES[n].in_process]
            asked = (
                "print_launch=true prints an engine's launch command"
                if self.print_launch
                else "serve=true starts an engine"
            )
            raise ConfigError(f"{asked}: add {' or '.join(f'backend={n}' for n in served)}")
        if self.serve_devices and not self.serve:
            raise ConfigError("serve_devices are the GPUs of the engine servers serve=true starts: add serve=true")
        if not self.print_launch and not self.out:
            raise ConfigError("out=<dump directory> is required")
        if not (self.print_launch or self.verify or self.serve or self.data):
            raise ConfigError("data=<prepared directory> is required (or verify=true to check a dump)")
        check_numbers(
            self,
            positive=(
                "max_tokens_per_batch",
                "max_batch_size",
                "shard_size_mb",
                "tp_size",
                "writer_threads",
                "dist_timeout_minutes",
            ),
        )
        check_dtype(self.dtype, auto=True)
        check_storage(self.storage)
        if self.compile and not engine.in_process:
            raise ConfigError(
                f"compile=true compiles the target run here ({here}); the {self.backend} engine runs its own"
            )
        if not engine.in_process and self.tp_size != 1:
            raise ConfigError(
                f"tp_size={self.tp_size} applies to {here}; the {self.backend} engine has its own parallelism"
            )


ConfigStore.instance().store(name="dump_schema", node=DumpConfig)


def stored_indices(capture: CaptureConfig, num_hidden_layers: int) -> tuple[tuple[int, ...], list[int]]:
    """The aux capture (HF indices, checked; the default when unset) and every index stored."""
    n = num_hidden_layers
    aux = default_aux_indices(n) if capture.aux_indices is None else validate_aux_indices(list(capture.aux_indices), n)
    extra = validate_aux_indices(sorted(capture.extra_indices), n) if capture.extra_indices else ()
    return aux, sorted(set(aux) | set(extra))
