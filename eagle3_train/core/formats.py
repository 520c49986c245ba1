"""Shard files between stages (docs/concepts/storage.md): safetensors only, written atomically, checksummed.

A shard packs many samples concatenated along tokens: ``input_ids`` int32 [T], ``loss_mask`` uint8
[T], ``cu_seqlens`` int64 [n+1], ``sample_ids`` int64 [n], and per-token state tensors [T, H]
(stored as fp8, each with its ``<key>.scale`` [T, n]: eagle3_train/core/storage.py).
Beside each finished shard ``<name>.safetensors`` a record ``<name>.json`` (checksum, sizes, counts)
is written atomically *after* it; a shard without its record is the leftover of a crash and is
discarded on resume.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3_train.core.errors import BadInputError, Eagle3Error
from eagle3_train.core.faults import fault_point
from eagle3_train.core.fileio import atomic_write_json, sha256_file

SHARD_SUFFIX = ".safetensors"
RECORD_SUFFIX = ".json"
INDEX_KEYS = ("input_ids", "loss_mask", "cu_seqlens", "sample_ids")
INDEX_DTYPES = {
    "input_ids": torch.int32,
    "loss_mask": torch.uint8,
    "cu_seqlens": torch.int64,
    "sample_ids": torch.int64,
}


@dataclass
class ShardRecord:
    """What the manifest knows of one shard."""

    name: str
    sha256: str
    bytes: int
    num_samples: int
    num_tokens: int
    tensors: dict[str, list] = field(default_factory=dict)  # key -> [dtype, *shape]
    extra: dict = field(default_factory=dict)  # stage-specific (e.g. non-finite sample ids)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ShardRecord:
        return cls(**d)


# safetensors dtype names (the format's header spelling)
_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}


def _serialize(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[str, int]:
    """Write ``tensors`` to ``path`` in the safetensors format; return (sha256, bytes).

    The header and each tensor's bytes are streamed straight from the tensors' memory (pinned
    host buffers in the dump), checksummed on the way: no serialised copy is built in memory.
    """
    header: dict[str, dict] = {}
    offset = 0
    views = []
    for name in sorted(tensors):
        t = tensors[name]
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        views.append(t.reshape(-1).view(torch.uint8).numpy().data if nbytes else b"")  # a memoryview, no copy
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8-byte alignment
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (len(head).to_bytes(8, "little"), head, *views):
            digest.update(chunk)
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return digest.hexdigest(), 8 + len(head) + offset


def write_shard(directory: Path, name: str, tensors: dict[str, torch.Tensor], extra: dict | None = None) -> ShardRecord:
    """Write ``<directory>/<name>.safetensors`` then its record, both atomically (temp + rename).

    Raises :class:`Eagle3Error` on a full disk, leaving neither file behind (so the run can be
    resumed once space is freed).
    """
    shard = directory / f"{name}{SHARD_SUFFIX}"
    tmp = directory / f".{name}{SHARD_SUFFIX}.tmp"
    try:
        sha, size = _serialize(tmp, tensors)
        os.replace(tmp, shard)
        fault_point("shard")  # tests: a crash between a shard and its record
        record = ShardRecord(
            name=name,
            sha256=sha,
            bytes=size,
            num_samples=int(tensors["sample_ids"].numel()),
            num_tokens=int(tensors["input_ids"].numel()),
            tensors={k: [str(v.dtype).removeprefix("torch."), *v.shape] for k, v in tensors.items()},
            extra=extra or {},
        )
        atomic_write_json(directory / f"{name}{RECORD_SUFFIX}", record.to_dict())
    except OSError as e:
        tmp.unlink(missing_ok=True)
        shard.unlink(missing_ok=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise Eagle3Error(
                f"out of disk space writing {shard}; nothing partial was left: free space and run "
                f"the same command again to resume"
            ) from None
        raise
    return record


def read_shard(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a shard; a corrupt file is reported by name."""
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises several types for truncated/garbled files
        raise BadInputError(f"shard {path} is corrupt or unreadable: {e}") from None


