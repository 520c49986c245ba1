"""Dump throughput (issue #16): eagle3-dump against its forward-pass floor and against the naive
way, bytes per token, and data-parallel scaling. Not part of the test suite.

    python3 benchmarks/bench_dump.py --out $OUT/dump_bench.json           # 1-2 H200s, < 8 min
    python3 benchmarks/bench_dump.py --small --out /tmp/dump_bench.json   # CPU smoke test

Llama-3.1-8B shapes (random bf16 weights, the tiny byte-level tokenizer), `--samples` random
sequences of `--seq` tokens, capture [2, 16, 29] + the final state. Cases, each in its own process
(torchrun for 2 ranks) within its share of `--budget` seconds (a crash, hang or out-of-memory
loses only that case; the JSON is rewritten after each case and by each case after each figure):

- `floor`: the bf16 matmul rate (8192^3 products), the forward floor (decoder FLOPs per token over
  that rate, tokens/s), and the local disk's plain sequential write rate (fsync'd);
- `eager`: the capture loop alone (forward, token selection, finiteness; no copy, no disk) and the
  real `Dumper.run` to local disk with `storage=dtype` (bf16), the transformers forward uncompiled:
  the configuration of the previous results (dump_h200_8b.json);
- `fast`: the same two with `compile=true`, the dump with `storage=fp8`, to local disk, then to RAM
  (`--shm`): what the issue's goals are about;
- `naive`: one sample at a time through the full model with `output_hidden_states=True`, then
  `torch.save` of the chosen states per sample (the reference implementations' way);
- `dp2`: `fast`'s dumps (local disk, RAM) on 2 GPUs (torchrun, data parallel), twice the samples,
  so each GPU does the work of the 1-GPU run (both GPUs write to the same disk: if it is the limit,
  the RAM figure shows the scaling of the rest).

The summary: bytes per token (goal <= 16.5 KiB), `fast` to disk over the floor (goal >= 0.70) and
over `naive` (goal >= 3), `dp2` over `fast` (goal >= 1.9). Warm-ups (the compilation included)
are outside the timings; the inductor cache is shared by the cases (`<dir>/inductor`).
`--small` runs tiny shapes on the CPU (gloo for 2 ranks): numbers meaningless.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import launcher, matmul_rate, part_recorder, random_llama, run_isolated, run_suite, sync

GOALS = {"bytes_per_token_kib": 16.5, "ratio_to_floor": 0.70, "speedup_vs_naive": 3.0, "dp2_speedup": 1.9}
# name, ranks, seconds at most
SUITE = [("floor", 1, 60), ("eager", 1, 90), ("fast", 1, 150), ("naive", 1, 60), ("dp2", 2, 150)]


def forward_flops_per_token(cfg, seq: int) -> float:
    """Decoder FLOPs per token (no lm_head): 2 x linear weights + causal attention (mean context)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size
    attention = 2 * 2 * h * (seq + 1) / 2  # QK^T and AV over the mean causal context
    return layers * (2 * per_layer + attention)


def make_prepared(path: Path, target, samples: int, seq: int) -> None:
    """``samples`` random sequences of ``seq`` tokens as eagle3-prepare would leave them (manifest last)."""
    import pyarrow as pa
    from datasets import Dataset

    from eagle3_train.core.contract import write_manifest

    rng = np.random.default_rng(0)
    ids = rng.integers(0, target.config.vocab_size, size=(samples, seq), dtype=np.int32)
    offsets = np.arange(samples + 1, dtype=np.int32) * seq
    table = pa.table(
        {
            "sample_id": pa.array(np.arange(samples, dtype=np.int64)),
            "input_ids": pa.ListArray.from_arrays(offsets, ids.reshape(-1)),
            "loss_mask": pa.ListArray.from_arrays(offsets, np.ones(samples * seq, dtype=np.uint8)),
            "num_tokens": pa.array(np.full(samples, seq, dtype=np.int32)),
            "num_loss_tokens": pa.array(np.full(samples, seq, dtype=np.int32)),
            "source": pa.array([f"random[{i}]" for i in range(samples)]),
        }
    )
    Dataset(table).save_to_disk(str(path / "dataset"))
    write_manifest(path, "prepare", {"fingerprint": "bench", "target": target.identity.to_dict(), "dataset": "dataset"})


