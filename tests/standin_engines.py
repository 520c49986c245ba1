"""Stand-ins for vLLM and SGLang servers, fed by a transformers model, for the served-dump and
served-regeneration tests.

No engine runs on the machines this project is tested on. These servers follow the API surface
that data_prep/dump/vllm.py and sglang.py document (read from vLLM 0.33.0 and SGLang 0.5.23): the requests, the
responses, vLLM's state files with their ``.lock`` and asynchronous write, SGLang's JSON rows and
``cached_tokens``. A request that asks for no states generates, as data_prep/served_regen.py
documents: token by token from the KV cache, greedy or seeded sampling, stopping as each engine
does. They also fail on demand: HTTP 503, slow answers, a file never written, wrong token ids, a
radix-cache hit, a chunked prefill, a prompt longer than the context, an engine that dies.

The vLLM stand-in also serves a target with an EAGLE-3 draft (``--speculative-config`` method
eagle3), as eagle3_train/evaluation/served_acceptance.py reads it (vLLM 0.26.0): ``/v1/chat/completions``
and a Prometheus ``/metrics`` with vLLM's speculative-decoding counters, advanced per request by a
given plan of accepted counts, or by the draft itself run as eagle3-eval runs it. For eagle3-bench
it can also answer as fast as a given simulated engine would (:class:`SimulatedSteps`: a target step,
a verify step, a draft step), and counts the requests in flight as each arrives.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle3_train.core import families


class _Standin:
    """An HTTP server on a free local port running ``handle_post(path, body)`` per request."""

    def __init__(self, model: Any, dtype: torch.dtype, port: int = 0):
        self.model = model.to(dtype).eval()
        self.dtype = dtype
        self.n = model.config.num_hidden_layers
        self.model_lock = threading.Lock()
        self.forward_lock = threading.Lock()  # guards the counters
        self.posts = 0
        self.fail_posts: set[int] = set()  # these POSTs (1-based) answer HTTP 503
        self.fail_from: int | None = None  # every POST from this one on answers 503
        self.die_at: int | None = None  # this POST finds the engine dead: dropped unanswered, the port closed
        self.slow_posts: dict[int, float] = {}  # these POSTs answer after a delay (seconds)
        self.hang_at: int | None = None  # this POST hangs the engine (sets ``hung``)
        self.hung = (
            False  # a stopped engine (SIGSTOP): nothing answers, /health included; no file is written or released
        )
        self.hung_since: float | None = None  # when hang_at hung it (monotonic)
        self.health_probes = 0  # GET /health requests
        self.closed = threading.Event()
        self.bodies: list[dict] = []  # every POST body, in arrival order
        self.prompts: list[list[int]] = []  # the token ids of every chat request, as its template rendered them
        self.in_flight = 0  # POSTs being answered now
        self.arrivals: list[int] = []  # POSTs in flight as each arrived (itself included), in arrival order
        self.version = "0.0.0+standin"  # what /version (vLLM) and /get_server_info (SGLang) say
        self.request = threading.local()  # .arrived: when the POST this thread answers arrived (monotonic)
        self.max_model_len: int | None = None  # generation: refuse prompt + max tokens beyond this (HTTP 400)
        eos = model.generation_config.eos_token_id
        self.engine_eos: set[int] = set(eos if isinstance(eos, list) else [eos])  # ids the engine stops on by itself
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, payload: Any) -> None:
                text = isinstance(payload, str)  # Prometheus text, else JSON
                data = payload.encode() if text else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                    self.wfile.write(data)

            def do_GET(self) -> None:
                if not standin.stall():
                    return
                if self.path == "/health":
                    with standin.forward_lock:
                        standin.health_probes += 1
                    self._send(200, {})
                elif self.path in ("/version", "/get_server_info"):
                    self._send(200, {"version": standin.version})
                elif self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "standin-model", "object": "model"}]})
                elif self.path == "/metrics" and (text := standin.metrics()) is not None:
                    self._send(200, text)
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                standin.request.arrived = time.monotonic()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with standin.forward_lock:
                    standin.posts += 1
                    number = standin.posts
                    standin.bodies.append(body)
                    standin.in_flight += 1
                    standin.arrivals.append(standin.in_flight)
                    if standin.hang_at is not None and number >= standin.hang_at and not standin.hung:
                        standin.hung, standin.hung_since = True, time.monotonic()
                try:
                    if not standin.stall():  # hung, then killed: never answered
                        return
                    if standin.die_at is not None and number >= standin.die_at:  # the process died: no answer, no port
                        self.close_connection = True
                        threading.Thread(target=standin.die, daemon=True).start()
                        return
                    if number in standin.slow_posts:
                        time.sleep(standin.slow_posts[number])
                    if number in standin.fail_posts or (standin.fail_from is not None and number >= standin.fail_from):
                        status, payload = 503, {"error": "service unavailable"}
                    else:
                        status, payload = standin.handle_post(self.path, body)
                finally:  # answered: no longer in flight (before the client can see it and send the next)
                    with standin.forward_lock:
                        standin.in_flight -= 1
                if standin.stall():
                    self._send(status, payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _Standin:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.die()

    def die(self) -> None:
        """Stop serving and close the port, as a killed engine does."""
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()

    def stall(self) -> bool:
        """(a request's or a file writer's thread) Wait while the engine is hung, as a stopped
        process does; False if it is gone meanwhile (nothing more is answered or written)."""
        if not self.hung:
            return True
        while self.hung and not self.closed.wait(0.05):
            pass
        return not self.closed.is_set()

    @torch.no_grad()
    def forward(self, prompt: list[int]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, int]:
        """HF hidden states [T, H] each (index N post-norm), the pre-norm final state, next token."""
        captured: dict[str, torch.Tensor] = {}
        with self.model_lock:  # the hook must see this request's forward only
            hook = self.model.model.norm.register_forward_pre_hook(lambda m, args: captured.setdefault("pre", args[0]))
            try:
                out = self.model(input_ids=torch.tensor([prompt]), output_hidden_states=True)
            finally:
                hook.remove()
        return tuple(h[0] for h in out.hidden_states), captured["pre"][0], int(out.logits[0, -1].argmax())

    @torch.no_grad()
    def generate(
        self,
        prompt: list[int],
        max_new: int,
        stop: set[int],
        temperature: float,
        top_p: float,
        seed: int | None,
        length_first: bool,
    ) -> tuple[list[int], str, int | None]:
        """Decode as an engine does: one token a step from the KV cache; temperature 0 takes the
        argmax, else a draw from softmax(logits / T) cut to the top-p mass, by a generator of
        the request's own seed. Returns (generated ids, stop token included; "stop" / "length";
        the matched stop id). ``length_first``: the length is checked before the stop token
        (SGLang), else after (vLLM)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        out: list[int] = []
        with self.model_lock:
            ids, past = torch.tensor([prompt]), None
            while True:
                step = self.model(input_ids=ids, cache=past, use_cache=True)
                past, logits = step.cache, step.logits[0, -1].float()  # [V]
                if temperature == 0:
                    token = int(logits.argmax())
                else:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    sorted_p, order = probs.sort(descending=True)
                    keep = sorted_p.cumsum(0) - sorted_p < top_p  # the smallest prefix holding top_p
                    token = int(order[keep][torch.multinomial(sorted_p[keep], 1, generator=gen)])
                out.append(token)
                if length_first and len(out) >= max_new:
                    return out, "length", None
                if token in stop:
                    return out, "stop", token
                if len(out) >= max_new:
                    return out, "length", None
                ids = torch.tensor([[token]])

    def too_long(self, prompt: list[int], max_new: int) -> bool:
        return self.max_model_len is not None and len(prompt) + max_new > self.max_model_len

    def handle_post(self, path: str, body: dict) -> tuple[int, Any]:
        raise NotImplementedError

    def metrics(self) -> str | None:
        """The Prometheus text of ``/metrics`` (None: no such route)."""
        return None