def read_keys(path: Path, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Only ``keys`` of a shard (cheap: safetensors reads just those bytes)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in keys}
    except Exception as e:
        raise BadInputError(f"shard {path} is corrupt or unreadable: {e}") from None


def check_shard(path: Path) -> None:
    """Refuse a shard whose bytes differ from those its producer recorded beside it (sha256, size).

    Raises :class:`BadInputError` naming the shard. The file is read once, sequentially; reads of
    its tensors that follow are served from the page cache.
    """
    record_path = path.with_suffix(RECORD_SUFFIX)
    try:
        record = ShardRecord.from_dict(json.loads(record_path.read_text()))
    except FileNotFoundError:
        raise BadInputError(
            f"shard {path} has no record {record_path.name} (its checksum): re-run the stage that wrote it"
        ) from None
    except (json.JSONDecodeError, TypeError) as e:
        raise BadInputError(f"shard record {record_path} is corrupt: {e}") from None
    size = path.stat().st_size
    sha = sha256_file(path) if size == record.bytes else None
    if sha != record.sha256:
        what = "sha256" if sha else f"size ({size} bytes, recorded {record.bytes})"
        raise BadInputError(
            f"shard {path} is corrupt: its {what} differs from {record_path.name} written with it; "
            f"re-run the stage that wrote it"
        )


def finished_records(directory: Path) -> list[ShardRecord]:
    """Records of the finished shards in ``directory`` (name order)."""
    out = []
    for rec in sorted(directory.glob(f"*{RECORD_SUFFIX}")):
        if rec.name.startswith("."):
            continue
        try:
            out.append(ShardRecord.from_dict(json.loads(rec.read_text())))
        except (json.JSONDecodeError, TypeError) as e:
            raise BadInputError(f"shard record {rec} is corrupt: {e}") from None
    return out


def remove_unfinished(directory: Path, prefix: str = "") -> list[str]:
    """Delete temp files, shards without a record and records without a shard whose names start
    with ``prefix`` (a writer's own, while others may still be writing); return their names."""
    removed = []
    for p in sorted(directory.iterdir()):
        if not p.name.removeprefix(".").startswith(prefix):
            continue
        partner = None
        if p.name.startswith(".") and p.name.endswith(".tmp"):
            pass
        elif p.suffix == SHARD_SUFFIX:
            partner = p.with_suffix(RECORD_SUFFIX)
        elif p.suffix == RECORD_SUFFIX:
            partner = p.with_suffix(SHARD_SUFFIX)
        else:
            continue
        if partner is None or not partner.exists():
            p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def iter_samples(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[int, slice]]:
    """``(sample_id, token slice)`` for every sample packed in a shard."""
    cu = tensors["cu_seqlens"].tolist()
    for i, sid in enumerate(tensors["sample_ids"].tolist()):
        yield sid, slice(cu[i], cu[i + 1])


def verify_shard(directory: Path, record: ShardRecord) -> list[str]:
    """Problems of one shard against its record: checksum, size, keys, dtypes, shapes."""
    path = directory / f"{record.name}{SHARD_SUFFIX}"
    if not path.is_file():
        return [f"{record.name}: file missing"]
    data = path.read_bytes()
    problems = []
    if len(data) != record.bytes:
        problems.append(f"{record.name}: {len(data)} bytes, manifest says {record.bytes}")
    if hashlib.sha256(data).hexdigest() != record.sha256:
        problems.append(f"{record.name}: sha256 differs from the manifest (the file changed or is corrupt)")
        return problems
    from safetensors.torch import load

    tensors = load(data)
    got = {k: [str(v.dtype).removeprefix("torch."), *v.shape] for k, v in tensors.items()}
    if got != record.tensors:
        problems.append(f"{record.name}: tensors {got} differ from the manifest {record.tensors}")
    cu = tensors.get("cu_seqlens")
    if cu is not None and (cu[0] != 0 or cu[-1] != record.num_tokens or (cu.diff() <= 0).any()):
        problems.append(f"{record.name}: cu_seqlens is not increasing from 0 to {record.num_tokens}")
    return problems
