"""Node scale (issue #20): eagle3-dump data parallel and tensor x data parallel, and training with
ZeRO-2 and ZeRO-3, on every GPU of one machine against that many times one GPU; the same states
from every dump layout; a killed ZeRO-3 run resumed on all ranks trains as an uninterrupted one.
Not part of the test suite.

    python3 benchmarks/bench_node.py --out $W/node_bench.json             # 8 H200s, ~13 min
    python3 benchmarks/bench_node.py --small --out /tmp/node_bench.json   # CPU smoke test, 4 ranks (gloo)

W, the world size, is the number of GPUs present (`--small`: 4 CPU ranks); the 8 in the case names
is W. Scaling is weak: every GPU gets the work of the one-GPU case, and efficiency = tokens/s over
W x the one-GPU tokens/s measured in the same run (goal >= 0.90). Cases, each in its own process
(torchrun for W ranks) within its share of `--budget` seconds (a crash, hang or out-of-memory loses
only that case; the JSON is rewritten after each case and by each case after each figure):

- `target`: a Llama-3.1-8B-shaped target with random bf16 weights (seed 0; `--small`: tiny, fp32)
  saved as a transformers directory with the tiny byte-level tokenizer, so every layout loads the
  same weights the way eagle3-dump does (tensor parallelism shards them as they load); random
  prepared data: `--samples` sequences of `--seq` tokens, and W times as many (the same first rows);
- `dump_1gpu`, `dump_dp8` (W data-parallel ranks), `dump_tp2dp4` (tp_size=2, W/2 copies): the
  real `Dumper` (compile=true, storage=fp8, capture [2, 16, 29] + final), W x the samples on W
  ranks. Each: the capture loop alone (forward, selection; no copy, no disk), then `Dumper.run`
  to `--dump-dir` (RAM by default: one disk shared by W writers would be the limit, and the dump
  writes 16 KiB per token), after a warm-up batch (the compilation included); then the shards
  holding the check samples are kept under `--dir` and the dump is deleted. A tp_size below W
  needs a transformers whose from_pretrained takes the tensor-parallel mesh (the H200 image's 5.17
  does; the dump refuses it with 5.24: README, Stage 2, Parallel);
- `dump_equal`: those samples' states, 1 GPU against each layout (benchmarks/compare_dumps.py):
  the same ids and masks, and every state within `EQUAL_REL_L2` (bf16 compute, fp8 storage);
- `train_1gpu` (grad_accum W), `train_zero2_8`, `train_zero3_8` (W ranks, grad_accum 1: the same
  global batch): benchmarks/bench_train.py on the 8B head (seq 2048, ttt 7, bf16, eager),
  2 warm-up then 10 timed optimizer steps; ZeRO-3 with `head_chunk=0`, as the trainer requires;
- `resume_8`: eagle3-train (`deepspeed=zero3`) on W ranks with the tiny target and small data, 6
  steps: uninterrupted, and killed after its step-4 checkpoint then run again (`resume=auto`); the
  losses of every step and the final weights compared (`RESUME_RTOL`).

`--small` runs tiny shapes on the CPU: numbers meaningless, a smoke test of the script.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import launcher, part_recorder, random_llama, run_isolated, run_suite

GOAL = 0.90  # each scaling efficiency
# Layouts differ in bf16 rounding (a tensor-parallel layer sums partial products in another order)
# and fp8 storage turns a rounding difference into one e4m3 step (1/16) of that element; a wrong
# layer, sample or shard order gives a relative error near 1 or more.
EQUAL_REL_L2 = 0.05
# A resumed run repeats the uninterrupted one's arithmetic; on the GPU, bf16 kernels that reduce
# in a varying order may differ in the last bits. A lost optimizer state or data position changes
# losses and weights by far more.
RESUME_RTOL = 1e-3
RESUME_STEPS, RESUME_SAVE_EVERY, RESUME_KILL_AFTER = 6, 2, 4
TESTS = Path(__file__).resolve().parents[1]
BENCH_TRAIN = Path(__file__).resolve().with_name("bench_train.py")
Record = Callable[[str, Any], None]  # a case's figure by name, written out at once


def suite_cases(world: int) -> list[tuple[str, int, float]]:
    """(name, ranks, seconds at most) in order; W-rank layouts need at least 2 ranks, TP2 x DP 4."""
    dp, tp = max(world, 2), max(world - world % 2, 4)
    return [
        ("target", 1, 300),
        ("dump_1gpu", 1, 240),
        ("dump_dp8", dp, 300),
        ("dump_tp2dp4", tp, 300),
        ("dump_equal", 1, 120),
        ("train_1gpu", 1, 180),
        ("train_zero2_8", dp, 180),
        ("train_zero3_8", dp, 240),
        ("resume_8", dp, 360),
    ]


DUMP_TP = {"dump_1gpu": 1, "dump_dp8": 1, "dump_tp2dp4": 2}
TRAIN = {"train_1gpu": 2, "train_zero2_8": 2, "train_zero3_8": 3}  # ZeRO stage


# -- one case, in its own process ---------------------------------------------------------------


def run_case(a: argparse.Namespace) -> None:
    """Measure ``a.case``; rank 0 rewrites the part file ``a.out`` after each figure."""
    record = part_recorder(a.out, a.case, limit=1000)

    if a.case == "target":
        make_target(a, record)
    elif a.case in DUMP_TP:
        dump_case(a, DUMP_TP[a.case], record)
    elif a.case == "dump_equal":
        dump_equal(a, record)
    elif a.case == "resume_8":
        resume_case(a, record)
    else:
        raise SystemExit(f"unknown case {a.case}")


def make_target(a: argparse.Namespace, record: Record) -> None:
    from bench_dump import make_prepared

    device = torch.device("cpu" if a.small else "cuda")
    torch.manual_seed(0)
    target = random_llama(a.small, device)
    start = time.perf_counter()
    path = Path(a.dir) / "target"
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    record(
        "target",
        {
            "path": str(path),
            "parameters": sum(p.numel() for p in target.model.parameters()),
            "dtype": str(target.model.dtype),
            "save_s": time.perf_counter() - start,
        },
    )
    for name, samples in (("prepared-1", a.samples), ("prepared-all", a.samples * a.world)):
        make_prepared(Path(a.dir) / name, target, samples, a.seq)
    record("prepared", {"samples_1gpu": a.samples, "samples_all": a.samples * a.world, "seq": a.seq})


def check_ids(a: argparse.Namespace) -> list[int]:
    """Sample ids compared across layouts: one from each of the first W batches (a different
    position in each), so every data-parallel rank of each layout wrote one, and the last."""
    width = max(1, a.tokens_per_batch // a.seq)
    batches = -(-a.samples // width)
    return sorted({b * width + b % width for b in range(min(a.world, batches))} | {a.samples - 1})


def dump_case(a: argparse.Namespace, tp: int, record: Record) -> None:
    from bench_dump import compute_only, timed_run, warm_up

    import data_prep.dump as dump
    from eagle3_train.core.formats import read_keys

    world = int(os.environ.get("WORLD_SIZE", 1))
    prepared = Path(a.dir) / ("prepared-1" if world == 1 else "prepared-all")
    out = Path(a.dump_dir) / a.case
    n = 8 if a.small else 32
    cfg = dump.DumpConfig(
        target=str(Path(a.dir) / "target"),
        data=str(prepared),
        out=str(out),
        dtype=a.dtype,
        progress=False,
        storage="fp8",
        compile=True,
        tp_size=tp,
        max_tokens_per_batch=a.tokens_per_batch,
        shard_size_mb=a.shard_mb,
        writer_threads=a.writer_threads,
        capture=dump.CaptureConfig(aux_indices=[2, n // 2, n - 3]),
    )
    start = time.perf_counter()
    dumper = dump.Dumper(cfg)
    dumper.backend.model()  # the weights, loaded (and sharded) here
    layout = f"tp{tp} x dp{world // tp}" if tp > 1 else f"dp{world}"
    record(
        "layout",
        {
            "world_size": world,
            "tp_size": tp,
            "data_parallel": world // tp,
            "desc": layout,
            "load_s": time.perf_counter() - start,
        },
    )
    warm = warm_up(dumper, a.seq)
    record("compute_only", compute_only(dumper) | {"warmup_s": warm})
    record("dump", timed_run(dumper) | {"where": str(out)})
    if dumper.dist.device.type == "cuda":
        peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30, device=dumper.dist.device)
        if world > 1:
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        record("peak_gpu_memory_gib", peak.item())
    if dumper.dist.rank == 0:  # keep the shards that hold the check samples, drop the dump
        ids, keep = set(check_ids(a)), Path(a.dir) / f"{a.case}-check"
        shutil.rmtree(keep, ignore_errors=True)
        (keep / "shards").mkdir(parents=True)
        for shard in sorted((out / "shards").glob("*.safetensors")):
            if ids & set(read_keys(shard, ("sample_ids",))["sample_ids"].tolist()):
                shutil.copy(shard, keep / "shards")
                shutil.copy(shard.with_suffix(".json"), keep / "shards")
        shutil.rmtree(out, ignore_errors=True)
        record("kept_for_check", {"shards": len(list((keep / "shards").glob("*.safetensors")))})
    dumper.backend.close()


def dump_equal(a: argparse.Namespace, record: Record) -> None:
    from compare_dumps import compare

    ids = check_ids(a)
    base = Path(a.dir) / "dump_1gpu-check"
    record("sample_ids", ids)
    for other in ("dump_dp8", "dump_tp2dp4"):
        kept = Path(a.dir) / f"{other}-check"
        if not (base / "shards").is_dir() or not (kept / "shards").is_dir():
            record(other, {"equal": None, "missing": "dump_1gpu or this layout kept no shards (it did not finish)"})
            continue
        report = compare(base, kept, set(ids))
        states = {k: v for k, v in report.items() if "rel_l2" in v}
        report["equal"] = (
            report["samples"]["common"] == len(ids)
            and bool(states)
            and all(report[k]["identical_samples"] == 1.0 for k in ("input_ids", "loss_mask"))
            and all(v["rel_l2"] <= EQUAL_REL_L2 for v in states.values())
        )
        record(other, report)


def resume_case(a: argparse.Namespace, record: Record) -> None:
    """Small data from the tiny target (the tests' helpers), then eagle3-train with ZeRO-3 on W
    ranks: uninterrupted, and killed after a checkpoint then resumed; losses and weights compared."""
    sys.path.insert(0, str(TESTS))
    from safetensors.torch import load_file

    from eagle3_train.core.faults import FAULT_ENV
    from test_standardize import make_dump
    from test_trainer import metrics, standardized

    root = Path(a.dir) / "resume"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    std = standardized(make_dump(root, "d", n=a.resume_samples), root / "std", 320)
    overrides = [
        f"data={std}",
        "target=tiny",
        "progress=false",
        "deepspeed=zero3",
        "train.ttt_length=3",
        "train.lr=3e-3",
        f"train.max_tokens_per_batch={a.resume_tokens}",
        "train.log_every=1",
        "train.epochs=1",
        f"train.max_steps={RESUME_STEPS}",
        f"train.save_every={RESUME_SAVE_EVERY}",
    ]

    def train(out: Path, kill_after: int = 0) -> dict[str, Any]:
        cmd = [*launcher(a.world), "-m", "eagle3_train.training.trainer", *overrides, f"out={out}"]
        # killed once the step after the checkpoint at kill_after is computed (eagle3_train/core/faults.py)
        env = dict(os.environ, **({FAULT_ENV: f"train.step:{kill_after + 1}"} if kill_after else {}))
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.resume_timeout)
        return {
            "exit": proc.returncode,
            "seconds": time.perf_counter() - start,
            "output_tail": (proc.stdout + proc.stderr)[-1500:] if bool(proc.returncode) != bool(kill_after) else None,
            "resumed": "resumed from" in proc.stdout + proc.stderr,
        }

    runs = {"whole": train(root / "whole")}
    record("whole", runs["whole"])
    runs["killed"] = train(root / "cut", kill_after=RESUME_KILL_AFTER)
    runs["killed"]["checkpoints"] = sorted(p.name for p in (root / "cut" / "checkpoints").glob("step*"))
    record("killed", runs["killed"])
    runs["resumed"] = train(root / "cut")
    record("resumed", runs["resumed"])
    if runs["whole"]["exit"] or runs["resumed"]["exit"] or not runs["killed"]["exit"]:
        record("equal", False)
        return

    def losses(out: Path) -> dict[int, float]:
        return {m["step"]: m["loss"] for m in metrics(out) if "loss" in m}

    def last_weights(out: Path) -> dict[str, torch.Tensor]:
        last = max((out / "checkpoints").glob("step*"), key=lambda p: int(p.name[4:]))
        return load_file(str(last / "draft.safetensors"))

    la, lb = losses(root / "whole"), losses(root / "cut")
    wa, wb = last_weights(root / "whole"), last_weights(root / "cut")
    loss_diff = max((abs(la[s] - lb[s]) / abs(la[s]) for s in la if s in lb), default=float("inf"))
    weight_diff = {
        k: ((wa[k].double() - wb[k].double()).norm() / wa[k].double().norm().clamp_min(1e-30)).item()
        for k in wa
        if wa[k].is_floating_point()
    }
    record(
        "comparison",
        {
            "steps": sorted(la),
            "steps_resumed_run": sorted(lb),
            "loss_max_rel_diff": loss_diff,
            "losses_bitwise_equal": la == lb,
            "weights_max_rel_l2": max(weight_diff.values()),
            "weights_bitwise_equal": all(torch.equal(wa[k], wb[k]) for k in wa),
        },
    )
    record(
        "equal",
        sorted(la) == sorted(lb) == list(range(1, RESUME_STEPS + 1))
        and runs["resumed"]["resumed"]
        and loss_diff <= RESUME_RTOL
        and max(weight_diff.values()) <= RESUME_RTOL,
    )


# -- the suite ----------------------------------------------------------------------------------


def suite(a: argparse.Namespace) -> None:
    """Every case in its own process, within ``--budget`` seconds; results to ``--out``."""
    gpus = a.world if a.small else torch.cuda.device_count()
    cases = suite_cases(a.world)
    for d in (a.dir, a.dump_dir):
        shutil.rmtree(d, ignore_errors=True)
        Path(d).mkdir(parents=True)
    results: dict[str, Any] = {
        "machine": f"{gpus} x {torch.cuda.get_device_name() if gpus and not a.small else 'cpu'}",
        "torch": torch.__version__,
        "shape": "tiny" if a.small else "llama-3.1-8b",
        "world_size": a.world,
        "seq": a.seq,
        "samples_per_gpu": a.samples,
        "tokens_per_batch": a.tokens_per_batch,
        "shard_mb": a.shard_mb,
        "writer_threads": a.writer_threads,
        "dump_dir": a.dump_dir,
        "dump_dir_free_gib": shutil.disk_usage(a.dump_dir).free / 2**30,
        "budget_s": a.budget,
        "goal_efficiency": GOAL,
        "equal_rel_l2": EQUAL_REL_L2,
        "resume_rtol": RESUME_RTOL,
        "cases": {},
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ranks = {name: r for name, r, _ in cases}
    run_suite(
        cases,
        results,
        out,
        a.budget,
        gpus,
        a.cases,
        lambda name, seconds: case_process(name, ranks[name], seconds, a),
        summary,
        least=30,
    )
    for d in (a.dir, a.dump_dir):
        shutil.rmtree(d, ignore_errors=True)


def case_process(name: str, ranks: int, seconds: float, a: argparse.Namespace) -> dict[str, Any]:
    part = Path(a.dir) / f"{name}.part.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(Path(a.dir) / "inductor"))
    if a.small:
        env["OMP_NUM_THREADS"] = "1"
    elif ranks == 1:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    if name in TRAIN:
        zero = TRAIN[name]
        options = [
            "--seqs",
            "256" if a.small else str(a.seq),
            "--grad-accum",
            str(a.world if ranks == 1 else 1),
            "--zero",
            str(zero),
            *(["--head-chunk", "0"] if zero == 3 else []),
            *(["--small", "--steps", "2"] if a.small else []),
        ]
        return run_isolated([*launcher(ranks), str(BENCH_TRAIN), *options, "--out", str(part)], part, seconds, env)
    if name in DUMP_TP:
        need = dump_bytes(a, 1 if ranks == 1 else a.world)
        free = shutil.disk_usage(a.dump_dir).free
        if free < 1.1 * need:
            return {
                "error": f"{a.dump_dir} has {free / 2**30:.1f} GiB free, the dump needs {need / 2**30:.1f} GiB: "
                f"give --dump-dir a place with room (RAM, so the disk does not limit W writers)"
            }
    options = [
        "--world",
        str(a.world),
        "--samples",
        str(a.samples),
        "--seq",
        str(a.seq),
        "--tokens-per-batch",
        str(a.tokens_per_batch),
        "--shard-mb",
        str(a.shard_mb),
        "--writer-threads",
        str(a.writer_threads),
        "--dir",
        a.dir,
        "--dump-dir",
        a.dump_dir,
        "--resume-samples",
        str(a.resume_samples),
        "--resume-tokens",
        str(a.resume_tokens),
        "--resume-timeout",
        str(max(60, int(seconds / 3))),
    ]
    launch = launcher(1 if name == "resume_8" else ranks)  # resume_8 starts its own W-rank runs
    cmd = [
        *launch,
        str(Path(__file__).resolve()),
        "--case",
        name,
        "--out",
        str(part),
        *options,
        *(["--small"] if a.small else []),
    ]
    return run_isolated(cmd, part, seconds, env)


def dump_bytes(a: argparse.Namespace, gpus: int) -> float:
    """Bytes the dump of ``gpus`` x ``--samples`` writes: fp8 states of the 3 aux layers and the
    final one with a float32 scale per token each, plus ids, mask and offsets."""
    hidden = 256 if a.small else 4096
    return gpus * a.samples * a.seq * (4 * (hidden + 4) + 13)


def summary(cases: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures from the cases there are: efficiencies with their goal, the state
    comparison, the resume."""
    s: dict[str, Any] = {}
    one = cases.get("dump_1gpu", {})
    for name, key in (("dump_dp8", "dump_dp"), ("dump_tp2dp4", "dump_tp2dp")):
        many = cases.get(name, {})
        world = many.get("layout", {}).get("world_size")
        for part in ("compute_only", "dump"):
            if world and "tokens_per_s" in one.get(part, {}) and "tokens_per_s" in many.get(part, {}):
                s[f"{key}_{part}_efficiency"] = many[part]["tokens_per_s"] / (world * one[part]["tokens_per_s"])
    if "tokens_per_s" in one.get("dump", {}):
        s["dump_1gpu_tokens_per_s"] = one["dump"]["tokens_per_s"]
    if "dump_equal" in cases:
        s["dump_states_equal"] = {
            k: cases["dump_equal"][k].get("equal") for k in ("dump_dp8", "dump_tp2dp4") if k in cases["dump_equal"]
        }

    def fitted(name: str) -> dict[str, Any]:
        runs = [r for r in cases.get(name, {}).get("runs", []) if r.get("fits")]
        return runs[0] if runs else {}

    base = fitted("train_1gpu")
    if base:
        s["train_1gpu_tokens_per_s"] = base["tokens_per_s"]
    for name, key in (("train_zero2_8", "train_zero2"), ("train_zero3_8", "train_zero3")):
        run, world = fitted(name), cases.get(name, {}).get("gpus")
        if base and run:
            s[f"{key}_efficiency"] = run["tokens_per_s"] / (world * base["tokens_per_s"])
    if "equal" in cases.get("resume_8", {}):
        s["resume_equal"] = cases["resume_8"]["equal"]
    s["goals_met"] = {k: v >= GOAL for k, v in s.items() if k.endswith("_efficiency") and "compute_only" not in k}
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results JSON (with --case: that case's part file)")
    p.add_argument("--dir", default="/tmp/bench_node", help="scratch directory on the local disk (deleted first)")
    p.add_argument("--dump-dir", default="/dev/shm/bench_node", help="where the timed dumps go (deleted first)")
    p.add_argument("--budget", type=float, default=1200, help="seconds for all cases together")
    p.add_argument("--cases", default="", help="only these cases (comma-separated names)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in the process the suite starts
    p.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)  # the suite's W, passed to each case
    p.add_argument("--samples", type=int, default=128, help="sequences per GPU")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--tokens-per-batch", type=int, default=16384)
    p.add_argument("--shard-mb", type=float, default=256)
    p.add_argument("--writer-threads", type=int, default=4)
    p.add_argument("--resume-samples", type=int, default=240, help=argparse.SUPPRESS)
    p.add_argument("--resume-tokens", type=int, default=200, help=argparse.SUPPRESS)
    p.add_argument("--resume-timeout", type=int, default=120, help=argparse.SUPPRESS)
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU: a smoke test of this script")
    a = p.parse_args()
    if a.small and a.samples == 128:
        a.samples, a.seq, a.tokens_per_batch, a.shard_mb = 16, 256, 1024, 1
    a.world = a.world or (4 if a.small else torch.cuda.device_count())
    a.dtype = "float32" if a.small else "bfloat16"
    if a.case:
        return run_case(a)
    return suite(a)


if __name__ == "__main__":
    main()
