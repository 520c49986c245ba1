"""``eagle3-bench``: the speed-up a draft buys in a serving engine, the figure users buy it for.

    eagle3-bench target=HuggingFaceTB/SmolLM2-135M-Instruct draft=runs/x/export out=runs/x/bench
    eagle3-bench baseline_url=http://127.0.0.1:8000 spec_url=http://127.0.0.1:8001 out=runs/x/bench

The engine (vLLM, or SGLang with ``engine=sglang``) serves the target twice: alone, and with the
exported draft. This command starts each in turn on ``port`` (``target=``, ``draft=``; its log goes
to ``out``) and stops it after its measurements, or uses servers already running (``baseline_url=``,
``spec_url=``). Each gets the same prompts (a prompt file read as eagle3-eval reads it, the first
``max_turns`` user turns of each conversation; the shipped held-out prompts by default) at each
concurrency of ``concurrency`` (that many requests in flight, a new one sent as one returns) and
each temperature of ``temperatures``, each level after ``max(warmup_requests, concurrency)``
conversations (none with ``warmup_requests=0``) at its own concurrency that are not counted (an engine compiles or tunes kernels per batch size: a
warm-up at another concurrency leaves the level's first request to pay for it). A level sends ``max(min_requests, requests_per_slot * concurrency)`` conversations, the prompt file
repeated as needed. Per level and engine it measures output tokens/s (the replies' tokens, as the
engine's ``usage`` counts them, over the level's wall time) and each request's time per output
token (its latency over its tokens: the prefill is included, there being no streaming); of the
speculating engine, its acceptance length over the level, read as ``eagle3-served-acceptance``
reads it (vLLM's ``/metrics`` counters before and after, SGLang's per-reply ``meta_info``); and the
speed-up, the speculating engine's tokens/s over the baseline's, and beside it the ratio of the two
engines' median times per output token (``speedup_by_tpot``), which one slow request cannot move.
A request slower than ``STALL_FACTOR`` times, and ``STALL_MIN_S`` seconds beyond, what its level's
medians say it should take (a compile, a stall or a retry inside the engine) is named in the report's
``warnings``, one warning a level with the worst such request, with both figures: the throughput
counts the whole stall.

Writes ``results.json`` (machine, command, date, engine version, settings, one row per temperature
and concurrency), ``requests.jsonl`` (each request: engine, level, tokens, latency) and
``speedup.png`` (speed-up against concurrency; the ``plots`` extra) to ``out``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import platform
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from eagle3_train.core.cli import config_dict, entry_point
from eagle3_train.core.errors import ConfigError, check_numbers
from eagle3_train.core.extras import optional_import
from eagle3_train.core.fileio import atomic_write_bytes
from eagle3_train.core.log import LogConfig
from eagle3_train.core.prompt_files import Conversation, read_conversations, shipped_prompts
from eagle3_train.core.reasoning import check_template_kwargs, request_kwargs
from eagle3_train.core.reports import BenchReport, BenchRow, write_report
from eagle3_train.engines import registry
from eagle3_train.engines.base import Engine, SpecMetrics, named_dtype
from eagle3_train.engines.http import EngineError, post_json, retrying, wait_ready
from eagle3_train.engines.launcher import stop_group
from eagle3_train.evaluation.plots import plot_speedup
from eagle3_train.evaluation.served_acceptance import (
    CHAT_ROUTE,
    EngineClient,
    SpecCounts,
    counter,
    figures,
    parse_prometheus,
)

logger = logging.getLogger(__name__)

COMMAND = "eagle3-bench"
RESULTS_NAME = "results.json"
SIDES = ("baseline", "spec")  # the target served alone, and with the draft


# ---- the config ---------------------------------------------------------------------------------


def config_dtype(path: str | None) -> str | None:
    """The dtype a local model directory's ``config.json`` names (None: no such directory, a hub
    name, or no dtype named)."""
    file = None if path is None else Path(path).expanduser() / "config.json"
    if file is None or not file.is_file():
        return None
    try:
        return named_dtype(json.loads(file.read_text()))
    except (OSError, ValueError):
        return None


@dataclass
class BenchConfig:
    """Options of ``eagle3-bench`` (``conf/bench.yaml``)."""

    out: str = MISSING  # where results.json, requests.jsonl, speedup.png and the started engines' logs go
    engine: str = "vllm"  # the serving engine (vllm | sglang): how it is started, where it counts its drafts
    target: str | None = None  # the target (directory or hub id) the started engines serve
    draft: str | None = None  # the exported draft directory the speculating engine serves, when started here
    num_speculative_tokens: int = 5  # draft tokens per step of the started speculating engine (a chain)
    baseline_url: str | None = None  # an engine already serving the target alone (null: start one)
    spec_url: str | None = None  # an engine already serving the target with the draft (null: start one)
    port: int = 8000  # where a started engine listens (one runs at a time)
    engine_args: str = ""  # more flags for the started engines, as shell words ("--enforce-eager --max-model-len 4096"; a --dtype here or in spec_args keeps the bench from naming one)
    spec_args: str = ""  # more flags for the started speculating engine only, after engine_args (SGLang trees: "--speculative-eagle-topk 4 --speculative-num-draft-tokens 16")
    startup_timeout_s: float = 1800.0  # how long an engine started here may take to answer /health
    wait_for_server_s: float = 0.0  # how long to wait for a given server's /health (0: it must answer now)
    prompts: str | None = None
    """JSONL (messages / MT-bench turns / HumanEval prompt / ...) or a saved dataset (null: the shipped held-out prompts)"""
    column: str | None = None  # the field holding each row's prompt (null: recognise the shape)
    max_turns: int = 1  # user turns sent per conversation (a later turn follows the engine's own reply)
    chat_template_kwargs: Any = None
    """flags every request carries to the engine's chat template (null: those the draft's data was prepared with, read from draft=; none without it); others are warned about"""
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 64])  # requests in flight, one level each
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    """sampling temperatures, each at every concurrency (0: greedy)"""
    requests_per_slot: int = 4  # a level sends max(min_requests, requests_per_slot x concurrency) conversations
    min_requests: int = 16  # the fewest conversations a level sends
    max_new_tokens: int = 256  # generated tokens per request at most (max_tokens)
    warmup_requests: int = (
        4  # before each level, max(this, its concurrency) conversations at its concurrency, not counted (0: none)
    )
    model: str | None = None  # the served model name to ask for (null: the first one /v1/models lists)
    request_timeout_s: float = 600.0  # one request's time limit
    retries: int = 0  # further attempts after a transient failure (a retried request counts in the level's time)
    backoff_s: float = 1.0  # the first retry's delay, doubled on every further one
    settle_s: float = 0.5
    """/metrics is read again every settle_s until two reads agree (the engine counts just after answering)"""
    plot: bool = True  # draw speedup.png (needs the plots extra, matplotlib)
    logging: LogConfig = field(default_factory=LogConfig)
    """the console (logging.level, logging.all_ranks, logging.progress_every_s)"""

    def __post_init__(self) -> None:
        registry.engine(self.engine, "bench", "engine")
        check_template_kwargs(self.chat_template_kwargs)
        for name in ("baseline_url", "spec_url"):
            url = getattr(self, name)
            if url is not None and not url.startswith(("http://", "https://")):
                raise ConfigError(f"{name} must be a base URL such as http://127.0.0.1:8000, got {url!r}")
        started = [name for name in ("baseline_url", "spec_url") if getattr(self, name) is None]
        if started and self.target is None:
            raise ConfigError(
                f"{' and '.join(started)} not given: the engine is started here on target=<the target "
                f"directory or hub id>; give target= or the running servers' URLs"
            )
        if self.spec_url is None and self.draft is None:
            raise ConfigError(
                "spec_url not given: the speculating engine is started here with draft=<the exported draft "
                "directory>; give draft= or spec_url="
            )
        if self.spec_args and self.spec_url is not None:
            raise ConfigError("spec_args are flags for the speculating engine started here: not with spec_url=")
        if not self.concurrency or len(set(self.concurrency)) != len(self.concurrency):
            raise ConfigError(f"concurrency must list distinct levels, got {list(self.concurrency)}")
        if any(c < 1 for c in self.concurrency):
            raise ConfigError(f"concurrency levels must be >= 1, got {list(self.concurrency)}")
        if not self.temperatures or any(not t >= 0 for t in self.temperatures):
            raise ConfigError(f"temperatures must list values >= 0 (0: greedy), got {list(self.temperatures)}")
        check_numbers(
            self,
            positive=(
                "num_speculative_tokens",
                "port",
                "max_turns",
                "requests_per_slot",
                "min_requests",
                "max_new_tokens",
                "request_timeout_s",
                "settle_s",
            ),
            non_negative=("startup_timeout_s", "wait_for_server_s", "warmup_requests", "retries", "backoff_s"),
        )


ConfigStore.instance().store(name="bench_schema", node=BenchConfig)


# ---- figures: pure functions --------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    lo = int(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def spread(values: list[float]) -> dict[str, float]:
    """Mean, median and 90th percentile."""
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p90": percentile(values, 90)}


@dataclass(frozen=True)
class Request:
    """One request's measurement."""

    source: str  # the conversation it came from (file:line)
    turn: int  # 1-based
    completion_tokens: int  # the engine's usage count
    latency_s: float  # from sending it to its whole reply
    finish_reason: str | None


