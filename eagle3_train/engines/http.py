"""The HTTP side of talking to a serving engine (vLLM, SGLang), shared by the served dump
(data_prep/dump/served.py), regeneration through a served engine (data_prep/served_regen.py) and the
engine's own acceptance figures (eagle3_train/evaluation/served_acceptance.py):
JSON POSTs whose failures are sorted into worth-retrying or not, retries with exponential backoff,
the wait for ``/health``, and vLLM's served model name."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from eagle3_train.core.errors import Eagle3Error
from eagle3_train.core.extras import optional_import

logger = logging.getLogger(__name__)

T = TypeVar("T")

HEALTH_PROBE_S = 10.0  # one /health probe's time limit (a host that drops packets fails in seconds)


class EngineError(Eagle3Error):
    """The engine answered, but not what was asked for: retrying cannot help."""


class Transient(Exception):
    """A failure worth retrying: connection, timeout, 5xx, a state file that did not come."""


class RetriesExhausted(EngineError):
    """Every attempt failed on something worth retrying: the server is gone or stuck (another
    replica may still answer)."""


async def post_json(session: Any, url: str, body: dict, parse_gate: asyncio.Semaphore | None = None) -> dict:
    """POST JSON; connection problems, timeouts, 408/429/5xx are :class:`Transient`, other
    errors are the engine refusing the request. ``parse_gate`` bounds how many large responses
    are parsed at once (parsing holds the GIL, so more at once only multiplies memory)."""
    aiohttp = optional_import("aiohttp")

    try:
        async with session.post(url, json=body) as resp:
            text = await resp.read()
            if resp.status in (408, 429) or resp.status >= 500:
                raise Transient(f"{url}: HTTP {resp.status}: {text[:300].decode(errors='replace')}")
            if resp.status != 200:
                raise EngineError(
                    f"{url} refused the request: HTTP {resp.status}: {text[:500].decode(errors='replace')}"
                )
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise Transient(f"{url}: {type(e).__name__}: {e}") from None
    try:
        if parse_gate is None:
            return await asyncio.to_thread(json.loads, text)
        async with parse_gate:
            return await asyncio.to_thread(json.loads, text)
    except ValueError:
        raise Transient(f"{url}: the response is not JSON: {text[:200]!r}") from None


async def health(session: Any, base_url: str, timeout_s: float = HEALTH_PROBE_S) -> str | None:
    """One ``GET /health`` probe: None when the server answers 200 within ``timeout_s``, else what
    went wrong (the HTTP status, the connection error, the timeout)."""
    aiohttp = optional_import("aiohttp")

    try:
        async with session.get(f"{base_url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} after {timeout_s:g} s"


async def wait_ready(
    session: Any,
    base_urls: list[str],
    wait_s: float,
    command: str = "eagle3-dump",
    hint: str = "print_launch=true shows how to start it",
    alive: Callable[[], None] | None = None,
) -> None:
    """Wait until every server answers ``/health`` (engines take minutes to load a large target);
    ``command`` and ``hint`` name the caller in its messages (the dump, or regeneration). ``wait_s``
    0: one probe, so an unreachable server fails at once. ``alive``: called between probes, raises
    when the engine processes this run started have died (no point waiting for them)."""
    deadline = time.monotonic() + wait_s
    for base in base_urls:
        said = False
        while True:
            if alive is not None:
                alive()
            problem = await health(session, base)
            if problem is None:
                break
            if time.monotonic() > deadline:
                raise Eagle3Error(
                    f"{base} did not become ready within {wait_s:.0f} s ({problem}); is the engine running? {hint}"
                )
            if not said:
                logger.info(f"{command}: waiting for {base} ({problem})")
                said = True
            await asyncio.sleep(2.0)


async def retrying(call: Callable[[int], Awaitable[T]], retries: int, backoff_s: float, what: str) -> T:
    """``call(attempt)`` until it does not raise :class:`Transient`, at most ``retries`` more times,
    sleeping ``backoff_s`` doubled on every retry (at most 60 s); then an :class:`EngineError`."""
    for attempt in range(retries + 1):
        try:
            return await call(attempt)
        except Transient as e:
            if attempt == retries:
                raise RetriesExhausted(f"{what}: {attempt + 1} attempts failed; the last: {e}") from None
            await asyncio.sleep(min(backoff_s * 2**attempt, 60.0))
    raise AssertionError("unreachable: the last attempt returns or raises")


async def served_model(session: Any, base_url: str, option: str) -> str:
    """The first model vLLM's ``/v1/models`` lists (what to send when ``option`` is not set)."""
    async with session.get(f"{base_url}/v1/models") as resp:
        if resp.status != 200:
            raise EngineError(f"{base_url}/v1/models answered HTTP {resp.status}; set {option}")
        models = (await resp.json()).get("data") or []
    if not models:
        raise EngineError(f"{base_url}/v1/models lists no model; set {option}")
    return models[0]["id"]
