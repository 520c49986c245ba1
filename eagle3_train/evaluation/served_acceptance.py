"""``eagle3-served-acceptance``: a serving engine's own speculative-decoding figures on a prompt file.

    vllm serve <target> --speculative-config '{"method": "eagle3", "model": "runs/x/export", "num_speculative_tokens": 5}'
    eagle3-served-acceptance server=http://127.0.0.1:8000 prompts=data_prep/prompts/heldout.jsonl out=runs/x/served

Sends every conversation of the prompt file (read as ``eagle3-eval`` reads it,
:mod:`eagle3_train.core.prompt_files`) to the engine's OpenAI-compatible ``/v1/chat/completions``,
greedily (temperature 0, ``max_new_tokens`` per turn), ``concurrency`` requests at a time; a
conversation's later user turns follow the engine's own replies to the earlier ones, as eagle3-eval
follows the target's. With ``template=client`` the prompts are rendered here instead, by the target's
own tokenizer (``tokenizer=``) exactly as eagle3-eval renders them, and sent as token ids (vLLM
``/v1/completions``, SGLang ``/generate``): for a target whose engine-side chat template differs
from its tokenizer's (vLLM renders gpt-oss chats in harmony tokens), or to compare with eval prompt
for prompt. The figures are the engine's, not ours: its Prometheus ``/metrics`` is read
before and after each category of prompts, and the counters' differences give them, so whatever the
server counted before the run does not count.

What vLLM counts (read from vLLM 0.26.0: ``vllm/v1/spec_decode/metrics.py``,
``vllm/v1/core/sched/scheduler.py``, ``vllm/v1/metrics/loggers.py``): a *draft* is one verify
step of one request that carried draft tokens (the prefill, which drafts nothing, is not one);
``accepted`` counts the draft tokens the target kept, before the reply is cut at a stop token or
``max_tokens``. Its log line's "Mean acceptance length" is ``1 + accepted / drafts`` (the target's
own token of each step counted, as eagle3-eval's τ counts it) and its "Per-position acceptance rate"
is ``accepted_per_position[i] / drafts``: the share of drafts whose first i+1 tokens were all
accepted. eagle3-eval's ``acceptance_per_position`` is conditional (accepted at position i among
the steps that reached it); the report gives both, so the two tools compare position by position.

SGLang (read from 0.5.17: ``srt/managers/tokenizer_manager.py``, ``srt/entrypoints/openai/serving_chat.py``)
exposes no Prometheus counters for these; it returns them per request instead, in the
``meta_info`` of a chat completion asked with ``return_meta_info``: ``spec_verify_ct`` (verify
steps: drafts), ``spec_num_proposed_drafts``, ``spec_num_correct_drafts`` (accepted) and
``spec_correct_drafts_histogram`` (steps that accepted exactly n drafts). This client sums them over
its own replies, so with SGLang other clients' requests never count.

The counters are the whole server's: requests of other clients during the run count too. The report
compares the server's count of finished requests and generated tokens with this run's, and warns when
they differ. Writes ``report.json`` and ``outputs.jsonl`` (per turn: tokens, finish reason, reply) to
``out``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from eagle3_train.core.cli import config_dict, entry_point
from eagle3_train.core.errors import BadInputError, ConfigError, check_numbers
from eagle3_train.core.extras import optional_import
from eagle3_train.core.fileio import atomic_write_bytes
from eagle3_train.core.log import LogConfig
from eagle3_train.core.prompt_files import Conversation, read_conversations
from eagle3_train.core.reasoning import check_template_kwargs, request_kwargs
from eagle3_train.core.reports import ServedReport, SpecFigures, write_report
from eagle3_train.engines import registry
from eagle3_train.engines.base import SpecMetrics
from eagle3_train.engines.http import EngineError, post_json, retrying, wait_ready

logger = logging.getLogger(__name__)

COMMAND = "eagle3-served-acceptance"
REPORT_NAME = "report.json"
SETTLE_READS = 10  # at most this many further reads of /metrics until two agree


# What vLLM 0.26.0 calls these figures (vllm/v1/spec_decode/metrics.py), written into the report.
DEFINITIONS = {
    "drafts": "verify steps of one request that carried draft tokens (the prefill is none)",
    "mean_acceptance_length": "1 + accepted_tokens / drafts (vLLM's 'Mean acceptance length': the bonus token counted; "
    "eagle3-eval's tau)",
    "acceptance_per_position": "drafts whose first i+1 tokens were all accepted / drafts (vLLM's 'Per-position "
    "acceptance rate')",
    "conditional_acceptance_per_position": "accepted at position i / accepted at position i-1 (drafts for i=0): the "
    "rate among steps that reached position i, as eagle3-eval's "
    "acceptance_per_position",
    "draft_acceptance_rate": "accepted_tokens / draft_tokens (vLLM's 'Avg Draft acceptance rate')",
}


@dataclass
class ServedAcceptanceConfig:
    """Options of ``eagle3-served-acceptance`` (``conf/served_acceptance.yaml``)."""

    server: str = MISSING  # the engine's base URL (http://host:port), serving the target with a draft
    prompts: str = MISSING  # JSONL (messages / MT-bench turns / HumanEval prompt / GSM8K question) or a saved dataset
    out: str = MISSING  # where report.json and outputs.jsonl go
    engine: str = "vllm"
    """whose figures are read: an engine whose metric names were read from its source (vllm | sglang)"""
    template: str = "server"  # server: the engine applies its chat template to the messages; client: `tokenizer` renders them here and token ids are sent (the prompts eagle3-eval decodes, token for token)
    tokenizer: str | None = None
    """with template=client: the target's directory (or hub id) whose chat template renders the prompts"""
    cache_dir: str | None = None  # with template=client and a GGUF tokenizer: where it is converted once
    chat_template_kwargs: Any = None
    """flags every request carries (the chat completion's chat_template_kwargs; with template=client, the render's) (null: the draft's training flags when draft= is given, else none)"""
    draft: str | None = None
    """the exported draft the engine serves: its training flags are the default chat_template_kwargs, and other flags are warned about"""
    model: str | None = None  # the served model name to ask for (null: the first one /v1/models lists)
    column: str | None = None  # the field holding each row's prompt (null: recognise the shape)
    max_new_tokens: int = 128  # generated tokens per turn (max_tokens)
    max_turns: int | None = None  # only the first N user turns of each conversation (null: all)
    limit: int | None = None  # only the first N conversations
    concurrency: int = 8  # requests in flight (the engine batches them)
    request_timeout_s: float = 600.0  # one request's time limit
    retries: int = 0
    """further attempts after a transient failure (a retried request the engine had served counts twice)"""
    backoff_s: float = 1.0  # the first retry's delay, doubled on every further one
    wait_for_server_s: float = 0.0  # how long to wait for the server's /health at start (0: it must answer now)
    settle_s: float = 0.5
    """/metrics is read again every settle_s until two reads agree (the engine counts just after answering)"""
    logging: LogConfig = field(default_factory=LogConfig)
    """the console (logging.level, logging.all_ranks, logging.progress_every_s)"""

    def __post_init__(self) -> None:
        registry.engine(self.engine, "acceptance", "engine")
        check_template_kwargs(self.chat_template_kwargs)
        if not self.server.startswith(("http://", "https://")):
            raise ConfigError(f"server must be a base URL such as http://127.0.0.1:8000, got {self.server!r}")
        if self.template not in ("server", "client"):
            raise ConfigError(
                f"template must be server (the engine's chat template) or client (rendered here with "
                f"tokenizer=), got {self.template!r}"
            )
        if (self.template == "client") != (self.tokenizer is not None):
            raise ConfigError(
                "template=client renders the prompts with tokenizer=<the target's directory>; pass both or neither"
            )
        check_numbers(
            self,
            positive=("max_new_tokens", "max_turns", "limit", "concurrency", "request_timeout_s"),
            non_negative=("retries", "backoff_s", "wait_for_server_s", "settle_s"),
        )


