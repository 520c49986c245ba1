"""The dump stage: eagle3-dump's tokens/s against its forward-pass floor and against the naive way,
bytes per token, data-parallel scaling (``speed``); and two dumps of the same data compared sample by
sample, e.g. a served one against transformers' (``compare``).

    python3 -m benchmarks.dump speed --out benchmarks/results/dump_h200x2.json   # 1-2 GPUs, < 8 min
    python3 -m benchmarks.dump speed --small --out /tmp/dump.json                # CPU smoke test
    python3 -m benchmarks.dump compare runs/q/dump_hf runs/q/dump_vllm [more dumps ...]

``speed``: Llama-3.1-8B shapes (random bf16 weights, the tiny byte-level tokenizer), ``--samples``
random sequences of ``--seq`` tokens, capture [2, 16, 29] + the final state. Cases, each in its own
process (torchrun for 2 ranks) within its share of ``--budget``:

- ``floor``: the bf16 matmul rate, the forward floor (decoder FLOPs per token over it), the disk's
  sequential write rate;
- ``eager``: the capture loop alone (no copy, no disk), then ``Dumper.run`` to disk, bf16 storage;
- ``fast``: the same with ``compile=true`` and fp8 storage, to disk, then to RAM (``--shm``);
- ``naive``: one sample at a time with ``output_hidden_states=True`` and ``torch.save`` per sample;
- ``dp2``: ``fast``'s dumps on 2 GPUs with twice the samples.

Goals: bytes per token <= 16.5 KiB, ``fast`` to disk >= 0.70 of the floor and >= 3x ``naive``,
``dp2`` >= 1.9x ``fast``. ``compare``: per stored key, the largest absolute difference and the
relative error ||a - b|| / ||a|| over the samples both hold (ids and masks: the share of identical
samples); engines compute in their own kernels, so bf16-level differences are expected, a wrong
layer reads near 1.
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

from benchmarks.lab import launcher, matmul_rate, part_recorder, random_llama, run_isolated, run_suite, sync
from benchmarks.result import Result, this_command

GOALS = {"bytes_per_token_kib": 16.5, "ratio_to_floor": 0.70, "speedup_vs_naive": 3.0, "dp2_speedup": 1.9}
SUITE = [("floor", 1, 60), ("eager", 1, 90), ("fast", 1, 150), ("naive", 1, 60), ("dp2", 2, 150)]
TOKENS_PER_BATCH, SHARD_MB, WRITER_THREADS = 16384, 256, 4


def forward_flops_per_token(cfg: Any, seq: int) -> float:
    """Decoder FLOPs per token (no lm_head): 2 x linear weights + causal attention (mean context)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size
    attention = 2 * 2 * h * (seq + 1) / 2  # QK^T and AV over the mean causal context
    return layers * (2 * per_layer + attention)


def make_prepared(path: Path, target: Any, samples: int, seq: int) -> None:
    """``samples`` random sequences of ``seq`` tokens as eagle3-prepare would leave them (manifest last)."""
    import pyarrow as pa
    from datasets import Dataset

    from eagle3_train.core.contract import write_manifest

    ids = np.random.default_rng(0).integers(0, target.config.vocab_size, size=(samples, seq), dtype=np.int32)
    offsets = np.arange(samples + 1, dtype=np.int32) * seq
    table = pa.table({
        "sample_id": pa.array(np.arange(samples, dtype=np.int64)),
        "input_ids": pa.ListArray.from_arrays(offsets, ids.reshape(-1)),
        "loss_mask": pa.ListArray.from_arrays(offsets, np.ones(samples * seq, dtype=np.uint8)),
        "num_tokens": pa.array(np.full(samples, seq, dtype=np.int32)),
        "num_loss_tokens": pa.array(np.full(samples, seq, dtype=np.int32)),
        "source": pa.array([f"random[{i}]" for i in range(samples)]),
    })  # fmt: skip
    Dataset(table).save_to_disk(str(path / "dataset"))
    write_manifest(path, "prepare", {"fingerprint": "bench", "target": target.identity.to_dict(), "dataset": "dataset"})


