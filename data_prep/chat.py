"""Chat-template rendering and the assistant loss mask, derived from the template itself.

How the mask is found, for any template, without per-model patterns:

1. Render the conversation with every assistant content replaced by a unique sentinel. Where each
   sentinel lands in the text is where the template puts that turn's content.
2. Substitute the real contents for the sentinels, and check that this equals rendering the real
   conversation (a template that rewrites assistant content -- e.g. drops earlier reasoning --
   is refused for that row, since its spans are not knowable).
3. Tokenise the text once with character offsets. A token is masked when it overlaps an assistant
   content span; the end-of-turn token is the special token that directly follows the content
   (after optional whitespace), which the model must learn to emit, so it is masked too.

The ids equal ``apply_chat_template(..., tokenize=True)``; no per-role tokenisation is spliced,
so no token boundary differs from what the target sees at serving time.

Conversations rendered as served. An engine answering assistant turn k renders the request
``messages[:k]`` with the generation prompt and the flags it was given (``chat_template_kwargs``),
and the model generates the reply after it. A conversation rendered once is only right for training
when, for every turn, that request followed by the reply is a prefix of the whole render. Templates
of reasoning models break this: Qwen3's, DeepSeek-R1's and Kimi-K2-Thinking's drop the reasoning
of earlier assistant turns, gpt-oss's earlier analysis channels, DeepSeek-V3.1's render no reasoning
at all. :func:`render_conversation` checks it by rendering each turn's request (never by family
name); where it fails, every assistant turn becomes its own sample: the request's ids, then the
reply's ids, the loss on the reply alone (its reasoning, its answer, its end-of-turn token).

A turn's reply is what the template renders after the request when the turn is the last message.
A template that renders the last turn differently from its own generation prompt (DeepSeek-V3.1
with ``thinking=true``: the prompt opens ``<think>``, the rendered turn closes it empty) has the
reply taken from the message's content as the model wrote it (reasoning inline, e.g.
``<think>…</think>answer``), minus what the prompt already holds, plus the template's end of turn.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from data_prep.conversations import REASONING_FIELDS, BadRow
from eagle3_train.core.split import MAX_TURNS
from eagle3_train.targets import template_kwargs

RENDER_MODES = ("auto", "whole", "per_turn")
MIN_PROMPT_OVERLAP = 3  # characters of a reply's start that must match the prompt's end to be dropped as already there


@dataclass
class Rendered:
    """A tokenised conversation."""

    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T], 1 on assistant content + end-of-turn tokens
    truncated: bool


def special_ids(tokenizer: Any, eos_ids: set[int] | None = None) -> set[int]:
    """Ids that can end an assistant turn: the tokenizer's special tokens and the eos ids."""
    ids = set(tokenizer.all_special_ids) | set(eos_ids or ())
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            ids.add(tokenizer.convert_tokens_to_ids(tok.content))
    return ids


def render_text(tokenizer: Any, messages: list[dict], source: str, add_generation_prompt: bool = False) -> str:
    """The template's text for ``messages``; template exceptions become a :class:`BadRow`."""
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs(tokenizer)
        )
    except Exception as e:  # jinja's raise_exception(), undefined fields, ...
        raise BadRow(source, "template_error", f"the chat template refused this conversation: {e}") from None


