"""``eagle3-dump backend=vllm|sglang``: the dump, from a target already served by an engine.

    eagle3-dump backend=vllm target=<hf dir> print_launch=true        # the engine command to run
    eagle3-dump backend=vllm target=<hf dir> data=<prepared> out=<dump> server.url=http://gpu1:8000
    eagle3-dump backend=vllm ... client.rank=3 client.world_size=8       # eight client processes

For targets that transformers cannot run at scale (DeepSeek, Kimi, Qwen3-235B), the states come
from the engine the team serves, so they are the engine's own numerics. The shards are those of
``backend=hf`` (DESIGN §3): everything downstream is unchanged.

What each engine offers (read from vLLM 0.33.0 and SGLang 0.5.23; no engine runs on the machines
this project is tested on, so the test suite drives these clients against stand-in servers that
follow the same API surface):

- **vLLM** (``extract_hidden_states`` + ``ExampleHiddenStatesConnector``): engine id ``v``
  captures HF index ``v``, and ``v = N`` is the last layer's output *before* the final norm. One
  request per sample (``/v1/completions``, ``prompt`` = token ids, ``max_tokens=1``); the engine
  writes ``hidden_states`` [T, K, H] (ascending ids) and ``token_ids`` [T] to a safetensors file
  after the response, holding ``<file>.lock`` until it is complete. ``last_hidden`` is the
  target's final RMSNorm, with weights read from the target checkpoint, applied to id ``N``.
- **SGLang**: engine id ``v`` captures HF index ``v + 1`` (the SGLang rule of
  eagle3_train/engines.py, so HF index 0 and the final layer cannot be asked for), returned as
  JSON rows ``[T][K*H]`` by ``/generate`` with ``return_hidden_states``; the post-norm final state
  comes from a second server started with ``--enable-return-hidden-states``. A radix-cache hit or
  a chunked prefill drops rows, hence ``--disable-radix-cache --chunked-prefill-size -1`` and the
  ``cached_tokens == 0`` and row-count checks.

Every response is checked: the token ids the engine saw, the shape (layers x hidden size), the
dtype (JSON values must be exact numbers of ``dtype``), finiteness (a sample with a non-finite
state is dropped and listed, as with ``backend=hf``), and the engine's next token against
``lm_head(last_hidden)`` of the checkpoint (does the engine serve this target, from these layers?).
A failed request is retried with exponential backoff; one that keeps failing stops the run after
writing every sample already received. Each client process writes its own shards and resumes by
sample id; the last one to finish writes the manifest.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shlex
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import numpy as np
import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from data_prep.dump import DumpConfig, Dumper, stored_indices
from eagle3_train.contract import MANIFEST_NAME
from eagle3_train.dist import DistInfo
from eagle3_train.engines import NESTED, Unexpressible, family_of, ids_for
from eagle3_train.errors import ConfigError, Eagle3Error
from eagle3_train.fileio import atomic_write_json
from eagle3_train.formats import remove_unfinished
from eagle3_train.targets import load_target, load_target_tensors, resolve_dtype, text_config

ENGINE_VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}
CHECKS_DIR = "next_token_check"  # <out>/next_token_check/<client rank>.json: each client's counts

# How transformers applies each family's final RMSNorm (x: the pre-norm state, h = x / rms(x) in
# fp32): llama-style multiplies in the model dtype, gpt_oss in fp32, gemma scales by (1 + w).
NORM_STYLES = ("llama", "fp32", "gemma")
FINAL_NORM_OF = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v2",
                     "deepseek_v3", "kimi_k2", "glm4_moe", "glm4_moe_lite"), "llama"),
    "gpt_oss": "fp32",
    **dict.fromkeys(("gemma", "gemma2", "gemma3_text"), "gemma"),
}
# Families whose SGLang server returns the *post-norm* final state with --enable-return-hidden-states.
SGLANG_POST_NORM_FAMILIES = ("llama",)
NEXT_TOKEN_TOP_K = 5  # the engine's next token must be among the checkpoint's top-k ...
NEXT_TOKEN_MIN_AGREEMENT = 0.9  # ... on at least this share of samples (checked from 16 on)
T = TypeVar("T")


class EngineError(Eagle3Error):
    """The engine answered, but not what this dump asked for: retrying cannot help."""


class Transient(Exception):
    """A failure worth retrying: connection, timeout, 5xx, a state file that did not come."""


def final_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str) -> torch.Tensor:
    """The target's final RMSNorm of ``x`` [T, H] (pre-norm, in the model dtype), computed as
    transformers computes it for that family, so ``last_hidden`` matches ``backend=hf``."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if style == "llama":
        return weight.to(x.dtype) * h.to(x.dtype)
    if style == "fp32":
        return (weight.float() * h).to(x.dtype)
    if style == "gemma":
        return (h * (1.0 + weight.float())).to(x.dtype)
    raise ConfigError(f"server.final_norm must be auto or one of {NORM_STYLES}, got {style!r}")


