"""vLLM: its layer-id rules, its command line, its hidden-state capture (served dump), its generation
endpoint (served regeneration) and its speculative-decoding counters (served acceptance).

**Rules** (read from vLLM 0.33.0): vLLM runs EAGLE-3 drafts (and ``extract_hidden_states``) only for
the target classes that implement its EAGLE-3 interface (:data:`EAGLE3_MODEL_TYPES`); it refuses
any other target at load. It reads the top-level ``eagle_aux_hidden_state_layer_ids`` first; its
default runner in 0.33, V2 (listed first), then ``eagle_config.layer_ids``, the V1 runner the nested
``eagle_config.eagle_aux_hidden_state_layer_ids``. Id v captures HF index v; v = N is the last
layer's output before the final norm. No id 0 gives the embeddings: the DeepSeek code (DeepSeek-V2/V3,
Kimi-K2) crashes on it, and the llama-family code hands over the embedding tensor itself, which the
first layer takes as its residual and ``fused_add_rms_norm`` then updates in place, so the draft gets
the last layer's pre-norm output instead (measured with vLLM 0.26.0 on an H200: a draft whose ids
start at 0 accepted 1.17 tokens per step; eagle3-eval predicted 1.39 feeding the embeddings and 1.16
feeding that state; ids without 0 agreed within 0.02; benchmarks/results/vllm_h200.json).

**Served dump** (API read from vLLM 0.33.0): ``extract_hidden_states`` with
``ExampleHiddenStatesConnector``; engine id ``v`` captures HF index ``v``, and the dump asks for id
``N`` too, the pre-norm final state. One request per sample (``/v1/completions``, ``prompt`` =
token ids, ``max_tokens=1``); the engine writes ``hidden_states`` [T, K, H] (ascending ids) and
``token_ids`` [T] to a safetensors file after the response, holding ``<file>.lock`` until it is
complete. ``last_hidden`` is the target's final RMSNorm, with weights read from the target
checkpoint, applied to id ``N``.

**Served regeneration** (``vllm/entrypoints/openai/completion/protocol.py`` @002032e,
``vllm/v1/core/sched/utils.py`` @018d5dc, ``vllm/sampling_params.py``): ``/v1/completions`` takes
``prompt`` as a list of ids, ``max_tokens``, ``temperature`` (0: greedy), ``top_p``, ``top_k``,
``seed`` (per request), ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens`` and
``return_token_ids``; ``choices[0]`` carries ``token_ids`` (the stop token included),
``finish_reason`` (``stop`` / ``length``) and ``stop_reason`` (the stop token's id). Fields left out
take the server's defaults, which ``--generation-config auto`` (the default) reads from the target's
generation_config.json (Qwen3's, say, sets top_k=20): every sampling field is therefore sent.
``ignore_eos`` is set so the engine stops at exactly the end-of-turn ids, as transformers does with
``eos_token_id=eos_ids``; the stop-token list still applies.

**Served acceptance** (read from vLLM 0.26.0: ``vllm/v1/spec_decode/metrics.py``,
``vllm/v1/metrics/loggers.py``): Prometheus counters on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eagle3_train.core import families
from eagle3_train.engines.base import (
    NESTED,
    NESTED_V2,
    TOP_KEY,
    Command,
    Engine,
    Generation,
    Rule,
    SpecMetrics,
    Unexpressible,
    identity,
    sampling_fields,
    shell,
)
from eagle3_train.engines.capture import (
    CaptureJob,
    ServerConfig,
    StateCapture,
    first_difference,
    port_of,
)
from eagle3_train.engines.heads import DraftForward, FlagRead
from eagle3_train.engines.http import EngineError, Transient, post_json, served_model, wait_ready

VERSION = "0.33.0"

# The draft's forward flags (read from vllm/model_executor/models/llama_eagle3.py of 0.26.0 and 0.33.0,
# alike in both, and vllm/transformers_utils/configs/speculators/algos.py:update_eagle3 for speculators
# configs, whose keys it copies from the top level with these defaults)
_EAGLE3 = "vllm/model_executor/models/llama_eagle3.py"
DRAFT_READS = {
    "aux_norm": FlagRead(
        (("eagle_config", "norm_before_fc"), ("norm_before_fc",)),
        weight="input_norm.weight",
        unflagged="skips",  # load_weights maps input_norm.* to nothing when the flag is off
        source=f"{_EAGLE3}: LlamaModel.__init__, Eagle3LlamaForCausalLM.combine_hidden_states and load_weights",
    ),
    "fc_norm": FlagRead(
        (("fc_norm",),),
        weight="fc_norm.{i}.weight",
        unflagged="fails",  # no fc_norm module to load into: AutoWeightsLoader raises
        source=f"{_EAGLE3}: LlamaModel.__init__ (one RMSNorm of target_hidden_size per aux state), "
        "Eagle3LlamaForCausalLM.combine_hidden_states (after input_norm)",
    ),
    "norm_before_residual": FlagRead(
        (("norm_before_residual",),),
        speculators_default=True,
        source=f"{_EAGLE3}: LlamaDecoderLayer.__init__ and _norm_before_residual (the first layer)",
    ),
    "norm_output": FlagRead(
        (("norm_output",),),
        source=f"{_EAGLE3}: LlamaModel.forward (aux_output, which the proposer feeds to the next step)",
    ),
}
DRAFT_FORWARDS = tuple(
    DraftForward("vllm", v, DRAFT_READS, loads_speculators=True, window_from_config=True, source=f"vLLM {v}: {_EAGLE3}")
    for v in ("0.26.0", "0.33.0")  # the first: the release this project serves with
)

# The target model_types whose vLLM 0.33.0 classes implement its EAGLE-3 interface (llama, mistral,
# qwen2, qwen3, qwen3_moe, deepseek_v2/v3 -- Kimi-K2 runs in the DeepSeek-V3 class -- and gpt_oss).
# (the family table's vllm_eagle3 and vllm_deepseek_code columns)
DEEPSEEK = families.model_types(vllm_eagle3=True, vllm_deepseek_code=True)
EAGLE3_MODEL_TYPES = families.model_types(vllm_eagle3=True)

_ID0 = (
    "vLLM's id 0 arrives overwritten: its capture keeps the embedding tensor, which the first layer makes "
    "its residual and fused_add_rms_norm updates in place (measured, vLLM 0.26.0)"
)
_DEEPSEEK_ID0 = "vLLM's DeepSeek code crashes on id 0 (its residual is still None there)"
_V2, _V1 = f"{VERSION} (V2 runner, the default)", f"{VERSION} (V1 runner)"
# V2, vLLM 0.33's default runner, never reads eagle_config.eagle_aux_hidden_state_layer_ids
RULES = (
    Rule(
        _V2,
        "*",
        ((TOP_KEY,), NESTED_V2),
        identity,
        "top-level key first",
        EAGLE3_MODEL_TYPES - DEEPSEEK,
        id0=_ID0,
        id0_is_final=True,
    ),
    Rule(_V2, "*", ((TOP_KEY,), NESTED_V2), identity, "top-level key first", DEEPSEEK, id0=_DEEPSEEK_ID0),
    Rule(
        _V1,
        "*",
        ((TOP_KEY,), NESTED),
        identity,
        "top-level key first",
        EAGLE3_MODEL_TYPES - DEEPSEEK,
        id0=_ID0,
        id0_is_final=True,
    ),
    Rule(_V1, "*", ((TOP_KEY,), NESTED), identity, "top-level key first", DEEPSEEK, id0=_DEEPSEEK_ID0),
)

# target model_type -> the real vLLM run that confirmed its rule: version, machine, date, results file
# Its served dump equal to the transformers dump (token ids identical, <= 4.3 % rel L2 per layer in
# bf16) and its served draft accepting at eval's tau (within 3 % on SmolLM2, the trained target;
# -11 % .. +5 % on random-init ones, whose greedy paths turn on near-tied logits).
_FAMILIES_RUN = "H200, 2026-12-02, tiny targets and SmolLM2 (benchmarks/results/families_vllm_h200.json)"
VERIFIED = {
    "llama": f"vLLM 0.26.0, H200, 2026-11-30 (benchmarks/results/vllm_h200.json); served dump and served draft, "
    f"{_FAMILIES_RUN}",
    **{
        mt: f"vLLM 0.26.0: served dump and served draft, {_FAMILIES_RUN}"
        for mt in ("mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss")
    },
}

# ``vllm serve``'s flags that this project writes or documents (vllm/engine/arg_utils.py and
# vllm/entrypoints/openai/cli_args.py of 0.33.0)
COMMAND = Command(
    ("vllm", "serve"),
    ("model",),
    {
        "--port": "int",
        "--host": "value",
        "--dtype": "value",
        "--speculative-config": "json",
        "--kv-transfer-config": "json",
        "--no-enable-prefix-caching": "switch",
        "--enforce-eager": "switch",
        "--gpu-memory-utilization": "value",
        "--kv-cache-memory-bytes": "int",
        "--max-model-len": "int",
        "--tensor-parallel-size": "int",
        "--served-model-name": "value",
        "--disable-log-stats": "switch",
        "--generation-config": "value",
        "--trust-remote-code": "switch",
        # passed through by eagle3-train source=served (engine.engine_args): parallelism, quantization, loading
        "--pipeline-parallel-size": "int",
        "--data-parallel-size": "int",
        "--enable-expert-parallel": "switch",
        "--quantization": "value",
        "--kv-cache-dtype": "value",
        "--load-format": "value",
        "--max-num-seqs": "int",
        "--max-num-batched-tokens": "int",
        "--seed": "int",
    },
    f"vLLM {VERSION}: vllm/engine/arg_utils.py, vllm/entrypoints/openai/cli_args.py",
)


def serve(target: str, draft: str | None, num_speculative_tokens: int, flags: dict[str, Any]) -> list[str]:
    """``vllm serve <target>`` with ``flags``, then ``--speculative-config {"method": "eagle3", ...}``
    for a ``draft`` (None: the target alone)."""
    if draft is None:
        return COMMAND.line(target, **flags)
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": num_speculative_tokens}
    return COMMAND.line(target, **flags, speculative_config=spec)


# ---- the served dump ------------------------------------------------------------------------------

# How transformers applies the final RMSNorm of each target vLLM serves (x: the pre-norm state,
# h = x / rms(x) in fp32): llama-style multiplies in the model dtype, gpt_oss in fp32.
FINAL_NORM_OF = {m: families.BY_TYPE[m].final_norm for m in EAGLE3_MODEL_TYPES}


def final_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str) -> torch.Tensor:
    """The target's final RMSNorm of ``x`` [T, H] (pre-norm, in the model dtype), computed as
    transformers computes it for that family, so ``last_hidden`` matches ``backend=hf``."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if style == "llama":
        return weight.to(x.dtype) * h.to(x.dtype)
    if style == "fp32":
        return (weight.float() * h).to(x.dtype)
    raise ValueError(f"unknown final-norm style {style!r}")


