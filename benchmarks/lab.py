"""What the benchmarks share: the measured matmul rate every efficiency figure is a fraction of, a
random-weight Llama target, stand-in conversations, and running each case in its own process within
a time budget (a crash, a hang or an out-of-memory loses that case alone)."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

WORDS = [
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
    return tokens_per_s(10 * 2 * n**3, device, lambda: [a @ b for _ in range(10)])


def first_micro_batches(trainer: Any, warmup: int, steps: int) -> tuple[list[Any], list[Any], int]:
    """A trainer's first ``warmup + steps`` host micro-batches: the warm-up ones, the timed ones,
    and the timed ones' tokens."""
    host = list(itertools.islice(trainer.train_batches(), warmup + steps))
    timed = host[warmup:]
    return host[:warmup], timed, sum(int(t.lengths.sum()) for t in timed)


def train_on(trainer: Any, batches: list[Any]) -> None:
    """One optimizer step per micro-batch, fed through the trainer's source as it feeds training."""
    stream = trainer.source.device_batches(iter(batches))
    for _ in batches:
        trainer.train_step(stream)


def conversations(path: Path, n: int, words: int, seed: int = 0) -> Path:
    """``n`` one-turn conversations of filler words whose replies run to about ``words`` words."""
    rng = random.Random(seed)
    turn = lambda role, k: {"role": role, "content": " ".join(rng.choices(WORDS, k=k))}  # noqa: E731
    path.write_text(
        "".join(json.dumps({"messages": [turn("user", 20), turn("assistant", words)]}) + "\n" for _ in range(n))
    )
    return path


def launcher(ranks: int, module: str) -> list[str]:
    """The command running ``module`` on ``ranks`` processes of this machine: Python, or torchrun for more."""
    if ranks == 1:
        return [sys.executable, "-m", module]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), "-m", module]


def part_recorder(out: str | Path) -> Callable[[str, Any], None]:
    """``record(key, value)`` inside a case's process: rank 0 rewrites the part file ``out`` with every
    figure so far, so a crash later in the case keeps them."""
    result: dict[str, Any] = {}

    def record(key: str, value: Any) -> None:
        result[key] = value
        if int(os.environ.get("RANK", 0)) == 0:
            Path(out).write_text(json.dumps(result, indent=1))
            print(f"{key}: {json.dumps(value)[:300]}", flush=True)

    return record


def run_isolated(cmd: list[str], part: Path, seconds: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` in its own process group for at most ``seconds``: the JSON it left in ``part``
    (whatever it wrote before failing), its wall time, and the error and its output's tail if it failed."""
    part.unlink(missing_ok=True)
    start = time.monotonic()
    env = dict(env or os.environ, PYTHONUNBUFFERED="1")
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
    budget: float,
    gpus: int,
    only: str,
    run: Callable[[str, float], dict[str, Any]],
    save: Callable[[dict[str, Any]], None],
    least: float = 60,
) -> dict[str, Any]:
    """Run each case ``(name, ranks, seconds at most)`` in order (``only``: comma-separated names,
    empty: all) as ``run(name, seconds)`` within ``budget`` seconds in all; a case needing more GPUs
    than ``gpus``, or left less than ``min(its seconds, least)``, is skipped with the reason.
    ``save(cases)`` after each case."""
    deadline = time.monotonic() + budget
    results: dict[str, Any] = {}
    for name, ranks, cap in cases:
        if only and name not in only.split(","):
            continue
        left = deadline - time.monotonic()
        if ranks > gpus:
            results[name] = {"skipped": f"needs {ranks} GPUs, this machine has {gpus}"}
        elif left < min(cap, least):
            results[name] = {"skipped": f"out of time ({left:.0f} s of the budget left)"}
        else:
            results[name] = run(name, min(cap, left))
        save(results)
        print(f"== {name}: {json.dumps(results[name])[:2000]}", flush=True)
    return results


def random_llama(small: bool, device: torch.device) -> Any:
    """A Llama-3.1-8B-shaped target (a small one with ``small``) with random weights, fp32 on the CPU
    and bf16 elsewhere, and the tiny byte-level tokenizer (data prepared for ``target=tiny`` is its data)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3_train.targets import Target, target_identity
    from eagle3_train.targets.tiny import build_tiny_tokenizer

    if small:
        cfg = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096)  # fmt: skip
    else:  # Llama-3.1-8B
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                          rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(default)
    tok = build_tiny_tokenizer()
    return Target(model, tok, cfg, target_identity("bench-llama-8b", cfg, tok), None)
