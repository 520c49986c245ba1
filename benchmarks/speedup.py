"""The speed-up a draft brings: served by an engine (eagle3-bench: output tokens/s with the draft over
without, per concurrency, and the engine's acceptance length), and eagle3-eval's τ on long replies (by
position in the reply) and with tree drafts beside chain-5; with SGLang, its acceptance length per tree
beside eval's τ over the very turns the engine was sent.

    python3 -m benchmarks.speedup --draft runs/x/export --engine vllm --out benchmarks/results/bench_vllm_h200.json
    python3 -m benchmarks.speedup --draft runs/x/export --engine sglang --steps bench,tree --out F.json
    python3 -m benchmarks.speedup --from W --engine sglang --out F.json     # the results of a run that came back
    python3 -m benchmarks.speedup --draft runs/demo/export --steps long,tree --eval-extra "limit=2 max_new_tokens=16" --out /tmp/s.json   # CPU

The embedded target, one GPU, the engine staged (benchmarks/staging). Steps (``--steps``), each keeping
its output under ``--work`` whatever the later ones do:

- ``bench``: vLLM eager and with CUDA graphs (``--modes``), concurrency 1/4/16/64, greedy, 256 new
  tokens; SGLang chain-5 and the trees 4/5/16 and 8/7/64 at concurrency 1 and 16, 128 new tokens,
  with ``--attention-backend triton`` (a staged SGLang lacks FlashAttention-3 kernels);
- ``long``: eagle3-eval chain-5 on 512 and 1024 new tokens, τ by reply position;
- ``tree``: eagle3-eval chain-5 and trees (topk / steps / draft tokens) 4/3/8, 4/5/16, 8/5/32, 8/7/64.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.result import Result, machine, this_command

TREES = [(1, 5, 6), (4, 3, 8), (4, 5, 16), (8, 5, 32), (8, 7, 64)]  # topk, steps, draft tokens; (1, 5, 6): chain-5
SGLANG_TREES = [(1, 5, 6), (4, 5, 16), (8, 7, 64)]
HELDOUT = Path(__file__).resolve().parents[1] / "data_prep" / "prompts" / "heldout.jsonl"
EVAL = [
    "-m",
    "eagle3_train.evaluation.eval",
    "target=embedded",
    f"prompts={HELDOUT}",
    "dtype=float32",
    "batch_size=37",
    "progress=false",
    "plot=false",
]
BENCH = ["-m", "eagle3_train.evaluation.bench", "plot=false"]


def step(w: Path, name: str, args: list[str], seconds: float) -> None:
    """``python3 args`` with its log in ``w/name.log``; a failure is logged, and the next step runs."""
    print(f"== {name}", flush=True)
    with (w / f"{name}.log").open("w") as log:
        try:
            rc = subprocess.run(
                [sys.executable, *args, f"out={w / name}"], stdout=log, stderr=subprocess.STDOUT, timeout=seconds
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "stopped at its timeout"
    if rc != 0:
        print(f"{name}: exit {rc} (see {w / name}.log)", flush=True)


def embedded_dir() -> str:
    """The embedded target's directory, which the engines serve (EAGLE3_CACHE: where it is unpacked)."""
    from eagle3_train.targets import load_target

    return str(load_target("embedded", cache_dir=os.environ.get("EAGLE3_CACHE")).local_dir)