def assistant_spans(tokenizer: Any, messages: list[dict], source: str) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages``; return the text and the character span of every assistant content."""
    nonce = secrets.token_hex(6)
    sentinels: list[str] = []
    masked = []
    for m in messages:
        if m["role"] == "assistant":
            sentinels.append(f"XEAGLE3SPAN{len(sentinels)}Z{nonce}X")
            masked.append({"role": "assistant", "content": sentinels[-1]})
        else:
            masked.append(m)
    with_sentinels = render_text(tokenizer, masked, source)
    contents = [m["content"] for m in messages if m["role"] == "assistant"]
    pieces, spans, cursor, length = [], [], 0, 0
    for sentinel, content in zip(sentinels, contents):
        at = with_sentinels.find(sentinel, cursor)
        if at < 0 or with_sentinels.count(sentinel) != 1:
            raise BadRow(
                source,
                "template_alters_content",
                "the chat template does not place this assistant turn's content verbatim, once",
            )
        pieces.append(with_sentinels[cursor:at])
        length += at - cursor
        spans.append((length, length + len(content)))
        pieces.append(content)
        length += len(content)
        cursor = at + len(sentinel)
    pieces.append(with_sentinels[cursor:])
    text = "".join(pieces)
    if text != render_text(tokenizer, messages, source):
        raise BadRow(
            source,
            "template_alters_content",
            "the chat template rewrites assistant content (e.g. drops earlier reasoning); "
            "assistant spans cannot be derived for this conversation",
        )
    return text, spans


@dataclass
class ServedTurn:
    """One assistant turn as an engine serves it: the request's text (generation prompt included)
    and the reply the model generates after it (end-of-turn token included)."""

    prompt: str
    reply: str


def _cut_after_end(tokenizer: Any, tail: str, end_ids: set[int]) -> str:
    """``tail`` up to and including its last end-of-turn token (what a template adds after the
    turn's end, e.g. a newline, is not generated); all of it when it has none."""
    enc = tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True)
    ends = [e for t, (_, e) in zip(enc["input_ids"], enc["offset_mapping"]) if t in end_ids]
    return tail[: ends[-1]] if ends else tail


def served_turn(tokenizer: Any, messages: list[dict], i: int, source: str, end_ids: set[int]) -> ServedTurn:
    """Assistant message ``i`` as served: ``messages[:i]`` rendered with the generation prompt, and
    the reply (module docstring)."""
    prompt = render_text(tokenizer, messages[:i], source, add_generation_prompt=True)
    full = render_text(tokenizer, messages[: i + 1], source)
    if full.startswith(prompt):
        return ServedTurn(prompt, _cut_after_end(tokenizer, full[len(prompt) :], end_ids))
    m = messages[i]
    content = m["content"]
    if any(m[f] not in full for f in _fields(m)):
        raise BadRow(
            source,
            "template_drops_reasoning",
            f"the chat template renders this turn differently from its own generation prompt and leaves out its "
            f"{'/'.join(f for f in _fields(m) if m.get(f))}: give the reasoning inline in content as the model writes "
            f"it (e.g. <think>...</think>answer), or pass a chat_template= that renders the last turn's reasoning",
            f"messages[{i}]",
        )
    overlap = next(
        (k for k in range(min(len(prompt), len(content)), MIN_PROMPT_OVERLAP - 1, -1) if prompt.endswith(content[:k])),
        0,
    )
    nonce = f"XEAGLE3END{secrets.token_hex(6)}X"
    closed = render_text(tokenizer, [*messages[:i], {"role": "assistant", "content": nonce}], source)
    after = closed[closed.find(nonce) + len(nonce) :] if closed.count(nonce) == 1 else ""
    return ServedTurn(prompt, content[overlap:] + _cut_after_end(tokenizer, after, end_ids))


def _fields(message: dict) -> list[str]:
    """The reasoning fields a message carries."""
    return [f for f in REASONING_FIELDS if isinstance(message.get(f), str) and message[f]]


@dataclass
class TurnSample:
    """One sample of a conversation: ``turn`` is None for the whole conversation, else the number
    (from 0) of the assistant turn it holds (per-turn rendering)."""

    turn: int | None
    rendered: Rendered | BadRow