def prepared_for(a: argparse.Namespace, target: Any, samples: int) -> Path:
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


def make_dumper(a: argparse.Namespace, target: Any, prepared: Path, out: Path, storage: str, compile: bool) -> Any:
    """The real Dumper on the random target, after a warm-up batch of the run's shape."""
    import data_prep.dump as dump
    import data_prep.dump.hf as hf
    import data_prep.dump.stage as stage

    stage.load_target = hf.load_target = lambda *args, **kw: target  # the random model built here
    n = target.config.num_hidden_layers
    cfg = dump.DumpConfig(
        target="bench", data=str(prepared), out=str(out), dtype=a.dtype, progress=False, storage=storage,
        compile=compile, max_tokens_per_batch=a.tokens_per_batch, shard_size_mb=a.shard_mb,
        writer_threads=WRITER_THREADS, capture=dump.CaptureConfig(aux_indices=[2, n // 2, n - 3]),
    )  # fmt: skip
    dumper = dump.Dumper(cfg)
    width = max(1, a.tokens_per_batch // a.seq)
    start = time.perf_counter()
    with torch.no_grad():  # as the dump runs (a compiled layer is specialised to the grad mode)
        dumper.backend.capture(hf.Batch(list(range(width)), [a.seq] * width))
    sync(dumper.dist.device)
    return dumper, time.perf_counter() - start


@torch.no_grad()
def compute_only(dumper: Any) -> dict[str, Any]:
    """The capture loop alone (forward, token selection, finiteness check), each data-parallel group
    on its share of the batches, timed between barriers: tokens/s of all ranks together."""
    import data_prep.dump.hf as hf
    from eagle3_train.core.dist import barrier

    cfg, backend = dumper.cfg, dumper.backend
    lengths = dumper.dataset["num_tokens"][:]
    batches = hf.plan_batches(np.arange(len(dumper.dataset)), lengths, cfg.max_tokens_per_batch, cfg.max_batch_size)
    barrier()
    start = time.perf_counter()
    for b in batches[backend.dp_rank :: backend.dp_size]:
        backend.capture(b)
    sync(dumper.dist.device)
    barrier()
    seconds = time.perf_counter() - start
    tokens = sum(sum(b.lengths) for b in batches)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def timed_run(dumper: Any) -> dict[str, Any]:
    """``Dumper.run`` (claim, batches, writer, manifest), timed; tokens/s over all ranks."""
    from eagle3_train.core.dist import barrier

    barrier()
    start = time.perf_counter()
    manifest = dumper.run()
    seconds = time.perf_counter() - start
    if manifest is None:  # a rank other than 0
        return {}
    counts = manifest["counts"]
    return {"tokens": counts["tokens"], "seconds": seconds, "tokens_per_s": counts["tokens"] / seconds,
            "bytes_per_token": counts["bytes_per_token"], "world_size": manifest["run"]["world_size"]}  # fmt: skip


def disk_write_rate(path: Path, gib: float) -> float:
    """Bytes/s of a plain sequential write with fsync, in 64 MiB blocks."""
    block, n = os.urandom(64 << 20), max(1, int(gib * 16))
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    path.unlink()
    return n * len(block) / (time.perf_counter() - start)


@torch.no_grad()
def naive_run(target: Any, prepared: Path, out: Path, samples: int, device: torch.device) -> dict[str, Any]:
    """One sample at a time, the full model with output_hidden_states, torch.save per sample."""
    from datasets import load_from_disk

    ds = load_from_disk(str(prepared / "dataset")).with_format("numpy")
    n = target.config.num_hidden_layers
    out.mkdir(parents=True, exist_ok=True)
    ids_of = lambda i: torch.tensor(ds[i]["input_ids"][None].astype(np.int64), device=device)  # noqa: E731
    target.model(ids_of(0), output_hidden_states=True)
    sync(device)
    start, tokens, written = time.perf_counter(), 0, 0
    for i in range(min(len(ds), samples)):
        ids = ids_of(i)
        hs = target.model(ids, output_hidden_states=True).hidden_states
        record = {"input_ids": ids[0].cpu(), "loss_mask": torch.tensor(ds[i]["loss_mask"]),
                  "hidden_state": torch.cat([hs[k][0] for k in (2, n // 2, n - 3)], -1).cpu(), "target": hs[-1][0].cpu()}  # fmt: skip
        torch.save(record, out / f"data_{i}.ckpt")
        tokens += ids.shape[1]
        written += (out / f"data_{i}.ckpt").stat().st_size
    os.sync()  # until the files are on disk, as eagle3-dump's fsync does
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "bytes_per_token": written / tokens}


def run_case(a: argparse.Namespace) -> None:
    """Measure ``a.case`` in this process; its part file is rewritten after each figure."""
    record = part_recorder(a.out)
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
    prepared = prepared_for(a, target, a.samples * (2 if a.case == "dp2" else 1))
    scratch = Path(a.dir) / a.case
    if a.case == "naive":
        record("naive", naive_run(target, prepared, scratch, a.samples // 8, device))
        shutil.rmtree(scratch, ignore_errors=True)
    else:
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
    if device.type == "cuda":
        record("peak_gpu_memory_gib", torch.cuda.max_memory_allocated() / 2**30)


def summary(cases: dict[str, Any]) -> dict[str, Any]:
    """The goals' figures from the cases there are, and which goals are met."""
    s: dict[str, Any] = {}
    tps = lambda case, part: cases.get(case, {}).get(part, {}).get("tokens_per_s")  # noqa: E731
    floor, fast, naive = cases.get("floor", {}).get("floor_tokens_per_s"), tps("fast", "to_disk"), tps("naive", "naive")
    if "bytes_per_token" in cases.get("fast", {}).get("to_disk", {}):
        s["bytes_per_token_kib"] = cases["fast"]["to_disk"]["bytes_per_token"] / 1024
    for case, part in (("eager", "compute_only"), ("eager", "to_disk"), ("fast", "compute_only"), ("fast", "to_ram")):
        if floor and tps(case, part):
            s[f"{case}_{part}_ratio_to_floor"] = tps(case, part) / floor
    if floor and fast:
        s["ratio_to_floor"] = fast / floor
    if fast and naive:
        s["speedup_vs_naive"] = fast / naive
    for part, key in (("to_disk", "dp2_speedup"), ("to_ram", "dp2_speedup_to_ram")):
        if tps("fast", part) and tps("dp2", part):
            s[key] = tps("dp2", part) / tps("fast", part)
    s["goals_met"] = {k: s[k] <= g if k == "bytes_per_token_kib" else s[k] >= g for k, g in GOALS.items() if k in s}
    return s


def speed(a: argparse.Namespace) -> None:
    """Every case in its own process within ``--budget`` seconds; the results file after each case."""
    gpus = 2 if a.small else torch.cuda.device_count()
    shutil.rmtree(a.dir, ignore_errors=True)
    Path(a.dir).mkdir(parents=True)
    settings = {"shape": "tiny" if a.small else "llama-3.1-8b", "seq": a.seq, "samples": a.samples,
                "tokens_per_batch": a.tokens_per_batch, "goals": GOALS}  # fmt: skip
    result = Result(
        what="eagle3-dump's tokens/s against its forward floor and the naive way, bytes per token, 2-GPU scaling",
        command=a.command,
        figures=settings,
    )

    def save(cases: dict[str, Any]) -> None:
        result.figures = {**settings, "summary": summary(cases), "cases": cases}
        result.write(a.out)

    def case(name: str, seconds: float) -> dict[str, Any]:
        part = Path(a.dir) / f"{name}.part.json"
        ranks = next(r for n, r, _ in SUITE if n == name)
        flags = ["--case", name, "--out", str(part), "--samples", str(a.samples), "--seq", str(a.seq),
                 "--shm", a.shm, "--dir", a.dir] + (["--small"] if a.small else [])  # fmt: skip
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(a.dir) / "inductor"))
        if ranks == 1 and not a.small:
            env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        return run_isolated([*launcher(ranks, "benchmarks.dump"), "speed", *flags], part, seconds, env)

    run_suite(SUITE, a.budget, gpus, a.cases, case, save, least=30)
    shutil.rmtree(a.dir, ignore_errors=True)


def samples(dump: Path, ids: set[int] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """The stored samples of ``dump`` by sample id (only ``ids``, when given), fp8 decoded."""
    from eagle3_train.core.formats import iter_samples, read_shard
    from eagle3_train.core.storage import decode

    out = {}
    for shard in sorted((dump / "shards").glob("*.safetensors")):
        t = decode(read_shard(shard))
        for sid, sl in iter_samples(t):
            if ids is None or sid in ids:
                out[sid] = {k: v[sl].clone() for k, v in t.items() if k not in ("cu_seqlens", "sample_ids")}
    return out


def compare(a: Path, b: Path, ids: set[int] | None = None) -> dict[str, dict[str, float]]:
    """Per key: the largest absolute difference and the relative L2 error over the samples both dumps
    hold; ids and masks: the share of identical samples."""
    sa, sb = samples(a, ids), samples(b, ids)
    common = sorted(set(sa) & set(sb))
    report: dict[str, dict[str, float]] = {}
    for key in sorted(set(sa[common[0]]) & set(sb[common[0]])) if common else []:
        if key in ("input_ids", "loss_mask"):
            report[key] = {"identical_samples": sum(torch.equal(sa[s][key], sb[s][key]) for s in common) / len(common)}
            continue
        pairs = [(sa[s][key].double(), sb[s][key].double()) for s in common]
        diff2, ref2 = sum((x - y).pow(2).sum().item() for x, y in pairs), sum(x.pow(2).sum().item() for x, _ in pairs)
        report[key] = {
            "max_abs": max((x - y).abs().max().item() for x, y in pairs),
            "rel_l2": (diff2 / max(ref2, 1e-30)) ** 0.5,
        }
    report["samples"] = {"first": len(sa), "second": len(sb), "common": len(common)}
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed", help="tokens/s of the dump against its floor, the naive way, and 2 GPUs")
    s.add_argument("--out", required=True, help="results JSON (with --case: that case's part file)")
    s.add_argument("--dir", default="/tmp/bench_dump", help="scratch directory on the local disk (deleted first)")
    s.add_argument("--budget", type=float, default=460, help="seconds for all cases together")
    s.add_argument(
        "--cases", default="", help="only these cases (comma-separated: " + ",".join(n for n, _, _ in SUITE) + ")"
    )
    s.add_argument("--case", help=argparse.SUPPRESS)  # one case, in the process the suite starts
    s.add_argument("--samples", type=int, default=None, help="random sequences (256; 16 with --small)")
    s.add_argument("--seq", type=int, default=None, help="tokens per sequence (2048; 256 with --small)")
    s.add_argument("--shm", default="/dev/shm", help="a RAM-backed directory for a disk-free run ('' to skip)")
    s.add_argument("--small", action="store_true", help="tiny shapes on the CPU: a smoke test, numbers meaningless")
    c = sub.add_parser("compare", help="two dumps or more of the same data, sample by sample")
    c.add_argument("dumps", nargs="+", help="the reference dump first, then the others")
    a = p.parse_args(argv)
    a.command = this_command("dump", argv)
    if a.what == "compare":
        from eagle3_train.core.contract import read_manifest

        dumps = [Path(d) for d in a.dumps]
        for d in dumps:
            read_manifest(d, "dump")  # a finished dump
        for other in dumps[1:]:
            print(f"{dumps[0]}  vs  {other}")
            for key, stats in compare(dumps[0], other).items():
                print(f"  {key:14s} " + "  ".join(f"{k}={v:.3g}" for k, v in stats.items()))
        return
    a.samples = a.samples or (16 if a.small else 256)
    a.seq = a.seq or (256 if a.small else 2048)
    a.tokens_per_batch, a.shard_mb = (1024, 1) if a.small else (TOKENS_PER_BATCH, SHARD_MB)
    a.dtype = "float32" if a.small else "bfloat16"
    return run_case(a) if a.case else speed(a)


if __name__ == "__main__":
    main()
