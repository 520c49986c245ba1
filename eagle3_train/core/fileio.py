"""Atomic file writes: a reader never sees a half-written file.

Every file is written to a temporary name in the same directory, flushed to disk, then renamed
over the final name (``os.replace`` is atomic on POSIX filesystems).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3_train.core.errors import BadInputError
from eagle3_train.core.faults import fault_point


def umask_mode(mode: int = 0o666) -> int:
    """``mode`` less the process umask: what ``open`` would give a new file (0644 under umask 022).
    Linux reports the umask in /proc; setting and restoring it (elsewhere) would briefly widen
    what other threads create meanwhile."""
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("Umask:"))
        mask = int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0)
        os.umask(mask)
    return mode & ~mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` either holds all of it or is untouched. The file
    gets the permissions the umask allows (mkstemp's own 0600 would hide an export from a serving
    process of another user)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, umask_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        fault_point("write")  # tests: a crash between the complete temporary file and its rename
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_safetensors(tensors: dict[str, Any], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, then the permissions the umask allows: save_file leaves
    0600, which hides weights from a serving engine running as another user."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, umask_mode())


def remove_temporaries(directory: str | os.PathLike) -> list[str]:
    """Delete the temporary files that atomic writes killed before their rename left directly in
    ``directory`` (``.<name>.<random>.tmp``); only its one writer may call it, as another's writes
    may be in flight. Returns their names."""
    directory = Path(directory)
    removed = sorted(p.name for p in directory.glob(".*.tmp") if p.is_file()) if directory.is_dir() else []
    for name in removed:
        (directory / name).unlink(missing_ok=True)
    return removed


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON, atomically."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n"
    atomic_write_bytes(path, text.encode())


def json_ready(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples become lists, paths strings), so that a value
    compares equal to its recorded copy."""
    return json.loads(json.dumps(obj, default=_json_default))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def sha256_text(text: str) -> str:
    """Hex sha256 of a string (utf-8)."""
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of the canonical (sorted, compact) JSON form of ``obj``."""
    return sha256_text(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default))


def remove_files(directory: Path, pattern: str) -> None:
    """Delete the files of ``directory`` that match the glob ``pattern``."""
    for path in directory.glob(pattern):
        path.unlink()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def table_rows(path: Path, kind: str) -> Iterator[tuple[str, Any]]:
    """``(location, row)`` of a parquet file or an Arrow IPC file/stream (``kind``: parquet or
    arrow), batch by batch (never all in memory); an unreadable file names itself."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(str(path)).iter_batches(batch_size=1024) if kind == "parquet" else _arrow_batches(path)
        row = 0
        for batch in batches:
            for item in batch.to_pylist():
                yield f"{path}[row {row}]", item
                row += 1
    except (pa.ArrowInvalid, OSError) as e:
        raise BadInputError(f"{path}: not a readable {kind} file ({e})") from None


def _arrow_batches(path: Path) -> Iterator[Any]:
    """An Arrow IPC stream (what ``datasets`` writes) or, failing that, an Arrow IPC file."""
    import pyarrow as pa

    try:
        yield from pa.ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
