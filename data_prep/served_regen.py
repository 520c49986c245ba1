"""Regeneration through a served engine (``regen.backend=vllm|sglang``), for targets that
transformers cannot generate from at scale.

    vllm serve <target> --port 8000
    eagle3-prepare target=<hf dir> input=... out=... regenerate=true regen.backend=vllm regen.server.url=http://gpu1:8000

:func:`served_generate_batch` keeps the contract of :func:`data_prep.regenerate.generate_batch`:
one reply per prompt, its ids up to (not including) the first end-of-turn id, and how many replies
hit ``max_new_tokens``. Each prompt goes to the engine as token ids, never as text, so the
engine's tokenizer cannot re-split it; the reply is read from the returned ids, never from the
engine's text. The HTTP client (``post_json``, ``wait_ready``, the retries) is the served dump's
(eagle3_train/engines/http.py).

What each engine offers, read from its source, is in its module: its generation endpoint, the
request it takes and the reply it gives (:class:`eagle3_train.engines.base.Generation`, in
eagle3_train/engines/vllm.py and sglang.py). No engine runs on the machines this project is tested
on; the tests drive this client against stand-in servers.

A reply is cut at its first end-of-turn id whatever the engine reports (old vLLM and SGLang
check the length before the stop token, so a stop token in the last place comes as ``length``);
one without an end-of-turn id counts as hitting the limit.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import Any

from eagle3_train.core.errors import ConfigError, check_numbers
from eagle3_train.core.extras import optional_import
from eagle3_train.engines import registry
from eagle3_train.engines.base import Generation
from eagle3_train.engines.http import EngineError, post_json, retrying, served_model, wait_ready


@dataclass
class ServedRegenConfig:
    """Where ``regen.backend=<engine>`` (vllm, sglang) finds the engine serving the target, and how hard to ask."""

    url: str = "http://127.0.0.1:8000"  # the engine's base URL (vLLM serves on 8000, SGLang on 30000 by default)
    model: str | None = None  # vLLM: the served model name; null: the first one /v1/models lists
    concurrency: int = 64  # requests in flight (the engine batches them; more keeps a large engine busy)
    request_timeout_s: float = 1800.0  # one request's time limit (a long reply on a loaded engine takes minutes)
    retries: int = 5  # further attempts after a transient failure (connection, 408/429/5xx, timeout)
    backoff_s: float = 1.0  # the first retry's delay; doubled on every further one (at most 60 s)
    wait_for_server_s: float = 900.0  # how long to wait at start for the engine's /health

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"regen.server.url must be an http(s):// URL, got {self.url!r}")
        check_numbers(
            self,
            "regen.server.",
            positive=("concurrency", "request_timeout_s"),
            non_negative=("retries", "backoff_s", "wait_for_server_s"),
        )


# -- what the client adds to each engine's request and takes from its reply ------------------------------


def prompt_seed(seed: int, index: int, prompt: list[int]) -> int:
    """The sampling seed of one request: a hash of the run's seed, the prompt's index and its ids.

    Engines seed each request on its own, so a reply depends on its seed only, not on what else
    is in flight; the ids keep equal indices of different calls from sharing a seed (correlated
    draws), the index keeps a prompt repeated within a call from repeating its reply.
    """
    h = hashlib.blake2b(f"{seed}:{index}:".encode(), digest_size=8)
    h.update(",".join(map(str, prompt)).encode())
    return int.from_bytes(h.digest(), "big") >> 1  # 63 bits: both engines take an int64


def cut_reply(
    ids: list[int], finish: str | None, matched: Any, eos_ids: list[int], max_new_tokens: int, where: str
) -> tuple[list[int], bool]:
    """The reply up to its first end-of-turn id, and whether it hit ``max_new_tokens`` instead;
    what transformers' generate would not have produced is refused."""
    if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
        raise EngineError(f"{where}: the returned ids are not a list of integers: {str(ids)[:200]}")
    if len(ids) > max_new_tokens:
        raise EngineError(f"{where}: {len(ids)} tokens came back for max_new_tokens={max_new_tokens}")
    eos = set(eos_ids)
    cut = next((j for j, t in enumerate(ids) if t in eos), None)
    if cut is not None:
        return ids[:cut], False
    if finish == "stop" and matched in eos:  # an engine that leaves its stop token out
        return ids, False
    if finish == "length":
        if len(ids) < max_new_tokens:
            raise EngineError(
                f"{where}: the engine stopped for length after {len(ids)} of {max_new_tokens} tokens: its "
                f"context is full; launch it with a longer context (vLLM --max-model-len, SGLang "
                f"--context-length) or lower regen.max_new_tokens"
            )
        return ids, True
    if finish == "stop":
        raise EngineError(
            f"{where}: the engine stopped on {matched!r}, which is not an end-of-turn id of this target "
            f"{sorted(eos)}: it serves another model, or stops on ids of its own (SGLang: the model's "
            f"eos ids); transformers would have gone on"
        )
    raise EngineError(f"{where}: finish_reason {finish!r} (expected stop or length)")