ConfigStore.instance().store(name="served_acceptance_schema", node=ServedAcceptanceConfig)


# ---- Prometheus text and the figures: pure functions -----------------------------------------


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a Prometheus text exposition, read by prometheus_client's parser: {sample name
    (``_total`` kept): [(labels, value)]}. Raises ValueError on text that is not the exposition."""
    parser = optional_import("prometheus_client.parser")
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def counter(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> list[tuple[dict[str, str], float]]:
    """A counter's samples (every label set): ``<name>_total``, or ``<name>`` as some exporters write it."""
    return samples.get(f"{name}_total") or samples.get(name) or []


@dataclass(frozen=True)
class SpecCounts:
    """One read of an engine's speculative-decoding counters, summed over label sets (engines,
    model names, finish reasons); ``accepted_per_position[i]`` is position i's (0-based)."""

    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_position: tuple[float, ...]
    requests: float
    generation_tokens: float

    def minus(self, before: SpecCounts, where: str) -> SpecCounts:
        """The counts between two reads; counters never go down unless the engine restarted."""
        # a position first counted between the reads has no earlier count
        now, then = _aligned(self.accepted_per_position, before.accepted_per_position)
        down = [
            f.name
            for f in fields(self)
            if f.name != "accepted_per_position" and getattr(self, f.name) < getattr(before, f.name)
        ]
        down += [f"accepted_per_position[{i}]" for i in range(len(now)) if now[i] < then[i]]
        if down:
            raise EngineError(
                f"{where}: the counters {down} went down between two reads: the engine restarted during "
                f"the run; run again"
            )
        return SpecCounts(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            tuple(a - b for a, b in zip(now, then)),
            self.requests - before.requests,
            self.generation_tokens - before.generation_tokens,
        )


