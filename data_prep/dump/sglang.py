"""``backend=sglang``: states from two SGLang servers (API read from SGLang 0.5.23).

Engine id ``v`` captures an HF index by the SGLang rule of the target's family (eagle3_train/
engines.py: ``v + 1`` for llama-family targets, so HF index 0 cannot be asked for), returned as
JSON rows ``[T][K*H]`` by ``/generate`` with ``return_hidden_states`` from a server launched with
``--enable-return-aux-hidden-states`` (which SGLang allows only with ``pp_size == 1``: engine flags
asking for pipeline stages are refused before launch); the post-norm final state comes from a
second server started with ``--enable-return-hidden-states`` (SGLang hands the logits processor the
post-norm state for llama, deepseek_v2 and gpt_oss targets alike). A radix-cache hit or a chunked
prefill drops rows, hence ``--disable-radix-cache --chunked-prefill-size -1`` and the
``cached_tokens == 0`` and row-count checks.
"""

from __future__ import annotations

import asyncio
import shlex
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from data_prep.dump.config import DumpConfig
from data_prep.dump.served import ServedBackend, port_of
from eagle3_train.core.errors import ConfigError
from eagle3_train.engines.http import EngineError, post_json, wait_ready
from eagle3_train.engines.rules import NESTED, Unexpressible, family_of, ids_for
from eagle3_train.targets import Target, resolve_dtype

if TYPE_CHECKING:
    from data_prep.dump.stage import Dumper

# Families whose SGLang server returns the *post-norm* final state with --enable-return-hidden-states
# (their model code passes the normed state to the logits processor).
POST_NORM_FAMILIES = ("llama", "deepseek", "gpt_oss")


def layer_ids(stored: list[int], model_type: str, num_hidden_layers: int) -> list[int]:
    """SGLang ids that capture the stored HF indices, by the rule export uses; refused (with the
    reason) where SGLang cannot capture them or its final state is not known to be post-norm."""
    try:
        ids = ids_for(stored, "sglang", model_type, num_hidden_layers)[NESTED]
    except Unexpressible as e:
        raise Unexpressible(f"backend=sglang cannot dump this capture: {e}") from None
    if family_of(model_type) not in POST_NORM_FAMILIES:
        raise Unexpressible(
            f"backend=sglang: for model_type {model_type!r} SGLang's returned final state is not known to be "
            f"the post-norm state that last_hidden must be; use backend=vllm (the final norm is then applied here)"
        )
    return ids


def pipeline_stages(engine_args: str) -> int:
    """The pipeline-parallel size that extra SGLang flags ask for (``--pp-size`` or
    ``--pipeline-parallel-size``, as SGLang spells them; 1 when absent)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--pp-size", "--pipeline-parallel-size", dest="pp", default="1")
    try:
        value = parser.parse_known_args(shlex.split(engine_args))[0].pp
        return int(value)
    except (ValueError, SystemExit):
        raise ConfigError(f"server.engine_args: cannot read the pipeline size from {engine_args!r}") from None


def check_engine_args(engine_args: str) -> None:
    """SGLang returns aux hidden states only with ``pp_size == 1``: refuse other flags before launch."""
    if (pp := pipeline_stages(engine_args)) != 1:
        raise ConfigError(f"server.engine_args asks SGLang for {pp} pipeline stages, but SGLang returns aux hidden states "
                          f"only with pp_size == 1: use tensor parallelism (--tp-size) instead")


def launch(model_path: str, ids: list[int] | None, dtype: str, port: int, extra: str = "") -> str:
    common = (f"python -m sglang.launch_server --model-path {shlex.quote(model_path)} --port {port} --dtype {dtype} "
              f"--disable-radix-cache --chunked-prefill-size -1")
    tail = f" {extra}" if extra else ""
    if ids is None:
        return f"{common} \\\n  --enable-return-hidden-states{tail}"
    return (f"{common} \\\n  --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 "
            f"--return-aux-hidden-state-layer-ids {' '.join(map(str, ids))}{tail}")


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
        await wait_ready(session, [self.url, self.final_url], self.cfg.client.wait_for_server_s)

    async def fetch(self, session: Any, sample_id: int, prompt: list[int], attempt: int) -> tuple[dict, int | None]:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_hidden_states": True}
        aux, final = await asyncio.gather(post_json(session, f"{self.url}/generate", body, self.parse_gate),
                                          post_json(session, f"{self.final_url}/generate", body, self.parse_gate))
        where = (f"{self.url} (sample {sample_id})", f"{self.final_url} (sample {sample_id})")
        assert self.parse_gate is not None  # start() ran
        async with self.parse_gate:
            states = await asyncio.to_thread(self.states, aux, final, prompt, where)
        generated = final.get("output_ids") or [None]
        return states, generated[0]


class Backend(ServedBackend):
    """``backend=sglang``: an aux-state server and a final-state server."""

    engine, version = "sglang", "0.5.23"

    def servers(self) -> dict[str, str]:
        return {"server.url": self.cfg.server.url, "server.final_url": self.cfg.server.final_url}

    def check(self, stage: Dumper) -> None:
        check_engine_args(self.cfg.server.engine_args)
        layer_ids(stage.stored, stage.identity.model_type, stage.spec.num_hidden_layers)

    def engine_lines(self, target: Target, path: str, stored: list[int]) -> list[str]:
        cfg = self.cfg
        check_engine_args(cfg.server.engine_args)
        ids = layer_ids(stored, target.identity.model_type, target.num_hidden_layers)
        extra = cfg.server.engine_args
        return [f"# aux-state server: ids {ids} capture HF indices {stored}",
                launch(path, ids, cfg.dtype, port_of(cfg.server.url, 30000), extra),
                "# final-state server (post-norm last_hidden):",
                launch(path, None, cfg.dtype, port_of(cfg.server.final_url, 30001), extra)]

    def client(self, stage: Dumper, tensors: dict[str, torch.Tensor]) -> SglangClient:
        states = SglangStates(stage.stored, stage.spec.hidden_size, resolve_dtype(self.cfg.dtype, "cuda"))
        return SglangClient(self.cfg, states)
