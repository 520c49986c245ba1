"""Training throughput of the draft head: tokens/s, model FLOP utilisation, peak memory, longest
sequence that fits, sequence and data parallelism. Not part of the test suite. 8B shapes by
default (docs/guide/benchmarks.md): H=4096, 32 heads, 8 kv heads, intermediate 14336, target vocab 128256, draft
vocab 32000, ttt 7, bf16, ZeRO-2, through the real `build_engine` and `ttt_losses`.

    python3 benchmarks/bench_train.py --suite --out $OUT/train_bench.json   # everything, 1-2 GPUs
    python3 benchmarks/bench_train.py --seqs 2048                            # one measurement
    python3 benchmarks/bench_train.py --seqs 2048 --profile                  # top kernels of 2 steps

Model FLOPs per token: 3 x (fc + 7 x (layer + attention + draft lm_head)) for forward and backward,
plus 1 x the target's lm_head (forward only, for the target distribution); recomputation
(activation checkpointing) is not counted. MFU = model FLOP/s per GPU over the bf16 8192^3 matmul
rate measured in the same process. `--small` runs tiny shapes on the CPU (gloo for 2 ranks): a
smoke test of the script, numbers meaningless.

`--suite` runs each case below in its own process (torchrun for 2 ranks), so an out-of-memory, a
crash or a hang of one loses nothing else; every case gets at most its share of `--budget` seconds
and the results file is rewritten after each case, with each case's error and output tail if it
failed. Cases (2-GPU ones skipped on one GPU):

- `mfu`: seq 2048, 1 GPU, grad_accum 2 (the data-parallel baseline's global batch), defaults
  (fused head, no checkpointing), plus the top kernels of two profiled steps and a check of the TTT
  attention on this device against the dense-mask reference (largest differences, fp32 and bf16);
- `longest_1gpu`: 1 GPU, activation checkpointing, 32768 / 65536 / 131072 until one does not fit;
- `sp2`: 2 GPUs, sequence parallel 2, checkpointing, 65536 / 131072 until one does not fit;
- `dp2`: 2 GPUs data parallel, seq 2048, grad_accum 1 (same global batch as `mfu`);
- `fit_32k_no_checkpointing`: does 32768 fit on 1 GPU without checkpointing;
- `mfu_compile`: `mfu` with the decoder layer compiled (runs last: compiling takes a while).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import launcher, matmul_rate, run_isolated, run_suite, sync

from eagle3_train.core.dist import init_distributed
from eagle3_train.model import DraftConfig, Eagle3Draft
from eagle3_train.training.config import DeepSpeedConfig, OptimConfig
from eagle3_train.training.data import Batch
from eagle3_train.training.parallel import build_engine, sequence_parallel
from eagle3_train.training.ttt import ttt_losses

SMALL = DraftConfig(
    hidden_size=256,
    target_hidden_size=256,
    num_aux=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=768,
    rms_norm_eps=1e-5,
    vocab_size=4096,
    draft_vocab_size=1024,
    max_position_embeddings=131072,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
LLAMA8B = DraftConfig(
    hidden_size=4096,
    target_hidden_size=4096,
    num_aux=3,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    rms_norm_eps=1e-5,
    vocab_size=128256,
    draft_vocab_size=32000,
    max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)

# name, ranks, case options, seconds at most, sequences on --small
SUITE = [
    ("mfu", 1, ["--seqs", "2048", "--grad-accum", "2", "--profile-top", "30", "--check-attention"], 150, "256"),
    (
        "longest_1gpu",
        1,
        ["--seqs", "32768,65536,131072", "--checkpointing", "--warmup", "1", "--steps", "1"],
        200,
        "512,1024",
    ),
    (
        "sp2",
        2,
        ["--seqs", "65536,131072", "--sp", "2", "--checkpointing", "--warmup", "1", "--steps", "1"],
        200,
        "512,1024",
    ),
    ("dp2", 2, ["--seqs", "2048", "--grad-accum", "1"], 120, "256"),
    ("fit_32k_no_checkpointing", 1, ["--seqs", "32768", "--warmup", "1", "--steps", "1"], 90, "512"),
    ("mfu_compile", 1, ["--seqs", "2048", "--grad-accum", "2", "--compile", "--warmup", "3"], 240, "256"),
]


def flops_per_token(c: DraftConfig, seq: int, ttt: int) -> float:
    h, kv = c.hidden_size, c.num_key_value_heads * c.head_dim
    q = c.num_attention_heads * c.head_dim
    layer = 2 * (2 * h * q + 2 * 2 * h * kv + q * h + 3 * h * c.intermediate_size)
    attention = 2 * 2 * q * (seq + 1) / 2
    head = 2 * h * c.draft_vocab_size
    fc = 2 * c.num_aux * c.target_hidden_size * h
    target_head = 2 * h * c.vocab_size
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


def measure(a: argparse.Namespace) -> None:
    """One case in this process (all ranks): each of ``--seqs`` in turn, ``--warmup`` then
    ``--steps`` timed optimizer steps, until one does not fit; rank 0 rewrites ``--out`` after each."""
    dist = init_distributed("cpu" if a.small else "auto", always=True)
    device = dist.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    c = SMALL if a.small else LLAMA8B
    sp = sequence_parallel(a.sp)
    dp = dist.world_size // sp.size
    rate = matmul_rate(device, 8192 if device.type == "cuda" else 512, dtype)
    torch.manual_seed(0)
    with device:  # initialised where it trains (the 8B head's 1e9 weights, most of them the embeddings)
        model = Eagle3Draft(c)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool, device=device)
    t2d[torch.randperm(c.vocab_size, device=device)[: c.draft_vocab_size]] = True
    with torch.no_grad():
        model.t2d.copy_(t2d)
    lm_head = (torch.randn(c.vocab_size, c.hidden_size, device=device) * 0.02).to(dtype)
    o = OptimConfig(
        ttt_length=a.ttt,
        lr=1e-4,
        grad_accum=a.grad_accum,
        head_chunk=a.head_chunk,
        activation_checkpointing=a.checkpointing,
        compile=a.compile,
        sequence_parallel=a.sp,
    )
    engine = build_engine(model, o, DeepSpeedConfig(zero_stage=a.zero), dtype, device, 1000, sp)
    if a.check_attention:
        check = guarded(attention_check, device, dtype)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "gpus": dist.world_size,
        "torch": torch.__version__,
        "shape": "small" if a.small else "llama-3.1-8b head",
        "ttt": a.ttt,
        "zero": a.zero,
        "sequence_parallel": sp.size,
        "data_parallel": dp,
        "grad_accum": a.grad_accum,
        "head_chunk": a.head_chunk,
        "activation_checkpointing": a.checkpointing,
        "compile": a.compile,
        "matmul_tflops": rate / 1e12,
        "runs": [],
    }
    if a.check_attention:
        report["attention_check"] = check

    def step(batch: Batch) -> None:
        for _ in range(a.grad_accum):
            loss, _ = ttt_losses(
                engine.module, batch, lm_head, t2d, a.ttt, o.loss_decay, head_chunk=a.head_chunk, sp=sp
            )
            engine.backward(loss * sp.size)
            engine.step()

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
                fits=True,
                step_s=seconds / a.steps,
                tokens_per_s=tokens_per_s,
                tokens_per_s_per_gpu=tokens_per_s / dist.world_size,
                model_gflop_per_token=flops / 1e9,
                mfu=tokens_per_s / dist.world_size * flops / rate,
                peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
            )
        except torch.OutOfMemoryError:
            run.update(fits=False)
        finally:
            batch = None  # noqa: F841
        if dist.is_main:
            Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
            print(json.dumps(run), flush=True)
        if not run["fits"]:  # longer ones will not fit either
            break
        if a.profile_top:
            report["profile_top"] = guarded(
                profile, step, synthetic_batch(c, seq, device, dtype), device, a.profile_top
            )
            if dist.is_main:
                Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
                print(json.dumps(report["profile_top"], indent=1), flush=True)


def guarded(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or the error it raised (an extra of a case never costs its numbers)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


def attention_check(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """``ttt_attention`` on this device (whichever SDPA kernel it picks) against the dense-mask
    reference of tests/test_model.py in fp32 on the CPU: the largest absolute difference of the
    output and of the gradients, for 1..7 TTT steps (8 heads over 2 kv heads, head dim 128)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from eagle3_train.model.draft import ttt_attention
    from test_model import dense_ttt_reference

    result = {}
    for dt in dict.fromkeys([torch.float32, dtype]):
        g = torch.Generator().manual_seed(0)
        b, nh, nkv, t, d = 1, 8, 2, 512, 128
        leaves = [torch.randn(b, nh, t, d, generator=g)] + [torch.randn(b, nkv, t, d, generator=g) for _ in range(14)]
        here = [x.to(device, dt).requires_grad_() for x in leaves]
        ref = [x.clone().requires_grad_() for x in leaves]
        worst = {"out": 0.0, "grad": 0.0}
        for steps in range(1, 8):
            n = 1 + 2 * steps
            got = ttt_attention(here[0], list(zip(here[1:n:2], here[2:n:2])), nh // nkv)
            want = dense_ttt_reference(ref[0], list(zip(ref[1:n:2], ref[2:n:2])), nh // nkv)
            worst["out"] = max(worst["out"], (got.float().cpu() - want).abs().max().item())
            grad = torch.randn(want.shape, generator=g)
            for x, y in zip(
                torch.autograd.grad(got, here[:n], grad.to(device, dt)), torch.autograd.grad(want, ref[:n], grad)
            ):
                worst["grad"] = max(worst["grad"], (x.float().cpu() - y).abs().max().item())
        result[str(dt).removeprefix("torch.")] = worst
    return result


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


def suite(a: argparse.Namespace) -> None:
    """Every case of SUITE in its own process, within ``--budget`` seconds; results to ``--out``."""
    gpus = torch.cuda.device_count() if not a.small else 2
    results: dict[str, Any] = {
        "machine": f"{gpus} x {torch.cuda.get_device_name() if gpus and not a.small else 'cpu'}",
        "torch": torch.__version__,
        "budget_s": a.budget,
        "cases": {},
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    script = str(Path(__file__).resolve())
    case = {c[0]: c for c in SUITE}
    run_suite(
        [(name, ranks, cap) for name, ranks, _, cap, _ in SUITE],
        results,
        out,
        a.budget,
        gpus,
        a.cases,
        lambda name, seconds: run_case(script, name, case[name][1], case[name][2], seconds, case[name][4], a),
        summary,
    )


def run_case(
    script: str, name: str, ranks: int, options: list[str], seconds: float, small_seqs: str, a: argparse.Namespace
) -> dict[str, Any]:
    part = Path(a.out).with_name(f".{Path(a.out).stem}.{name}.json")
    if a.small:
        options = [*options, "--small", "--seqs", small_seqs, "--steps", "2"]
    cmd = [*launcher(ranks), script, *options, "--out", str(part), "--ttt", str(a.ttt), "--zero", str(a.zero)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if ranks == 1 and not a.small:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    return run_isolated(cmd, part, seconds, env)


def summary(cases: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures from the cases there are: MFU at 2048, longest fitting sequences,
    data-parallel speed-up at the same global batch."""

    def fitting(name: str) -> list[dict[str, Any]]:
        return [r for r in cases.get(name, {}).get("runs", []) if r.get("fits")]

    s: dict[str, Any] = {}
    if "attention_check" in cases.get("mfu", {}):
        s["attention_check"] = cases["mfu"]["attention_check"]
    for name in ("mfu", "mfu_compile"):
        if fitting(name):
            s[name] = fitting(name)[0]["mfu"]
            s[f"{name}_tokens_per_s_per_gpu"] = fitting(name)[0]["tokens_per_s_per_gpu"]
    for name in ("longest_1gpu", "sp2", "fit_32k_no_checkpointing"):
        if name in cases and "runs" in cases[name]:
            s[f"{name}_seq"] = max((r["seq"] for r in fitting(name)), default=None)
    if fitting("mfu") and fitting("dp2"):
        s["dp2_speedup"] = fitting("dp2")[0]["tokens_per_s"] / fitting("mfu")[0]["tokens_per_s"]
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", action="store_true", help="run every case, each in its own process")
    p.add_argument("--out", default=None, help="results JSON (required with --suite)")
    p.add_argument("--budget", type=float, default=460, help="--suite: seconds for all cases together")
    p.add_argument("--cases", default="", help="--suite: only these cases (comma-separated names)")
    p.add_argument("--seqs", default="2048", help="sequence lengths, in order, until one does not fit")
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per sequence length")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel ranks (of the torchrun world)")
    p.add_argument("--head-chunk", type=int, default=OptimConfig.head_chunk)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--compile", action="store_true", help="torch.compile the decoder layer")
    p.add_argument("--profile-top", type=int, default=0, help="after timing, the top N kernels of two steps")
    p.add_argument("--check-attention", action="store_true", help="TTT attention here vs the dense-mask reference")
    p.add_argument("--profile", action="store_true", help="print the top kernels of two steps and exit")
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU")
    a = p.parse_args()
    if a.suite:
        if not a.out:
            p.error("--suite needs --out")
        return suite(a)
    if a.profile:
        a.profile_top, a.steps = a.profile_top or 30, 1
    a.out = a.out or os.devnull
    measure(a)


if __name__ == "__main__":
    main()
