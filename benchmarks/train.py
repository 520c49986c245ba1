"""Training the draft head: tokens/s, model FLOP utilisation, peak memory, the longest sequence that
fits, sequence and data parallelism, on the 8B head's shapes (H=4096, 32 / 8 heads, intermediate
14336, target vocab 128256, draft vocab 32000, ttt 7, bf16, ZeRO-2) through the real
``build_engine`` and ``ttt_losses``.

    python3 -m benchmarks.train --out benchmarks/results/train_h200x2.json    # 1-2 GPUs, < 8 min
    python3 -m benchmarks.train --small --out /tmp/train.json                 # CPU smoke test

Model FLOPs per token: 3 x (fc + ttt x (layer + attention + draft lm_head)) for forward and backward,
plus the target's lm_head forward (the target distribution); recomputation is not counted. MFU =
model FLOP/s per GPU over the bf16 8192^3 matmul rate measured in the same process. Cases, each in
its own process (torchrun for 2 ranks) within its share of ``--budget`` (2-GPU ones skipped on one):

- ``mfu``: seq 2048, 1 GPU, grad_accum 2 (the data-parallel case's global batch), and the top kernels
  of two profiled steps;
- ``longest_1gpu``: activation checkpointing, 32768 / 65536 / 131072 until one does not fit;
- ``sp2``: 2 GPUs, sequence parallel, checkpointing, 65536 / 131072 until one does not fit;
- ``dp2``: 2 GPUs data parallel, seq 2048, grad_accum 1 (the same global batch as ``mfu``);
- ``fit_32k_no_checkpointing``: whether 32768 fits on 1 GPU without checkpointing;
- ``mfu_compile``: ``mfu`` with the decoder layer compiled (last: compiling takes a while).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.lab import launcher, matmul_rate, run_isolated, run_suite, sync
from benchmarks.result import Result, this_command
from eagle3_train.core.dist import init_distributed
from eagle3_train.model import DraftConfig, Eagle3Draft
from eagle3_train.training.config import (
    DeepSpeedConfig,
    LoopConfig,
    ObjectiveConfig,
    OptimConfig,
    RuntimeConfig,
    TrainConfig,
)
from eagle3_train.training.data import Batch
from eagle3_train.training.parallel import build_engine, sequence_parallel
from eagle3_train.training.ttt import ttt_losses

SMALL = DraftConfig(
    hidden_size=256, target_hidden_size=256, num_aux=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    intermediate_size=768, rms_norm_eps=1e-5, vocab_size=4096, draft_vocab_size=1024, max_position_embeddings=131072,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)  # fmt: skip
LLAMA8B = DraftConfig(
    hidden_size=4096, target_hidden_size=4096, num_aux=3, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5, vocab_size=128256, draft_vocab_size=32000,
    max_position_embeddings=131072,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)  # fmt: skip

# name, ranks, case options, seconds at most, sequences with --small
SUITE = [
    ("mfu", 1, ["--seqs", "2048", "--grad-accum", "2", "--profile-top", "30"], 150, "256"),
    ("longest_1gpu", 1, ["--seqs", "32768,65536,131072", "--checkpointing", "--warmup", "1", "--steps", "1"], 200, "512,1024"),
    ("sp2", 2, ["--seqs", "65536,131072", "--sp", "2", "--checkpointing", "--warmup", "1", "--steps", "1"], 200, "512,1024"),
    ("dp2", 2, ["--seqs", "2048", "--grad-accum", "1"], 120, "256"),
    ("fit_32k_no_checkpointing", 1, ["--seqs", "32768", "--warmup", "1", "--steps", "1"], 90, "512"),
    ("mfu_compile", 1, ["--seqs", "2048", "--grad-accum", "2", "--compile", "--warmup", "3"], 240, "256"),
]  # fmt: skip


def flops_per_token(c: DraftConfig, seq: int, ttt: int) -> float:
    h, kv, q = c.hidden_size, c.num_key_value_heads * c.head_dim, c.num_attention_heads * c.head_dim
    layer = 2 * (2 * h * q + 2 * 2 * h * kv + q * h + 3 * h * c.intermediate_size)
    attention = 2 * 2 * q * (seq + 1) / 2
    head, fc, target_head = 2 * h * c.draft_vocab_size, 2 * c.num_aux * c.target_hidden_size * h, 2 * h * c.vocab_size
    return 3 * (fc + ttt * (layer + attention + head)) + target_head


def synthetic_batch(c: DraftConfig, seq: int, device: torch.device, dtype: torch.dtype) -> Batch:
    g = torch.Generator(device).manual_seed(0)
    return Batch(
        aux_hidden=torch.randn(1, seq, c.num_aux * c.target_hidden_size, generator=g, device=device, dtype=dtype),
        last_hidden=torch.randn(1, seq, c.hidden_size, generator=g, device=device, dtype=dtype),
        input_ids=torch.randint(0, c.vocab_size, (1, seq), generator=g, device=device),
        loss_mask=torch.ones(1, seq, dtype=torch.bool, device=device),
        lengths=torch.tensor([seq], device=device),
        sample_ids=torch.zeros(1, dtype=torch.int64),
    )


def profile(step: Any, batch: Batch, device: torch.device, top: int) -> list[dict[str, Any]]:
    """The ``top`` kernels (ops on the CPU) of two steps by self time."""
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(2):
            step(batch)
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:top]
    return [{"name": e.key[:120], "calls": e.count, "self_ms": getattr(e, key) / 1e3 / 2} for e in events]


def measure(a: argparse.Namespace) -> None:
    """One case in this process (all ranks): each of ``--seqs`` in turn, ``--warmup`` then ``--steps``
    timed optimizer steps, until one does not fit; rank 0 rewrites ``--out`` after each."""
    dist = init_distributed("cpu" if a.small else "auto", always=True)
    device = dist.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    c = SMALL if a.small else LLAMA8B
    sp = sequence_parallel(a.sp)
    dp = dist.world_size // sp.size
    rate = matmul_rate(device, 8192 if device.type == "cuda" else 512, dtype)
    torch.manual_seed(0)
    with device:  # initialised where it trains (the 8B head's 1e9 weights, most of them embeddings)
        model = Eagle3Draft(c)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool, device=device)
    t2d[torch.randperm(c.vocab_size, device=device)[: c.draft_vocab_size]] = True
    with torch.no_grad():
        model.t2d.copy_(t2d)
    lm_head = (torch.randn(c.vocab_size, c.hidden_size, device=device) * 0.02).to(dtype)
    cfg = TrainConfig(
        data="-", out="-", objective=ObjectiveConfig(ttt_length=a.ttt), optim=OptimConfig(lr=1e-4),
        loop=LoopConfig(grad_accum=a.grad_accum), deepspeed=DeepSpeedConfig(zero_stage=2),
        runtime=RuntimeConfig(activation_checkpointing=a.checkpointing, compile=a.compile, sequence_parallel=a.sp),
    )  # fmt: skip
    engine = build_engine(model, cfg, dtype, device, 1000, sp)
    report: dict[str, Any] = {"gpus": dist.world_size, "sequence_parallel": sp.size, "data_parallel": dp,
                              "grad_accum": a.grad_accum, "activation_checkpointing": a.checkpointing,
                              "compile": a.compile, "matmul_tflops": rate / 1e12, "runs": []}  # fmt: skip

    def step(batch: Batch) -> None:
        for _ in range(a.grad_accum):
            loss, _ = ttt_losses(
                engine.module,
                batch,
                lm_head,
                t2d,
                a.ttt,
                cfg.objective.loss_decay,
                head_chunk=cfg.runtime.head_chunk,
                sp=sp,
            )
            engine.backward(loss * sp.size)
            engine.step()

    def save() -> None:
        if dist.is_main:
            Path(a.out).write_text(json.dumps(report, indent=1) + "\n")

    for seq in [int(s) for s in a.seqs.split(",")]:
        run: dict[str, Any] = {"seq": seq}
        report["runs"].append(run)
        try:
            batch = synthetic_batch(c, seq, device, dtype)
            start = time.perf_counter()
            for _ in range(a.warmup):
                step(batch)
            sync(device)
            run["warmup_s"] = time.perf_counter() - start
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            for _ in range(a.steps):
                step(batch)
            sync(device)
            seconds = time.perf_counter() - start
            tokens_per_s = a.steps * a.grad_accum * dp * seq / seconds  # every data-parallel rank trains `seq` tokens
            flops = flops_per_token(c, seq, a.ttt)
            run.update(
                fits=True, step_s=seconds / a.steps, tokens_per_s=tokens_per_s,
                tokens_per_s_per_gpu=tokens_per_s / dist.world_size, model_gflop_per_token=flops / 1e9,
                mfu=tokens_per_s / dist.world_size * flops / rate,
                peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
            )  # fmt: skip
        except torch.OutOfMemoryError:
            run.update(fits=False)
        finally:
            batch = None  # noqa: F841
        save()
        if not run["fits"]:  # longer ones will not fit either
            break
        if a.profile_top:
            report["profile_top"] = profile(step, synthetic_batch(c, seq, device, dtype), device, a.profile_top)
            save()


def summary(cases: dict[str, Any]) -> dict[str, Any]:
    """MFU at 2048, the longest fitting sequences, the data-parallel speed-up at the same global batch."""

    def fitting(name: str) -> list[dict[str, Any]]:
        return [r for r in cases.get(name, {}).get("runs", []) if r.get("fits")]

    s: dict[str, Any] = {}
    for name in ("mfu", "mfu_compile"):
        if fitting(name):
            s[name] = fitting(name)[0]["mfu"]
            s[f"{name}_tokens_per_s_per_gpu"] = fitting(name)[0]["tokens_per_s_per_gpu"]
    for name in ("longest_1gpu", "sp2", "fit_32k_no_checkpointing"):
        if "runs" in cases.get(name, {}):
            s[f"{name}_seq"] = max((r["seq"] for r in fitting(name)), default=None)
    if fitting("mfu") and fitting("dp2"):
        s["dp2_speedup"] = fitting("dp2")[0]["tokens_per_s"] / fitting("mfu")[0]["tokens_per_s"]
    return s


def suite(a: argparse.Namespace) -> None:
    """Every case of SUITE in its own process within ``--budget`` seconds; the results file after each."""
    gpus = 2 if a.small else torch.cuda.device_count()
    settings = {"shape": "small" if a.small else "llama-3.1-8b head", "ttt": a.ttt, "zero": 2}
    result = Result(what="training the 8B-shaped draft head: tokens/s, MFU, longest sequence, sequence and data "
                    "parallelism", command=a.command, figures=settings)  # fmt: skip
    by_name = {name: (ranks, options, small_seqs) for name, ranks, options, _, small_seqs in SUITE}

    def save(cases: dict[str, Any]) -> None:
        result.figures = {**settings, "summary": summary(cases), "cases": cases}
        result.write(a.out)

    def case(name: str, seconds: float) -> dict[str, Any]:
        ranks, options, small_seqs = by_name[name]
        part = Path(a.out).with_name(f".{Path(a.out).stem}.{name}.json")
        if a.small:
            options = [*options, "--small", "--seqs", small_seqs, "--steps", "2"]
        cmd = [*launcher(ranks, "benchmarks.train"), "--case", name, *options, "--out", str(part), "--ttt", str(a.ttt)]
        env = dict(os.environ)
        if ranks == 1 and not a.small:
            env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        return run_isolated(cmd, part, seconds, env)

    run_suite([(name, ranks, cap) for name, ranks, _, cap, _ in SUITE], a.budget, gpus, a.cases, case, save)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    p.add_argument("--out", required=True, help="results JSON (with --case: that case's part file)")
    p.add_argument("--budget", type=float, default=460, help="seconds for all cases together")
    p.add_argument(
        "--cases", default="", help="only these cases (comma-separated: " + ",".join(c[0] for c in SUITE) + ")"
    )
    p.add_argument("--ttt", type=int, default=7, help="test-time-training steps")
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU: a smoke test, numbers meaningless")
    case = p  # one case's options: the suite passes them to the process it starts
    case.add_argument("--case", help=argparse.SUPPRESS)
    case.add_argument("--seqs", default="2048", help=argparse.SUPPRESS)
    case.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    case.add_argument("--steps", type=int, default=10, help=argparse.SUPPRESS)
    case.add_argument("--grad-accum", type=int, default=1, help=argparse.SUPPRESS)
    case.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    case.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    case.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    case.add_argument("--profile-top", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.command = this_command("train", argv)
    return measure(a) if a.case else suite(a)


if __name__ == "__main__":
    main()
