"""Evaluation prompts as users have them, read into conversations of user turns.

Recognised rows (JSONL, ``.jsonl.gz`` too, parquet, Arrow, or a ``datasets`` dataset saved with
``save_to_disk``), the conversation formats ``eagle3-prepare`` reads among them:

| shape | example | turns |
|---|---|---|
| ours / OpenAI | ``{"messages": [{"role": "system", ...}, {"role": "user", ...}, ...]}`` | every user message (assistant messages are dropped: the target writes its own) |
| ShareGPT | ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}`` | every human turn (speaker names as prepare reads them) |
| MT-bench ``question.jsonl`` | ``{"question_id": 81, "category": "writing", "turns": ["...", "..."]}`` | ``turns`` |
| HumanEval | ``{"task_id": ..., "prompt": "def f(...):\\n    ..."}`` | ``[prompt]`` |
| GSM8K | ``{"question": "...", "answer": "..."}`` | ``[question]`` |

``column`` names the field to read instead (a string, a list of strings, or a list of messages).
A row's ``category`` (a string) groups the report; rows without one take the file's (or dataset
directory's) name. Anything else stops with the file, line and field.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_train.core.errors import BadInputError
from eagle3_train.core.rows import BadRow, iter_raw_rows

# ShareGPT uses many speaker names; these are the ones whose meaning is unambiguous.
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "tool": "tool",  # a tool's result: in the context the draft sees, never in the loss
    "ipython": "tool",
    "function": "tool",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}

SHAPES = ("messages", "conversations", "turns", "prompt", "question")


SHIPPED_PROMPTS = "data_prep.prompts"  # the package whose data files are the shipped prompt files


def shipped_prompts(name: str) -> Path:
    """A prompt file shipped in ``data_prep/prompts/`` (``heldout.jsonl``, ``train.jsonl``), found
    by :mod:`importlib.resources` as that package's data, in a checkout and in an installed wheel
    alike (the package holds data only: eagle3_train imports no code of data_prep)."""
    try:
        path: Path | None = Path(str(importlib.resources.files(SHIPPED_PROMPTS) / name)).resolve()
    except ModuleNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise BadInputError(
            f"the shipped prompt file {path or f'{SHIPPED_PROMPTS}/{name}'} is missing (this installation lacks "
            f"data_prep/prompts); give prompts=<a prompt file>"
        )
    return path


@dataclass
class Conversation:
    """User turns to send one after the other, each after the target's own reply to the previous.

    Args:
        source: where it was read (``file:line`` or ``dataset[row]``), for messages.
        category: the report group.
        turns: the user messages.
        system: a leading system prompt, if the row had one.
    """

    source: str
    category: str
    turns: list[str]
    system: str | None = None

    def messages(self, turn: int, replies: list[str]) -> list[dict[str, str]]:
        """The chat up to user turn ``turn`` (0-based), with ``replies`` as the assistant's answers
        to the earlier turns."""
        out = [{"role": "system", "content": self.system}] if self.system is not None else []
        for user, reply in zip(self.turns[:turn], replies[:turn]):
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        return out + [{"role": "user", "content": self.turns[turn]}]


def read_conversations(path: str | Path, column: str | None = None, limit: int | None = None) -> list[Conversation]:
    """Conversations of a prompt file, a directory of them, or a saved dataset (the first ``limit``
    of them), read by the one row reader (:func:`eagle3_train.core.rows.iter_raw_rows`)."""
    path = Path(path).expanduser()
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise BadInputError(
            f"prompts {path} holds the splits {splits}: point prompts at one of them (e.g. {path / splits[0]})"
        )
    default_category = (
        path.name.removesuffix(".gz").removesuffix(".jsonl").removesuffix(".parquet").removesuffix(".arrow")
    )
    out = []
    for source, row in iter_raw_rows(str(path), what="prompts"):
        if isinstance(row, BadRow):
            raise row
        out.append(conversation(row, source, column, default_category))
        if limit and len(out) >= limit:
            break
    if not out:
        raise BadInputError(f"prompts {path}: no prompts in it")
    return out


def conversation(row: Any, source: str, column: str | None, default_category: str) -> Conversation:
    """One row as a :class:`Conversation`; ``source`` names it in errors."""
    if not isinstance(row, dict):
        raise BadInputError(f"{source}: expected an object, got {type(row).__name__}")
    category = row.get("category", default_category)
    if not isinstance(category, str):
        raise BadInputError(f"{source}: field 'category' must be a string, got {category!r}")
    if column is not None:
        if column not in row:
            raise BadInputError(f"{source}: no field {column!r} (column={column}); fields: {sorted(row)}")
        field, value = column, row[column]
    else:
        shape = next((f for f in SHAPES if f in row), None)
        if shape is None:
            raise BadInputError(
                f"{source}: unknown prompt shape (fields {sorted(row)}): expected one of "
                f"{list(SHAPES)}, or name the field with column=<field>"
            )
        field, value = shape, row[shape]
    if isinstance(value, str):
        return Conversation(source, category, [_text(value, source, field)])
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return Conversation(source, category, [_text(v, source, field) for v in value])
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return _from_messages(value, source, field, category)
    raise BadInputError(
        f"{source}: field {field!r} must be a string, a non-empty list of strings or a list of "
        f"messages, got {_show(value)}"
    )


def _from_messages(messages: list[dict], source: str, field: str, category: str) -> Conversation:
    """OpenAI messages (role, content) or ShareGPT turns (from, value), roles read as prepare reads them."""
    system, turns = None, []
    for i, m in enumerate(messages):
        role_key, text_key = ("from", "value") if "from" in m else ("role", "content")
        raw, content = m.get(role_key), m.get(text_key)
        role = ROLE_ALIASES.get(raw.lower()) if isinstance(raw, str) else None
        if not isinstance(content, str):
            raise BadInputError(f"{source}: field '{field}[{i}].{text_key}' must be a string, got {_show(content)}")
        if role == "system" and i == 0:
            system = content
        elif role == "user":
            turns.append(content)
        elif role == "tool":
            raise BadInputError(
                f"{source}: field '{field}[{i}]' is a tool message: eval replays the user turns "
                f"and lets the target answer, so a tool's result has no place (drop the row)"
            )
        elif role != "assistant":  # the target answers for itself
            raise BadInputError(
                f"{source}: field '{field}[{i}].{role_key}' is {raw!r}: expected user or assistant "
                f"(or system, first; known names: {sorted(ROLE_ALIASES)})"
            )
    if not turns:
        raise BadInputError(f"{source}: field {field!r}: no user turn")
    return Conversation(source, category, turns, system)


def _text(value: str, source: str, field: str) -> str:
    if not value.strip():
        raise BadInputError(f"{source}: field {field!r} is empty")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