def level_figures(requests: list[Request], seconds: float) -> dict[str, Any]:
    """One engine's figures over one level: output tokens/s over the level's wall time, and the
    spread of the time per output token (a request's latency over its tokens) and of latency."""
    tokens = sum(r.completion_tokens for r in requests)
    per_token = [r.latency_s / r.completion_tokens for r in requests if r.completion_tokens]
    return {
        "requests": len(requests),
        "completion_tokens": tokens,
        "seconds": seconds,
        "output_tokens_per_s": tokens / seconds,
        "time_per_output_token_s": spread(per_token) if per_token else None,
        "latency_s": spread([r.latency_s for r in requests]),
    }


STALL_FACTOR = 5.0  # a request this many times slower than its level's median says it should be is a stall ...
STALL_MIN_S = 0.5  # ... and this many seconds slower at least (a scheduler's hiccup on a fast reply is none)


def stalled(
    requests: list[Request], factor: float = STALL_FACTOR, min_s: float = STALL_MIN_S
) -> list[tuple[Request, float]]:
    """The requests of a level (of 4 or more) whose latency exceeds ``factor`` times, and by at least
    ``min_s`` seconds, what the level's medians expect of them: the larger of the median latency and
    the median time per output token times the request's own tokens (a long reply is not a stall, nor
    a one-token reply's prefill). Each with the latency expected of it."""
    if len(requests) < 4:
        return []
    per_token = [r.latency_s / r.completion_tokens for r in requests if r.completion_tokens]
    median = percentile([r.latency_s for r in requests], 50)
    tpot = percentile(per_token, 50) if per_token else 0.0
    expected = [(r, max(median, tpot * r.completion_tokens)) for r in requests]
    return [(r, e) for r, e in expected if r.latency_s > factor * e and r.latency_s - e >= min_s]


