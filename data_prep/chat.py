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
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from data_prep.conversations import BadRow


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
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
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
    truncated = len(ids) > max_length
    if truncated:
        if not truncate:
            raise BadRow(source, "too_long", f"{len(ids)} tokens exceed max_length={max_length} (truncate=false)")
        ids, mask = ids[:max_length], mask[:max_length]
    if not mask.any():
        raise BadRow(
            source,
            "no_assistant_tokens",
            f"no assistant token within the first max_length={max_length} tokens "
            f"(the conversation has {len(enc['input_ids'])})",
        )
    return Rendered(ids, mask, truncated)