def norm_style(model_type: str, configured: str) -> str:
    if configured != "auto":
        if configured not in NORM_STYLES:
            raise ConfigError(f"server.final_norm must be auto or one of {NORM_STYLES}, got {configured!r}")
        return configured
    if model_type not in FINAL_NORM_OF:
        raise ConfigError(
            f"the final norm of model_type {model_type!r} is not known here, so last_hidden cannot be rebuilt "
            f"from vLLM's pre-norm state; set server.final_norm to one of {NORM_STYLES} after checking its "
            f"RMSNorm in transformers"
        )
    return FINAL_NORM_OF[model_type]


def vllm_layer_ids(stored: list[int], num_hidden_layers: int) -> list[int]:
    """vLLM ids for the stored HF indices (the same numbers) plus N, the pre-norm final state."""
    return sorted(stored) + [num_hidden_layers]


def sglang_layer_ids(stored: list[int], model_type: str, num_hidden_layers: int) -> list[int]:
    """SGLang ids that capture the stored HF indices, by the rule export uses; refused (with the
    reason) where SGLang cannot capture them or its final state is not known to be post-norm."""
    try:
        ids = ids_for(stored, "sglang", model_type, num_hidden_layers)[NESTED]
    except Unexpressible as e:
        raise Unexpressible(f"backend=sglang cannot dump this capture: {e}") from None
    if family_of(model_type) not in SGLANG_POST_NORM_FAMILIES:
        raise Unexpressible(
            f"backend=sglang: for model_type {model_type!r} SGLang's returned final state is not known to be "
            f"the post-norm state that last_hidden must be; use backend=vllm (the final norm is then applied here)"
        )
    return ids


# -- launch commands ------------------------------------------------------------------------------


def _port(url: str, default: int) -> int:
    return urlparse(url).port or default


def vllm_launch(model_path: str, ids: list[int], dtype: str, port: int, storage: str) -> str:
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": storage, "allow_custom_save_path": True}}
    return (
        f"vllm serve {shlex.quote(model_path)} --port {port} --dtype {dtype} --no-enable-prefix-caching \\\n"
        f"  --speculative-config {shlex.quote(json.dumps(spec, separators=(',', ':')))} \\\n"
        f"  --kv-transfer-config {shlex.quote(json.dumps(kv, separators=(',', ':')))}"
    )


def sglang_launch(model_path: str, ids: list[int] | None, dtype: str, port: int) -> str:
    common = (f"python -m sglang.launch_server --model-path {shlex.quote(model_path)} --port {port} --dtype {dtype} "
              f"--disable-radix-cache --chunked-prefill-size -1")
    if ids is None:
        return f"{common} \\\n  --enable-return-hidden-states"
    return (f"{common} \\\n  --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 "
            f"--return-aux-hidden-state-layer-ids {' '.join(map(str, ids))}")