def render_conversation(
    tokenizer: Any,
    messages: list[dict],
    source: str,
    *,
    max_length: int,
    truncate: bool,
    end_ids: set[int],
    mode: str = "auto",
) -> tuple[list[TurnSample], dict[str, int]]:
    """The samples of one conversation (module docstring): one, the whole conversation, when every
    turn's served request and reply continue its render; else (``mode=auto``) one per assistant
    turn, each ``BadRow`` or not on its own. ``mode=whole`` refuses such a conversation,
    ``mode=per_turn`` always renders per turn. Also returns what the rendering cost: ``tokens``
    rendered, ``tokens_whole`` (the conversation rendered once) and ``shared_prefix_tokens`` (ids a
    turn's sample shares with the previous turn's, which a prefix cache could skip)."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    served: list[ServedTurn] | None = None
    whole_error: BadRow | None = None
    text: str | None = None  # the conversation rendered once
    if mode != "per_turn":
        try:
            text, spans = assistant_spans(tokenizer, messages, source)
        except BadRow as e:
            if e.reason != "template_alters_content":
                raise
            whole_error = _rewrites(source)
        else:
            served = [served_turn(tokenizer, messages, i, source, end_ids) for i in turns]
            if all(text.startswith(t.prompt + t.reply) for t in served):
                # the reply regions: what the model generates, reasoning included, beside the content spans
                regions = [(len(t.prompt), len(t.prompt) + len(t.reply)) for t in served]
                r = _tokenise(tokenizer, text, spans, source, max_length, truncate, end_ids, regions)
                return [TurnSample(None, r)], {}
            whole_error = _rewrites(source)
    if mode == "whole":
        assert whole_error is not None
        raise whole_error
    if len(turns) > MAX_TURNS:
        raise BadRow(source, "too_many_turns", f"{len(turns)} assistant turns; per-turn rendering takes {MAX_TURNS}")
    if served is None:
        served = [served_turn(tokenizer, messages, i, source, end_ids) for i in turns]
    out, previous, cost = [], None, {"tokens": 0, "tokens_whole": 0, "shared_prefix_tokens": 0}
    for n, t in enumerate(served):
        ids_p = tokenizer(t.prompt, add_special_tokens=False)["input_ids"]
        ids_r = tokenizer(t.reply, add_special_tokens=False)["input_ids"]
        ids = np.asarray(ids_p + ids_r, dtype=np.int32)
        mask = np.concatenate([np.zeros(len(ids_p), np.uint8), np.ones(len(ids_r), np.uint8)])
        where = f"{source} (assistant turn {n + 1})"
        cost["tokens"] += min(len(ids), max_length) if truncate else len(ids)
        if previous is not None:
            k = min(len(previous), len(ids))
            differ = np.nonzero(previous[:k] != ids[:k])[0]
            cost["shared_prefix_tokens"] += int(differ[0]) if len(differ) else k
        previous = ids
        out.append(TurnSample(n, _cut(ids, mask, where, max_length, truncate)))
    whole = text if text is not None else render_text(tokenizer, messages, source)
    cost["tokens_whole"] = len(tokenizer(whole, add_special_tokens=False)["input_ids"])
    return out, cost


def _rewrites(source: str) -> BadRow:
    return BadRow(
        source,
        "template_rewrites_history",
        "rendered once, this conversation is not what the engine renders for each turn (the chat template "
        "rewrites earlier turns, e.g. drops their reasoning); render=auto trains each turn as served",
    )


def _cut(ids: np.ndarray, mask: np.ndarray, source: str, max_length: int, truncate: bool) -> Rendered | BadRow:
    """``max_length`` applied; a BadRow when it refuses or leaves nothing to train on."""
    total = len(ids)
    truncated = total > max_length
    if truncated:
        if not truncate:
            return BadRow(source, "too_long", f"{total} tokens exceed max_length={max_length} (truncate=false)")
        ids, mask = ids[:max_length], mask[:max_length]
    if not mask.any():
        return BadRow(
            source,
            "no_assistant_tokens",
            f"no assistant token within the first max_length={max_length} tokens (the sample has {total})",
        )
    return Rendered(ids, mask, truncated)


def render_with_mask(
    tokenizer: Any,
    messages: list[dict],
    source: str,
    *,
    max_length: int,
    truncate: bool,
    end_ids: set[int],
) -> Rendered:
    """Tokenise a conversation and mark its assistant tokens (module docstring says how).

    Raises :class:`BadRow` when the conversation is longer than ``max_length`` and ``truncate`` is
    off, or when truncation leaves no assistant token to train on.
    """
    text, spans = assistant_spans(tokenizer, messages, source)
    return _tokenise(tokenizer, text, spans, source, max_length, truncate, end_ids)


def _tokenise(
    tokenizer: Any,
    text: str,
    spans: list[tuple[int, int]],
    source: str,
    max_length: int,
    truncate: bool,
    end_ids: set[int],
    regions: list[tuple[int, int]] = (),  # type: ignore[assignment]
) -> Rendered:
    """``text`` tokenised once, the tokens overlapping ``spans`` masked (and each content span's
    end-of-turn token), and those overlapping ``regions`` (served replies, their end included)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), dtype=np.uint8)
    starts, ends = offsets[:, 0], offsets[:, 1]
    for a, b in spans:
        inside = np.nonzero((starts < b) & (ends > a))[0]
        if len(inside) == 0:
            continue
        mask[inside] = 1
        # The end-of-turn token: the first special token after the content, if only whitespace
        # stands between them; the whitespace tokens are generated too, so they are masked.
        j = inside[-1] + 1
        while j < len(ids) and ids[j] not in end_ids and text[starts[j] : ends[j]].isspace():
            j += 1
        if j < len(ids) and ids[j] in end_ids and text[b : starts[j]].strip() == "":
            mask[inside[-1] + 1 : j + 1] = 1
    for a, b in regions:
        mask[(starts < b) & (ends > a)] = 1
    cut = _cut(ids, mask, source, max_length, truncate)
    if isinstance(cut, BadRow):
        raise cut
    return cut