# vLLM's target classes with its EAGLE-3 interface (by model_type), from the family table; it refuses
# others at load, and its DeepSeek code (DeepSeek-V2/V3, Kimi-K2) fails on layer id 0.
VLLM_EAGLE3_MODEL_TYPES = families.model_types(vllm_eagle3=True)
VLLM_NO_ID_0 = families.model_types(vllm_eagle3=True, vllm_deepseek_code=True)


@dataclass(frozen=True)
class SimulatedSteps:
    """How long an engine would take, in seconds: a reply arrives no sooner than its tokens would
    take to decode, each request as if alone on the engine (so requests in flight overlap, as in
    an ideal batch). Without a draft a reply of n tokens takes ``n * target_step_s``; with one, its
    first token (the prefill's) ``target_step_s`` and each verify step ``verify_s + k * draft_step_s``."""

    target_step_s: float  # one target step, one new token
    verify_s: float  # one target forward over the k + 1 tokens of a verify step
    draft_step_s: float  # one draft step

    def reply_s(self, tokens: int, drafts: int, k: int) -> float:
        if not k:
            return tokens * self.target_step_s
        return self.target_step_s + drafts * (self.verify_s + k * self.draft_step_s)


class EngineRefused(RuntimeError):
    """The engine would not start with this model and configuration."""