def launch_text(cfg: DumpConfig) -> str:
    """The engine command(s) that serve exactly the capture ``cfg`` asks for, and the client
    command that dumps from them (``print_launch=true``)."""
    if cfg.target == "tiny":
        raise ConfigError("target=tiny exists only inside this process; no engine can serve it")
    target = load_target(cfg.target, cache_dir=cfg.cache_dir, load_model=False, trust_remote_code=cfg.trust_remote_code)
    n, model_type = target.num_hidden_layers, target.identity.model_type
    _, stored = stored_indices(cfg.capture, n)
    path = str(target.local_dir or cfg.target)
    lines = [f"# eagle3-dump backend={cfg.backend}: {model_type}, N={n}, HF indices stored {stored} + last_hidden",
             f"# (engine API as read from {cfg.backend} {ENGINE_VERSIONS[cfg.backend]})"]
    if cfg.backend == "vllm":
        ids = vllm_layer_ids(stored, n)
        storage = cfg.server.server_files_dir or cfg.server.files_dir or (
            str(Path(cfg.out).expanduser().resolve() / "engine_files") if cfg.out else "<out>/engine_files")
        lines += [f"# ids {ids}: HF indices {stored}, and {n} = the pre-norm final state (last_hidden = final norm of it)",
                  vllm_launch(path, ids, cfg.dtype, _port(cfg.server.url, 8000), storage)]
    else:
        ids = sglang_layer_ids(stored, model_type, n)
        lines += [f"# aux-state server: ids {ids} capture HF indices {stored}",
                  sglang_launch(path, ids, cfg.dtype, _port(cfg.server.url, 30000)),
                  "# final-state server (post-norm last_hidden):",
                  sglang_launch(path, None, cfg.dtype, _port(cfg.server.final_url, 30001))]
    lines += ["# then, once the server is up:",
              f"eagle3-dump backend={cfg.backend} target={shlex.quote(cfg.target)} data={cfg.data or '<prepared>'} "
              f"out={cfg.out or '<dump>'} "
              f"server.url={cfg.server.url}" + (f" server.final_url={cfg.server.final_url}" if cfg.backend == "sglang" else "")
              + (f" capture.aux_indices=[{','.join(map(str, cfg.capture.aux_indices))}]" if cfg.capture.aux_indices else "")
              + (f" capture.extra_indices=[{','.join(map(str, cfg.capture.extra_indices))}]" if cfg.capture.extra_indices else "")]
    return "\n".join(lines)


# -- responses -> states --------------------------------------------------------------------------


