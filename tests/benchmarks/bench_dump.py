"""Dump throughput: eagle3-dump against its forward-pass floor and against the naive way.

Not part of the test suite. On a GPU (Llama-3.1-8B shapes, random bf16 weights, seq 2048):

    python tests/benchmarks/bench_dump.py --out /tmp/bench_dump

Reports, in one run: the bf16 matmul rate (8192^3 products), the forward floor (FLOPs per token
over that rate), eagle3-dump's tokens/s (the real `Dumper.run`, shards written to --out) and its
ratio to the floor, bytes written per token; and the same for the naive way the reference
implementations use (one sample at a time through the full model with `output_hidden_states=True`,
then `torch.save` of the chosen states per sample). `--small` runs a tiny shape on the CPU as a
smoke test of the script.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from common import matmul_rate, random_llama, sync


def forward_flops_per_token(cfg, seq: int) -> float:
    """Decoder FLOPs per token (no lm_head): 2 x linear weights + causal attention (mean context)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size
    attention = 2 * 2 * h * (seq + 1) / 2  # QK^T and AV over the mean causal context
    return layers * (2 * per_layer + attention)


def make_prepared(path: Path, target, samples: int, seq: int) -> None:
    import pyarrow as pa
    from datasets import Dataset

    from eagle3_train.contract import write_manifest

    rng = np.random.default_rng(0)
    ids = rng.integers(0, target.config.vocab_size, size=(samples, seq), dtype=np.int32)
    offsets = np.arange(samples + 1, dtype=np.int32) * seq
    table = pa.table({
        "sample_id": pa.array(np.arange(samples, dtype=np.int64)),
        "input_ids": pa.ListArray.from_arrays(offsets, ids.reshape(-1)),
        "loss_mask": pa.ListArray.from_arrays(offsets, np.ones(samples * seq, dtype=np.uint8)),
        "num_tokens": pa.array(np.full(samples, seq, dtype=np.int32)),
        "num_loss_tokens": pa.array(np.full(samples, seq, dtype=np.int32)),
        "source": pa.array([f"random[{i}]" for i in range(samples)]),
    })
    Dataset(table).save_to_disk(str(path / "dataset"))
    write_manifest(path, "prepare", {"fingerprint": "bench", "target": target.identity.to_dict(), "dataset": "dataset"})


