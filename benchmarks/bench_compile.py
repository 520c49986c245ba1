"""What train.compile costs and buys for the recipe's draft (SmolLM2-135M's: H=576, 9/3 heads, MLP
6144, draft vocab 16384, ttt 5): the seconds of compiling, the graphs, and the training tokens/s
after them, for three ways to run the decoder layer, each in its own process (fresh compiler state):

- ``eager``: nothing compiled;
- ``layer``: the whole decoder layer compiled with dynamic sizes (train.compile until 2026-11-30:
  one graph per TTT step and grad mode, the attention's keys growing with the step);
- ``parts``: :func:`eagle3_train.training.parallel.apply_compile`, the layer's two step-independent parts.

Every variant runs the same batches through the real ``ttt_losses`` (fused head, compiled too when
the layer is), backward and an AdamW step: ``--steps`` training batches of about ``--tokens``
padded tokens whose rows are drawn from 64..448 tokens (the synthesized conversations' range), then
``--eval-steps`` no-grad batches as the periodic eval runs them. ``compile_s`` is the time over
all batches minus what they take at the steady rate (the median tokens/s of the second half).

    python3 benchmarks/bench_compile.py --out F                        # GPU: 32768 tokens, bf16
    python3 benchmarks/bench_compile.py --tokens 512 --steps 10 --out F   # this CPU (fp32)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import run_isolated, sync

VARIANTS = ("eager", "layer", "parts")


def draft_config():
    from eagle3_train.model import DraftConfig

    return DraftConfig(
        hidden_size=576,
        target_hidden_size=576,
        num_aux=3,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=6144,
        rms_norm_eps=1e-5,
        vocab_size=49152,
        draft_vocab_size=16384,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )


def batches(n: int, tokens: int, seed: int):
    """(rows, length) of ``n`` batches: the longest row drawn from 64..448, as many rows as fit."""
    rng = np.random.default_rng(seed)
    return [(max(1, tokens // t), t) for t in rng.integers(64, 449, n).tolist()]


def case(a: argparse.Namespace) -> None:
    from eagle3_train.model import Eagle3Draft
    from eagle3_train.training.data import Batch
    from eagle3_train.training.parallel import apply_compile
    from eagle3_train.training.ttt import ttt_losses

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = draft_config()
    model = Eagle3Draft(cfg).to(dev, dtype)
    with torch.no_grad():
        model.t2d[: cfg.draft_vocab_size] = True
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, device=dev, dtype=dtype) * 0.02
    if a.variant == "layer":
        model.midlayer.compile(dynamic=True)
    elif a.variant == "parts":
        apply_compile(model)
    compiled = a.variant != "eager"
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator(device=dev).manual_seed(1)
    result = {
        "variant": a.variant,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "tokens_per_batch": a.tokens,
        "steps": [],
    }
    plan = [(True, s) for s in batches(a.steps, a.tokens, 0)] + [(False, s) for s in batches(a.eval_steps, a.tokens, 1)]
    for train, (b, t) in plan:
        lengths = torch.randint(t // 2, t + 1, (b,), generator=g, device=dev)
        lengths[0] = t
        batch = Batch(
            aux_hidden=torch.randn(b, t, 3 * cfg.hidden_size, device=dev, dtype=dtype, generator=g),
            last_hidden=torch.randn(b, t, cfg.hidden_size, device=dev, dtype=dtype, generator=g),
            input_ids=torch.randint(0, cfg.vocab_size, (b, t), device=dev, generator=g),
            loss_mask=torch.arange(t, device=dev)[None] < lengths[:, None],
            lengths=lengths,
            sample_ids=torch.arange(b),
        )
        sync(dev)
        start = time.perf_counter()
        with torch.set_grad_enabled(train):
            loss, _ = ttt_losses(model, batch, head, model.t2d, 5, 0.8, head_chunk=b * t, compiled_head=compiled)
            if train:
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        sync(dev)
        result["steps"].append({"train": train, "rows": b, "length": t, "s": round(time.perf_counter() - start, 4)})
    from torch._dynamo.utils import counters

    result["graphs"] = int(counters["stats"]["unique_graphs"])
    Path(a.part).write_text(json.dumps(result))


def summary(r: dict) -> dict:
    """compile_s, steady tokens/s, eval's first-batch seconds from one variant's step list."""
    steps = [s for s in r["steps"] if s["train"]]
    rate = [s["rows"] * s["length"] / s["s"] for s in steps[len(steps) // 2 :]]
    steady = float(np.median(rate))
    total = sum(s["s"] for s in steps)
    ideal = sum(s["rows"] * s["length"] for s in steps) / steady
    evals = [s for s in r["steps"] if not s["train"]]
    return {
        "compile_s": round(total - ideal, 1),
        "first_step_s": steps[0]["s"],
        "steady_tokens_per_s": round(steady),
        "train_s": round(total, 1),
        "eval_first_s": evals[0]["s"] if evals else None,
        "eval_rest_s": round(sum(s["s"] for s in evals[1:]), 2),
        "graphs": r.get("graphs"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--tokens", type=int, default=32768, help="padded tokens per batch (the recipe's per GPU)")
    p.add_argument("--steps", type=int, default=60, help="training batches")
    p.add_argument("--eval-steps", type=int, default=4)
    p.add_argument("--seconds", type=float, default=900, help="at most, per variant")
    p.add_argument("--out", required=True)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--part", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.variant:
        return case(a)
    out = Path(a.out)
    results = {
        "what": "train.compile's cost and gain for the recipe's draft (benchmarks/bench_compile.py)",
        "command": " ".join(sys.argv),
        "variants": {},
    }
    for v in a.variants.split(","):
        part = out.with_suffix(f".{v}.part")
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            v,
            "--part",
            str(part),
            "--tokens",
            str(a.tokens),
            "--steps",
            str(a.steps),
            "--eval-steps",
            str(a.eval_steps),
            "--out",
            a.out,
        ]
        r = run_isolated(cmd, part, a.seconds)
        if "steps" in r:
            r["summary"] = summary(r)
        results["variants"][v] = r
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"== {v}: {json.dumps(r.get('summary', r))[:1500]}", flush=True)


if __name__ == "__main__":
    main()