def run(a: argparse.Namespace, w: Path) -> None:
    steps, extra = a.steps.split(","), a.eval_extra.split()
    if "bench" in steps:
        a.target = a.target or embedded_dir()
    if "bench" in steps and a.engine == "vllm":
        for mode in a.modes.split(","):
            flags = "--dtype bfloat16" + (" --enforce-eager" if mode == "eager" else "")
            step(
                w,
                f"bench_{mode}",
                [*BENCH, f"target={a.target}", f"draft={a.draft}", "max_new_tokens=256", f"engine_args={flags}"],
                600,
            )
    if "bench" in steps and a.engine == "sglang":
        for topk, n, tokens in SGLANG_TREES:
            args = [*BENCH, "engine=sglang", f"target={a.target}", f"draft={a.draft}", "max_new_tokens=128", "concurrency=[1,16]",
                    f"num_speculative_tokens={n}", "engine_args=--mem-fraction-static 0.5 --attention-backend triton --sampling-backend pytorch",
                    f"spec_args=--speculative-eagle-topk {topk} --speculative-num-draft-tokens {tokens}"]  # fmt: skip
            step(w, f"bench_sglang_{topk}_{n}_{tokens}", args, 600)
    for new in (512, 1024) if "long" in steps else ():
        step(w, f"eval_{new}", [*EVAL, f"draft={a.draft}", "k=5", f"max_new_tokens={new}", *extra], 1800)
    for topk, n, tokens in TREES if "tree" in steps else ():
        tree = [f"k={n}", f"topk={topk}", f"num_steps={n}", f"num_draft_tokens={tokens}", "max_new_tokens=128"]
        step(w, f"eval_tree_{topk}_{n}_{tokens}", [*EVAL, f"draft={a.draft}", *tree, *extra], 1800)


def _load(p: Path) -> Any:
    return json.loads(p.read_text()) if p.is_file() else None