def dump_layer_ids(stored: list[int], model_type: str, num_hidden_layers: int) -> list[int]:
    """vLLM ids for the stored HF indices (the same numbers, by the rule export uses) plus N, the
    pre-norm final state; refused (with the reason) for a target vLLM does not serve this way, or
    ids its code fails on."""
    try:
        ids = ENGINE.ids_for(stored, model_type, num_hidden_layers)[(TOP_KEY,)]
    except Unexpressible as e:
        raise Unexpressible(f"backend=vllm cannot dump this capture: {e}") from None
    return sorted(ids) + [num_hidden_layers]


def launch(model_path: str, ids: list[int], dtype: str, port: int, storage: str, extra: str = "") -> str:
    """The ``vllm serve`` command that writes the states of engine ``ids`` to ``storage``."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {TOP_KEY: ids}},
    }
    kv = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": storage, "allow_custom_save_path": True},
    }
    argv = COMMAND.line(
        model_path,
        port=port,
        dtype=dtype,
        no_enable_prefix_caching=True,
        speculative_config=spec,
        kv_transfer_config=kv,
    )
    return shell(argv, ("--speculative-config", "--kv-transfer-config"), extra)


class VllmStates:
    """Turns one vLLM state file into the shard's states (HF indices + post-norm ``last_hidden``)."""

    def __init__(
        self,
        stored: list[int],
        ids: list[int],
        hidden: int,
        dtype: torch.dtype,
        norm_weight: torch.Tensor,
        eps: float,
        style: str,
    ):
        self.stored, self.ids = stored, ids
        self.hidden, self.dtype = hidden, dtype
        self.norm_weight, self.eps, self.style = norm_weight, eps, style

    def __call__(self, data: dict[str, torch.Tensor], prompt: list[int], where: str) -> dict[str, torch.Tensor]:
        if "hidden_states" not in data or "token_ids" not in data:
            raise EngineError(f"{where}: expected tensors hidden_states and token_ids, found {sorted(data)}")
        tokens = data["token_ids"].tolist()
        if tokens != prompt:
            raise EngineError(
                f"{where}: the engine's token_ids differ from the prompt ({first_difference(tokens, prompt)}): it "
                f"serves another tokenizer, or cut the prompt (max_model_len)"
            )
        hs = data["hidden_states"]  # [T, K, H], K = len(ids), ascending ids
        want = [len(prompt), len(self.ids), self.hidden]
        if list(hs.shape) != want:
            raise EngineError(
                f"{where}: hidden_states has shape {list(hs.shape)}, expected {want} (T, engine ids {self.ids}, "
                f"hidden size): the engine was launched for another capture; see print_launch=true"
            )
        if hs.dtype != self.dtype:
            raise EngineError(
                f"{where}: the engine's states are {hs.dtype}, this dump stores {self.dtype}: set dtype= "
                f"to the engine's --dtype"
            )
        states = {f"hidden.{k}": hs[:, i] for i, k in enumerate(self.stored)}
        states["last_hidden"] = final_norm(hs[:, -1], self.norm_weight, self.eps, self.style)
        return states


