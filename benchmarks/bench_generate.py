"""Generation throughput of the target writing training data (issue #12/#13: synthesis is the
recipe's slowest stage): new tokens/s of regenerate.generate_sorted for each way transformers can
batch it, on the same prompts, each case in its own process within a time budget.

Cases (``--cases``, default all): ``padded_<B>`` (model.generate on left-padded, length-sorted
batches of B prompts, today's default), ``static_<B>`` (regen.batching=static: the same with a
static KV cache, which generate compiles), ``graph_<B>`` (regen.batching=graph: our static-cache
decode loop, one CUDA graph per batch), ``continuous_<B>`` (regen.batching=continuous, B replies
in flight), each greedy; ``..._sampled`` samples at temperature 1.0, top-p 0.99 as the questions of
synthesize are; ``..._x<P>`` runs P processes on the one GPU at once, each with a P-th of the
prompts (what several synthesis ranks per GPU do), and reports their joint rate. Greedy cases also report how many replies equal the first greedy case's (bf16
kernels differ between batchings, so a few may diverge after a near tie).

Prompts: the first user turn of each conversation in ``--conversations`` (a .jsonl.gz that
``eagle3-prepare synthesize=N save_conversations=...`` wrote), rendered with the target's chat
template, or the shipped prompts repeated when none is given.

    python3 benchmarks/bench_generate.py --out $OUT/generate.json --n 4096 \\
        --conversations synth_16384.jsonl.gz          # a GPU machine staged with benchmarks/staging/gpu_stage.sh
    python3 benchmarks/bench_generate.py --small --out /tmp/g.json   # tiny target on the CPU
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import run_isolated, run_suite  # noqa: E402

CASES = (
    "graph_2048",
    "graph_4096",
    "padded_1024",
    "padded_4096",
    "padded_1024_x3",
    "static_1024",
    "continuous_1024",
    "padded_1024_sampled",
    "padded_1024_sampled_x3",
)


def prompts_for(a: argparse.Namespace, tokenizer) -> list[list[int]]:
    """Token ids of ``a.n`` generation prompts (user turn + the assistant header)."""
    if a.conversations:
        with gzip.open(a.conversations, "rt") as f:
            firsts = [next(m for m in json.loads(line)["messages"] if m["role"] == "user")["content"] for line in f]
    else:
        import data_prep.prompts as shipped

        path = Path(shipped.__file__).parent / "train.jsonl"
        firsts = [json.loads(line)["messages"][0]["content"] for line in path.read_text().splitlines() if line.strip()]
    texts = [firsts[i % len(firsts)] for i in range(a.n)]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for t in texts
    ]


def one(a: argparse.Namespace) -> None:
    """Run the case ``a.case`` and write its result JSON to ``a.part``."""
    import torch

    from data_prep.regenerate import RegenConfig, generate_sorted
    from eagle3_train.targets import eos_ids, load_target

    target = load_target(
        "tiny" if a.small else "embedded",
        cache_dir=a.cache_dir,
        dtype="float32" if a.small else "bfloat16",
        device="cpu" if a.small else "cuda",
    )
    model, tokenizer = target.model.eval(), target.tokenizer
    eos = sorted(eos_ids(model, tokenizer, target.local_dir))
    prompts = prompts_for(a, tokenizer)
    parts = a.case.split("_")
    procs = int(parts[-1][1:]) if parts[-1].startswith("x") else 1
    cfg = RegenConfig(
        max_new_tokens=a.max_new_tokens,
        batching=parts[0],
        batch_size=int(parts[1]),
        do_sample="sampled" in parts,
        temperature=1.0,
        top_p=0.99,
    )
    children = []
    if procs > 1 and a.shard is None:
        for i in range(procs):
            Path(f"{a.part}.ready{i}").unlink(
                missing_ok=True
            )  # this process is shard 0; the others run beside it on the same GPU
        for i in range(1, procs):
            children.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--shard", str(i)]))
    shard = a.shard or 0
    prompts = prompts[shard::procs]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    torch.manual_seed(0)
    # compile, graphs, allocator: on 64 prompts, or (--warm-all) on all of them, so that every batch shape
    # static and continuous batching meet in the timed pass is compiled already (their steady state)
    warm = generate_sorted(model, prompts if a.warm_all else prompts[: min(64, len(prompts))], cfg, eos, pad, seed=0)
    del warm
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if procs > 1:  # start together: every process loaded and warmed up first
        ready = Path(f"{a.part}.ready{shard}")
        ready.write_text("")
        while sum(Path(f"{a.part}.ready{i}").is_file() for i in range(procs)) < procs:
            time.sleep(0.05)
    start = time.time()  # wall clock: shards of one case are compared across processes
    replies, hit_limit = generate_sorted(model, prompts, cfg, eos, pad, seed=1)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    end = time.time()
    new_tokens = sum(len(r) + (len(r) < cfg.max_new_tokens) for r in replies)  # the end-of-turn token counts
    out = {
        "prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "new_tokens": new_tokens,
        "hit_max_new_tokens": hit_limit,
        "start": start,
        "end": end,
    }
    if torch.cuda.is_available():
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    part = Path(a.part if a.shard is None else f"{a.part}.{a.shard}")
    part.write_text(json.dumps(out))
    if a.shard is not None:
        return
    for child in children:
        child.wait()
    for i in range(procs):
        Path(f"{a.part}.ready{i}").unlink(missing_ok=True)
    shards = [out] + [
        json.loads(Path(f"{a.part}.{i}").read_text()) for i in range(1, procs) if Path(f"{a.part}.{i}").is_file()
    ]
    if len(shards) < procs:
        raise RuntimeError(f"{procs - len(shards)} of {procs} processes wrote no result")
    seconds = max(x["end"] for x in shards) - min(x["start"] for x in shards)
    total = {k: sum(x[k] for x in shards) for k in ("prompts", "prompt_tokens", "new_tokens", "hit_max_new_tokens")}
    total.update(processes=procs, seconds=round(seconds, 2), new_tokens_per_s=round(total["new_tokens"] / seconds))
    if "peak_gib" in out:
        total["peak_gib_per_process"] = out["peak_gib"]
    part.write_text(json.dumps(total))
    if not cfg.do_sample and procs == 1:
        Path(a.part + ".replies").write_text(json.dumps(replies))


def suite(a: argparse.Namespace) -> None:
    import torch
    import transformers

    results = {
        "what": "new tokens/s of data_prep.regenerate.generate_sorted, embedded target (SmolLM2-135M-Instruct), bf16",
        "n": a.n,
        "max_new_tokens": a.max_new_tokens,
        "warm_all": a.warm_all,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cases": {},
    }
    if torch.cuda.is_available():
        results["device"] = torch.cuda.get_device_name(0)
    reference: list | None = None

    def run(name: str, seconds: float) -> dict:
        nonlocal reference
        part = Path(a.out).with_suffix(f".{name}.part")
        cmd = [
            sys.executable,
            __file__,
            "--case",
            name,
            "--part",
            str(part),
            "--n",
            str(a.n),
            "--max-new-tokens",
            str(a.max_new_tokens),
            "--cache-dir",
            a.cache_dir,
        ]
        cmd += ["--conversations", a.conversations] if a.conversations else []
        cmd += ["--small"] if a.small else []
        cmd += ["--warm-all"] if a.warm_all else []
        replies_file = Path(str(part) + ".replies")
        replies_file.unlink(missing_ok=True)
        r = run_isolated(cmd, part, seconds)
        if replies_file.is_file():
            replies = json.loads(replies_file.read_text())
            replies_file.unlink()
            if reference is None:
                reference, r["greedy_reference"] = replies, True
            else:
                r["replies_equal_to_reference"] = sum(x == y for x, y in zip(replies, reference)) / len(reference)
        return r

    def fastest(cases: dict) -> dict:  # of the greedy cases: the answers, most of what synthesis generates
        rated = [
            (c["new_tokens_per_s"], name)
            for name, c in cases.items()
            if "new_tokens_per_s" in c and "sampled" not in name
        ]
        return {"fastest_greedy": max(rated)[1], "new_tokens_per_s": max(rated)[0]} if rated else {}

    names = a.cases.split(",") if a.cases else list(CASES)
    run_suite(
        [(name, 1, a.case_budget) for name in names], results, Path(a.out), a.budget, 1, "", run, fastest, least=20
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="generate.json")
    p.add_argument(
        "--cases",
        default="",
        help=f"comma-separated, of {CASES} (or any <padded|static|continuous|graph>_<B>[_sampled][_x<P>])",
    )
    p.add_argument("--n", type=int, default=4096, help="prompts per case")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--conversations", default="", help="a .jsonl.gz of conversations: their first user turns")
    p.add_argument("--cache-dir", default="/tmp/e3cache")
    p.add_argument("--budget", type=float, default=420, help="seconds for all cases together")
    p.add_argument("--case-budget", type=float, default=150, help="seconds for one case at most")
    p.add_argument(
        "--warm-all",
        action="store_true",
        help="warm up on every prompt (each case then runs twice): "
        "the steady state, with every shape compiled before the timed pass",
    )
    p.add_argument("--small", action="store_true", help="the tiny target on the CPU (a check that it runs)")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--shard", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.case:
        one(a)
    else:
        suite(a)


if __name__ == "__main__":
    main()
