"""Rows of conversation or prompt files, wherever they are: a ``.jsonl`` (or ``.jsonl.gz``), ``.json``,
``.parquet`` or ``.arrow`` file, a directory of such files, a dataset saved with ``save_to_disk``, or a
dataset id. One reader for every stage (eagle3-prepare's conversations, eagle3-eval's and the
engines' prompts), each row with its location (``file:line``, ``file[item i]``, ``dataset[row i]``)
so that any problem is reported where the user can find it.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3_train.core.errors import BadInputError
from eagle3_train.core.fileio import table_rows

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


def iter_raw_rows(input: str, split: str = "train", what: str = "input") -> Iterator[tuple[str, Any]]:
    """Yield ``(location, row)`` for every row of ``input``.

    ``input`` is a ``.jsonl``/``.json`` file, a directory of such files (read in name order), a
    dataset saved with ``save_to_disk``, or a dataset id for ``datasets.load_dataset``. A line of
    a JSONL file that is not valid JSON is yielded as a :class:`BadRow` in place of the row; ``what``
    names the input in messages (``input``, ``prompts``).
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
                f"{what} directory {path} holds no {', '.join(KINDS_TEXT)} files, and is no dataset "
                f"saved with save_to_disk"
            )
        for f in files:
            yield from _iter_file(f)
    elif input.startswith((".", "/", "~")) or input.endswith((".json", ".jsonl", ".jsonl.gz")):
        raise BadInputError(f"{what} {input} does not exist")
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