REASONING_OFF = ("drop", "keep")  # prepare's reasoning_off


def thinking_off(tokenizer: Any, markers: tuple[str, str] | None) -> bool:
    """Whether the template renders requests with thinking off: its generation prompt closes the
    reasoning block before the reply begins (Qwen3's ``enable_thinking=false`` opens and closes an
    empty ``<think></think>``, DeepSeek-V3.1's ``thinking=false`` closes ``</think>``), so the engine's
    replies hold no reasoning. Found by rendering, never by family name."""
    if markers is None:
        return False
    start, end = markers
    probe = f"XEAGLE3PROBE{secrets.token_hex(6)}X"
    prompt = render_text(tokenizer, [{"role": "user", "content": probe}], "probe", add_generation_prompt=True)
    tail = prompt[prompt.rfind(probe) + len(probe) :]
    return end in tail and tail.rfind(end) > tail.rfind(start)


def reasoning_when_off(messages: list[dict], markers: tuple[str, str], policy: str) -> tuple[list[dict], int]:
    """One rule for a reply's reasoning under a template with thinking off, wherever the data puts
    it, inline (``<think>…</think>answer``) or in a field (``reasoning_content``, ``reasoning``,
    ``thinking``): ``drop`` leaves the answer alone, as the engine's replies with thinking off are;
    ``keep`` keeps it inline (a field's reasoning moved there), after the empty block the request
    closes. Returns the messages and how many replies carried reasoning."""
    start, end = markers
    out, count = [], 0
    for m in messages:
        if m["role"] != "assistant":
            out.append(m)
            continue
        fields = _fields(m)
        stripped = m["content"].lstrip()
        inline = stripped.startswith(start) and end in stripped
        if not (inline or fields):
            out.append(m)
            continue
        count += 1
        if inline:
            reasoning, answer = stripped[len(start) :].split(end, 1)
        else:
            reasoning, answer = m[fields[0]], m["content"]
        kept = {k: v for k, v in m.items() if k not in REASONING_FIELDS}
        answer = answer.lstrip()
        kept["content"] = answer if policy == "drop" else f"{start}\n{reasoning.strip()}\n{end}\n\n{answer}"
        out.append(kept)
    return out, count