def make_dumper(args, target, prepared: Path, out: Path):
    import data_prep.dump as dump
    import data_prep.dump.hf as hf
    import data_prep.dump.stage as stage

    stage.load_target = hf.load_target = lambda *a, **k: target  # the random model built above
    n = target.config.num_hidden_layers
    cfg = dump.DumpConfig(target="bench", data=str(prepared), out=str(out), dtype=args.dtype, progress=False,
                          max_tokens_per_batch=args.tokens_per_batch, shard_size_mb=args.shard_mb,
                          writer_threads=args.writer_threads, capture=dump.CaptureConfig(aux_indices=[2, n // 2, n - 3]))
    dumper = dump.Dumper(cfg)
    # warm-up: one batch through the same code path (CUDA kernels, allocator)
    dumper.backend.capture(hf.Batch([0, 1], [args.seq] * 2))
    sync(dumper.dist.device)
    return dumper


@torch.no_grad()
def run_compute_only(args, target, prepared: Path) -> dict:
    """The capture loop alone (forward, token selection, finiteness check): no host copy, no disk."""
    import data_prep.dump.hf as hf

    dumper = make_dumper(args, target, prepared, Path(args.out) / "unused")
    batches = hf.plan_batches(np.arange(len(dumper.dataset)), dumper.dataset["num_tokens"][:],
                                args.tokens_per_batch, 256)
    start = time.perf_counter()
    for b in batches:
        dumper.backend.capture(b)
    sync(dumper.dist.device)
    seconds = time.perf_counter() - start
    tokens = sum(sum(b.lengths) for b in batches)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def disk_write_rate(path: Path, gib: float = 2.0) -> float:
    """Bytes/s of a plain sequential write with fsync, in 64 MiB blocks."""
    import os

    block = os.urandom(64 << 20)
    n = int(gib * 16)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    rate = n * len(block) / (time.perf_counter() - start)
    path.unlink()
    return rate


def run_ours(args, target, prepared: Path, out: Path) -> dict:
    dumper = make_dumper(args, target, prepared, out)
    start = time.perf_counter()
    manifest = dumper.run()
    seconds = time.perf_counter() - start
    tokens = manifest["counts"]["tokens"]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "bytes_per_token": manifest["counts"]["bytes_per_token"], "shards": len(manifest["shards"])}


@torch.no_grad()
def run_naive(args, target, prepared: Path, out: Path, device) -> dict:
    """One sample at a time, full model with output_hidden_states, torch.save per sample."""
    import os

    from datasets import load_from_disk

    ds = load_from_disk(str(prepared / "dataset")).with_format("numpy")
    n = target.config.num_hidden_layers
    aux = [2, n // 2, n - 3]
    out.mkdir(parents=True, exist_ok=True)
    samples = min(len(ds), args.naive_samples)
    target.model(torch.tensor(ds[0]["input_ids"][None].astype(np.int64), device=device), output_hidden_states=True)
    sync(device)
    start = time.perf_counter()
    tokens = written = 0
    for i in range(samples):
        ids = torch.tensor(ds[i]["input_ids"][None].astype(np.int64), device=device)
        hs = target.model(ids, output_hidden_states=True).hidden_states
        record = {
            "input_ids": ids[0].cpu(),
            "loss_mask": torch.tensor(ds[i]["loss_mask"]),
            "hidden_state": torch.cat([hs[k][0] for k in aux], dim=-1).cpu(),
            "target": hs[-1][0].cpu(),
        }
        path = out / f"data_{i}.ckpt"
        torch.save(record, path)
        tokens += ids.shape[1]
        written += path.stat().st_size
    os.sync()  # count the time until the files are on disk, as eagle3-dump's fsync does
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "bytes_per_token": written / tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/bench_dump", help="scratch directory (deleted first)")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--naive-samples", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--tokens-per-batch", type=int, default=16384)
    p.add_argument("--shard-mb", type=float, default=1024)
    p.add_argument("--writer-threads", type=int, default=4)
    p.add_argument("--shm", default="/dev/shm", help="a RAM-backed directory for a disk-free run ('' to skip)")
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU: a smoke test of this script")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rate = matmul_rate(device, 8192 if device.type == "cuda" else 1024, torch.bfloat16 if device.type == "cuda" else torch.float32)
    target = random_llama(args.small, device)
    flops = forward_flops_per_token(target.config, args.seq)
    floor = rate / flops
    make_prepared(root / "prepared", target, args.samples, args.seq)
    disk = disk_write_rate(root / "disk_probe")
    compute = run_compute_only(args, target, root / "prepared")
    ours = run_ours(args, target, root / "prepared", root / "ours")
    shutil.rmtree(root / "ours")
    in_ram = None
    if args.shm and Path(args.shm).is_dir():
        ram_dir = Path(args.shm) / "bench_dump_ours"
        shutil.rmtree(ram_dir, ignore_errors=True)
        in_ram = run_ours(args, target, root / "prepared", ram_dir)
        shutil.rmtree(ram_dir)
        in_ram["ratio_to_floor"] = in_ram["tokens_per_s"] / floor
    naive = run_naive(args, target, root / "prepared", root / "naive", device)
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "shape": "tiny" if args.small else "llama-3.1-8b", "seq": args.seq, "samples": args.samples,
        "matmul_tflops": rate / 1e12, "forward_gflop_per_token": flops / 1e9, "floor_tokens_per_s": floor,
        "disk_write_gb_per_s": disk / 1e9,
        "compute_only": compute | {"ratio_to_floor": compute["tokens_per_s"] / floor},
        "ours": ours | {"ratio_to_floor": ours["tokens_per_s"] / floor},
        "ours_to_ram": in_ram,
        "naive": naive | {"ratio_to_floor": naive["tokens_per_s"] / floor},
        "speedup_vs_naive": ours["tokens_per_s"] / naive["tokens_per_s"],
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    print(json.dumps(report, indent=2))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
