"""A stage's output directory: the one answer to "is it finished, and was it made for this very
request?", used by every stage (prepare and its synthesis/regeneration chunks, dump, standardize,
train, eval).

The *request* is what decides a directory's content: the options that change the output (not
where it goes or how fast it is made), the inputs by fingerprint, the target's identity. A run
records it in ``request.json`` when it claims the directory (so a resumed run is checked before it
adds to a partial output) and inside the record written last (``manifest.json``; eval's
``report.json``), whose presence marks the directory finished. Two requests are the same when
every field is; otherwise the run is refused with every differing field listed (left: what the
directory holds, right: this run), or, where the stage allows it, the old output is replaced.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3_train.core.contract import MANIFEST_NAME, differences, read_manifest, write_manifest
from eagle3_train.core.errors import BadInputError, ContractError
from eagle3_train.core.fileio import atomic_write_json, json_ready

REQUEST_NAME = "request.json"


class StageDir:
    """One stage's output directory and the request this run makes of it.

    Args:
        path: the directory.
        stage: the stage name its record carries (``read_manifest`` checks it).
        request: what this run is asked to produce (JSON-ready; compared field by field).
        record: the file written last, whose presence marks the directory finished.
        what: how messages name the directory's content (default: the stage name).
        hint: what a refused user can do; a callable gets the differing fields.
        exclusive: one process at a time (global rank 0 of a run): :meth:`claim` takes the
            directory's lock (:func:`hold_lock`), and a second process is refused, naming the first.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        stage: str,
        request: dict[str, Any],
        *,
        record: str = MANIFEST_NAME,
        what: str | None = None,
        hint: str | Callable[[list[str]], str] = "use another out=, or delete it",
        exclusive: bool = False,
    ):
        self.path, self.stage, self.request = Path(path), stage, json_ready(request)
        self.record, self.what, self.hint = record, what or stage, hint
        self.exclusive = exclusive

    def differences(self, recorded: dict[str, Any] | None) -> list[str]:
        """Every field in which a recorded request differs from this run's, as ``field: old != new``."""
        return differences(recorded or {}, self.request)

    def _refusal(self, diffs: list[str], finished: bool) -> ContractError:
        hint = self.hint(diffs) if callable(self.hint) else self.hint
        state = "a finished" if finished else "an unfinished"
        return ContractError(
            f"{self.path} holds {state} {self.what} made otherwise (left: the directory, right: this run):\n  "
            + "\n  ".join(diffs)
            + f"\n{hint}"
        )

    def recorded(self) -> bool:
        """Whether the record written last is there: the directory holds a finished output (of this
        request or another: :meth:`finished` tells which). Reading it needs no lock."""
        return (self.path / self.record).is_file()

    def finished(self, replace: bool = False) -> dict[str, Any] | None:
        """The record of a finished output made for this request; None when there is none. One
        made for another request is refused, or with ``replace`` its record is removed (None)."""
        if not self.recorded():
            return None
        record = read_manifest(self.path, self.stage, name=self.record)
        diffs = self.differences(record.get("request"))
        if not diffs:
            return record
        if not replace:
            raise self._refusal(diffs, finished=True)
        (self.path / self.record).unlink(missing_ok=True)
        return None

    def claim(self, replace: bool = False, clear: Callable[[], None] | None = None) -> bool:
        """Record the request before work starts or resumes. A partial output made for another
        request is refused, or with ``replace`` cleared by ``clear()`` (before the new request is
        recorded, so a crash never leaves old files under a new request). Returns whether it was
        replaced."""
        self.path.mkdir(parents=True, exist_ok=True)
        if self.exclusive and int(os.environ.get("RANK", "0")) == 0:
            hold_lock(self.path, self.what)
        file = self.path / REQUEST_NAME
        replaced = False
        if file.is_file():
            try:
                recorded = json.loads(file.read_text())
            except json.JSONDecodeError as e:
                raise BadInputError(f"{file}: not valid JSON ({e}); delete it to start over") from None
            diffs = self.differences(recorded)
            if diffs and not replace:
                raise self._refusal(diffs, finished=self.recorded())
            replaced = bool(diffs)
            if replaced and clear is not None:
                clear()
        if not replaced and file.is_file():
            return False
        atomic_write_json(file, self.request)
        return replaced

    def write_manifest(self, body: dict[str, Any]) -> dict[str, Any]:
        """Write the record last (atomically), with the request, and return it as read back."""
        write_manifest(self.path, self.stage, {**body, "request": self.request}, name=self.record)
        return read_manifest(self.path, self.stage, name=self.record)


LOCK_NAME = ".eagle3.lock"
_HELD: dict[Path, int] = {}  # lock file -> its open descriptor in this process (kept until it exits)


def hold_lock(path: Path, what: str, name: str = LOCK_NAME) -> None:
    """Take the lock file ``path/name`` for the rest of this process (the kernel drops it when the
    process dies, kill -9 included, so a crash never leaves a stale lock); another process holding
    it is refused, naming its pid, host and start. ``name``: one lock per writer where several
    processes share a directory by design (the served dump's clients)."""
    import fcntl
    import socket
    import time

    file = Path(path).resolve() / name
    if file in _HELD:
        return
    fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (ValueError, OSError):
            holder = {}
        os.close(fd)
        raise ContractError(
            f"{file.parent} is in use: another process is writing this {what} (pid "
            f"{holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('since', '?')}); "
            f"wait for it to finish, or choose another out="
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(
        fd,
        json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        ).encode(),
        0,
    )
    _HELD[file] = fd
