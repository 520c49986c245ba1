"""Reading conversations from files or datasets, in ShareGPT or OpenAI form.

Every row is normalised to ``[{"role": "system"|"user"|"assistant", "content": str}, ...]`` and
carries its location (``file:line``, ``file[item i]`` or ``dataset[row i]``) so that any problem
is reported where the user can find it.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_train.core.errors import BadInputError
from eagle3_train.core.fileio import table_rows
from eagle3_train.core.prompt_files import ROLE_ALIASES

# Where a message may carry its reasoning apart from its content, by the names templates and engines
# use: reasoning_content (Qwen3, Kimi-K2, DeepSeek's API, vLLM and SGLang responses), reasoning (vLLM's
# newer responses), thinking (gpt-oss's template). Kept as given and passed to the template as given.
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


class BadRow(BadInputError):
    """A row that cannot be used; ``reason`` is a short code counted under ``on_bad_row=skip``."""

    def __init__(self, source: str, reason: str, message: str, field: str | None = None):
        self.source, self.reason, self.field, self.message = source, reason, field, message
        where = f"{source}: field '{field}'" if field else source
        super().__init__(f"{where}: {message} [{reason}]")

    def __reduce__(self) -> tuple:  # rebuilt whole when it crosses from a tokenising process
        return type(self), (self.source, self.reason, self.message, self.field)


@dataclass
class Conversation:
    """A normalised conversation and where it came from."""

    messages: list[dict[str, str]]
    source: str
    meta: dict[str, Any] = field(default_factory=dict)


def iter_raw_rows(input: str, split: str = "train") -> Iterator[tuple[str, Any]]:
    """Yield ``(location, row)`` for every row of ``input``.

    ``input`` is a ``.jsonl``/``.json`` file, a directory of such files (read in name order), a
    dataset saved with ``save_to_disk``, or a dataset id for ``datasets.load_dataset``. A line of
    a JSONL file that is not valid JSON is yielded as a :class:`BadRow` in place of the row.
    """
    path = Path(input).expanduser()
    if path.is_file():
        yield from _iter_file(path)
    elif path.is_dir():
        if _saved_dataset(path):
            yield from _iter_dataset(_load_from_disk(path, split), f"{path}[{split}]" if _is_dict(path) else str(path))
            return
        files = sorted(p for p in path.iterdir() if _kind(p) is not None and p.is_file())
        if not files:
            raise BadInputError(
                f"input directory {path} holds no {', '.join(KINDS_TEXT)} files, and is no dataset "
                f"saved with save_to_disk"
            )
        for f in files:
            yield from _iter_file(f)
    elif input.startswith((".", "/", "~")) or input.endswith((".json", ".jsonl", ".jsonl.gz")):
        raise BadInputError(f"input {input} does not exist")
    else:
        yield from _iter_dataset(_load_hub(input, split), f"{input}[{split}]")


KINDS_TEXT = (".jsonl", ".jsonl.gz", ".json", ".parquet", ".arrow")


def _kind(path: Path) -> str | None:
    """``json``, ``jsonl`` (also gzip-compressed, ``.jsonl.gz``), ``parquet``, ``arrow`` (an Arrow
    IPC stream or file, as ``datasets`` writes its cache) or ``None`` for other files."""
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    return {".json": "json", ".parquet": "parquet", ".arrow": "arrow"}.get(path.suffix.lower())


def _saved_dataset(path: Path) -> bool:
    return any((path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _is_dict(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file()


def _iter_file(path: Path) -> Iterator[tuple[str, Any]]:
    kind = _kind(path)
    if kind is None:
        raise BadInputError(f"input file {path} is none of {', '.join(KINDS_TEXT)}")
    if kind in ("parquet", "arrow"):
        yield from table_rows(path, kind)
        return
    if kind == "json":
        raw = path.read_bytes()
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            line, column = raw.count(b"\n", 0, e.start) + 1, e.start - raw.rfind(b"\n", 0, e.start)
            raise BadInputError(f"{path}:{line}: {_not_utf8(e, column)}") from None
        except json.JSONDecodeError as e:
            raise BadInputError(f"{path}:{e.lineno}: malformed JSON: {e.msg}") from None
        if not isinstance(data, list):
            raise BadInputError(f"{path}: a .json input must hold a list of conversations")
        for i, row in enumerate(data):
            yield f"{path}[item {i}]", row
        return
    # bytes, decoded line by line: an undecodable line is one bad row (skippable), not a traceback
    with gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            source = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield source, BadRow(source, "bad_encoding", _not_utf8(e, e.start + 1))
                continue
            if not text.strip():
                continue
            try:
                yield source, json.loads(text)
            except json.JSONDecodeError as e:
                yield source, BadRow(source, "malformed_json", f"malformed JSON: {e.msg} (column {e.colno})")


def _not_utf8(e: UnicodeDecodeError, column: int) -> str:
    return f"not valid UTF-8 (byte 0x{e.object[e.start]:02x} at column {column}): re-encode the file as UTF-8"


def _iter_dataset(ds: Any, name: str) -> Iterator[tuple[str, Any]]:
    for i, row in enumerate(ds):
        yield f"{name}[row {i}]", row


def _load_from_disk(path: Path, split: str) -> Any:
    """A dataset saved with ``save_to_disk``; of a DatasetDict, its ``split``."""
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise BadInputError(
                f"{path} is a DatasetDict without a split {split!r}; its splits: {list(ds)} (choose one with split=)"
            )
        return ds[split]
    return ds


def _load_hub(name: str, split: str) -> Any:
    import datasets

    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # offline, unknown id, no such split: all are the user's to fix
        raise BadInputError(
            f"input {name} is not a local file or directory, and loading it as a dataset failed: {e}"
        ) from None


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