def read_counts(text: str, names: SpecMetrics, where: str) -> SpecCounts:
    """The counters ``names`` lists, from one ``/metrics`` text; refuses a server that has none
    (not speculating, or another engine) and a partial set, naming ``where``."""
    try:
        samples = parse_prometheus(text)
    except ValueError as e:
        raise EngineError(f"{where} answered something that is not Prometheus text ({e}): {text[:200]!r}") from None
    found = {key: counter(samples, getattr(names, key)) for key in ("drafts", "draft_tokens", "accepted")}
    if not any(found.values()):
        raise EngineError(
            f"{where} exposes no speculative-decoding counters ({names.drafts}, ... as read from "
            f"{names.read_from}): the engine does not speculate, or is not {names.engine}; start it as "
            f"{names.enable}"
        )
    missing = [getattr(names, key) for key, v in found.items() if not v]
    if missing:
        raise EngineError(f"{where} exposes {names.drafts} but not {missing}: not the {names.read_from} metrics")
    per: dict[int, float] = {}
    for labels, value in counter(samples, names.accepted_per_position):
        try:
            position = int(labels[names.position_label])
        except (KeyError, ValueError):
            raise EngineError(
                f"{where}: a sample of {names.accepted_per_position} has no integer label "
                f"{names.position_label!r}: {labels}"
            ) from None
        per[position] = per.get(position, 0.0) + value
    total = lambda rows: sum(v for _, v in rows)  # noqa: E731
    return SpecCounts(
        total(found["drafts"]),
        total(found["draft_tokens"]),
        total(found["accepted"]),
        tuple(per.get(i, 0.0) for i in range(max(per) + 1)) if per else (),
        total(counter(samples, names.requests)),
        total(counter(samples, names.generation_tokens)),
    )


def reply_counts(meta: dict[str, Any], names: SpecMetrics, completion_tokens: int, where: str) -> SpecCounts:
    """One reply's counts from its ``meta_info`` (engines with ``per_reply``); a reply of one
    token verifies nothing and carries none of the keys."""
    if names.drafts not in meta:
        if completion_tokens > 1:
            raise EngineError(
                f"{where}: a reply of {completion_tokens} tokens carries no {names.drafts} in its meta_info "
                f"(as read from {names.read_from}): the engine does not speculate; start it as "
                f"{names.enable}"
            )
        return SpecCounts(0, 0, 0, (), 1, completion_tokens)
    hist = [float(x) for x in meta.get(names.accepted_per_position) or []]  # steps that accepted exactly n drafts
    drafts, proposed = float(meta[names.drafts]), float(meta.get(names.draft_tokens, 0))
    # SGLang cuts the histogram after the largest count seen ([15]: every step accepted none); the
    # positions past it, up to the draft length, accepted nothing
    k = max(len(hist) - 1, round(proposed / drafts) if drafts else 0)
    per = tuple(sum(hist[i + 1 :]) for i in range(k))
    return SpecCounts(drafts, proposed, float(meta[names.accepted]), per, 1, completion_tokens)


