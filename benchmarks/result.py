"""The one results file: every benchmark writes it through :class:`Result`, and the docs' results
pages (docs/gen_pages.py) read it through the same class.

A file holds ``schema_version``, ``what`` was measured, on which ``machine``, by which ``command``,
on which ``date``, over how many ``runs``, then its figures at the top level and its ``tables``
(title, header, rows: shown on the results page as they are). A file written before the schema
(no ``schema_version``) reads as version 0: its head fields where it has them, the rest figures.
``code_at`` names the commit whose tree the command runs in, where the script has left since.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
HEAD = ("what", "machine", "command", "date", "runs", "code_at")


def machine() -> str:
    """This machine in words: its GPUs (or CPU cores) and torch's version."""
    try:
        import torch
    except ImportError:
        return f"{os.cpu_count()} CPU cores"
    if torch.cuda.is_available():
        gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    else:
        gpus = f"{os.cpu_count()} CPU cores, no GPU"
    return f"{gpus}, torch {torch.__version__}"


def this_command(program: str, argv: list[str] | None = None) -> str:
    """The command line that runs ``benchmarks/<program>.py`` again with ``argv`` (this process's by default)."""
    return f"python3 -m benchmarks.{program} " + shlex.join(sys.argv[1:] if argv is None else argv)


def _is_head(key: str, value: Any) -> bool:
    return isinstance(value, str) or (key == "command" and isinstance(value, dict))


def today() -> str:
    return datetime.now(timezone.utc).date().isoformat()


@dataclasses.dataclass
class Result:
    """One measurement, as written to ``benchmarks/results/<name>.json``.

    Args:
        what: what was measured, in a sentence or two.
        command: the exact command that made it (named commands, where several did).
        machine: the machine in words (GPUs, torch).
        date: the day it ran (ISO).
        runs: ``single run``, ``median of N``, or what the runs were.
        figures: the numbers by name (nested dicts allowed).
        tables: ready-made tables, each ``{"title", "header", "rows"}``.
        code_at: the commit whose tree the command runs in, where its script has left the tree.
        schema_version: :data:`SCHEMA_VERSION` when written here; 0 for a file older than the schema.
    """

    what: str
    command: str | dict[str, str]
    machine: str = dataclasses.field(default_factory=machine)
    date: str = dataclasses.field(default_factory=today)
    runs: str = "single run"
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    tables: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    code_at: str | None = None
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        head = {k: getattr(self, k) for k in HEAD if getattr(self, k) is not None}
        tables = {"tables": self.tables} if self.tables else {}
        return {"schema_version": self.schema_version, **head, **self.figures, **tables}

    def write(self, path: str | Path) -> None:
        """Write the file whole (a reader never sees half of it)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n")
        tmp.replace(path)

    @classmethod
    def from_dict(cls, data: Any) -> Result:
        """A result from a file's JSON; a version-1 file must carry every head field."""
        if not isinstance(data, dict):
            raise ValueError(f"a results file holds an object, not a {type(data).__name__}")
        data = dict(data)
        version = data.pop("schema_version", 0)
        if version > SCHEMA_VERSION:
            raise ValueError(f"schema_version {version} is newer than this reader's {SCHEMA_VERSION}")
        if version == SCHEMA_VERSION:
            missing = [k for k in HEAD[:-1] if k not in data]
            if missing:
                raise ValueError(f"a schema {version} results file lacks {missing}")
        # in a file older than the schema, a head field of another shape (runs as a list) is a figure
        head = {k: data.pop(k) for k in HEAD if _is_head(k, data.get(k))}
        if "command" not in head and isinstance(data.get("commands"), dict):
            head["command"] = data.pop("commands")
        tables = data.pop("tables", [])
        return cls(
            what=head.pop("what", ""),
            command=head.pop("command", ""),
            machine=head.pop("machine", ""),
            date=head.pop("date", ""),
            runs=head.pop("runs", ""),
            figures=data,
            tables=tables if isinstance(tables, list) else [],
            code_at=head.pop("code_at", None),
            schema_version=version,
        )

    @classmethod
    def read(cls, path: str | Path) -> Result:
        return cls.from_dict(json.loads(Path(path).read_text()))