def wait_and_load(path: Path, timeout_s: float, stop: threading.Event | None = None) -> dict[str, torch.Tensor]:
    """Read a vLLM state file once the engine has released its ``.lock`` (a shared lock is
    granted only after the engine's exclusive one is gone); the lock exists before the response.
    ``stop``: set when the request is cancelled, ends the wait within a poll (a cancelled asyncio
    task does not stop the thread it awaits, which would hold a worker until ``timeout_s``)."""
    lock = path.with_name(path.name + ".lock")
    deadline = time.monotonic() + timeout_s
    delay = 0.002
    stop = stop or threading.Event()

    def pause() -> None:
        nonlocal delay
        if stop.wait(delay):
            raise Transient(f"{path}: the wait was cancelled")
        delay = min(2 * delay, 0.25)

    while not lock.exists():  # on a shared filesystem it may show up late
        if time.monotonic() > deadline:
            raise Transient(f"{lock} did not appear within {timeout_s:.0f} s")
        pause()
    fd = os.open(lock, os.O_RDONLY)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise Transient(f"{path} was still being written after {timeout_s:.0f} s") from None
                pause()
        if not path.is_file():
            raise Transient(f"the engine released {lock.name} without writing {path} (see the engine's log)")
        try:
            return load_file(str(path))
        except Exception as e:  # safetensors raises several types for a damaged file
            raise Transient(f"{path} is unreadable: {e}") from None
    finally:
        os.close(fd)