def _aligned(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Two per-position counts padded with zeros to the longer one's positions."""
    k = max(len(a), len(b))
    return tuple(a) + (0.0,) * (k - len(a)), tuple(b) + (0.0,) * (k - len(b))


def add(a: SpecCounts, b: SpecCounts) -> SpecCounts:
    """The counts of two disjoint sets of replies together."""
    pa, pb = _aligned(a.accepted_per_position, b.accepted_per_position)
    return SpecCounts(
        a.drafts + b.drafts,
        a.draft_tokens + b.draft_tokens,
        a.accepted + b.accepted,
        tuple(x + y for x, y in zip(pa, pb)),
        a.requests + b.requests,
        a.generation_tokens + b.generation_tokens,
    )


def _count(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def figures(d: SpecCounts) -> SpecFigures | None:
    """The figures of a difference of counts (see :data:`DEFINITIONS`); None when nothing was drafted."""
    if not d.drafts:
        return None
    per = list(d.accepted_per_position)
    reached = [d.drafts, *per[:-1]]  # position i is reached by the drafts accepted up to i-1
    return SpecFigures(
        drafts=_count(d.drafts),
        draft_tokens=_count(d.draft_tokens),
        accepted_tokens=_count(d.accepted),
        mean_acceptance_length=1 + d.accepted / d.drafts,
        mean_draft_length=d.draft_tokens / d.drafts,
        draft_acceptance_rate=d.accepted / d.draft_tokens if d.draft_tokens else 0.0,
        acceptance_per_position=[a / d.drafts for a in per],
        conditional_acceptance_per_position=[a / r if r else 0.0 for a, r in zip(per, reached)],
    )


# ---- the requests: one row per route --------------------------------------------------------

# every field that changes greedy tokens is sent: the server's defaults come from the target's
# generation_config.json (vLLM's --generation-config auto), which may set a repetition penalty
GREEDY = {
    "temperature": 0.0,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
}


@dataclass(frozen=True)
class Route:
    """One way to ask an engine for a greedy reply.

    Args:
        body: (model, prompt: messages or token ids, max_new_tokens) -> the JSON body.
        parse: the response -> ({text, finish_reason, prompt_tokens, completion_tokens}, meta_info or None).
        needs: what the response must hold, for the error message.
        meta_at: where the per-reply figures are, for the error message.
    """

    body: Any
    parse: Any
    needs: str
    meta_at: str


def _openai_parse(resp: dict, text_of: Any) -> tuple[dict, Any]:
    choice, usage = resp["choices"][0], resp["usage"]
    return (
        {
            "text": text_of(choice) or "",
            "finish_reason": choice.get("finish_reason"),
            "prompt_tokens": int(usage["prompt_tokens"]),
            "completion_tokens": int(usage["completion_tokens"]),
        },
        choice.get("meta_info"),
    )


def _generate_parse(resp: dict) -> tuple[dict, Any]:
    """SGLang's native ``/generate`` (read from 0.5.17: ``srt/managers/io_struct.py``): ``text`` and
    ``meta_info`` with the token counts and ``finish_reason`` ``{"type": "stop" | "length", ...}``."""
    meta = resp["meta_info"]
    reason = meta.get("finish_reason")
    return (
        {
            "text": resp["text"],
            "finish_reason": reason.get("type") if isinstance(reason, dict) else reason,
            "prompt_tokens": int(meta["prompt_tokens"]),
            "completion_tokens": int(meta["completion_tokens"]),
        },
        meta,
    )


CHAT_ROUTE = Route(
    lambda model, messages, n: {"model": model, "messages": messages, "max_tokens": n, **GREEDY},
    lambda resp: _openai_parse(resp, lambda ch: ch["message"]["content"]),
    "choices[0].message.content and usage",
    "choices[0].meta_info",
)
ID_ROUTES = {
    "/v1/completions": Route(
        lambda model, ids, n: {"model": model, "prompt": ids, "max_tokens": n, **GREEDY},
        lambda resp: _openai_parse(resp, lambda ch: ch["text"]),
        "choices[0].text and usage",
        "choices[0].meta_info",
    ),
    "/generate": Route(
        lambda model, ids, n: {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}},
        _generate_parse,
        "text and meta_info (prompt_tokens, completion_tokens)",
        "meta_info",
    ),
}


# ---- the client ------------------------------------------------------------------------------


@dataclass
class Reply:
    """The engine's answer to one user turn."""

    conversation: Conversation
    turn: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    text: str


class EngineClient:
    """One engine server as served acceptance and ``eagle3-bench`` talk to it: the model it serves,
    and its speculative-decoding counts (its ``/metrics``, or for engines that count per reply the
    sum over this client's replies) read once they settle.

    Args:
        url: the server's base URL.
        names: where the engine counts its speculative decoding.
        settle_s: ``/metrics`` is read again every this many seconds until two reads agree.
        model: the served model to ask for (None: the first one ``/v1/models`` lists).
    """

    def __init__(self, url: str, names: SpecMetrics, settle_s: float, model: str | None = None):
        self.url = url.rstrip("/")
        self.names = names
        self.settle_s = settle_s
        self.model: str | None = model
        self.warnings: list[str] = []
        self.tally = SpecCounts(0, 0, 0, (), 0, 0)  # per_reply engines: the sum over this client's replies

    async def get(self, session: Any, path: str) -> str:
        """GET ``path`` of the server as text; an unreachable server or an error status names the URL."""
        aiohttp = optional_import("aiohttp")

        url = f"{self.url}{path}"
        try:
            async with session.get(url) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise EngineError(f"{url} is unreachable ({type(e).__name__}: {e}); is the engine running?") from None
        if resp.status != 200:
            raise EngineError(f"{url} answered HTTP {resp.status}: {text[:300]}")
        return text

    async def models(self, session: Any) -> list[str]:
        """What ``/v1/models`` lists; the model asked for must be among them."""
        try:
            listed = [m["id"] for m in json.loads(await self.get(session, "/v1/models"))["data"]]
        except (ValueError, KeyError, TypeError):
            raise EngineError(f"{self.url}/v1/models did not answer an OpenAI model list") from None
        if not listed:
            raise EngineError(f"{self.url}/v1/models lists no model")
        if self.model is None:
            self.model = listed[0]
        elif self.model not in listed:
            raise ConfigError(f"model={self.model} is not served by {self.url} (/v1/models lists {listed})")
        return listed

    async def counts(self, session: Any) -> SpecCounts:
        if self.names.per_reply:
            return self.tally
        return read_counts(await self.get(session, "/metrics"), self.names, f"{self.url}/metrics")

    async def settled(self, session: Any) -> SpecCounts:
        """The counters once two reads ``settle_s`` apart agree: the engine records a step's
        counts just after it answers, so the last answer's may still be on their way."""
        if self.names.per_reply:  # counted from the replies themselves: nothing on its way
            return self.tally
        last = await self.counts(session)
        for _ in range(SETTLE_READS):
            await asyncio.sleep(self.settle_s)
            now = await self.counts(session)
            if now == last:
                return now
            last = now
        self.warnings.append(
            f"{self.url}/metrics kept changing after the last reply ({SETTLE_READS} reads "
            f"{self.settle_s} s apart): another client is using the server"
        )
        return last

    def count_reply(self, meta: Any, completion_tokens: int, where: str, meta_at: str) -> None:
        """Add one reply's figures (its ``meta_info``, found at ``meta_at``) to the tally of an
        engine that counts per reply."""
        if not isinstance(meta, dict):
            raise EngineError(
                f"{where} answered without {meta_at} although asked with return_meta_info (as "
                f"{self.names.read_from} does): not {self.names.engine}?"
            )
        self.tally = add(self.tally, reply_counts(meta, self.names, completion_tokens, where))


class ServedAcceptance(EngineClient):
    """Sends the prompt file to the engine, category by category, reading ``/metrics`` around each."""

    def __init__(self, cfg: ServedAcceptanceConfig):
        metrics = registry.engine(cfg.engine, "acceptance", "engine").metrics
        assert metrics is not None, "an engine of the acceptance role has its metric names"
        super().__init__(cfg.server, metrics, cfg.settle_s, cfg.model)
        self.cfg = cfg
        self.out = Path(cfg.out).expanduser()
        self.tokenizer = None
        if cfg.tokenizer is not None:  # template=client (the config has both or neither)
            from eagle3_train.targets import load_target

            self.tokenizer = load_target(cfg.tokenizer, cache_dir=cfg.cache_dir, load_model=False).tokenizer
        if cfg.draft is not None and not (Path(cfg.draft).expanduser() / "config.json").is_file():
            raise BadInputError(f"draft={cfg.draft} has no config.json: not an exported draft")
        self.template_kwargs, warning = request_kwargs(cfg.draft, cfg.chat_template_kwargs, "this run")
        if warning:
            self.warnings.append(warning)

    async def chat(self, session: Any, gate: asyncio.Semaphore, messages: list[dict[str, str]], what: str) -> dict:
        """One greedy reply to ``messages``: the engine's chat completion (``template=server``) or
        a completion of the prompt's token ids rendered here (``template=client``). Returns its
        text, finish reason and token counts."""
        c = self.cfg
        if self.tokenizer is not None:  # template=client
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True, **self.template_kwargs
            )["input_ids"]
            route = ID_ROUTES[self.names.ids_route]
            path, body = self.names.ids_route, route.body(self.model, list(ids), c.max_new_tokens)
        else:
            route = CHAT_ROUTE
            path, body = "/v1/chat/completions", CHAT_ROUTE.body(self.model, messages, c.max_new_tokens)
            if self.template_kwargs:  # vLLM and SGLang pass them to the template as they are
                body["chat_template_kwargs"] = self.template_kwargs
        if self.names.per_reply:
            body["return_meta_info"] = True
        url = f"{self.url}{path}"
        async with gate:
            resp = await retrying(
                lambda attempt: post_json(session, url, body), c.retries, c.backoff_s, f"{url} ({what})"
            )
        try:
            out, meta = route.parse(resp)
        except (KeyError, IndexError, TypeError, ValueError):
            raise EngineError(f"{url} ({what}) answered without {route.needs}: {json.dumps(resp)[:300]}") from None
        if self.names.per_reply:
            self.count_reply(meta, out["completion_tokens"], f"{url} ({what})", route.meta_at)
        return out

    async def converse(self, session: Any, gate: asyncio.Semaphore, conversation: Conversation) -> list[Reply]:
        """Every user turn in order, each after the engine's own replies to the earlier ones."""
        turns = (
            len(conversation.turns) if self.cfg.max_turns is None else min(len(conversation.turns), self.cfg.max_turns)
        )
        replies: list[Reply] = []
        for turn in range(turns):
            messages = conversation.messages(turn, [r.text for r in replies])
            r = await self.chat(session, gate, messages, f"{conversation.source} turn {turn + 1}")
            replies.append(
                Reply(conversation, turn, r["prompt_tokens"], r["completion_tokens"], r["finish_reason"], r["text"])
            )
        return replies

    async def measure(
        self,
    ) -> tuple[list[str], SpecCounts, SpecCounts, dict[str, tuple[list[Reply], SpecCounts]], float]:
        """Send every category's conversations (concurrently within one), reading the counters
        before the first and after each. Returns the served models, the first and the last read,
        per category its replies and the counts between its reads, and the seconds spent."""
        aiohttp = optional_import("aiohttp")

        c = self.cfg
        conversations = read_conversations(c.prompts, c.column, c.limit)
        categories: dict[str, list[Conversation]] = {}
        for conv in conversations:
            categories.setdefault(conv.category, []).append(conv)
        timeout = aiohttp.ClientTimeout(total=c.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=2 * c.concurrency)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            await wait_ready(
                session,
                [self.url],
                c.wait_for_server_s,
                command=COMMAND,
                hint=f"start it with speculative decoding first: {self.names.enable}",
            )
            models = await self.models(session)
            first = before = await self.counts(session)
            gate = asyncio.Semaphore(c.concurrency)
            start = time.perf_counter()
            per: dict[str, tuple[list[Reply], SpecCounts]] = {}
            for category, convs in categories.items():
                tasks = [asyncio.create_task(self.converse(session, gate, conv)) for conv in convs]
                try:
                    replies = await asyncio.gather(*tasks)
                except BaseException:  # one failed: the others stop too, before the session closes
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    raise
                after = await self.settled(session)
                per[category] = ([r for rs in replies for r in rs], after.minus(before, f"{self.url}/metrics"))
                before = after
            seconds = time.perf_counter() - start
        return models, first, before, per, seconds

    def report(
        self,
        models: list[str],
        first: SpecCounts,
        last: SpecCounts,
        per: dict[str, tuple[list[Reply], SpecCounts]],
        seconds: float,
    ) -> ServedReport:
        replies = [r for rs, _ in per.values() for r in rs]
        delta = last.minus(first, f"{self.url}/metrics")
        tokens = sum(r.completion_tokens for r in replies)
        overall = figures(delta)
        if overall is None:
            raise EngineError(
                f"{self.url}/metrics counted no speculative drafts over {len(replies)} requests ({tokens} "
                f"tokens generated): the engine did not speculate (stats off with --disable-log-stats, or "
                f"replies of one token); start it as {self.names.enable}"
            )
        if delta.requests != len(replies) or delta.generation_tokens != tokens:
            self.warnings.append(
                f"the server counted {_count(delta.requests)} finished requests and {_count(delta.generation_tokens)} "
                f"generated tokens during the run, this client {len(replies)} and {tokens}: other requests (another "
                f"client, a retry) are in the figures"
            )
        if delta.accepted_per_position and abs(sum(delta.accepted_per_position) - delta.accepted) > 0.5:
            self.warnings.append(
                f"the per-position counts sum to {_count(sum(delta.accepted_per_position))}, not the "
                f"{_count(delta.accepted)} accepted tokens: the position counters mean something else"
            )
        finish: dict[str, int] = {}
        for r in replies:
            finish[str(r.finish_reason)] = finish.get(str(r.finish_reason), 0) + 1
        return ServedReport(
            **asdict(overall),  # the figures over the whole run, at the report's top
            server=self.url,
            engine=self.cfg.engine,
            metrics_read_from=self.names.read_from,
            models=models,
            model=self.model,
            prompts=self.cfg.prompts,
            conversations=len({id(r.conversation) for r in replies}),
            requests=len(replies),
            prompt_tokens=sum(r.prompt_tokens for r in replies),
            completion_tokens=tokens,
            finish_reasons=finish,
            max_new_tokens=self.cfg.max_new_tokens,
            num_speculative_tokens=len(delta.accepted_per_position) or None,
            categories={
                cat: {"requests": len(rs), "completion_tokens": sum(r.completion_tokens for r in rs)}
                | (asdict(f) if (f := figures(d)) is not None else {"drafts": 0})
                for cat, (rs, d) in per.items()
            },
            server_counted={
                "requests": _count(delta.requests),
                "generation_tokens": _count(delta.generation_tokens),
            },
            counters_before={
                "drafts": _count(first.drafts),
                "draft_tokens": _count(first.draft_tokens),
                "accepted_tokens": _count(first.accepted),
            },
            definitions=DEFINITIONS,
            warnings=self.warnings,
            chat_template_kwargs=self.template_kwargs,
            seconds=seconds,
            completion_tokens_per_s=tokens / max(seconds, 1e-9),
            config=config_dict(self.cfg),
        )

    def run(self) -> ServedReport:
        models, first, last, per, seconds = asyncio.run(self.measure())
        report = self.report(models, first, last, per, seconds)
        lines = [
            json.dumps(
                {
                    "source": r.conversation.source,
                    "category": r.conversation.category,
                    "turn": r.turn + 1,
                    "prompt_tokens": r.prompt_tokens,
                    "completion_tokens": r.completion_tokens,
                    "finish_reason": r.finish_reason,
                    "reply": r.text,
                }
            )
            + "\n"
            for rs, _ in per.values()
            for r in rs
        ]
        atomic_write_bytes(self.out / "outputs.jsonl", "".join(lines).encode())
        write_report(self.out / REPORT_NAME, report)
        for warning in self.warnings:
            logger.warning(f"{COMMAND}: warning: {warning}")
        cats = {
            cat: round(v["mean_acceptance_length"], 2)
            for cat, v in report.categories.items()
            if "mean_acceptance_length" in v
        }
        logger.info(
            f"{COMMAND} ({self.cfg.engine} at {self.url}, model {self.model}): mean acceptance length "
            f"{report.mean_acceptance_length:.2f} over {report.drafts} drafts of "
            f"{report.mean_draft_length:.2f} tokens, acceptance per position "
            f"{[round(p, 3) for p in report.acceptance_per_position]} (conditional "
            f"{[round(p, 3) for p in report.conditional_acceptance_per_position]}); per category {cats}; "
            f"{report.requests} requests, {report.completion_tokens} tokens in {seconds:.1f} s -> {self.out}"
        )
        return report


main = entry_point("served_acceptance", ServedAcceptanceConfig, lambda cfg: ServedAcceptance(cfg).run())

if __name__ == "__main__":
    main()
