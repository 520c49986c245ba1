"""Reasoning in replies: the flags a chat template was rendered with (``chat_template_kwargs``), and
where a generated reply's reasoning ends and its answer begins.

A reply's reasoning is the stretch between a start marker and an end marker (``<think>`` and
``</think>`` for Qwen3, DeepSeek-R1/V3.1 and Kimi-K2; ``<|channel|>analysis`` and ``<|end|>`` for
gpt-oss's harmony format). A reply is inside reasoning from its first token when the request's
generation prompt left a start marker open (DeepSeek-R1 opens ``<think>\\n`` there) or the reply
begins with one; it stays there up to and including the first end marker.
"""

from __future__ import annotations

import json
from typing import Any

PROMPT_TAIL = 32  # prompt tokens looked at for a reasoning block the generation prompt opened

# template text that names the markers -> the markers (the first that the template holds)
KNOWN_MARKERS = (("</think>", ("<think>", "</think>")), ("<|channel|>", ("<|channel|>analysis", "<|end|>")))


def markers_for(template: str | None, configured: list[str] | tuple[str, ...] | None) -> tuple[str, str] | None:
    """The reasoning markers: ``configured`` (a start and an end string) or, when None, the known
    ones the chat template text mentions; None when neither gives any."""
    if configured is not None:
        if len(configured) != 2 or not all(isinstance(m, str) and m for m in configured):
            from eagle3_train.core.errors import ConfigError

            raise ConfigError(f"reasoning_markers must be two non-empty strings [start, end], got {configured!r}")
        return configured[0], configured[1]
    for needle, markers in KNOWN_MARKERS:
        if template and needle in template:
            return markers
    return None


def reasoning_tokens(tokenizer: Any, prompt_tail: list[int], tokens: list[int], markers: tuple[str, str]) -> int:
    """How many of the reply's first ``tokens`` are reasoning (the end marker counted in); 0 when
    the reply does not start inside reasoning."""
    start, end = markers
    before = "".join(tokenizer.decode([t]) for t in prompt_tail)
    pieces = [tokenizer.decode([t]) for t in tokens]
    text = "".join(pieces)
    opened = before.rfind(start) > before.rfind(end) if start in before else False
    if not opened and not text.lstrip().startswith(start):
        return 0
    at = text.find(end, 0 if opened else text.find(start) + len(start))
    if at < 0:
        return len(tokens)  # cut off inside its reasoning
    stop, length = at + len(end), 0
    for i, piece in enumerate(pieces):
        if length >= stop:
            return i
        length += len(piece)
    return len(tokens)


def check_template_kwargs(value: Any, option: str = "chat_template_kwargs") -> None:
    """Refuse flags that are not a mapping of names to JSON values (what engines accept)."""
    from eagle3_train.core.errors import ConfigError

    if value is None:
        return
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(
            f"{option} must be a mapping of flag names to values, e.g. {option}={{enable_thinking: false}} or "
            f"+{option}.enable_thinking=false; got {value!r}"
        )
    try:
        json.dumps(value)
    except TypeError as e:
        raise ConfigError(
            f"{option}: the values must be JSON values (strings, numbers, booleans, lists, maps): {e}"
        ) from None


def kwargs_warning(trained: dict[str, Any] | None, used: dict[str, Any] | None, who: str) -> str | None:
    """A warning when ``used`` (the flags ``who`` renders requests with) differs from the flags the
    draft's data was rendered with; None when they agree."""
    trained, used = dict(trained or {}), dict(used or {})
    if trained == used:
        return None
    keys = sorted(set(trained) | set(used))
    diff = ", ".join(
        f"{k}: trained {json.dumps(trained.get(k))} != {json.dumps(used.get(k))}"
        for k in keys
        if trained.get(k) != used.get(k)
    )
    return (
        f"{who} renders requests with chat_template_kwargs {json.dumps(used, sort_keys=True)}, the draft was trained on "
        f"renders with {json.dumps(trained, sort_keys=True)} ({diff}): the contexts it sees differ from those it learnt "
        f"(reasoning on or off, another effort), and acceptance can fall"
    )


def request_kwargs(draft: str | None, given: dict[str, Any] | None, who: str) -> tuple[dict[str, Any], str | None]:
    """The flags requests carry: ``given``, else those the exported ``draft`` (a directory; its
    config.json, where it has one) was trained with, else none; and a warning when they differ
    from the draft's."""
    from pathlib import Path

    config = Path(draft).expanduser() / "config.json" if draft is not None else None
    trained = trained_kwargs(json.loads(config.read_text())) if config is not None and config.is_file() else None
    flags = dict(given if given is not None else trained or {})
    return flags, kwargs_warning(trained, flags, who) if trained is not None else None


def trained_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """The flags an exported draft's data was rendered with (its config's target identity)."""
    return dict(((config.get("eagle3_train") or {}).get("target") or {}).get("chat_template_kwargs") or {})