def _first_difference(got: list[int], want: list[int]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"position {i}: engine {a}, prompt {b}"
    return f"lengths: engine {len(got)}, prompt {len(want)}"


def exact_rows(rows: Any, width: int, dtype: torch.dtype, where: str) -> torch.Tensor:
    """JSON rows ``[T][width]`` -> a tensor of ``dtype``, exactly: every engine value is a number
    of ``dtype`` written out in full, so a value that is not one means the engine runs another dtype."""
    try:
        t = torch.from_numpy(np.array(rows, dtype=np.float64))
    except (TypeError, ValueError) as e:
        raise EngineError(f"{where}: hidden_states is not a [T][{width}] array of numbers ({e})") from None
    if t.ndim != 2 or t.shape[1] != width:
        raise EngineError(f"{where}: hidden_states has shape {list(t.shape)}, expected [T, {width}]")
    out = t.to(dtype)
    inexact = (out.double() != t) & ~t.isnan()
    if inexact.any():
        raise EngineError(
            f"{where}: values such as {t[inexact][0].item()!r} are not {str(dtype).removeprefix('torch.')} "
            f"numbers: the engine runs in another dtype; set dtype= to the engine's --dtype"
        )
    return out


class VllmStates:
    """Turns one vLLM state file into the shard's states (HF indices + post-norm ``last_hidden``)."""

    def __init__(self, stored: list[int], num_hidden_layers: int, hidden: int, dtype: torch.dtype,
                 norm_weight: torch.Tensor, eps: float, style: str):
        self.stored, self.ids = stored, vllm_layer_ids(stored, num_hidden_layers)
        self.hidden, self.dtype = hidden, dtype
        self.norm_weight, self.eps, self.style = norm_weight, eps, style

    def __call__(self, data: dict[str, torch.Tensor], prompt: list[int], where: str) -> dict[str, torch.Tensor]:
        if "hidden_states" not in data or "token_ids" not in data:
            raise EngineError(f"{where}: expected tensors hidden_states and token_ids, found {sorted(data)}")
        tokens = data["token_ids"].tolist()
        if tokens != prompt:
            raise EngineError(
                f"{where}: the engine's token_ids differ from the prompt ({_first_difference(tokens, prompt)}): it "
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
            raise EngineError(f"{where}: the engine's states are {hs.dtype}, this dump stores {self.dtype}: set dtype= "
                              f"to the engine's --dtype")
        states = {f"hidden.{k}": hs[:, i] for i, k in enumerate(self.stored)}
        states["last_hidden"] = final_norm(hs[:, -1], self.norm_weight, self.eps, self.style)
        return states


class SglangStates:
    """Turns the two SGLang responses (aux server, final-state server) into the shard's states."""

    def __init__(self, stored: list[int], hidden: int, dtype: torch.dtype):
        self.stored, self.hidden, self.dtype = stored, hidden, dtype

    def rows(self, response: dict, width: int, prompt: list[int], where: str) -> torch.Tensor:
        meta = response.get("meta_info")
        if not isinstance(meta, dict):
            raise EngineError(f"{where}: the response has no meta_info")
        cached = meta.get("cached_tokens", 0)
        if cached:
            raise EngineError(f"{where}: cached_tokens={cached}: the radix cache served part of the prompt and its rows "
                              f"are missing; launch the server with --disable-radix-cache")
        if meta.get("prompt_tokens", len(prompt)) != len(prompt):
            raise EngineError(f"{where}: prompt_tokens={meta['prompt_tokens']} for a prompt of {len(prompt)} tokens")
        hs = meta.get("hidden_states")
        if not hs:
            raise EngineError(f"{where}: no hidden_states in meta_info: launch the server as print_launch=true shows")
        rows = hs[0]  # the prefill's rows; later entries belong to generated tokens
        if len(rows) != len(prompt):
            raise EngineError(f"{where}: {len(rows)} rows for {len(prompt)} prompt tokens: a chunked prefill returns only "
                              f"its last chunk; launch the server with --chunked-prefill-size -1")
        return exact_rows(rows, width, self.dtype, where)

    def __call__(self, aux: dict, final: dict, prompt: list[int], where: tuple[str, str]) -> dict[str, torch.Tensor]:
        h = self.hidden
        cat = self.rows(aux, len(self.stored) * h, prompt, where[0])  # [T, K*H], ascending layers
        states = {f"hidden.{k}": cat[:, i * h : (i + 1) * h] for i, k in enumerate(self.stored)}
        states["last_hidden"] = self.rows(final, h, prompt, where[1])
        return states


# -- talking to the engines -----------------------------------------------------------------------


async def _post(session: Any, url: str, body: dict, parse_gate: asyncio.Semaphore | None = None) -> dict:
    """POST JSON; connection problems, timeouts, 408/429/5xx are :class:`Transient`, other
    errors are the engine refusing the request. ``parse_gate`` bounds how many large responses
    are parsed at once (parsing holds the GIL, so more at once only multiplies memory)."""
    import aiohttp

    try:
        async with session.post(url, json=body) as resp:
            text = await resp.read()
            if resp.status in (408, 429) or resp.status >= 500:
                raise Transient(f"{url}: HTTP {resp.status}: {text[:300].decode(errors='replace')}")
            if resp.status != 200:
                raise EngineError(f"{url} refused the request: HTTP {resp.status}: {text[:500].decode(errors='replace')}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise Transient(f"{url}: {type(e).__name__}: {e}") from None
    try:
        if parse_gate is None:
            return await asyncio.to_thread(json.loads, text)
        async with parse_gate:
            return await asyncio.to_thread(json.loads, text)
    except ValueError:
        raise Transient(f"{url}: the response is not JSON: {text[:200]!r}") from None


async def _wait_ready(session: Any, base_urls: list[str], wait_s: float, command: str = "eagle3-dump",
                      hint: str = "print_launch=true shows how to start it") -> None:
    """Wait until every server answers ``/health`` (engines take minutes to load a large target);
    ``command`` and ``hint`` name the caller in its messages (the dump, or regeneration)."""
    import aiohttp

    deadline = time.monotonic() + wait_s
    for base in base_urls:
        said = False
        while True:
            try:
                async with session.get(f"{base}/health") as resp:
                    if resp.status == 200:
                        break
                    problem = f"HTTP {resp.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                problem = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise Eagle3Error(f"{base} did not become ready within {wait_s:.0f} s ({problem}); is the engine running? "
                                  f"{hint}")
            if not said:
                print(f"{command}: waiting for {base} ({problem})", flush=True)
                said = True
            await asyncio.sleep(2.0)


async def _retrying(call: Callable[[int], Awaitable[T]], retries: int, backoff_s: float, what: str) -> T:
    """``call(attempt)`` until it does not raise :class:`Transient`, at most ``retries`` more times,
    sleeping ``backoff_s`` doubled on every retry (at most 60 s); then an :class:`EngineError`."""
    for attempt in range(retries + 1):
        try:
            return await call(attempt)
        except Transient as e:
            if attempt == retries:
                raise EngineError(f"{what}: {attempt + 1} attempts failed; the last: {e}") from None
            await asyncio.sleep(min(backoff_s * 2**attempt, 60.0))
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _served_model(session: Any, base_url: str, option: str) -> str:
    """The first model vLLM's ``/v1/models`` lists (what to send when ``option`` is not set)."""
    async with session.get(f"{base_url}/v1/models") as resp:
        if resp.status != 200:
            raise EngineError(f"{base_url}/v1/models answered HTTP {resp.status}; set {option}")
        models = (await resp.json()).get("data") or []
    if not models:
        raise EngineError(f"{base_url}/v1/models lists no model; set {option}")
    return models[0]["id"]


def wait_and_load(path: Path, timeout_s: float) -> dict[str, torch.Tensor]:
    """Read a vLLM state file once the engine has released its ``.lock`` (a shared lock is
    granted only after the engine's exclusive one is gone); the lock exists before the response."""
    lock = path.with_name(path.name + ".lock")
    deadline = time.monotonic() + timeout_s
    delay = 0.002
    while not lock.exists():  # on a shared filesystem it may show up late
        if time.monotonic() > deadline:
            raise Transient(f"{lock} did not appear within {timeout_s:.0f} s")
        time.sleep(delay)
        delay = min(2 * delay, 0.25)
    fd = os.open(lock, os.O_RDONLY)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise Transient(f"{path} was still being written after {timeout_s:.0f} s") from None
                time.sleep(delay)
                delay = min(2 * delay, 0.25)
        if not path.is_file():
            raise Transient(f"the engine released {lock.name} without writing {path} (see the engine's log)")
        try:
            return load_file(str(path))
        except Exception as e:  # safetensors raises several types for a damaged file
            raise Transient(f"{path} is unreadable: {e}") from None
    finally:
        os.close(fd)


class VllmClient:
    """One request per sample to vLLM's ``/v1/completions``; the states arrive as a file."""

    def __init__(self, cfg: DumpConfig, states: VllmStates, rank: int, out: Path):
        self.cfg, self.states = cfg, states
        self.url = cfg.server.url.rstrip("/")
        files = Path(cfg.server.files_dir).expanduser() if cfg.server.files_dir else out / "engine_files"
        self.client_dir = files.resolve() / f"{rank:05d}"
        self.server_root = Path(cfg.server.server_files_dir or files.resolve())
        self.server_dir = self.server_root / f"{rank:05d}"
        self.model = cfg.server.model

    async def start(self, session: Any) -> None:
        if self.client_dir.exists():  # a crashed run's files: the engine is done with them
            shutil.rmtree(self.client_dir)
        self.client_dir.mkdir(parents=True)
        await _wait_ready(session, [self.url], self.cfg.client.wait_for_server_s)
        if self.model is None:
            self.model = await _served_model(session, self.url, "server.model")

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
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True,
                "kv_transfer_params": {"hidden_states_path": str(self.server_dir / name)}}
        resp = await _post(session, f"{self.url}/v1/completions", body)
        engine_path = (resp.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not engine_path:
            raise EngineError(f"{self.url}: the response names no kv_transfer_params.hidden_states_path: launch vLLM with "
                              f"the hidden-states connector (print_launch=true)")
        path = self._local(engine_path)
        try:
            data = await asyncio.to_thread(wait_and_load, path, self.cfg.client.file_timeout_s)
        finally:
            if not self.cfg.client.keep_files:
                path.unlink(missing_ok=True)
                path.with_name(path.name + ".lock").unlink(missing_ok=True)
        states = await asyncio.to_thread(self.states, data, prompt, f"{engine_path} (sample {sample_id})")
        generated = ((resp.get("choices") or [{}])[0].get("token_ids")) or [None]
        return states, generated[0]


class SglangClient:
    """One ``/generate`` request per sample to each of the two SGLang servers.

    The states come as JSON text (~12 bytes per value): parsing them is this client's bottleneck,
    about 6 million values per second on one core (parse + exact conversion, measured on this
    project's 2-core test machine): ~370 tokens/s of an 8B-shaped capture (4 x 4096 values per token). One response is parsed at a time, so memory stays near
    ``client.concurrency`` raw responses; use more client processes for more throughput."""

    def __init__(self, cfg: DumpConfig, states: SglangStates):
        self.cfg, self.states = cfg, states
        self.url, self.final_url = cfg.server.url.rstrip("/"), cfg.server.final_url.rstrip("/")
        self.parse_gate: asyncio.Semaphore | None = None  # made inside the event loop (start)

    async def start(self, session: Any) -> None:
        self.parse_gate = asyncio.Semaphore(1)
        await _wait_ready(session, [self.url, self.final_url], self.cfg.client.wait_for_server_s)

    async def fetch(self, session: Any, sample_id: int, prompt: list[int], attempt: int) -> tuple[dict, int | None]:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_hidden_states": True}
        aux, final = await asyncio.gather(_post(session, f"{self.url}/generate", body, self.parse_gate),
                                          _post(session, f"{self.final_url}/generate", body, self.parse_gate))
        where = (f"{self.url} (sample {sample_id})", f"{self.final_url} (sample {sample_id})")
        async with self.parse_gate:
            states = await asyncio.to_thread(self.states, aux, final, prompt, where)
        generated = final.get("output_ids") or [None]
        return states, generated[0]


# -- the stage ------------------------------------------------------------------------------------


class ServedDumper(Dumper):
    """The dump stage as one client process of ``client.world_size``; see the module docstring."""

    def __init__(self, cfg: DumpConfig):
        super().__init__(cfg)
        model_type = self.identity.model_type
        if cfg.backend == "sglang":
            sglang_layer_ids(self.stored, model_type, self.spec.num_hidden_layers)  # refuses what SGLang cannot capture
        else:
            self.norm_style = norm_style(model_type, cfg.server.final_norm)

    def _ranks(self) -> DistInfo:
        c = self.cfg.client
        rank = c.rank if c.rank is not None else int(os.environ.get("RANK", 0))
        world = c.world_size if c.world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
        if not 0 <= rank < world:
            raise ConfigError(f"client.rank={rank} must be in [0, client.world_size={world})")
        return DistInfo(rank, world, 0, torch.device("cpu"))

    def _say(self, text: str) -> None:
        print(f"eagle3-dump [client {self.dist.rank}/{self.dist.world_size}]: {text}", flush=True)

    def _claim(self) -> None:
        """Every client records (or checks) the request and clears only its own crash leftovers:
        the others may be writing right now."""
        removed = self._record_request(prefix=f"{self.dist.rank:05d}-")
        if removed:
            self._say(f"removed {len(removed)} unfinished files of an interrupted run")

    def _run_info(self) -> dict[str, Any]:
        urls = [self.cfg.server.url] + ([self.cfg.server.final_url] if self.cfg.backend == "sglang" else [])
        counts = [json.loads(p.read_text()) for p in sorted((self.out / CHECKS_DIR).glob("*.json"))]
        total = {k: sum(c[k] for c in counts) for k in ("checked", "agreed")}
        return {"backend": self.cfg.backend, "engine_api": f"{self.cfg.backend} {ENGINE_VERSIONS[self.cfg.backend]}",
                "servers": urls, "client_world_size": self.dist.world_size, "next_token_check": total}

    def _record_agreement(self) -> None:
        """Add this run's next-token counts to this client's file (summed into the manifest)."""
        path = self.out / CHECKS_DIR / f"{self.dist.rank:05d}.json"
        before = json.loads(path.read_text()) if path.is_file() else {"checked": 0, "agreed": 0}
        atomic_write_json(path, {k: before[k] + self.agreement[k] for k in before})

    def run(self) -> dict[str, Any] | None:
        if (manifest := self._finished()) is not None:
            return manifest
        self._claim()
        todo = self._todo()
        mine = todo[self.sample_ids[todo] % self.dist.world_size == self.dist.rank]  # stable across restarts
        self.agreement = {"checked": 0, "agreed": 0}
        start = time.time()
        written = tokens = 0
        if len(mine):
            self._prepare_client()
            written, tokens = asyncio.run(self._fetch_all(mine))
            self._record_agreement()
        records, ids, nonfinite, missing = self._coverage()
        if len(missing):
            self._say(f"my share is done; {len(missing)} samples of other clients are still missing. The last client to "
                      f"finish writes {MANIFEST_NAME} (or run this command again once all are done)")
            return None
        remove_unfinished(self.shard_dir)  # every sample is stored: nobody is writing any more
        return self._finalize(time.time() - start, [written, tokens])

    def _prepare_client(self) -> None:
        """The per-engine client, with what it needs from the checkpoint (final norm, lm_head)."""
        cfg, spec = self.cfg, self.spec
        dtype = resolve_dtype(cfg.dtype, "cuda")
        names = ("norm",) if cfg.backend == "vllm" else ()
        names += ("head",) if cfg.client.check_next_token else ()
        tensors: dict[str, torch.Tensor] = {}
        if names:
            _, tensors = load_target_tensors(cfg.target, names, cache_dir=cfg.cache_dir, trust_remote_code=cfg.trust_remote_code)
        self.head = tensors.get("head")
        if cfg.backend == "vllm":
            eps = float(getattr(text_config(self.target.config), "rms_norm_eps", 1e-6))
            states = VllmStates(self.stored, spec.num_hidden_layers, spec.hidden_size, dtype, tensors["norm"], eps,
                                self.norm_style)
            self.client: VllmClient | SglangClient = VllmClient(cfg, states, self.dist.rank, self.out)
        else:
            self.client = SglangClient(cfg, SglangStates(self.stored, spec.hidden_size, dtype))

    async def _fetch_all(self, rows: np.ndarray) -> tuple[int, int]:
        """Keep ``client.concurrency`` requests in flight; hand finished samples to the writer.
        On a failure that retries cannot fix, store what arrived, then stop. Returns (bytes, tokens)."""
        import aiohttp

        c = self.cfg.client
        writer = self._writer()
        lengths = self.dataset["num_tokens"][:]
        bar = tqdm(total=int(lengths[rows].sum()), unit="tok", unit_scale=True, disable=not self.cfg.progress,
                   desc=f"dump client {self.dist.rank}/{self.dist.world_size} ({self.cfg.backend})")
        queue = iter(rows.tolist())
        pending: set[asyncio.Task] = set()
        tokens = samples = 0
        failure: BaseException | None = None
        timeout = aiohttp.ClientTimeout(total=c.request_timeout_s)
        try:
            async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=2 * c.concurrency)) as session:
                await self.client.start(session)
                while failure is None:
                    while len(pending) < c.concurrency and (row := next(queue, None)) is not None:
                        pending.add(asyncio.create_task(self._sample(session, row)))
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
                raise Eagle3Error(f"stopped: {failure}\n  {samples} samples received before the stop are stored; fix "
                                  f"the cause and run the same command again to resume") from None
            raise failure
        self._say(f"{samples} samples, {tokens} tokens received; next-token check: {self.agreement}")
        return writer.bytes_written, tokens

    async def _sample(self, session: Any, row: int) -> tuple[dict[str, torch.Tensor], int]:
        """One sample's states and index tensors, retried with exponential backoff."""
        c = self.cfg.client
        record = self.dataset[row]
        sample_id = int(self.sample_ids[row])
        prompt = record["input_ids"].astype(np.int64).tolist()
        states, next_token = await _retrying(lambda attempt: self.client.fetch(session, sample_id, prompt, attempt),
                                             c.retries, c.backoff_s, f"sample {sample_id}")
        finite = all(bool(torch.isfinite(t).all()) for t in states.values())
        if finite and next_token is not None and self.head is not None:
            await asyncio.to_thread(self._check_next_token, states["last_hidden"][-1], int(next_token), sample_id)
        piece = dict(states)
        piece["finite"] = torch.tensor([finite])
        piece["input_ids"] = torch.from_numpy(record["input_ids"].astype(np.int32))
        piece["loss_mask"] = torch.from_numpy(record["loss_mask"].astype(np.uint8))
        piece["sample_ids"] = torch.tensor([sample_id], dtype=torch.int64)
        return piece, len(prompt)

    def _check_next_token(self, last: torch.Tensor, token: int, sample_id: int) -> None:
        """The engine's greedy next token should be (near) the top of the checkpoint's
        ``lm_head(last_hidden)``; a low agreement means another model or other layers."""
        logits = self.head @ last.to(self.head.dtype)  # [V]
        top = logits.float().topk(NEXT_TOKEN_TOP_K).indices.tolist()
        a = self.agreement
        a["checked"] += 1
        a["agreed"] += token in top
        if a["checked"] >= 16 and a["agreed"] < NEXT_TOKEN_MIN_AGREEMENT * a["checked"]:
            raise EngineError(
                f"the engine's next token is outside the top {NEXT_TOKEN_TOP_K} of lm_head(last_hidden) of target "
                f"{self.cfg.target} on {a['checked'] - a['agreed']} of {a['checked']} samples (e.g. sample {sample_id}: "
                f"engine {token}, checkpoint top {top}): the engine serves another model, or its last captured state is "
                f"not the final layer (compare its launch command with print_launch=true)"
            )
