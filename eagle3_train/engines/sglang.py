"""SGLang: its layer-id rules, its command line, its hidden-state capture (served dump), its
generation endpoint (served regeneration) and its speculative-decoding figures (served acceptance).

**Rules** (read from SGLang 0.5.17 and 0.5.23): SGLang reads only the nested
``eagle_config.eagle_aux_hidden_state_layer_ids`` (a top-level key is ignored: the default, silently).
Id v captures HF index v+1 for llama-family targets; its DeepSeek code guesses (a list starting at 1
is taken as 0-based layer numbers: +1, else as it is); its gpt_oss code adds 1 unless the largest id
is N. Its draft applies ``fc`` only when the incoming width differs from the draft's hidden size.

**Served dump** (API read from SGLang 0.5.23): engine id ``v`` captures an HF index by the rule of
the target's family, returned as JSON rows ``[T][K*H]`` by ``/generate`` with
``return_hidden_states`` from a server launched with ``--enable-return-aux-hidden-states`` (which
SGLang allows only with ``pp_size == 1``: engine flags asking for pipeline stages are refused before
launch); the post-norm final state comes from a second server started with
``--enable-return-hidden-states`` (SGLang hands the logits processor the post-norm state for llama,
deepseek_v2 and gpt_oss targets alike). A radix-cache hit or a chunked prefill drops rows, hence
``--disable-radix-cache --chunked-prefill-size -1`` and the ``cached_tokens == 0`` and row-count checks.

**Served regeneration** (``python/sglang/srt/managers/io_struct.py`` @001067f,
``sampling/sampling_params.py`` @00c17ca, ``managers/detokenizer_manager.py`` @000935b):
``/generate`` takes ``input_ids`` and ``sampling_params`` {``max_new_tokens``, ``temperature``,
``top_p``, ``top_k``, ``stop_token_ids``, ``skip_special_tokens``, ``sampling_seed``}; it returns
``output_ids`` (the matched stop token included: only the text is trimmed) and
``meta_info.finish_reason`` = {``type``: ``stop``, ``matched``: id} or {``type``: ``length``}. Its
``ignore_eos`` would also disable ``stop_token_ids``, so it is not sent: SGLang also stops at the
model's own eos ids (normally the same set; a stop on another id is refused by the client).
``sampling_seed`` is applied only by a server launched with ``--enable-deterministic-inference``.

**Served acceptance** (read from SGLang 0.5.17: ``srt/managers/tokenizer_manager.py``,
``srt/entrypoints/openai/serving_chat.py``): no Prometheus counters for speculative decoding; each
reply asked with ``return_meta_info`` carries them in its ``meta_info``.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
from typing import Any

import numpy as np
import torch

from eagle3_train.core import families
from eagle3_train.core.errors import ConfigError
from eagle3_train.engines.base import (
    NESTED,
    Command,
    Engine,
    Generation,
    Rule,
    SpecMetrics,
    Unexpressible,
    plus_one,
    sampling_fields,
    shell,
)
from eagle3_train.engines.capture import CaptureJob, ServerConfig, StateCapture, port_of
from eagle3_train.engines.heads import DraftForward, FlagRead
from eagle3_train.engines.http import EngineError, post_json, wait_ready

VERSION = "0.5.23"
_READ = "0.5.17, 0.5.23"

# The draft's forward flags (read from python/sglang/srt/models/llama_eagle3.py of 0.5.17 and 0.5.23,
# alike in both). Its load_weights drops any name it has no parameter for, without a word; it applies
# input_norm and fc_norm only where it applies fc (the captured width differs from the hidden size).
_EAGLE3 = "python/sglang/srt/models/llama_eagle3.py"
DRAFT_READS = {
    "aux_norm": FlagRead(
        (("eagle_config", "norm_before_fc"), ("norm_before_fc",)),
        weight="input_norm.weight",
        source=f"{_EAGLE3}: LlamaModel.__init__ and LlamaModel.forward",
    ),
    "fc_norm": FlagRead(
        (("fc_norm",),),
        weight="fc_norm.{i}.weight",  # also loads the legacy names aux_norm_low/mid/high as fc_norm.0/1/2
        legacy=("use_aux_norm",),
        source=f"{_EAGLE3}: LlamaModel.__init__ (one RMSNorm of target_hidden_size per aux state), "
        "LlamaModel.forward (after input_norm)",
    ),
    "norm_before_residual": FlagRead(
        (),
        source=f"{_EAGLE3}: LlamaDecoderLayer.forward, whose input layer takes residual = hidden_states "
        "before hidden_norm",
        instead="it would serve this head with the raw residual h, not hidden_norm(h)",
    ),
    "norm_output": FlagRead(
        (("norm_output",),),
        source=f"{_EAGLE3}: LlamaModel.forward (the aux state the draft loop feeds to the next step)",
    ),
}
DRAFT_FORWARDS = tuple(
    # no reader for speculators configs (no model_type); a window only from --speculative-draft-window-size
    DraftForward(
        "sglang", v, DRAFT_READS, loads_speculators=False, window_from_config=False, source=f"SGLang {v}: {_EAGLE3}"
    )
    for v in ("0.5.17", "0.5.23")  # the first: the release this project serves with
)


def _deepseek(ids: list[int], n: int) -> list[int]:
    # SGLang's DeepSeek code guesses: a list starting at 1 is taken as 0-based layer numbers
    return [v + 1 for v in ids] if ids and ids[0] == 1 else list(ids)


def _gpt_oss(ids: list[int], n: int) -> list[int]:
    return list(ids) if ids and max(ids) == n else [v + 1 for v in ids]


RULES = (
    Rule(_READ, "llama", (NESTED,), plus_one, "reads only eagle_config; a top-level key is ignored"),
    Rule(
        _READ,
        "deepseek",
        (NESTED,),
        _deepseek,
        "adds 1 only when the first id is 1",
        unwritable="a first HF index of 1 cannot be written: ids starting at 1 are shifted by one, ids starting "
        "at 0 are not; choose a first layer other than 1, or serve with vLLM",
    ),
    Rule(_READ, "gpt_oss", (NESTED,), _gpt_oss, "adds 1 unless the largest id is N"),
)

# target model_type -> the real SGLang run that confirmed its rule. SGLang's acceptance length was
# within 1.7 % of eval's tau for each (SGLang 0.5.17 has no aux-state dump).
_RUN = "H200, 2026-12-02, tiny targets and SmolLM2 (benchmarks/results/families_sglang_h200.json)"
VERIFIED = {
    mt: f"SGLang 0.5.17: served draft, {_RUN}"
    for mt in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss")
}

# ``python -m sglang.launch_server``'s flags that this project writes or documents
# (python/sglang/srt/server_args.py of 0.5.23)
COMMAND = Command(
    ("python", "-m", "sglang.launch_server"),
    (),
    {
        "--model-path": "value",
        "--port": "int",
        "--host": "value",
        "--dtype": "value",
        "--speculative-algorithm": "value",
        "--speculative-draft-model-path": "value",
        "--speculative-num-steps": "int",
        "--speculative-eagle-topk": "int",
        "--speculative-num-draft-tokens": "int",
        "--disable-radix-cache": "switch",
        "--chunked-prefill-size": "int",
        "--enable-return-hidden-states": "switch",
        "--enable-return-aux-hidden-states": "switch",
        "--return-aux-hidden-state-layer-ids": "ints",
        "--tp-size": "int",
        "--pp-size": "int",
        "--context-length": "int",
        "--mem-fraction-static": "value",
        "--enable-deterministic-inference": "switch",
        "--trust-remote-code": "switch",
    },
    f"SGLang {VERSION}: python/sglang/srt/server_args.py",
)


def serve(target: str, draft: str | None, num_speculative_tokens: int, flags: dict[str, Any]) -> list[str]:
    """SGLang serving ``target`` with ``flags``, then the EAGLE-3 ``draft`` (None: the target alone)
    as a chain of ``num_speculative_tokens`` (top-k 1: the draft tokens eagle3-eval's chain drafts,
    plus the target's own)."""
    if draft is None:
        return COMMAND.line(model_path=target, **flags)
    k = num_speculative_tokens
    return COMMAND.line(
        model_path=target,
        **flags,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft,
        speculative_num_steps=k,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=k + 1,
    )


# ---- the served dump ------------------------------------------------------------------------------

# Families whose SGLang server returns the *post-norm* final state with --enable-return-hidden-states
# (their model code passes the normed state to the logits processor).


def dump_layer_ids(stored: list[int], model_type: str, num_hidden_layers: int) -> list[int]:
    """SGLang ids that capture the stored HF indices, by the rule export uses; refused (with the
    reason) where SGLang cannot capture them or its final state is not known to be post-norm."""
    try:
        ids = ENGINE.ids_for(stored, model_type, num_hidden_layers)[NESTED]
    except Unexpressible as e:
        raise Unexpressible(f"backend=sglang cannot dump this capture: {e}") from None
    row = families.family(model_type)
    if row is None or not row.sglang_final_post_norm:
        raise Unexpressible(
            f"backend=sglang: for model_type {model_type!r} SGLang's returned final state is not known to be "
            f"the post-norm state that last_hidden must be; use backend=vllm (the final norm is then applied here)"
        )
    return ids


def pipeline_stages(engine_args: str) -> int:
    """The pipeline-parallel size that extra SGLang flags ask for (``--pp-size`` or
    ``--pipeline-parallel-size``, as SGLang spells them; 1 when absent)."""
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
        raise ConfigError(
            f"server.engine_args asks SGLang for {pp} pipeline stages, but SGLang returns aux hidden states "
            f"only with pp_size == 1: use tensor parallelism (--tp-size) instead"
        )


def launch(model_path: str, ids: list[int] | None, dtype: str, port: int, extra: str = "") -> str:
    """The server that returns the states of engine ``ids`` (None: the post-norm final state)."""
    common = dict(model_path=model_path, port=port, dtype=dtype, disable_radix_cache=True, chunked_prefill_size=-1)
    if ids is None:
        return shell(
            COMMAND.line(**common, enable_return_hidden_states=True), ("--enable-return-hidden-states",), extra
        )
    argv = COMMAND.line(
        **common,
        enable_return_aux_hidden_states=True,
        speculative_algorithm="EAGLE3",
        return_aux_hidden_state_layer_ids=ids,
    )
    return shell(argv, ("--enable-return-aux-hidden-states",), extra)


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
            raise EngineError(
                f"{where}: cached_tokens={cached}: the radix cache served part of the prompt and its rows "
                f"are missing; launch the server with --disable-radix-cache"
            )
        if meta.get("prompt_tokens", len(prompt)) != len(prompt):
            raise EngineError(f"{where}: prompt_tokens={meta['prompt_tokens']} for a prompt of {len(prompt)} tokens")
        hs = meta.get("hidden_states")
        if not hs:
            raise EngineError(f"{where}: no hidden_states in meta_info: launch the server as print_launch=true shows")
        rows = hs[0]  # the prefill's rows; later entries belong to generated tokens
        if len(rows) != len(prompt):
            raise EngineError(
                f"{where}: {len(rows)} rows for {len(prompt)} prompt tokens: a chunked prefill returns only "
                f"its last chunk; launch the server with --chunked-prefill-size -1"
            )
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
    project's 2-core test machine): ~370 tokens/s of an 8B-shaped capture (4 x 4096 values per
    token). One response is parsed at a time, so memory stays near ``client.concurrency`` raw
    responses; use more client processes for more throughput."""

    def __init__(self, job: CaptureJob, states: SglangStates):
        self.job, self.states = job, states
        self.url, self.final_url = job.server.url.rstrip("/"), job.server.final_url.rstrip("/")
        self.parse_gate: asyncio.Semaphore | None = None  # made inside the event loop (start)

    async def start(self, session: Any) -> None:
        self.parse_gate = asyncio.Semaphore(1)
        await wait_ready(session, [self.url, self.final_url], self.job.client.wait_for_server_s)

    async def fetch(self, session: Any, sample_id: int, prompt: list[int], attempt: int) -> tuple[dict, int | None]:
        assert self.parse_gate is not None, "start() first"
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_hidden_states": True,
        }
        aux, final = await asyncio.gather(
            post_json(session, f"{self.url}/generate", body, self.parse_gate),
            post_json(session, f"{self.final_url}/generate", body, self.parse_gate),
        )
        where = (f"{self.url} (sample {sample_id})", f"{self.final_url} (sample {sample_id})")
        async with self.parse_gate:
            states = await asyncio.to_thread(self.states, aux, final, prompt, where)
        generated = final.get("output_ids") or [None]
        return states, generated[0]


class SglangCapture(StateCapture):
    """An aux-state server and a final-state server."""

    read_from = VERSION
    memory_flag, length_flag = "--mem-fraction-static", "--context-length"
    oldest = (
        "0.5.23",
        "SGLang 0.5.17 has no --return-aux-hidden-state-layer-ids (its aux states are the model's defaults); "
        "the capture was read from 0.5.23",
    )
    final_server = True

    def servers(self, server: ServerConfig) -> dict[str, str]:
        return {"server.url": server.url, "server.final_url": server.final_url}

    def layer_ids(self, stored: list[int], model_type: str, num_hidden_layers: int, server: ServerConfig) -> list[int]:
        check_engine_args(server.engine_args)
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
        ids = self.layer_ids(stored, model_type, num_hidden_layers, server)
        extra = server.engine_args
        return [
            f"# aux-state server: ids {ids} capture HF indices {stored}",
            launch(model_path, ids, dtype, port_of(server.url, 30000), extra),
            "# final-state server (post-norm last_hidden):",
            launch(model_path, None, dtype, port_of(server.final_url, 30001), extra),
        ]

    def client(self, job: CaptureJob, tensors: dict[str, torch.Tensor]) -> SglangClient:
        return SglangClient(job, SglangStates(job.stored, job.hidden_size, job.dtype))


# ---- served regeneration and served acceptance -----------------------------------------------------


def generation_request(
    prompt: list[int], model: str | None, sampling: dict, eos_ids: list[int], seed: int | None
) -> dict:
    """A ``/generate`` body: the prompt as ids, every sampling field, stop at ``eos_ids``."""
    params = {
        "max_new_tokens": int(sampling["max_new_tokens"]),
        **sampling_fields(sampling),
        "stop_token_ids": eos_ids,
        "skip_special_tokens": False,
    }
    if seed is not None:
        params["sampling_seed"] = seed
    return {"input_ids": prompt, "sampling_params": params}


def generation_reply(resp: dict, where: str) -> tuple[list[int], str | None, Any]:
    """(generated ids, finish reason, the stop token it matched) of a ``/generate`` response."""
    ids = resp.get("output_ids")
    if ids is None:
        raise EngineError(f"{where}: the response has no output_ids (it has {sorted(resp)})")
    finish = (resp.get("meta_info") or {}).get("finish_reason") or {}
    if not isinstance(finish, dict):
        raise EngineError(f"{where}: meta_info.finish_reason is {finish!r}, expected an object with a type")
    return ids, finish.get("type"), finish.get("matched")


ENGINE = Engine(
    name="sglang",
    title="SGLang",
    version=VERSION,
    rules=RULES,
    verified=VERIFIED,
    exports=True,
    forwards=DRAFT_FORWARDS,
    skips_fc=True,
    foreign_weights="would silently drop",
    # an H200 on 2026-12-03, SGLang 0.5.17: a float16 target (SmolLM2 from GGUF) with a bfloat16
    # draft stopped at its first request (the draft's rmsnorm got float16 states: "Mismatched Tensor
    # ... expected dtype=float16"); with --dtype bfloat16 it went on to load and capture
    draft_dtype_own="SGLang 0.5.17 stops at the first request with a dtype mismatch in the draft's rmsnorm",
    command=COMMAND,
    serve=serve,
    capture=SglangCapture(),
    version_route=("/get_server_info", "version"),  # SGLang 0.5.17: srt/entrypoints/http_server.py
    generation=Generation(
        "/generate",
        False,
        generation_request,
        generation_reply,
        "SGLang: python/sglang/srt/managers/io_struct.py @001067f",
    ),
    metrics=SpecMetrics(
        "sglang",
        "SGLang 0.5.17: srt/managers/tokenizer_manager.py (_calculate_spec_decoding_metrics), "
        "srt/entrypoints/openai/serving_chat.py (return_meta_info)",
        "spec_verify_ct",
        "spec_num_proposed_drafts",
        "spec_num_correct_drafts",
        "spec_correct_drafts_histogram",
        "",
        "",
        "completion_tokens",
        shell(serve("<target>", "<draft>", 5, {})),
        per_reply=True,
        ids_route="/generate",
    ),
)
