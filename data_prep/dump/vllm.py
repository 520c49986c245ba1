"""``backend=vllm``: states from a vLLM server (API read from vLLM 0.33.0).

vLLM serves them through ``extract_hidden_states`` with ``ExampleHiddenStatesConnector``, only for
targets whose vLLM class implements its EAGLE-3 interface (``eagle3_train.engines.rules.VLLM_EAGLE3``;
vLLM refuses any other at load, so this backend refuses it before launch): engine id ``v`` captures
HF index ``v``, and ``v = N`` is the last layer's output *before* the final norm. Its DeepSeek code
(DeepSeek-V2/V3, Kimi-K2) crashes on id 0, so HF index 0 is refused for those targets.
One request per sample (``/v1/completions``, ``prompt`` = token ids, ``max_tokens=1``); the engine
writes ``hidden_states`` [T, K, H] (ascending ids) and ``token_ids`` [T] to a safetensors file
after the response, holding ``<file>.lock`` until it is complete. ``last_hidden`` is the target's
final RMSNorm, with weights read from the target checkpoint, applied to id ``N``.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shlex
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from data_prep.dump.config import DumpConfig
from data_prep.dump.served import ServedBackend, first_difference, port_of
from eagle3_train.engines.http import EngineError, Transient, post_json, served_model, wait_ready
from eagle3_train.engines.rules import TOP_KEY, VLLM_EAGLE3, Unexpressible, ids_for
from eagle3_train.targets import Target, resolve_dtype, text_config

if TYPE_CHECKING:
    from data_prep.dump.stage import Dumper

# How transformers applies the final RMSNorm of each target vLLM serves (x: the pre-norm state,
# h = x / rms(x) in fp32): llama-style multiplies in the model dtype, gpt_oss in fp32.
FINAL_NORM_OF = {**dict.fromkeys(VLLM_EAGLE3 - {"gpt_oss"}, "llama"), "gpt_oss": "fp32"}


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


def layer_ids(stored: list[int], model_type: str, num_hidden_layers: int) -> list[int]:
    """vLLM ids for the stored HF indices (the same numbers, by the rule export uses) plus N, the
    pre-norm final state; refused (with the reason) for a target vLLM does not serve this way, or
    ids its code fails on."""
    try:
        ids = ids_for(stored, "vllm", model_type, num_hidden_layers)[(TOP_KEY,)]
    except Unexpressible as e:
        raise Unexpressible(f"backend=vllm cannot dump this capture: {e}") from None
    return sorted(ids) + [num_hidden_layers]


def launch(model_path: str, ids: list[int], dtype: str, port: int, storage: str, extra: str = "") -> str:
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": storage, "allow_custom_save_path": True}}
    return (
        f"vllm serve {shlex.quote(model_path)} --port {port} --dtype {dtype} --no-enable-prefix-caching \\\n"
        f"  --speculative-config {shlex.quote(json.dumps(spec, separators=(',', ':')))} \\\n"
        f"  --kv-transfer-config {shlex.quote(json.dumps(kv, separators=(',', ':')))}" + (f" {extra}" if extra else "")
    )


class VllmStates:
    """Turns one vLLM state file into the shard's states (HF indices + post-norm ``last_hidden``)."""

    def __init__(self, stored: list[int], ids: list[int], hidden: int, dtype: torch.dtype,
                 norm_weight: torch.Tensor, eps: float, style: str):
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
            raise EngineError(f"{where}: the engine's states are {hs.dtype}, this dump stores {self.dtype}: set dtype= "
                              f"to the engine's --dtype")
        states = {f"hidden.{k}": hs[:, i] for i, k in enumerate(self.stored)}
        states["last_hidden"] = final_norm(hs[:, -1], self.norm_weight, self.eps, self.style)
        return states


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
        await wait_ready(session, [self.url], self.cfg.client.wait_for_server_s)
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
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True,
                "kv_transfer_params": {"hidden_states_path": str(self.server_dir / name)}}
        resp = await post_json(session, f"{self.url}/v1/completions", body)
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



class Backend(ServedBackend):
    """``backend=vllm``: one server; ``last_hidden`` is normed here from its pre-norm id N."""

    engine, version = "vllm", "0.33.0"
    tensors = ("norm",)

    def servers(self) -> dict[str, str]:
        return {"server.url": self.cfg.server.url}

    def check(self, stage: Dumper) -> None:
        self.ids = layer_ids(stage.stored, stage.identity.model_type, stage.spec.num_hidden_layers)

    def engine_lines(self, target: Target, path: str, stored: list[int]) -> list[str]:
        cfg, n = self.cfg, target.num_hidden_layers
        ids = layer_ids(stored, target.identity.model_type, n)
        storage = cfg.server.server_files_dir or cfg.server.files_dir or (
            str(Path(cfg.out).expanduser().resolve() / "engine_files") if cfg.out else "<out>/engine_files")
        return [f"# ids {ids}: HF indices {stored}, and {n} = the pre-norm final state (last_hidden = final norm of it)",
                launch(path, ids, cfg.dtype, port_of(cfg.server.url, 8000), storage, cfg.server.engine_args)]

    def client(self, stage: Dumper, tensors: dict[str, torch.Tensor]) -> VllmClient:
        spec = stage.spec
        eps = float(getattr(text_config(stage.target.config), "rms_norm_eps", 1e-6))
        states = VllmStates(stage.stored, self.ids, spec.hidden_size, resolve_dtype(self.cfg.dtype, "cuda"),
                            tensors["norm"], eps, FINAL_NORM_OF[stage.identity.model_type])
        return VllmClient(self.cfg, states, stage.dist.rank, stage.out)
