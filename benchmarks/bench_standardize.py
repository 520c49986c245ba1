"""Standardize throughput beside a plain file copy of the same bytes, measured in the same run.

Not part of the test suite:

    python benchmarks/bench_standardize.py --out /tmp/bench_std --shards 8 --shard-mb 256

Builds a synthetic dump (random bf16 states, H=4096, stored layers [2, 16, 29] + extra [8], as an
8B target would give), then times (1) copying every dump shard to a scratch directory with fsync,
(2) eagle3-standardize choosing 3 of the 4 stored layers with a 5% eval split. Throughput is dump
bytes processed per second in both cases.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

from data_prep.standardize import StandardizeConfig, Standardizer
from eagle3_train.core.contract import CaptureSpec, TargetIdentity, write_manifest
from eagle3_train.core.formats import write_shard


def make_dump(root: Path, shards: int, shard_mb: float, hidden: int, seq: int) -> int:
    """A dump of random states; returns its shard bytes."""
    stored, aux = [2, 8, 16, 29], [2, 16, 29]
    per_token = (len(stored) + 1) * hidden * 2
    tokens = int(shard_mb * 2**20) // per_token // seq * seq
    (root / "shards").mkdir(parents=True)
    records = []
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(tokens, hidden, generator=gen).bfloat16()
    for s in range(shards):
        n = tokens // seq
        t = {
            "input_ids": torch.randint(0, 128256, (tokens,), generator=gen, dtype=torch.int32),
            "loss_mask": torch.ones(tokens, dtype=torch.uint8),
            "cu_seqlens": torch.arange(n + 1, dtype=torch.int64) * seq,
            "sample_ids": torch.arange(s * n, (s + 1) * n, dtype=torch.int64),
            "last_hidden": base.roll(s, 0),
        } | {f"hidden.{k}": base.roll(k + s, 0) for k in stored}
        records.append(write_shard(root / "shards", f"00000-bench-{s:05d}", t).to_dict())
    ident = TargetIdentity("bench-llama-8b", "llama", "c" * 64, "t" * 64, "h" * 64)
    spec = CaptureSpec(tuple(aux), 32, hidden, 128256, "bfloat16", ident)
    write_manifest(root, "dump", {"capture": spec.to_dict(), "stored_indices": stored, "shards": records})
    return sum(r["bytes"] for r in records)


def drop_caches() -> bool:
    """Ask the kernel to forget cached file pages (needs root; harmless if refused)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def copy_rate(dump: Path, scratch: Path, total: int) -> float:
    scratch.mkdir()
    start = time.perf_counter()
    for src in sorted((dump / "shards").glob("*.safetensors")):
        dst = scratch / src.name
        shutil.copyfile(src, dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())
    return total / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/bench_std")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--shard-mb", type=float, default=256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--no-verify", action="store_true", help="skip the inputs' sha256 check")
    args = p.parse_args()
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    total = make_dump(root / "dump", args.shards, args.shard_mb, args.hidden, args.seq)
    cold = drop_caches()
    copy = copy_rate(root / "dump", root / "copy", total)
    shutil.rmtree(root / "copy")
    drop_caches()
    cfg = StandardizeConfig(
        dumps=[str(root / "dump")],
        out=str(root / "std"),
        eval_fraction=0.05,
        draft_vocab_size=32000,
        workers=args.workers,
        verify_inputs=not args.no_verify,
        progress=False,
    )
    start = time.perf_counter()
    manifest = Standardizer(cfg).run()
    seconds = time.perf_counter() - start
    report = {
        "cpus": os.cpu_count(),
        "dump_bytes": total,
        "shards": args.shards,
        "page_cache_dropped": cold,
        "copy_gb_per_s": copy / 1e9,
        "standardize_gb_per_s": total / seconds / 1e9,
        "standardize_seconds": seconds,
        "ratio_to_copy": total / seconds / copy,
        "bytes_written": manifest["counts"]["bytes"],
        "verify_inputs": cfg.verify_inputs,
    }
    print(json.dumps(report, indent=2))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
