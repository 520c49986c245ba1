"""Training throughput of the draft head: tokens/s, model FLOP utilisation, peak memory, longest
sequence that fits. Not part of the test suite. On a GPU, 8B shapes (DESIGN §5):

    python tests/benchmarks/bench_train.py

H=4096, 32 heads, 8 kv heads, intermediate 14336, target vocab 128256, draft vocab 32000, seq 2048,
ttt 7, bf16, ZeRO-2, through the real `build_engine` and `ttt_losses`. Model FLOPs per token:
3 x (fc + 7 x (layer + attention + draft lm_head)) for forward and backward, plus 1 x the target's
lm_head (forward only, for the target distribution). MFU = model FLOP/s over the bf16 8192^3 matmul
rate measured in the same run. `--small` runs tiny shapes on the CPU (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from common import matmul_rate, sync

from eagle3_train.data import Batch
from eagle3_train.dist import init_distributed
from eagle3_train.model import DraftConfig, Eagle3Draft
from eagle3_train.trainer import DeepSpeedConfig, OptimConfig, build_engine, ttt_losses


def flops_per_token(c: DraftConfig, seq: int, ttt: int) -> float:
    h, kv = c.hidden_size, c.num_key_value_heads * c.head_dim
    q = c.num_attention_heads * c.head_dim
    layer = 2 * (2 * h * q + 2 * 2 * h * kv + q * h + 3 * h * c.intermediate_size)
    attention = 2 * 2 * q * (seq + 1) / 2
    head = 2 * h * c.draft_vocab_size
    fc = 2 * c.num_aux * c.target_hidden_size * h
    target_head = 2 * h * c.vocab_size
    return 3 * (fc + ttt * (layer + attention + head)) + target_head


def synthetic_batch(c: DraftConfig, seq: int, device, dtype) -> Batch:
    g = torch.Generator(device).manual_seed(0)
    return Batch(
        aux_hidden=torch.randn(1, seq, c.num_aux * c.target_hidden_size, generator=g, device=device, dtype=dtype),
        last_hidden=torch.randn(1, seq, c.hidden_size, generator=g, device=device, dtype=dtype),
        input_ids=torch.randint(0, c.vocab_size, (1, seq), generator=g, device=device),
        loss_mask=torch.ones(1, seq, dtype=torch.bool, device=device),
        lengths=torch.tensor([seq], device=device),
        sample_ids=torch.zeros(1, dtype=torch.int64),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--max-seq", type=int, default=65536, help="largest sequence tried for 'longest that fits'")
    p.add_argument("--small", action="store_true")
    p.add_argument("--profile", action="store_true", help="print the top kernels of two steps and exit")
    args = p.parse_args()
    dist = init_distributed("cpu" if args.small else "auto", always=True)
    device = dist.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.small:
        c = DraftConfig(hidden_size=256, target_hidden_size=256, num_aux=3, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, intermediate_size=768, rms_norm_eps=1e-5, vocab_size=4096, draft_vocab_size=1024,
                        max_position_embeddings=131072, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        c = DraftConfig(hidden_size=4096, target_hidden_size=4096, num_aux=3, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5, vocab_size=128256, draft_vocab_size=32000,
                        max_position_embeddings=131072,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    rate = matmul_rate(device, 8192 if device.type == "cuda" else 1024, dtype)
    torch.manual_seed(0)
    model = Eagle3Draft(c)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[torch.randperm(c.vocab_size)[: c.draft_vocab_size]] = True
    with torch.no_grad():
        model.t2d.copy_(t2d)
    model.to(device)
    lm_head = (torch.randn(c.vocab_size, c.hidden_size) * 0.02).to(device, dtype)
    t2d = t2d.to(device)
    o = OptimConfig(ttt_length=args.ttt, lr=1e-4)
    engine = build_engine(model, o, DeepSpeedConfig(zero_stage=args.zero), dtype, device, 1000)

    batches: dict[int, Batch] = {}

    def step(seq: int) -> None:
        if seq not in batches:  # made once: the timing is of the training step, not of randn
            batches.clear()
            batches[seq] = synthetic_batch(c, seq, device, dtype)
        loss, _ = ttt_losses(engine.module, batches[seq], lm_head, t2d, args.ttt, o.loss_decay)
        engine.backward(loss)
        engine.step()

    for _ in range(2):  # warm-up
        step(args.seq)
    sync(device)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(2):
                step(args.seq)
            sync(device)
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60))
        return
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(args.seq)
    sync(device)
    seconds = time.perf_counter() - start
    tokens_per_s = args.steps * args.seq / seconds
    flops = flops_per_token(c, args.seq, args.ttt)
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "shape": "small" if args.small else "llama-3.1-8b head", "seq": args.seq, "ttt": args.ttt, "zero": args.zero,
        "matmul_tflops": rate / 1e12, "model_gflop_per_token": flops / 1e9,
        "tokens_per_s": tokens_per_s, "mfu": tokens_per_s * flops / rate,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    longest, seq = None, args.seq
    while seq <= args.max_seq and device.type == "cuda":
        try:
            torch.cuda.reset_peak_memory_stats()
            step(seq)
            sync(device)
            longest = {"seq": seq, "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
            seq *= 2
        except torch.OutOfMemoryError:
            engine.zero_grad()
            torch.cuda.empty_cache()
            break
    report["longest_fitting_seq"] = longest
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