def prepared_for(a: argparse.Namespace, target, samples: int) -> Path:
    """This case's prepared data: made by rank 0, waited for by the others."""
    path = Path(a.dir) / f"{a.case}-prepared"
    if int(os.environ.get("RANK", 0)) == 0:
        make_prepared(path, target, samples, a.seq)
    deadline = time.monotonic() + 300
    while not (path / "manifest.json").is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was not prepared by rank 0")
        time.sleep(0.5)
    return path


def make_dumper(a: argparse.Namespace, target, prepared: Path, out: Path, storage: str, compile: bool):
    """The real Dumper on the random target, after a warm-up batch of the run's shape (kernels,
    allocator, the compilation)."""
    import data_prep.dump as dump
    import data_prep.dump.hf as hf
    import data_prep.dump.stage as stage

    stage.load_target = hf.load_target = lambda *args, **kw: target  # the random model built here
    n = target.config.num_hidden_layers
    cfg = dump.DumpConfig(
        target="bench",
        data=str(prepared),
        out=str(out),
        dtype=a.dtype,
        progress=False,
        storage=storage,
        compile=compile,
        max_tokens_per_batch=a.tokens_per_batch,
        shard_size_mb=a.shard_mb,
        writer_threads=a.writer_threads,
        capture=dump.CaptureConfig(aux_indices=[2, n // 2, n - 3]),
    )
    dumper = dump.Dumper(cfg)
    return dumper, warm_up(dumper, a.seq)


@torch.no_grad()  # as the dump runs it (a compiled layer is specialised to the grad mode)
def warm_up(dumper, seq: int) -> float:
    """Seconds of one batch of the run's shape (kernels, allocator, the compilation), on every rank."""
    import data_prep.dump.hf as hf

    width = max(1, dumper.cfg.max_tokens_per_batch // seq)
    start = time.perf_counter()
    dumper.backend.capture(hf.Batch(list(range(width)), [seq] * width))
    sync(dumper.dist.device)
    return time.perf_counter() - start


@torch.no_grad()
def compute_only(dumper) -> dict[str, Any]:
    """The capture loop alone (forward, token selection, finiteness check): no host copy, no disk.
    Each data-parallel group runs its share of the batches, as the dump would, timed between
    barriers: tokens/s of all ranks together."""
    import data_prep.dump.hf as hf
    from eagle3_train.core.dist import barrier

    cfg, backend = dumper.cfg, dumper.backend
    batches = hf.plan_batches(
        np.arange(len(dumper.dataset)), dumper.dataset["num_tokens"][:], cfg.max_tokens_per_batch, cfg.max_batch_size
    )
    barrier()
    start = time.perf_counter()
    for b in batches[backend.dp_rank :: backend.dp_size]:
        backend.capture(b)
    sync(dumper.dist.device)
    barrier()
    seconds = time.perf_counter() - start
    tokens = sum(sum(b.lengths) for b in batches)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def timed_run(dumper) -> dict[str, Any]:
    """``Dumper.run`` (claim, batches, writer, manifest), timed; tokens/s over all ranks."""
    from eagle3_train.core.dist import barrier

    barrier()
    start = time.perf_counter()
    manifest = dumper.run()
    seconds = time.perf_counter() - start
    if manifest is None:  # a rank other than 0
        return {}
    tokens = manifest["counts"]["tokens"]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "bytes_per_token": manifest["counts"]["bytes_per_token"],
        "shards": len(manifest["shards"]),
        "world_size": manifest["run"]["world_size"],
    }


def disk_write_rate(path: Path, gib: float) -> float:
    """Bytes/s of a plain sequential write with fsync, in 64 MiB blocks."""
    block = os.urandom(64 << 20)
    n = max(1, int(gib * 16))
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    rate = n * len(block) / (time.perf_counter() - start)
    path.unlink()
    return rate


@torch.no_grad()
def naive_run(a: argparse.Namespace, target, prepared: Path, out: Path, device: torch.device) -> dict[str, Any]:
    """One sample at a time, full model with output_hidden_states, torch.save per sample."""
    from datasets import load_from_disk

    ds = load_from_disk(str(prepared / "dataset")).with_format("numpy")
    n = target.config.num_hidden_layers
    aux = [2, n // 2, n - 3]
    out.mkdir(parents=True, exist_ok=True)
    samples = min(len(ds), a.naive_samples)
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


# -- one case, in its own process ---------------------------------------------------------------


def run_case(a: argparse.Namespace) -> None:
    """Measure ``a.case``; the part file ``a.out`` is rewritten after each figure."""
    record = part_recorder(a.out, a.case)

    device = torch.device("cpu") if a.small else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if a.case == "floor":
        size, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
        rate = matmul_rate(device, size, dtype)
        flops = forward_flops_per_token(random_llama(a.small, torch.device("meta")).config, a.seq)
        record("matmul_tflops", rate / 1e12)
        record("forward_gflop_per_token", flops / 1e9)
        record("floor_tokens_per_s", rate / flops)
        record("disk_write_gb_per_s", disk_write_rate(Path(a.dir) / "disk_probe", 0.05 if a.small else 4.0) / 1e9)
        return
    target = random_llama(a.small, device)
    samples = a.samples * (2 if a.case == "dp2" else 1)
    prepared = prepared_for(a, target, samples)
    scratch = Path(a.dir) / a.case
    if a.case == "naive":
        record("naive", naive_run(a, target, prepared, scratch, device))
        shutil.rmtree(scratch, ignore_errors=True)
    elif a.case in ("eager", "fast", "dp2"):
        storage, compiled = ("dtype", False) if a.case == "eager" else ("fp8", True)
        if a.case != "dp2":
            dumper, warm = make_dumper(a, target, prepared, scratch / "unused", storage, compiled)
            record("compute_only", compute_only(dumper) | {"warmup_s": warm})
        places = [("to_disk", scratch / "disk")]
        if a.case != "eager" and a.shm and Path(a.shm).is_dir():
            places.append(("to_ram", Path(a.shm) / f"bench_dump_{a.case}"))
        for key, where in places:
            shutil.rmtree(where, ignore_errors=True)
            dumper, warm = make_dumper(a, target, prepared, where, storage, compiled)
            record(key, timed_run(dumper) | {"warmup_s": warm})
            shutil.rmtree(where, ignore_errors=True)
    else:
        raise SystemExit(f"unknown case {a.case}")
    if device.type == "cuda":
        record("peak_gpu_memory_gib", torch.cuda.max_memory_allocated() / 2**30)


# -- the suite ----------------------------------------------------------------------------------


def suite(a: argparse.Namespace) -> None:
    """Every case of SUITE in its own process, within ``--budget`` seconds; results to ``--out``."""
    gpus = torch.cuda.device_count() if not a.small else 2
    results: dict[str, Any] = {
        "machine": f"{gpus} x {torch.cuda.get_device_name() if gpus and not a.small else 'cpu'}",
        "torch": torch.__version__,
        "shape": "tiny" if a.small else "llama-3.1-8b",
        "seq": a.seq,
        "samples": a.samples,
        "tokens_per_batch": a.tokens_per_batch,
        "shard_mb": a.shard_mb,
        "writer_threads": a.writer_threads,
        "budget_s": a.budget,
        "goals": GOALS,
        "cases": {},
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(a.dir, ignore_errors=True)
    Path(a.dir).mkdir(parents=True)
    ranks = {name: r for name, r, _ in SUITE}
    run_suite(
        SUITE,
        results,
        out,
        a.budget,
        gpus,
        a.cases,
        lambda name, seconds: case_process(name, ranks[name], seconds, a),
        summary,
        least=30,
    )
    shutil.rmtree(a.dir, ignore_errors=True)


def case_process(name: str, ranks: int, seconds: float, a: argparse.Namespace) -> dict[str, Any]:
    part = Path(a.dir) / f"{name}.part.json"
    options = [
        "--samples",
        str(a.samples),
        "--naive-samples",
        str(a.naive_samples),
        "--seq",
        str(a.seq),
        "--tokens-per-batch",
        str(a.tokens_per_batch),
        "--shard-mb",
        str(a.shard_mb),
        "--writer-threads",
        str(a.writer_threads),
        "--shm",
        a.shm,
        "--dir",
        a.dir,
    ]
    cmd = [
        *launcher(ranks),
        str(Path(__file__).resolve()),
        "--case",
        name,
        "--out",
        str(part),
        *options,
        *(["--small"] if a.small else []),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(Path(a.dir) / "inductor"))
    if ranks == 1 and not a.small:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    return run_isolated(cmd, part, seconds, env)


def summary(cases: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures from the cases there are, each with its goal."""
    s: dict[str, Any] = {}
    floor = cases.get("floor", {}).get("floor_tokens_per_s")
    fast = cases.get("fast", {}).get("to_disk", {})
    naive = cases.get("naive", {}).get("naive", {})
    if "bytes_per_token" in fast:
        s["bytes_per_token_kib"] = fast["bytes_per_token"] / 1024
    if floor:
        s["floor_tokens_per_s"] = floor
        for case, part in (
            ("eager", "compute_only"),
            ("eager", "to_disk"),
            ("fast", "compute_only"),
            ("fast", "to_disk"),
            ("fast", "to_ram"),
            ("naive", "naive"),
        ):
            if "tokens_per_s" in cases.get(case, {}).get(part, {}):
                s[f"{case}_{part}_ratio_to_floor".replace("naive_naive", "naive")] = (
                    cases[case][part]["tokens_per_s"] / floor
                )
        if "tokens_per_s" in fast:
            s["ratio_to_floor"] = fast["tokens_per_s"] / floor
    if "tokens_per_s" in fast and "tokens_per_s" in naive:
        s["speedup_vs_naive"] = fast["tokens_per_s"] / naive["tokens_per_s"]
    for part, key in (("to_disk", "dp2_speedup"), ("to_ram", "dp2_speedup_to_ram")):
        one, two = cases.get("fast", {}).get(part, {}), cases.get("dp2", {}).get(part, {})
        if "tokens_per_s" in one and "tokens_per_s" in two:
            s[key] = two["tokens_per_s"] / one["tokens_per_s"]
    s["goals_met"] = {
        k: (s[k] <= goal if k == "bytes_per_token_kib" else s[k] >= goal) for k, goal in GOALS.items() if k in s
    }
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results JSON (with --case: that case's part file)")
    p.add_argument("--dir", default="/tmp/bench_dump", help="scratch directory on the local disk (deleted first)")
    p.add_argument("--budget", type=float, default=460, help="seconds for all cases together")
    p.add_argument("--cases", default="", help="only these cases (comma-separated names)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in the process the suite starts
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--naive-samples", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--tokens-per-batch", type=int, default=16384)
    p.add_argument("--shard-mb", type=float, default=256)
    p.add_argument("--writer-threads", type=int, default=4)
    p.add_argument("--shm", default="/dev/shm", help="a RAM-backed directory for a disk-free run ('' to skip)")
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU: a smoke test of this script")
    a = p.parse_args()
    if a.small and a.samples == 256:
        a.samples, a.naive_samples, a.seq, a.tokens_per_batch, a.shard_mb = 16, 4, 256, 1024, 1
    a.dtype = "float32" if a.small else "bfloat16"
    if a.case:
        return run_case(a)
    return suite(a)


if __name__ == "__main__":
    main()