# -- the client -------------------------------------------------------------------------------------


def served_generate_batch(
    prompts: list[list[int]],
    cfg: ServedRegenConfig,
    sampling: dict,
    eos_ids: list[int],
    backend: str,
    bar: Any = None,
) -> tuple[list[list[int]], int]:
    """Generate one reply per prompt with the engine serving the target at ``cfg.url``.

    Args:
        prompts: rendered prompts as token ids; each is one request.
        cfg: the server and the client's limits.
        sampling: ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_p`` and ``seed``
            (an int, or ``None`` for unseeded sampling); prompt ``i`` samples with
            :func:`prompt_seed` of it, so replies do not depend on ``cfg.concurrency``.
        eos_ids: end-of-turn ids; generation stops at any of them.
        backend: an engine with a generation endpoint (``vllm``, ``sglang``).
        bar: a tqdm advanced by one per reply, or ``None``.

    Returns:
        The reply ids up to (not including) the first end-of-turn id, in the order of ``prompts``,
        and how many replies hit ``max_new_tokens``.
    """
    generation = registry.ENGINES[backend].generation if backend in registry.ENGINES else None
    if generation is None:
        served = [n for n, e in registry.ENGINES.items() if e.generation is not None]
        raise ConfigError(f"regen.backend for a served engine must be one of {served}, got {backend!r}")
    if not prompts:
        return [], 0
    cut = asyncio.run(_generate_all(prompts, cfg, generation, sampling, list(eos_ids), bar))
    return [ids for ids, _ in cut], sum(hit for _, hit in cut)


async def _generate_all(
    prompts: list[list[int]], cfg: ServedRegenConfig, engine: Generation, sampling: dict, eos_ids: list[int], bar: Any
) -> list[tuple[list[int], bool]]:
    """Keep ``cfg.concurrency`` requests in flight; the first failure that retries cannot fix
    cancels the rest and is raised."""
    aiohttp = optional_import("aiohttp")

    url = cfg.url.rstrip("/")
    endpoint = f"{url}{engine.path}"
    max_new = int(sampling["max_new_tokens"])
    seed = sampling["seed"] if sampling["do_sample"] else None  # greedy replies need none
    results: list[tuple[list[int], bool] | None] = [None] * len(prompts)
    todo = iter(range(len(prompts)))  # shared by the workers: each index is taken once

    async def one(session: Any, model: str | None, i: int) -> tuple[list[int], bool]:
        where = f"{endpoint} (prompt {i})"
        body = engine.request(
            prompts[i], model, sampling, eos_ids, None if seed is None else prompt_seed(seed, i, prompts[i])
        )

        async def attempt(_: int) -> dict:
            try:
                return await post_json(session, endpoint, body)
            except EngineError as e:  # a refusal: name the prompt (the URL is in the message)
                raise EngineError(f"prompt {i}: {e}") from None

        resp = await retrying(attempt, cfg.retries, cfg.backoff_s, where)
        return cut_reply(*engine.reply(resp, where), eos_ids, max_new, where)

    async def worker(session: Any, model: str | None) -> None:
        for i in todo:
            results[i] = await one(session, model, i)
            if bar is not None:
                bar.update(1)

    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=cfg.concurrency)) as session:
        await wait_ready(
            session,
            [url],
            cfg.wait_for_server_s,
            command="eagle3-prepare",
            hint="README 'Regeneration through a served engine' shows how to start it",
        )
        model = (cfg.model or await served_model(session, url, "regen.server.model")) if engine.names_model else None
        workers = [asyncio.create_task(worker(session, model)) for _ in range(min(cfg.concurrency, len(prompts)))]
        try:
            done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # a failure, or Ctrl-C: stop the requests still in flight
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        for w in done:
            if not w.cancelled() and (error := w.exception()) is not None:
                raise error
    return results  # type: ignore[return-value]  # every index was filled, or a worker raised