class StandinVllm(_Standin):
    """vLLM with ``extract_hidden_states`` and ``ExampleHiddenStatesConnector``: id v is HF index
    v, v = N the pre-norm final state; the file is written after the response, under a lock.
    Started for a model without vLLM's EAGLE-3 interface, or a DeepSeek model with id 0, it refuses
    (:class:`EngineRefused`), as vLLM fails at load.

    With ``speculative`` (the ``--speculative-config`` of method eagle3) and a ``tokenizer``, it
    serves ``/v1/chat/completions`` greedily and counts as vLLM 0.26.0's ``/metrics`` does
    (vllm/v1/spec_decode/metrics.py): each request's drafts are ``accepted_plan`` (the accepted
    count of each of its drafts, whatever it generates, or a function of its messages that gives
    them) or, without a plan, the verify steps of the draft in ``speculative["model"]`` run by
    eagle3-eval's decoder on the layers vLLM's rule reads from its config. Requests alternate
    between ``engines`` label sets, as data-parallel engines do; ``other_traffic`` counts one more
    request of the plan per request (another client).

    For eagle3-bench: ``accept_each`` is a plan that follows the reply (each draft accepts that many
    tokens, the last one what is left of the reply, so ``1 + accepted / drafts`` is the reply's
    tokens after the first per draft, as in vLLM when a reply is not cut mid-draft); ``scripted``
    gives the reply's tokens (prompt ids, max tokens -> ids) without running the model, at any
    temperature; ``steps`` makes each reply arrive as late as that simulated engine would answer it;
    ``generated`` counts every token replied to a chat or completion of generated text."""

    def __init__(
        self,
        model: Any,
        layer_ids: list[int] | None = None,
        storage: Path | None = None,
        dtype: torch.dtype = torch.float32,
        allow_custom_save_path: bool = True,
        write_delay_s: float = 0.02,
        port: int = 0,
        tokenizer: Any = None,
        speculative: dict | None = None,
        accepted_plan: list[int] | Callable[[list[dict]], list[int]] | None = None,
        engines: int = 1,
        reply_meta: bool = False,
        accept_each: int | None = None,
        scripted: Callable[[list[int], int], list[int]] | None = None,
        steps: SimulatedSteps | None = None,
    ):
        if (
            speculative is not None
            and speculative.get("method") == "eagle3"
            and model.config.model_type not in VLLM_EAGLE3_MODEL_TYPES
        ):
            raise EngineRefused(f"Model does not support EAGLE3 interface ({model.config.model_type})")
        if layer_ids is not None:
            model_type = model.config.model_type
            if model_type not in VLLM_EAGLE3_MODEL_TYPES:
                raise EngineRefused(f"Model does not support EAGLE3 interface ({model_type})")
            if model_type in VLLM_NO_ID_0 and 0 in layer_ids:
                raise EngineRefused("the DeepSeek model's residual is None at layer 0")
        super().__init__(model, dtype, port)
        # without layer_ids and storage: a plain ``vllm serve`` (generation only)
        self.layer_ids, self.storage = sorted(layer_ids or []), Path(storage) if storage else None
        self.allow_custom_save_path, self.write_delay_s = allow_custom_save_path, write_delay_s
        self.unwritten_posts: set[int] = set()  # these requests' files are never written
        self.held_posts: set[int] = set()  # these requests' files are never written nor their locks released
        self.shift_tokens = False  # report token ids one off (another tokenizer)
        self.requests = 0
        self.tokenizer, self.speculative, self.accepted_plan = tokenizer, speculative, accepted_plan
        self.other_traffic = False
        self.k = int(speculative["num_speculative_tokens"]) if speculative else 0
        # reply_meta: count as SGLang 0.5.17 does instead, in each chat reply's meta_info (asked with
        # return_meta_info; srt/managers/tokenizer_manager.py), with SGLang's rule for the layers
        self.reply_meta, self.hide_spec = reply_meta, False
        self.accept_each, self.scripted, self.steps = accept_each, scripted, steps
        self.generated = 0
        self.decoder = None
        if speculative and accepted_plan is None and accept_each is None:
            self.decoder = self._draft_decoder(speculative["model"], "sglang" if reply_meta else "vllm")
        # the counters, per engine label: drafts, draft tokens, accepted, accepted per position,
        # finished requests per reason, generated tokens
        self.counts = [
            {
                "drafts": 0,
                "draft_tokens": 0,
                "accepted": 0,
                "per_pos": [0] * self.k,
                "finished": {"stop": 0, "length": 0, "abort": 0},
                "generation_tokens": 0,
            }
            for _ in range(engines)
        ]
        self.chats = 0

    def _draft_decoder(self, draft_dir: str, engine: str) -> Any:
        """eagle3-eval's chain decoder over this model and the exported draft, fed the layers that
        ``engine``'s rule reads from the draft's config (vLLM: top-level ids first)."""
        from eagle3_train.engines.rules import resolve
        from eagle3_train.evaluation.decoding import SpecDecoder
        from eagle3_train.serving.loading import load_draft
        from eagle3_train.targets import Target, eos_ids, target_identity

        identity = target_identity("standin", self.model.config, self.tokenizer)
        draft, config = load_draft(  # the forward ``engine`` computes for it (its flags, what it leaves out)
            Path(draft_dir), Target(self.model, self.tokenizer, self.model.config, identity, None), engine
        )
        rule = resolve(config, engine, self.model.config.model_type, self.n)[0]
        layers = rule.fed  # in vLLM's order, N for the last layer's pre-norm output (an id N, or id 0)
        return SpecDecoder(self.model, draft.to(self.dtype), layers, self.k, eos_ids(self.model, self.tokenizer))

    def count_request(self, accepted: list[int], tokens: int, reason: str) -> None:
        """Advance the counters by one finished request: its drafts' accepted counts (each a draft
        of ``k`` tokens), its generated tokens, its finish reason."""
        with self.forward_lock:
            c = self.counts[self.chats % len(self.counts)]
            self.chats += 1
            for a in accepted:
                assert 0 <= a <= self.k, (a, self.k)
                c["drafts"] += 1
                c["draft_tokens"] += self.k
                c["accepted"] += a
                for i in range(a):
                    c["per_pos"][i] += 1
            c["finished"][reason] += 1
            c["generation_tokens"] += tokens

    def metrics(self) -> str | None:
        """vLLM's counters as prometheus_client writes them (``_total`` and ``_created`` samples),
        the speculative ones only when it speculates, and a gauge beside them."""
        lines = []

        def counter(name: str, doc: str, rows: list[tuple[dict[str, str], float]]) -> None:
            lines.extend([f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter"])
            for labels, value in rows:
                text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                lines.append(f"{name}_total{{{text}}} {float(value)}")
                lines.append(f"{name}_created{{{text}}} 1.7646e+09")

        with self.forward_lock:
            engines = [{"engine": str(i), "model_name": "standin-model"} for i in range(len(self.counts))]
            lines += [
                "# HELP vllm:num_requests_running Number of requests in model execution batches.",
                "# TYPE vllm:num_requests_running gauge",
            ]
            lines += [
                f'vllm:num_requests_running{{engine="{e["engine"]}",model_name="standin-model"}} 0.0' for e in engines
            ]
            if self.speculative and not self.reply_meta:
                for key, name, doc in (
                    ("drafts", "num_drafts", "Number of spec decoding drafts."),
                    ("draft_tokens", "num_draft_tokens", "Number of draft tokens."),
                    ("accepted", "num_accepted_tokens", "Number of accepted tokens."),
                ):
                    counter(f"vllm:spec_decode_{name}", doc, [(e, c[key]) for e, c in zip(engines, self.counts)])
                counter(
                    "vllm:spec_decode_num_accepted_tokens_per_pos",
                    "Accepted tokens per draft position.",
                    [
                        (e | {"position": str(i)}, c["per_pos"][i])
                        for e, c in zip(engines, self.counts)
                        for i in range(self.k)
                    ],
                )
            counter(
                "vllm:request_success",
                "Count of successfully processed requests.",
                [
                    (e | {"finished_reason": r}, n)
                    for e, c in zip(engines, self.counts)
                    for r, n in c["finished"].items()
                ],
            )
            counter(
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                [(e, c["generation_tokens"]) for e, c in zip(engines, self.counts)],
            )
        return "\n".join(lines) + "\n"

    def chat(self, body: dict) -> tuple[int, Any]:
        """``/v1/chat/completions``, greedy: the chat template over ``messages``, then the draft
        chain (or plain greedy decoding with a plan); stops at the model's eos ids or ``max_tokens``."""
        if self.tokenizer is None:
            return 400, {"error": {"message": "this stand-in was started without a tokenizer", "code": 400}}
        if body.get("model") != "standin-model":
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist.", "code": 404}}
        temperature = body.get("temperature", 1.0)
        if temperature != 0 and self.scripted is None:
            return 400, {"error": {"message": "the stand-in decodes greedily only (temperature 0)", "code": 400}}
        prompt = self.tokenizer.apply_chat_template(  # the request's flags reach the template, as vLLM passes them
            body["messages"],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **(body.get("chat_template_kwargs") or {}),
        )["input_ids"]
        self.prompts.append(list(prompt))
        max_new = body.get("max_tokens", 16)
        if self.too_long(prompt, max_new):
            return 400, {
                "error": {
                    "message": f"This model's maximum context length is {self.max_model_len} tokens.",
                    "code": 400,
                }
            }
        ids, accepted, reason = self.speculate(prompt, max_new, body["messages"])
        if self.steps is not None:  # answer when the simulated engine would have
            reply_s = self.steps.reply_s(len(ids), len(accepted), self.k)
            time.sleep(max(0.0, self.request.arrived + reply_s - time.monotonic()))
        text = self.tokenizer.decode(ids[:-1] if reason == "stop" else ids, skip_special_tokens=True)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": reason,
            "stop_reason": None,
        }
        if self.reply_meta and body.get("return_meta_info"):
            choice["meta_info"] = self.spec_meta(ids, accepted)
        return 200, {
            "id": f"chatcmpl-{self.chats}",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
        }

    def speculate(
        self, prompt: list[int], max_new: int, messages: list[dict] | None
    ) -> tuple[list[int], list[int], str]:
        """One greedy reply with the draft chain (or plain greedy decoding with a plan), counted:
        its tokens, each draft's accepted count, its finish reason."""
        if self.decoder is not None:
            with self.model_lock:
                (out,) = self.decoder.speculative([prompt], max_new, 1)
            ids, accepted = out.tokens, out.accepted
        else:
            if self.scripted is not None:
                ids = self.scripted(prompt, max_new)[:max_new]
            else:
                ids, _, _ = self.generate(prompt, max_new, self.engine_eos, 0.0, 1.0, None, length_first=False)
            if self.accept_each is not None and self.speculative:
                # the first token is the prefill's; drafts of accept_each + 1 tokens follow, the last cut
                a, rest = self.accept_each, len(ids) - 1
                drafts = -(-rest // (a + 1)) if rest > 0 else 0
                accepted = [a] * max(drafts - 1, 0) + ([rest - (drafts - 1) * (a + 1) - 1] if drafts else [])
            else:
                plan = self.accepted_plan
                accepted = list(plan(messages) if callable(plan) else plan or [])
        reason = "stop" if ids and ids[-1] in self.engine_eos else "length"
        with self.forward_lock:
            self.generated += len(ids)
        self.count_request(accepted, len(ids), reason)
        if self.other_traffic:
            self.count_request(accepted, len(ids), reason)
        return ids, accepted, reason

    def spec_meta(self, ids: list[int], accepted: list[int]) -> dict:
        """SGLang 0.5.17's meta_info of one reply (srt/managers/tokenizer_manager.py)."""
        meta = {"id": f"chatcmpl-{self.chats}", "completion_tokens": len(ids)}
        if accepted and not self.hide_spec:  # SGLang adds these only for a request that verified drafts
            meta |= {
                "spec_verify_ct": len(accepted),
                "spec_num_correct_drafts": sum(accepted),
                "spec_num_proposed_drafts": self.k * len(accepted),
                "spec_accept_length": len(ids) / len(accepted),
                "spec_correct_drafts_histogram": [accepted.count(n) for n in range(self.k + 1)],
            }
        return meta

    def generate_route(self, body: dict) -> tuple[int, Any]:
        """SGLang's native ``/generate`` with ``input_ids``, speculating (as SGLang: ``reply_meta``)."""
        prompt, params = body["input_ids"], body.get("sampling_params") or {}
        if params.get("temperature", 1.0) != 0:
            return 400, {"error": {"message": "the stand-in decodes greedily only (temperature 0)", "code": 400}}
        ids, accepted, reason = self.speculate(prompt, params.get("max_new_tokens", 128), None)
        text = self.tokenizer.decode(ids[:-1] if reason == "stop" else ids, skip_special_tokens=True)
        meta = self.spec_meta(ids, accepted) | {"prompt_tokens": len(prompt), "finish_reason": {"type": reason}}
        return 200, {"text": text, "output_ids": ids, "meta_info": meta}

    def handle_post(self, path: str, body: dict) -> tuple[int, Any]:
        if path == "/v1/chat/completions":
            return self.chat(body)
        if path == "/generate" and self.reply_meta and self.speculative:
            return self.generate_route(body)
        if path != "/v1/completions":
            return 404, {"error": f"no route {path}"}
        prompt = body["prompt"]
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return 400, {"error": "prompt must be token ids here"}
        if "kv_transfer_params" not in body:
            return self.complete(prompt, body)
        if self.storage is None:
            return 400, {"error": "this server was launched without the hidden-states connector"}
        hidden, pre_norm, next_token = self.forward(prompt)
        # vLLM's id 0 keeps the embedding tensor, which its in-place residual update turns into the
        # last layer's pre-norm output by the time the states are read (measured, vLLM 0.26.0)
        layers = [pre_norm if v in (0, self.n) else hidden[v] for v in self.layer_ids]
        states = torch.stack(layers, dim=1).to(self.dtype).contiguous()  # [T, K, H]
        with self.forward_lock:
            self.requests += 1
            number = self.requests
        custom = (body.get("kv_transfer_params") or {}).get("hidden_states_path")
        filename = (
            custom if custom and self.allow_custom_save_path else str(self.storage / f"cmpl-{number}.safetensors")
        )
        os.makedirs(os.path.dirname(filename), exist_ok=True)
        lock = os.open(filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(lock, fcntl.LOCK_EX)  # taken before the response, released once written
        token_ids = torch.tensor(prompt, dtype=torch.int64) + (1 if self.shift_tokens else 0)
        write, held = number not in self.unwritten_posts, number in self.held_posts

        def write_later() -> None:
            try:
                time.sleep(self.write_delay_s)
                if held:  # a writer stuck until the engine stops
                    self.closed.wait()
                elif write and self.stall():
                    save_file({"hidden_states": states, "token_ids": token_ids}, filename)
            finally:
                os.close(lock)

        threading.Thread(target=write_later, daemon=True).start()
        return 200, {
            "id": f"cmpl-{number}",
            "object": "text_completion",
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "text": "?",
                    "token_ids": [next_token],
                    "prompt_token_ids": prompt,
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1},
            "kv_transfer_params": {"hidden_states_path": filename},
        }

    def complete(self, prompt: list[int], body: dict) -> tuple[int, Any]:
        """A plain completion: stops at ``stop_token_ids`` and, unless ``ignore_eos``, the
        model's own eos ids; ``token_ids`` hold the stop token, ``stop_reason`` names it."""
        if body.get("model") != "standin-model":
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist.", "code": 404}}
        max_new = body.get("max_tokens", 16)
        if self.too_long(prompt, max_new):
            return 400, {
                "error": {
                    "message": f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {len(prompt) + max_new} tokens.",
                    "code": 400,
                }
            }
        if (
            self.speculative and self.speculative.get("method") == "eagle3" and not self.reply_meta
        ):  # with the draft: speculates as chat does
            if body.get("temperature", 1.0) != 0:
                return 400, {"error": {"message": "the stand-in decodes greedily only (temperature 0)", "code": 400}}
            ids, _, reason = self.speculate(prompt, max_new, None)
            text = self.tokenizer.decode(ids[:-1] if reason == "stop" else ids, skip_special_tokens=True)
            return 200, {
                "id": f"cmpl-{self.chats}",
                "object": "text_completion",
                "model": body["model"],
                "choices": [{"index": 0, "text": text, "finish_reason": reason, "stop_reason": None}],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(ids),
                    "total_tokens": len(prompt) + len(ids),
                },
            }
        stop = set(body.get("stop_token_ids") or []) | (set() if body.get("ignore_eos") else self.engine_eos)
        temperature = body.get("temperature", 1.0)
        ids, finish, matched = self.generate(
            prompt, max_new, stop, temperature, body.get("top_p", 1.0), body.get("seed"), length_first=False
        )
        with self.forward_lock:
            self.requests += 1
            number = self.requests
        choice = {
            "index": 0,
            "text": "?",
            "finish_reason": finish,
            "stop_reason": matched,
            "token_ids": ids if body.get("return_token_ids") else None,
            "prompt_token_ids": prompt if body.get("return_token_ids") else None,
        }
        return 200, {
            "id": f"cmpl-{number}",
            "object": "text_completion",
            "model": body["model"],
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
        }


class StandinSglang(_Standin):
    """SGLang ``/generate`` with ``return_hidden_states``: with ``layer_ids`` (the aux server),
    rows [T][K*H] of HF indices v+1; without (the final-state server), the post-norm state [T][H].
    Aux-state return with more than one pipeline stage is refused (:class:`EngineRefused`), as
    SGLang's server-argument check does."""

    def __init__(
        self,
        model: Any,
        layer_ids: list[int] | None = None,
        dtype: torch.dtype = torch.float32,
        port: int = 0,
        pp_size: int = 1,
    ):
        if layer_ids is not None and pp_size != 1:
            raise EngineRefused("enable_return_aux_hidden_states requires pp_size == 1")
        super().__init__(model, dtype, port)
        self.layer_ids = layer_ids
        self.cached_tokens = 0  # pretend a radix-cache hit of this many tokens (their rows go missing)
        self.chunk = 0  # pretend a chunked prefill: only the last ``chunk`` rows come back

    def handle_post(self, path: str, body: dict) -> tuple[int, Any]:
        if path != "/generate":
            return 404, {"error": f"no route {path}"}
        prompt = body["input_ids"]
        if not body.get("return_hidden_states"):
            return self.generate_ids(prompt, body.get("sampling_params") or {})
        hidden, _, next_token = self.forward(prompt)
        if self.layer_ids is not None:
            rows = torch.cat([hidden[v + 1] for v in self.layer_ids], dim=-1)  # [T, K*H]
        else:
            rows = hidden[self.n]  # post-norm
        rows = rows.to(self.dtype)[self.cached_tokens :]
        if self.chunk:
            rows = rows[-self.chunk :]
        meta = {
            "id": "req",
            "prompt_tokens": len(prompt),
            "completion_tokens": 1,
            "cached_tokens": self.cached_tokens,
            "finish_reason": {"type": "length", "length": 1},
        }
        if body.get("return_hidden_states"):
            meta["hidden_states"] = [rows.float().tolist()]
        return 200, {"text": "?", "output_ids": [next_token], "meta_info": meta}

    def generate_ids(self, prompt: list[int], params: dict) -> tuple[int, Any]:
        """``/generate`` without states: stops at ``stop_token_ids`` and the model's eos ids
        (``ignore_eos`` disables both, as in SGLang); the length is checked first; ``output_ids``
        hold the matched stop token."""
        max_new = params.get("max_new_tokens", 128)
        if self.too_long(prompt, max_new):
            return 400, {
                "error": {
                    "message": f"Requested token count exceeds the model's maximum context length of "
                    f"{self.max_model_len} tokens.",
                    "code": 400,
                }
            }
        stop = set() if params.get("ignore_eos") else set(params.get("stop_token_ids") or []) | self.engine_eos
        temperature = params.get("temperature", 1.0)
        ids, finish, matched = self.generate(
            prompt, max_new, stop, temperature, params.get("top_p", 1.0), params.get("sampling_seed"), length_first=True
        )
        reason = {"type": "stop", "matched": matched} if finish == "stop" else {"type": "length", "length": max_new}
        meta = {
            "id": "req",
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "finish_reason": reason,
        }
        return 200, {"text": "?", "output_ids": ids, "meta_info": meta}


def main(argv: list[str]) -> None:
    """Serve from an engine's own command line, so launch scripts can be tested end to end:

        standin_engines.py vllm serve MODEL --port P --dtype D --no-enable-prefix-caching
            --speculative-config JSON --kv-transfer-config JSON       (extract_hidden_states)
        standin_engines.py vllm serve MODEL --port P --dtype D
            --speculative-config '{"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K}'
        standin_engines.py vllm serve MODEL --port P                    (no draft: plain generation)
        standin_engines.py sglang --model-path MODEL --port P --dtype D --disable-radix-cache
            --chunked-prefill-size -1 (--enable-return-aux-hidden-states --speculative-algorithm EAGLE3
            --return-aux-hidden-state-layer-ids ID... | --enable-return-hidden-states)

    Flags the engines need for a correct dump are required here too; --enforce-eager,
    --gpu-memory-utilization and --max-model-len are taken (the last one enforced). Stand-in only:
    ``--standin-accept-each A`` counts drafts of A accepted tokens (``accept_each``) instead of running
    the draft, ``--standin-steps T,V,D`` answers as :class:`SimulatedSteps` (T, V, D) would."""
    import argparse

    from transformers import AutoModelForCausalLM

    engine, rest = argv[0], argv[1:]
    p = argparse.ArgumentParser(prog=f"standin {engine}")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--standin-accept-each", type=int)
    p.add_argument("--standin-steps", type=lambda s: SimulatedSteps(*map(float, s.split(","))))
    if engine == "vllm":
        p.add_argument("--dtype", default="float32")  # vLLM's "auto": the stand-in's fp32
        p.add_argument("serve")
        p.add_argument("model")
        p.add_argument("--no-enable-prefix-caching", action="store_true")
        p.add_argument("--speculative-config", type=json.loads)
        p.add_argument("--kv-transfer-config", type=json.loads)
        p.add_argument("--enforce-eager", action="store_true")
        p.add_argument("--gpu-memory-utilization", type=float)
        p.add_argument("--max-model-len", type=int)
        p.add_argument("--kv-cache-memory-bytes", type=int)
        p.add_argument("--chat-template")  # a .jinja file: the template chat requests are rendered with
    else:
        p.add_argument("--dtype", required=True)
        p.add_argument("--model-path", dest="model", required=True)
        p.add_argument("--disable-radix-cache", action="store_true", required=True)
        p.add_argument("--chunked-prefill-size", type=int, choices=[-1], required=True)
        p.add_argument("--enable-return-aux-hidden-states", action="store_true")
        p.add_argument("--speculative-algorithm")
        p.add_argument("--return-aux-hidden-state-layer-ids", type=int, nargs="+")
        p.add_argument("--enable-return-hidden-states", action="store_true")
        p.add_argument("--pp-size", "--pipeline-parallel-size", dest="pp_size", type=int, default=1)
        p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)  # one process here
    args = p.parse_args(rest)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    if engine == "vllm" and (args.speculative_config is None or args.speculative_config["method"] == "eagle3"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        if args.chat_template:
            tokenizer.chat_template = Path(args.chat_template).read_text()
        server: _Standin = StandinVllm(
            model,
            dtype=dtype,
            port=args.port,
            speculative=args.speculative_config,
            tokenizer=tokenizer,
            accept_each=args.standin_accept_each,
            steps=args.standin_steps,
        )
        server.max_model_len = args.max_model_len
    elif engine == "vllm":
        assert args.speculative_config["method"] == "extract_hidden_states"
        assert args.no_enable_prefix_caching and args.kv_transfer_config, "the dump needs both"
        ids = args.speculative_config["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        extra = args.kv_transfer_config["kv_connector_extra_config"]
        server = StandinVllm(
            model,
            ids,
            Path(extra["shared_storage_path"]),
            dtype,
            allow_custom_save_path=extra.get("allow_custom_save_path", False),
            port=args.port,
        )
    elif args.enable_return_aux_hidden_states:
        assert args.speculative_algorithm == "EAGLE3" and args.return_aux_hidden_state_layer_ids
        server = StandinSglang(
            model, args.return_aux_hidden_state_layer_ids, dtype, port=args.port, pp_size=args.pp_size
        )
    else:
        assert args.enable_return_hidden_states
        server = StandinSglang(model, None, dtype, port=args.port)
    server.server.serve_forever()


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
