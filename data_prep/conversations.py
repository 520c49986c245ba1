"""Reading conversations from files or datasets, in ShareGPT or OpenAI form.

Every row is normalised to ``[{"role": "system"|"user"|"assistant", "content": str}, ...]`` and
carries its location (``file:line``, ``file[item i]`` or ``dataset[row i]``) so that any problem
is reported where the user can find it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_train.core.prompt_files import ROLE_ALIASES
from eagle3_train.core.rows import (  # noqa: F401  (the reader is core's; prepare's modules import it from here too)
    KINDS_TEXT,
    REASONING_FIELDS,
    BadRow,
    _is_dict,
    _kind,
    iter_raw_rows,
)


@dataclass
class Conversation:
    """A normalised conversation and where it came from."""

    messages: list[dict[str, str]]
    source: str
    meta: dict[str, Any] = field(default_factory=dict)


def normalize(row: Any, source: str, *, need_assistant: bool = True) -> Conversation:
    """Turn one raw row into a :class:`Conversation`, or raise :class:`BadRow` saying why.

    Accepted: ``{"conversations": [{"from", "value"}, ...]}`` (ShareGPT) and
    ``{"messages": [{"role", "content"}, ...]}`` (OpenAI). A system message may only come first.
    Assistant content is stripped of surrounding whitespace (a template would often trim it anyway,
    and a reply never usefully starts with blank lines).
    """
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(source, "missing_field", f"row is a {type(row).__name__}, not an object")
    if "messages" in row:
        key, role_key, text_key = "messages", "role", "content"
    elif "conversations" in row:
        key, role_key, text_key = "conversations", "from", "value"
    else:
        raise BadRow(source, "missing_field", "row has neither 'messages' (OpenAI) nor 'conversations' (ShareGPT)")
    turns = row[key]
    if not isinstance(turns, list):
        raise BadRow(source, "missing_field", f"must be a list, got {type(turns).__name__}", key)
    if not turns:
        raise BadRow(source, "empty_conversation", "conversation has no messages", key)
    messages = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise BadRow(source, "missing_field", f"message is a {type(turn).__name__}, not an object", where)
        if role_key not in turn:
            raise BadRow(source, "missing_field", "message has no role", f"{where}.{role_key}")
        raw_role = turn[role_key]
        role = ROLE_ALIASES.get(str(raw_role).lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise BadRow(
                source,
                "unknown_role",
                f"unknown role {raw_role!r}; known: {sorted(ROLE_ALIASES)}",
                f"{where}.{role_key}",
            )
        content = _text(turn.get(text_key), source, f"{where}.{text_key}")
        if role == "system" and i != 0:
            raise BadRow(source, "misplaced_system", "a system message may only be the first message", where)
        message = {"role": role, "content": content}
        if role == "assistant":
            message["content"] = content = content.strip()
            for name in REASONING_FIELDS:
                value = turn.get(name)
                if value is None:
                    continue
                if not isinstance(value, str):
                    raise BadRow(
                        source, "bad_reasoning", f"must be a string, got {type(value).__name__}", f"{where}.{name}"
                    )
                if value.strip():
                    message[name] = value.strip()
            if not content and len(message) == 2:
                raise BadRow(source, "empty_content", "assistant message is empty", f"{where}.{text_key}")
        messages.append(message)
    if not any(m["role"] != "system" for m in messages):
        raise BadRow(source, "empty_conversation", "conversation holds only a system prompt", key)
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadRow(source, "no_assistant_turn", "conversation has no assistant turn to train on", key)
    meta = {k: row[k] for k in ("id", "category") if k in row and isinstance(row[k], (str, int))}
    return Conversation(messages, source, meta)


def _text(value: Any, source: str, where: str) -> str:
    """Message content: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    if value is None:
        raise BadRow(source, "missing_field", "message has no content", where)
    raise BadRow(source, "bad_content", f"content must be text, got {type(value).__name__}", where)


def input_fingerprint(input: str) -> dict[str, Any]:
    """What identifies the input's content: file hashes, a saved dataset's state, or the hub id."""
    from eagle3_train.core.fileio import sha256_file

    path = Path(input).expanduser()
    if path.is_file():
        return {"files": {path.name: sha256_file(path)}}
    if path.is_dir():
        if (path / "state.json").is_file():
            return {"dataset_state": json.loads((path / "state.json").read_text())}
        if _is_dict(path):
            return {
                "dataset_dict": {
                    p.name: json.loads((p / "state.json").read_text())
                    for p in sorted(path.iterdir())
                    if (p / "state.json").is_file()
                }
            }
        files = sorted(p for p in path.iterdir() if _kind(p) is not None and p.is_file())
        return {"files": {p.name: sha256_file(p) for p in files}}
    return {"hub_dataset": input}