def _jsonl(p: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.is_file() else []


def served(w: Path) -> tuple[dict[str, Any], list[list[str]], dict[str, Any] | None]:
    """Per bench directory and row: tokens/s without and with the draft, the speed-up, the engine's τ."""
    figures, rows, head = {}, [], None
    for p in sorted(w.glob("bench_*/results.json")):
        r, name = json.loads(p.read_text()), p.parent.name.removeprefix("bench_")
        head = head or r
        for row in r["rows"]:
            b, s = row["baseline"], row.get("spec") or {}
            t = row.get("temperature") or 0.0
            v = figures[f"{name}_c{row['concurrency']}" + (f"_t{t}" if t else "")] = {
                "baseline_tokens_per_s": round(b["output_tokens_per_s"], 1),
                "spec_tokens_per_s": round(s.get("output_tokens_per_s", float("nan")), 1),
                "speedup": round(row["speedup"], 3),
                "engine_tau": round(s.get("mean_acceptance_length", float("nan")), 3),
            }
            rows.append([name, str(row["concurrency"]), str(t), f"{v['baseline_tokens_per_s']:.1f}",
                         f"{v['spec_tokens_per_s']:.1f}", f"{v['speedup']:.2f}", f"{v['engine_tau']:.2f}"])  # fmt: skip
    return figures, rows, head


def eval_tau_on(outputs: Path, sent: set[tuple[str, int]]) -> tuple[float, int] | None:
    """eagle3-eval's τ over the (prompt file line, turn) pairs an engine was sent, from eval's per-turn
    ``outputs.jsonl``, and how many turns it covers; None where eval has none of them."""
    mine = [r for r in _jsonl(outputs) if (Path(r["source"]).name, r["turn"]) in sent]
    steps = [x for r in mine for x in r["accepted"]]
    return (1 + sum(steps) / len(steps), len(mine)) if steps else None


def sent_turns(requests: Path, concurrency: int) -> set[tuple[str, int]]:
    """The (prompt file line, turn) pairs eagle3-bench sent the speculating engine at ``concurrency``
    (the file's name alone: eval and the bench may name the same prompt file by different paths)."""
    return {
        (Path(r["source"]).name, r["turn"])
        for r in _jsonl(requests)
        if r["engine"] == "spec" and r["concurrency"] == concurrency
    }


def summarise(w: Path, a: argparse.Namespace) -> Result:
    figures, bench_rows, head = served(w)
    tables = [{"title": "Served speed-up (output tokens/s with the draft over without)", "rows": bench_rows,
               "header": ["engine run", "concurrency", "temperature", "baseline tok/s", "with draft tok/s", "speed-up ×", "engine τ"]}]  # fmt: skip
    long_rows, tree_rows, vs_engine = [], [], []
    for n in (512, 1024):
        r = _load(w / f"eval_{n}" / "report.json")
        for b in (r or {}).get("by_reply_position") or []:
            long_rows.append([str(n), f"{b['from']}–{b['to']}", f"{b['tau']:.3f}", str(b["tokens"])])
        if r:
            figures[f"eval_tau_{n}_new_tokens"] = round(r["tau"], 4)
            long_rows.append([str(n), "all", f"{r['tau']:.3f}", str(r["tokens"])])
    chain = (_load(w / "eval_tree_1_5_6" / "report.json") or {}).get("tau")
    for topk, n, tokens in TREES:
        d = w / f"eval_tree_{topk}_{n}_{tokens}"
        r = _load(d / "report.json")
        if r:
            figures[f"eval_tau_tree_{topk}_{n}_{tokens}"] = round(r["tau"], 4)
            tree_rows.append([str(topk), str(n), str(tokens), f"{r['tau']:.3f}", str(r.get("lossless")),
                              f"{r['tau'] / chain:.2f}" if chain else "—"])  # fmt: skip
        for row in (_load(w / f"bench_sglang_{topk}_{n}_{tokens}" / "results.json") or {}).get("rows", []):
            sent = sent_turns(w / f"bench_sglang_{topk}_{n}_{tokens}" / "requests.jsonl", row["concurrency"])
            same, tau = eval_tau_on(d / "outputs.jsonl", sent), (row.get("spec") or {}).get("mean_acceptance_length")
            vs_engine.append([str(topk), str(n), str(tokens), str(row["concurrency"]), f"{tau:.3f}" if tau else "—",
                              f"{same[0]:.3f} ({same[1]})" if same else "—", f"{tau / same[0]:.3f}" if same and tau else "—"])  # fmt: skip
    tables += [
        {"title": "τ by position in the reply (eagle3-eval, chain k=5)", "header": ["new tokens", "reply positions", "τ", "tokens"], "rows": long_rows},
        {"title": "Tree drafts against chain-5 (eagle3-eval, 128 new tokens)", "header": ["topk", "steps", "draft tokens", "τ", "lossless", "× chain-5 τ"], "rows": tree_rows},
        {"title": "SGLang's acceptance length against eagle3-eval's τ on the same turns", "rows": vs_engine,
         "header": ["topk", "steps", "draft tokens", "concurrency", "SGLang τ", "eval τ, same turns (turns)", "SGLang / eval"]},
    ]  # fmt: skip
    where = (
        machine()
        if head is None
        else ", ".join(head["machine"].get("gpus", [])) + f"; {a.engine} {head['engine']['spec'].get('version')}"
    )
    return Result(
        what=f"the speed-up of one draft: served by {a.engine} (eagle3-bench) and eagle3-eval's τ on long replies and trees",
        command=a.command,
        machine=where,
        figures={"draft": a.draft, "engine": a.engine, **figures},
        tables=[t for t in tables if t["rows"]],  # a step that did not run shows no table
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--draft", help="the exported draft (eagle3-export's out)")
    p.add_argument("--from", dest="from_", metavar="W", help="only the results, from the work directory of a run")
    p.add_argument("--target", help="the target directory the engine serves (default: the embedded target's)")
    p.add_argument("--engine", default="vllm", choices=["vllm", "sglang"], help="the engine serving the bench")
    p.add_argument("--work", default="/tmp/bench_speedup", help="each step's output and log")
    p.add_argument("--steps", default="bench,long,tree", help="comma-separated: bench,long,tree")
    p.add_argument("--modes", default="eager,graphs", help="vLLM: eager, CUDA graphs, or both")
    p.add_argument("--eval-extra", default="", help="eagle3-eval overrides added to its steps (space-separated)")
    a = p.parse_args(argv)
    a.command = this_command("speedup", argv)
    if not (a.draft or a.from_):
        p.error("--draft (to run) or --from (results only) is needed")
    w = Path(a.from_ or a.work)
    if not a.from_:
        w.mkdir(parents=True, exist_ok=True)
        run(a, w)
    summarise(w, a).write(a.out)


if __name__ == "__main__":
    main()