def remove_tree(path: Path, tries: int = 5) -> None:
    """``shutil.rmtree``, where a file may vanish under it: an engine still finishing a write renames
    its temporary file away between the listing and the unlink (seen once in CI, a stand-in engine).
    A file already gone is what removing it wanted; the walk starts again over what is left."""
    for _ in range(tries - 1):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            if not path.exists():
                return
    shutil.rmtree(path)


class VllmClient:
    """One request per sample to vLLM's ``/v1/completions``; the states arrive as a file."""

    def __init__(self, job: CaptureJob, states: VllmStates):
        self.job, self.states = job, states
        server = job.server
        self.url = server.url.rstrip("/")
        files = Path(server.files_dir).expanduser() if server.files_dir else job.out / "engine_files"
        self.client_dir = files.resolve() / f"{job.rank:05d}"
        self.server_root = Path(server.server_files_dir or files.resolve())
        self.server_dir = self.server_root / f"{job.rank:05d}"
        self.model = server.model

    async def start(self, session: Any) -> None:
        if self.client_dir.exists():  # a crashed run's files: the engine is done with them
            remove_tree(self.client_dir)
        self.client_dir.mkdir(parents=True)
        await wait_ready(session, [self.url], self.job.client.wait_for_server_s)
        if self.model is None:
            self.model = await served_model(session, self.url, "server.model")

    def _local(self, engine_path: str) -> Path:
        """The engine's path for a file, as this client sees it."""
        p = Path(engine_path)
        try:
            return self.client_dir.parent / p.relative_to(self.server_root)
        except ValueError:
            raise EngineError(
                f"the engine wrote {engine_path}, outside {self.server_root}: launch it with allow_custom_save_path "
                f"(print_launch=true), or set server.server_files_dir to its shared_storage_path"
            ) from None

    async def fetch(self, session: Any, sample_id: int, prompt: list[int], attempt: int) -> tuple[dict, int | None]:
        name = f"{sample_id}.{attempt}.safetensors"  # a late file of a timed-out attempt cannot be mistaken
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0.0,
            "return_token_ids": True,
            "kv_transfer_params": {"hidden_states_path": str(self.server_dir / name)},
        }
        resp = await post_json(session, f"{self.url}/v1/completions", body)
        engine_path = (resp.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not engine_path:
            raise EngineError(
                f"{self.url}: the response names no kv_transfer_params.hidden_states_path: launch vLLM with "
                f"the hidden-states connector (print_launch=true)"
            )
        path = self._local(engine_path)
        client = self.job.client
        stop = threading.Event()
        try:
            data = await asyncio.to_thread(wait_and_load, path, client.file_timeout_s, stop)
        finally:
            stop.set()  # cancelled: the thread stops waiting too
            if not client.keep_files:
                path.unlink(missing_ok=True)
                path.with_name(path.name + ".lock").unlink(missing_ok=True)
        states = await asyncio.to_thread(self.states, data, prompt, f"{engine_path} (sample {sample_id})")
        generated = ((resp.get("choices") or [{}])[0].get("token_ids")) or [None]
        return states, generated[0]


class VllmCapture(StateCapture):
    """One server; ``last_hidden`` is normed here from its pre-norm id N."""

    read_from = VERSION
    tensors = ("norm",)
    memory_flag, length_flag = "--gpu-memory-utilization", "--max-model-len"
    writes_files = True  # into the files directory, from its first request

    def servers(self, server: ServerConfig) -> dict[str, str]:
        return {"server.url": server.url}

    def layer_ids(self, stored: list[int], model_type: str, num_hidden_layers: int, server: ServerConfig) -> list[int]:
        return dump_layer_ids(stored, model_type, num_hidden_layers)

    def launch_lines(
        self,
        model_path: str,
        model_type: str,
        num_hidden_layers: int,
        stored: list[int],
        dtype: str,
        server: ServerConfig,
        out: str | None,
    ) -> list[str]:
        n = num_hidden_layers
        ids = dump_layer_ids(stored, model_type, n)
        storage = (
            server.server_files_dir
            or server.files_dir
            or (str(Path(out).expanduser().resolve() / "engine_files") if out else "<out>/engine_files")
        )
        return [
            f"# ids {ids}: HF indices {stored}, and {n} = the pre-norm final state (last_hidden = final norm of it)",
            launch(model_path, ids, dtype, port_of(server.url, 8000), storage, server.engine_args),
        ]

    def client(self, job: CaptureJob, tensors: dict[str, torch.Tensor]) -> VllmClient:
        ids = dump_layer_ids(job.stored, job.model_type, job.num_hidden_layers)
        states = VllmStates(
            job.stored,
            ids,
            job.hidden_size,
            job.dtype,
            tensors["norm"],
            job.rms_norm_eps,
            FINAL_NORM_OF[job.model_type],
        )
        return VllmClient(job, states)


# ---- served regeneration ---------------------------------------------------------------------------


def generation_request(
    prompt: list[int], model: str | None, sampling: dict, eos_ids: list[int], seed: int | None
) -> dict:
    """A ``/v1/completions`` body: the prompt as ids, every sampling field, stop at ``eos_ids`` only."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": int(sampling["max_new_tokens"]),
        **sampling_fields(sampling),
        "stop_token_ids": eos_ids,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "return_token_ids": True,
    }
    if seed is not None:
        body["seed"] = seed
    return body


def generation_reply(resp: dict, where: str) -> tuple[list[int], str | None, Any]:
    """(generated ids, finish reason, the stop token it matched) of a ``/v1/completions`` response."""
    choices = resp.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise EngineError(f"{where}: expected one completion choice, got {str(choices)[:200]}")
    ids = choices[0].get("token_ids")
    if ids is None:
        raise EngineError(
            f"{where}: the response has no choices[0].token_ids: this vLLM ignores return_token_ids "
            f"(a vLLM with return_token_ids is needed)"
        )
    return ids, choices[0].get("finish_reason"), choices[0].get("stop_reason")


ENGINE = Engine(
    name="vllm",
    title="vLLM",
    version=VERSION,
    rules=RULES,
    verified=VERIFIED,
    serves=EAGLE3_MODEL_TYPES,
    serves_note="runs EAGLE-3 drafts only for targets whose class implements its EAGLE-3 interface",
    exports=True,
    forwards=DRAFT_FORWARDS,
    foreign_weights="would fail on",
    command=COMMAND,
    serve=serve,
    capture=VllmCapture(),
    version_route=("/version", "version"),  # vLLM 0.26.0: vllm/entrypoints/openai/api_server.py
    # vLLM 0.26.0: vllm/v1/attention/backends/flash_attn.py, FlashAttentionMetadataBuilder takes the heads
    # and head size from the (target's) model_config and plans FA3's schedule with them for every KV-cache
    # group, the draft's too; fixed upstream by vllm-project/vllm#53336 (after 0.26)
    attention_planned_by_target="releases without its PR #53336 (merged 2026-08-22; 0.26.0 is one) plan the "
    "draft's attention with the target's heads and head size under FlashAttention 3 (their default on Hopper "
    "GPUs), and can fail at start with 'scheduler_metadata must have shape (metadata_size)' (seen with "
    "0.26.0 on an H200); serve those with --attention-config.flash_attn_version=2, or train the draft with "
    "the target's attention shape",
    generation=Generation(
        "/v1/completions",
        True,
        generation_request,
        generation_reply,
        "vLLM: vllm/entrypoints/openai/completion/protocol.py @002032e",
    ),
    metrics=SpecMetrics(
        "vllm",
        "vLLM 0.26.0: vllm/v1/spec_decode/metrics.py (SpecDecodingProm), vllm/v1/metrics/loggers.py",
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "position",
        "vllm:request_success",
        "vllm:generation_tokens",
        shell(serve("<target>", "<draft>", 5, {})) + " (and without --disable-log-stats)",
    ),
)