def level_requests(c: int, cfg: BenchConfig) -> int:
    """Conversations sent at concurrency ``c``."""
    return max(cfg.min_requests, cfg.requests_per_slot * c)


def cycled(conversations: list[Conversation], n: int) -> list[Conversation]:
    """The first ``n`` of the conversations repeated as often as needed."""
    return [conversations[i % len(conversations)] for i in range(n)]


# ---- the engines: started here, or given ---------------------------------------------------------


class StartedEngine:
    """An engine process started here: its output goes to ``log``; ``stop`` ends its whole process
    group (the engines start workers of their own)."""

    def __init__(self, argv: list[str], log: Path, url: str):
        self.argv, self.log, self.url = argv, log, url
        if argv[0] == "python":  # the engine's module runs in this interpreter's environment
            argv = [sys.executable, *argv[1:]]
        if shutil.which(argv[0]) is None:
            raise ConfigError(
                f"{argv[0]} is not on PATH: install the engine, or give the running servers' URLs "
                f"(baseline_url=, spec_url=)"
            )
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = log.open("w")
        self.proc = subprocess.Popen(argv, stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        """Until ``/health`` answers 200; the engine exiting first, or ``timeout_s`` passing, is an error
        quoting its log's tail."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise EngineError(
                    f"the engine exited with status {self.proc.returncode} before answering /health "
                    f"({shlex.join(self.argv)}); its log {self.log} ends:\n{self.tail()}"
                )
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp,
            ):
                if resp.status == 200:
                    return
            if time.monotonic() > deadline:
                raise EngineError(
                    f"the engine did not answer {self.url}/health within {timeout_s:.0f} s "
                    f"({shlex.join(self.argv)}); its log {self.log} ends:\n{self.tail()}"
                )
            time.sleep(1.0)

    def tail(self, lines: int = 20) -> str:
        self.log_file.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 60.0) -> None:
        stop_group(self.proc, grace_s)
        self.log_file.close()


# ---- the measurement ----------------------------------------------------------------------------


class Bench:
    """Measures each engine in turn (the baseline, then the speculating one) at every level."""

    def __init__(self, cfg: BenchConfig):
        self.cfg = cfg
        self.engine: Engine = registry.engine(cfg.engine, "bench", "engine")
        assert self.engine.metrics is not None and self.engine.version_route is not None  # the bench role says so
        self.names: SpecMetrics = self.engine.metrics
        self.out = Path(cfg.out).expanduser()
        self.warnings: list[str] = []
        self.template_kwargs, flags_warning = request_kwargs(cfg.draft, cfg.chat_template_kwargs, COMMAND)
        if flags_warning:
            self.warnings.append(flags_warning)
            logger.warning(f"{COMMAND}: {flags_warning}")
        if cfg.plot:  # fail before the engines start, not after the measurements
            optional_import("matplotlib")
        self.prompts = cfg.prompts if cfg.prompts is not None else str(shipped_prompts("heldout.jsonl"))
        self.conversations = read_conversations(self.prompts, cfg.column)
        self.dtype_flags = self.one_dtype()

    def one_dtype(self) -> list[str]:
        """``--dtype D`` for both engines where this engine runs the draft in its own config's
        dtype (``Engine.draft_dtype_own``), the local configs of target and draft name different
        dtypes and ``engine_args`` names none; both sides get it so that the two engines compare
        like with like."""
        c = self.cfg
        words = shlex.split(c.engine_args) + shlex.split(c.spec_args)
        if any(w == "--dtype" or w.startswith("--dtype=") for w in words):
            return []
        draft = config_dtype(c.draft)
        clash = self.engine.dtype_clash(draft, config_dtype(c.target))
        if clash is None:
            return []
        assert draft is not None  # a clash names both dtypes
        self.warnings.append(f"{clash}: both engines run --dtype {draft} (engine_args='--dtype ...' to choose)")
        logger.warning(f"{COMMAND}: {self.warnings[-1]}")
        return ["--dtype", draft]

    def argv(self, side: str) -> list[str]:
        """The command that starts the engine of ``side``, the user's ``engine_args`` last (and, for
        the speculating engine, its ``spec_args`` after them)."""
        c = self.cfg
        assert c.target is not None  # checked by the config
        draft = None if side == "baseline" else str(c.draft)
        extra = self.dtype_flags + shlex.split(c.engine_args) + (shlex.split(c.spec_args) if draft is not None else [])
        return self.engine.serve_command(c.target, draft, c.num_speculative_tokens, port=c.port) + extra

    @contextlib.contextmanager
    def server(self, side: str) -> Iterator[tuple[str, list[str] | None]]:
        """The URL of the engine of ``side`` (and the command that started it here, or None)."""
        given = self.cfg.baseline_url if side == "baseline" else self.cfg.spec_url
        if given is not None:
            yield given.rstrip("/"), None
            return
        url = f"http://127.0.0.1:{self.cfg.port}"
        argv = self.argv(side)
        logger.info(f"{COMMAND}: starting the {side} engine: {shlex.join(argv)}")
        engine = StartedEngine(argv, self.out / f"engine-{side}.log", url)
        try:
            engine.wait_ready(self.cfg.startup_timeout_s)
            yield url, argv
        finally:
            engine.stop()

    async def ask(
        self,
        session: Any,
        client: EngineClient,
        messages: list[dict[str, str]],
        temperature: float,
        speculating: bool,
        what: str,
    ) -> tuple[dict, float]:
        """One chat completion; its reply (text, finish reason, token counts) and latency. A
        speculating engine that counts per reply adds the reply's figures to ``client.tally``."""
        c = self.cfg
        body = CHAT_ROUTE.body(client.model, messages, c.max_new_tokens) | {"temperature": temperature}
        if self.template_kwargs:  # vLLM and SGLang pass them to the chat template as they are
            body["chat_template_kwargs"] = self.template_kwargs
        if self.names.per_reply:
            body["return_meta_info"] = True
        url = f"{client.url}/v1/chat/completions"
        start = time.perf_counter()
        resp = await retrying(lambda attempt: post_json(session, url, body), c.retries, c.backoff_s, f"{url} ({what})")
        latency = time.perf_counter() - start
        try:
            out, meta = CHAT_ROUTE.parse(resp)
        except (KeyError, IndexError, TypeError, ValueError):
            raise EngineError(f"{url} ({what}) answered without {CHAT_ROUTE.needs}: {json.dumps(resp)[:300]}") from None
        if self.names.per_reply:
            if speculating:
                client.count_reply(meta, out["completion_tokens"], f"{url} ({what})", CHAT_ROUTE.meta_at)
            elif isinstance(meta, dict) and self.names.drafts in meta:
                raise EngineError(
                    f"{url} ({what}): the baseline engine's reply carries {self.names.drafts}: it "
                    f"serves the target with a draft; the baseline must serve it alone"
                )
        return out, latency

    async def level(
        self,
        session: Any,
        client: EngineClient,
        conversations: list[Conversation],
        concurrency: int,
        temperature: float,
        speculating: bool,
    ) -> list[Request]:
        """Send ``conversations`` with ``concurrency`` of them in flight (a new one as one ends);
        a conversation's turns one after the other."""
        pending = iter(conversations)
        done: list[Request] = []

        async def worker() -> None:
            for conv in pending:  # the workers share the iterator: each takes the next conversation
                replies: list[str] = []
                for turn in range(min(len(conv.turns), self.cfg.max_turns)):
                    out, latency = await self.ask(
                        session,
                        client,
                        conv.messages(turn, replies),
                        temperature,
                        speculating,
                        f"{conv.source} turn {turn + 1}",
                    )
                    done.append(Request(conv.source, turn + 1, out["completion_tokens"], latency, out["finish_reason"]))
                    replies.append(out["text"])

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:  # one failed: the others stop too, before the session closes
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return done

    async def version(self, session: Any, client: EngineClient) -> str:
        assert self.engine.version_route is not None
        path, key = self.engine.version_route
        try:
            return str(json.loads(await client.get(session, path))[key])
        except (EngineError, ValueError, KeyError, TypeError) as e:
            self.warnings.append(f"{client.url}{path} did not say the engine's version ({e})")
            return "unknown"

    async def drafts_counted(self, session: Any, client: EngineClient) -> float:
        """The engine's drafts so far by its ``/metrics`` (0 when it has no such counter)."""
        text = await client.get(session, "/metrics")
        try:
            return sum(v for _, v in counter(parse_prometheus(text), self.names.drafts))
        except ValueError as e:
            raise EngineError(f"{client.url}/metrics is not Prometheus text ({e})") from None

    async def measure(self, side: str, url: str) -> dict[str, Any]:
        """Every level on the engine at ``url``: its model and version, the warm-up, and per level its
        figures and requests (and, speculating, its counts between the level's reads)."""
        aiohttp = optional_import("aiohttp")

        c = self.cfg
        speculating = side == "spec"
        client = EngineClient(url, self.names, c.settle_s, c.model)
        timeout = aiohttp.ClientTimeout(total=c.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=2 * max(c.concurrency + [c.warmup_requests]))
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            wait = 0.0 if (c.baseline_url if side == "baseline" else c.spec_url) is None else c.wait_for_server_s
            await wait_ready(session, [url], wait, command=COMMAND, hint="start it first, or let eagle3-bench start it")
            models = await client.models(session)
            version = await self.version(session, client)
            checks_metrics = not speculating and not self.names.per_reply
            drafts_before = await self.drafts_counted(session, client) if checks_metrics else 0.0
            warmup: list[Request] = []
            levels = []
            for temperature in c.temperatures:
                for concurrency in c.concurrency:
                    if c.warmup_requests:  # this level's batch size warmed up (its kernels compiled) first
                        warmup += await self.level(
                            session,
                            client,
                            cycled(self.conversations, max(c.warmup_requests, concurrency)),
                            concurrency,
                            temperature,
                            speculating,
                        )
                    before = await client.settled(session) if speculating else None
                    convs = cycled(self.conversations, level_requests(concurrency, c))
                    start = time.perf_counter()
                    requests = await self.level(session, client, convs, concurrency, temperature, speculating)
                    seconds = time.perf_counter() - start
                    counts = None if before is None else (await client.settled(session)).minus(before, f"{url}/metrics")
                    levels.append(
                        {
                            "temperature": temperature,
                            "concurrency": concurrency,
                            "requests": requests,
                            "seconds": seconds,
                            "counts": counts,
                        }
                    )
                    logger.info(
                        f"{COMMAND}: {side}: temperature {temperature}, concurrency {concurrency}: "
                        f"{sum(r.completion_tokens for r in requests) / seconds:.1f} tokens/s"
                    )
            if checks_metrics and (drafted := await self.drafts_counted(session, client) - drafts_before):
                raise EngineError(
                    f"{url}/metrics counted {drafted:.0f} drafts during the baseline's run: the baseline "
                    f"engine serves the target with a draft; it must serve it alone"
                )
        self.warnings += client.warnings
        return {
            "url": url,
            "models": models,
            "model": client.model,
            "version": version,
            "levels": levels,
            "warmup": {"requests": len(warmup), "completion_tokens": sum(r.completion_tokens for r in warmup)},
        }

    def spec_figures(self, counts: SpecCounts, requests: list[Request], where: str) -> dict[str, Any]:
        """The engine's acceptance figures over one level; no drafts at all is an error."""
        tokens = sum(r.completion_tokens for r in requests)
        found = figures(counts)
        if found is None:
            raise EngineError(
                f"{where} counted no speculative drafts over {len(requests)} requests ({tokens} tokens): "
                f"the engine does not speculate; start it as {self.names.enable}"
            )
        if not self.names.per_reply and (counts.requests != len(requests) or counts.generation_tokens != tokens):
            self.warnings.append(
                f"{where}: the server counted {counts.requests:.0f} requests and "
                f"{counts.generation_tokens:.0f} tokens during a level, this client {len(requests)} "
                f"and {tokens}: other requests are in the figures"
            )
        return {
            "mean_acceptance_length": found.mean_acceptance_length,
            "drafts": found.drafts,
            "accepted_tokens": found.accepted_tokens,
            "draft_acceptance_rate": found.draft_acceptance_rate,
            "mean_draft_length": found.mean_draft_length,
            "acceptance_per_position": found.acceptance_per_position,
        }

    def rows(self, measured: dict[str, dict[str, Any]]) -> list[BenchRow]:
        """One row per temperature and concurrency: each engine's figures and the speed-up."""
        rows = []
        for base, spec in zip(measured["baseline"]["levels"], measured["spec"]["levels"]):
            figs = {
                side: level_figures(level["requests"], level["seconds"]) for side, level in zip(SIDES, (base, spec))
            }
            figs["spec"] |= self.spec_figures(
                spec["counts"], spec["requests"], f"{measured['spec']['url']} (concurrency {spec['concurrency']})"
            )
            tpot = [figs[side]["time_per_output_token_s"] for side in SIDES]
            row = BenchRow(
                temperature=base["temperature"],
                concurrency=base["concurrency"],
                baseline=figs["baseline"],
                spec=figs["spec"],
                speedup=figs["spec"]["output_tokens_per_s"] / figs["baseline"]["output_tokens_per_s"],
                speedup_by_tpot=tpot[0]["p50"] / tpot[1]["p50"] if all(tpot) and tpot[1]["p50"] else None,
            )
            for side, level in (("baseline", base), ("spec", spec)):
                found = stalled(level["requests"])
                if not found:
                    continue
                r, expected = max(found, key=lambda f: f[0].latency_s - f[1])  # the worst; one warning a level
                more = f" (and {len(found) - 1} more request(s) of the level)" if len(found) > 1 else ""
                self.warnings.append(
                    f"{side}, concurrency {level['concurrency']}, temperature {level['temperature']}: "
                    f"{r.source} turn {r.turn} took {r.latency_s:.2f} s for {r.completion_tokens} tokens, "
                    f"{r.latency_s / expected:.0f}x what the level's medians expect ({expected:.2f} s; a "
                    f"compile, a stall or a retry in the engine){more}; the level took {level['seconds']:.1f} s: "
                    f"speed-up {row.speedup:.2f}x by throughput, "
                    + (
                        f"{row.speedup_by_tpot:.2f}x by median time per token"
                        if row.speedup_by_tpot is not None
                        else "no time per token to set beside it"
                    )
                )
            rows.append(row)
        return rows

    def run(self) -> BenchReport:
        c = self.cfg
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        measured: dict[str, dict[str, Any]] = {}
        for side in SIDES:
            with self.server(side) as (url, argv):
                measured[side] = asyncio.run(self.measure(side, url)) | {"started_here": argv}
        rows = self.rows(measured)
        report = BenchReport(
            what=f"eagle3-bench: output tokens/s of {c.engine} serving the target alone and with the draft, "
            f"speed-up per concurrency",
            machine=machine(),
            command=shlex.join([COMMAND, *sys.argv[1:]]),
            date=started,
            engine={"name": c.engine, "metrics_read_from": self.names.read_from}
            | {side: {k: v for k, v in measured[side].items() if k != "levels"} for side in SIDES},
            settings={
                "prompts": self.prompts,
                "conversations": len(self.conversations),
                "max_turns": c.max_turns,
                "max_new_tokens": c.max_new_tokens,
                "num_speculative_tokens": c.num_speculative_tokens if c.spec_url is None else None,
                "concurrency": list(c.concurrency),
                "temperatures": list(c.temperatures),
                "conversations_per_level": {str(n): level_requests(n, c) for n in c.concurrency},
            },
            rows=rows,
            warnings=self.warnings,
            chat_template_kwargs=self.template_kwargs,
            config=config_dict(c),
        )
        lines = [
            json.dumps(
                {
                    "engine": side,
                    "temperature": lv["temperature"],
                    "concurrency": lv["concurrency"],
                    "source": r.source,
                    "turn": r.turn,
                    "completion_tokens": r.completion_tokens,
                    "latency_s": r.latency_s,
                    "finish_reason": r.finish_reason,
                }
            )
            + "\n"
            for side in SIDES
            for lv in measured[side]["levels"]
            for r in lv["requests"]
        ]
        atomic_write_bytes(self.out / "requests.jsonl", "".join(lines).encode())
        write_report(self.out / RESULTS_NAME, report)
        if c.plot:
            plot_speedup(report, self.out / "speedup.png")
        for warning in self.warnings:
            logger.warning(f"{COMMAND}: warning: {warning}")
        summary = ", ".join(
            f"c={r.concurrency}"
            + (f" T={r.temperature}" if len(c.temperatures) > 1 else "")
            + f": {r.speedup:.2f}x (tau {r.spec['mean_acceptance_length']:.2f}"
            + (
                f"; {r.speedup_by_tpot:.2f}x by median time per token)"
                if r.speedup_by_tpot is not None and not 0.8 < r.speedup_by_tpot / r.speedup < 1.25
                else ")"
            )
            for r in rows
        )
        logger.info(f"{COMMAND} ({c.engine}): speed-up {summary} -> {self.out / RESULTS_NAME}")
        return report


def machine() -> dict[str, Any]:
    """The machine this command runs on (the engines', when it started them): host, OS, Python, GPUs."""
    gpus = None
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            gpus = [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else None
    return {"host": platform.node(), "os": platform.platform(), "python": platform.python_version(), "gpus": gpus}


main = entry_point("bench", BenchConfig, lambda cfg: Bench(cfg).run())

if __name__ == "__main__":
    main()
