"""Shared by the benchmarks: the measured matmul rate every efficiency figure is a fraction of, a
random-weight Llama target, running one case in its own process, and filler words for stand-in text."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FILLER_WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "mountain",
    "python",
    "code",
    "list",
    "tree",
    "graph",
    "sort",
    "bread",
    "poem",
    "sea",
    "light",
]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def first_micro_batches(trainer: Any, warmup: int, steps: int) -> tuple[list[Any], list[Any], int]:
    """A trainer's first ``warmup + steps`` host micro-batches: the warm-up ones, the timed ones,
    and the timed ones' tokens."""
    host = list(itertools.islice(trainer.train_batches(), warmup + steps))
    timed = host[warmup:]
    return host[:warmup], timed, sum(int(t.lengths.sum()) for t in timed)


def train_on(trainer: Any, batches: list[Any]) -> None:
    """One optimizer step per micro-batch, fed through the trainer's source (its forward, or the
    engine's states, overlapped as the source does it)."""
    stream = trainer.source.device_batches(iter(batches))
    for _ in batches:
        trainer.train_step(stream)


def tokens_per_s(tokens: int, device: torch.device, work: Callable[[], Any]) -> float:
    """``tokens`` over the seconds ``work()`` takes, the device synchronised on both sides."""
    sync(device)
    begin = time.perf_counter()
    work()
    sync(device)
    return tokens / (time.perf_counter() - begin)


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype) -> float:
    """Dense matmul FLOP/s measured here: mean of 10 n^3 products after 3 warm-ups."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * n**3 / (time.perf_counter() - start)


def launcher(ranks: int) -> list[str]:
    """The start of a command that runs a script on ``ranks`` processes of this machine: plain
    Python for one, torchrun (a free port each time) for more."""
    if ranks == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]


def part_recorder(out: str | Path, case: str, limit: int | None = None) -> Callable[[str, Any], None]:
    """``record(key, value)`` for a case running in its own process: adds the figure to the case's
    result and, on rank 0, rewrites the part file ``out`` and prints it (cut at ``limit`` characters),
    so a crash later in the case keeps every figure recorded before it."""
    result: dict[str, Any] = {}
    rank = int(os.environ.get("RANK", 0))

    def record(key: str, value: Any) -> None:
        result[key] = value
        if rank == 0:
            Path(out).write_text(json.dumps(result, indent=1))
            print(f"{case}.{key}: {json.dumps(value)[:limit]}", flush=True)

    return record


def run_isolated(cmd: list[str], part: Path, seconds: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` in its own process group for at most ``seconds``. Its result is the JSON it left
    in ``part`` (whatever it wrote before failing, so a crash or an out-of-memory loses only what
    came after), with the wall time, and the error and the output's tail if it failed."""
    part.unlink(missing_ok=True)
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=seconds)
        error = None if proc.returncode == 0 else f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        error = f"stopped after {seconds:.0f} s"
    result = json.loads(part.read_text()) if part.is_file() else {}
    part.unlink(missing_ok=True)
    result["wall_s"] = time.monotonic() - start
    if error:
        result.update(error=error, output_tail=output[-3000:])
    return result


def run_suite(
    cases: list[tuple[str, int, float]],
    results: dict[str, Any],
    out: Path,
    budget: float,
    gpus: int,
    only: str,
    run: Callable[[str, float], dict[str, Any]],
    summary: Callable[[dict[str, Any]], dict[str, Any]],
    least: float = 60,
) -> None:
    """Run each case ``(name, ranks, seconds at most)`` in order (``only``: comma-separated names,
    empty: all) as ``run(name, seconds)``, within ``budget`` seconds in all; a case needing more
    GPUs than ``gpus``, or left less than ``min(its seconds, least)``, is skipped with the reason.
    ``results["cases"]`` and ``results["summary"]`` are rewritten to ``out`` after each case."""
    deadline = time.monotonic() + budget
    for name, ranks, cap in cases:
        if only and name not in only.split(","):
            continue
        left = deadline - time.monotonic()
        if ranks > gpus:
            results["cases"][name] = {"skipped": f"needs {ranks} GPUs, this machine has {gpus}"}
        elif left < min(cap, least):
            results["cases"][name] = {"skipped": f"out of time ({left:.0f} s of the budget left)"}
        else:
            results["cases"][name] = run(name, min(cap, left))
        results["summary"] = summary(results["cases"])
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"== {name}: {json.dumps(results['cases'][name])[:2000]}", flush=True)
    print(json.dumps(results.get("summary", {}), indent=1), flush=True)


def random_llama(small: bool, device: torch.device) -> Any:
    """A Llama-3.1-8B-shaped target (a small one with ``small``) with random weights, fp32 on the CPU and bf16
    elsewhere, and the tiny byte-level tokenizer, so data prepared for ``target=tiny`` is its data."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3_train.targets import Target, target_identity
    from eagle3_train.targets.tiny import build_tiny_tokenizer

    if small:
        cfg = LlamaConfig(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=4096,
            max_position_embeddings=4096,
        )
    else:  # Llama-3.1-8B
        cfg = LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        )
    cfg._attn_implementation = "sdpa"
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(default)
    tok = build_tiny_tokenizer()
    return Target(model, tok, cfg, target_identity("bench-llama-8b", cfg, tok), None)
