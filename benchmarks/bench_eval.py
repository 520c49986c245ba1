"""eagle3-eval speed: the pre-batching decoder (batch 1) against batched decoding, in one run.

Not part of the test suite. On one GPU, from the repository root:

    python3 -m benchmarks.bench_eval --draft runs/x/export --out benchmarks/results/eval_h200.json

The embedded target (SmolLM2-135M) by default, fp32 (so the batch sizes must agree token for
token), the first ``--n`` first-turn prompts of ``--prompts`` x ``--max-new`` new tokens, chain of
``--k``. Phases, each printed and written to ``--out`` as soon as it ends:

1. ``batched``: :class:`eagle3_train.evaluation.decoding.SpecDecoder` at ``--batch-size`` over all prompts;
2. ``greedy``: its plain greedy reference at the same batch size (speculative over greedy);
3. ``legacy``: ``tests/legacy_eval.py``, eval's decoder before batching (batch 1, draft recomputed
   over the whole context each step), over the first ``--legacy-n`` prompts -- the baseline;
4. ``batch1``: the new decoder at batch 1 over the first ``--batch1-n`` prompts (tau at batch 1).

Tokens/s = new tokens / wall seconds of decoding (transformers eager, after a warm-up), prefill
included. ``same_tokens_*`` count prompts whose tokens and accepted counts agree exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from eagle3_train.core.prompt_files import read_conversations
from eagle3_train.evaluation.decoding import Decoded
from eagle3_train.evaluation.eval import EvalConfig, Evaluator
from tests.legacy_eval import LegacySpecDecoder

PROMPTS = ["data_prep/prompts/heldout.jsonl", "data_prep/prompts/train.jsonl"]


def tau(accepted: list[list[int]]) -> float:
    steps = [a for acc in accepted for a in acc]
    return (sum(steps) + len(steps)) / max(len(steps), 1)


def timed(device: torch.device, fn):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def phase(decoded: list[Decoded], seconds: float, **extra) -> dict:
    tokens = sum(len(d.tokens) for d in decoded)
    return {
        "prompts": len(decoded),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tau": tau([d.accepted for d in decoded]),
    } | extra


def agree(a: list[Decoded], b: list[Decoded]) -> int:
    return sum(x.tokens == y.tokens and x.accepted == y.accepted for x, y in zip(a, b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="an exported draft directory")
    p.add_argument("--out", required=True, help="the results JSON to write")
    p.add_argument("--target", default="embedded")
    p.add_argument("--engine", default="sglang")
    p.add_argument("--prompts", nargs="+", default=PROMPTS, help="prompt files, read in order")
    p.add_argument("--n", type=int, default=80)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--legacy-n", type=int, default=16, help="prompts for the old decoder (about 10 s each)")
    p.add_argument("--batch1-n", type=int, default=80, help="prompts for the new decoder at batch 1")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cache-dir", default=os.environ.get("EAGLE3_CACHE", str(Path.home() / ".cache/eagle3_train")))
    a = p.parse_args()

    ev = Evaluator(
        EvalConfig(
            draft=a.draft,
            target=a.target,
            engine=a.engine,
            prompts=a.prompts[0],
            k=a.k,
            max_new_tokens=a.max_new,
            batch_size=a.batch_size,
            dtype=a.dtype,
            cache_dir=a.cache_dir,
            progress=False,
        )
    )
    conversations = [c for path in a.prompts for c in read_conversations(path)][: a.n]
    prompts = [ev.tokenize(c, 0, []) for c in conversations]
    dec, dev = ev.decoder, ev.decoder.device
    legacy = LegacySpecDecoder(ev.target, ev.draft, ev.layers, a.k, ev.eos)
    dec.speculative(prompts[:4], 16, 4)  # warm-up: kernels, allocator
    legacy.generate(prompts[0], 16)
    results = {
        "command": " ".join(["python3 -m benchmarks.bench_eval"] + sys.argv[1:]),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "target": a.target,
        "dtype": a.dtype,
        "draft": a.draft,
        "engine": a.engine,
        "captured_hf_indices": ev.layers,
        "prompts": len(prompts),
        "max_new_tokens": a.max_new,
        "k": a.k,
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "timing": "transformers eager execution; wall seconds of decoding incl. prefill, after a warm-up",
    }

    def report(name: str, value: dict) -> None:
        results[name] = value
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
        print(f"{name}: {json.dumps(value)}", flush=True)

    batched, seconds = timed(dev, lambda: dec.speculative(prompts, a.max_new, a.batch_size))
    c = dec.counters
    report(
        "batched",
        phase(
            batched,
            seconds,
            batch_size=a.batch_size,
            compactions=c.compactions,
            draft_positions_per_verify_step=c.draft_positions / max(c.row_rounds, 1),
        ),
    )
    refs, seconds = timed(dev, lambda: dec.greedy(prompts, a.max_new, a.batch_size))
    greedy_tokens = sum(len(r.tokens) for r in refs)
    report(
        "greedy",
        {
            "batch_size": a.batch_size,
            "tokens": greedy_tokens,
            "seconds": seconds,
            "tokens_per_s": greedy_tokens / seconds,
            "identical_to_batched": sum(r.tokens == b.tokens for r, b in zip(refs, batched)),
        },
    )
    results["speculative_over_greedy"] = results["batched"]["tokens_per_s"] / results["greedy"]["tokens_per_s"]

    n = min(a.legacy_n, len(prompts))
    old: list[Decoded] = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts[:n]):
        tokens, accepted = legacy.generate(prompt, a.max_new)
        old.append(Decoded(tokens, accepted))
        print(f"legacy: {i + 1}/{n} prompts, {time.perf_counter() - start:.0f} s", flush=True)
    report(
        "legacy", phase(old, time.perf_counter() - start, batch_size=1, same_tokens_as_batched=agree(old, batched[:n]))
    )
    results["batched_over_legacy"] = results["batched"]["tokens_per_s"] / results["legacy"]["tokens_per_s"]
    results["tau_batched_on_legacy_prompts"] = tau([d.accepted for d in batched[:n]])

    m = min(a.batch1_n, len(prompts))
    one, seconds = timed(dev, lambda: dec.speculative(prompts[:m], a.max_new, 1))
    report(
        "batch1",
        phase(one, seconds, same_tokens_as_batched=agree(one, batched[:m]), same_tokens_as_legacy=agree(one[:n], old)),
    )
    results["tau_batched_on_batch1_prompts"] = tau([d.accepted for d in batched[:m]])
    results["same_tau_batch1_and_batched"] = results["batch1"]["tau"] == results["tau_batched_on_batch1_prompts"]
    report(
        "summary",
        {
            k: results[k]
            for k in (
                "batched_over_legacy",
                "speculative_over_greedy",
                "same_tau_batch1_and_batched",
                "tau_batched_on_legacy_prompts",
            )
        },
    )


if __name__ == "__main__":
    main()
