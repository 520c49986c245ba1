"""Condense benchmarks/speedup_gpu.sh's output directory into the results JSONs the docs
show (issue #34): the served speed-up per engine mode and concurrency (eagle3-bench), and eval's
tau on long replies (by reply position) and with tree drafts next to chain-5, SGLang's acceptance
length for the same trees next to eval's tau (--sglang, speedup_gpu.sh STEPS=sglang's W), and eval's
graph-captured decoder against its graph-captured greedy (eval_graph_b*, STEPS=geval).

    python3 -m benchmarks.speedup_results W --bench-out results/bench_vllm_h200.json \
        --eval-out results/eval_trees_long_h200.json --sglang W_SGLANG --note "..."

Each output carries ``tables`` (title, header, rows) that docs/gen_pages.py renders as they are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.scaling_results import read_jsonl


def _load(p: Path) -> dict[str, Any] | None:
    return json.loads(p.read_text()) if p.is_file() else None


def bench_summary(w: Path) -> dict[str, Any]:
    modes, rows, head = {}, [], None
    for mode in ("eager", "graphs"):
        r = _load(w / f"bench_{mode}" / "results.json")
        if r is None:
            continue
        head = head or r
        modes[mode] = {
            "command": r.get("command"),
            "date": r.get("date"),
            "engine_args": r["config"].get("engine_args"),
        }
        for row in r["rows"]:
            b, s = row["baseline"], row.get("spec") or {}
            key = f"{mode}_c{row['concurrency']}" + (f"_t{row['temperature']}" if row.get("temperature") else "")
            modes[mode][key] = {
                "baseline_tokens_per_s": round(b["output_tokens_per_s"], 1),
                "spec_tokens_per_s": round(s.get("output_tokens_per_s", float("nan")), 1),
                "speedup": round(row["speedup"], 3),
                "engine_tau": round(s.get("mean_acceptance_length", float("nan")), 3),
                "baseline_tpot_ms": round(b["time_per_output_token_s"]["p50"] * 1e3, 2),
                "spec_tpot_ms": round(s.get("time_per_output_token_s", {}).get("p50", float("nan")) * 1e3, 2),
            }
            v = modes[mode][key]
            rows.append(
                [
                    mode,
                    str(row["concurrency"]),
                    str(row.get("temperature", 0.0)),
                    f"{v['baseline_tokens_per_s']:.1f}",
                    f"{v['spec_tokens_per_s']:.1f}",
                    f"{v['speedup']:.2f}",
                    f"{v['engine_tau']:.2f}",
                    f"{v['baseline_tpot_ms']:.2f} / {v['spec_tpot_ms']:.2f}",
                ]
            )
    if head is None:
        raise SystemExit(f"no bench_eager/ or bench_graphs/ results.json under {w}")
    cfg = head["config"]
    return {
        "what": "issue #34: the served speed-up, eagle3-bench in vLLM (eager and CUDA graphs), target served alone "
        "and with the draft, greedy",
        "machine": ", ".join(head["machine"].get("gpus", [])) + f"; vLLM {head['engine']['spec'].get('version')}",
        "date": head.get("date"),
        "settings": {
            "draft": cfg.get("draft"),
            "k": cfg.get("num_speculative_tokens"),
            "max_new_tokens": cfg.get("max_new_tokens"),
            "min_requests": cfg.get("min_requests"),
            "requests_per_slot": cfg.get("requests_per_slot"),
            "prompts": cfg.get("prompts") or "the shipped held-out prompts",
        },
        **modes,
        "tables": [
            {
                "title": "Served speed-up (output tokens/s with the draft over without)",
                "header": [
                    "mode",
                    "concurrency",
                    "temperature",
                    "baseline tok/s",
                    "with draft tok/s",
                    "speed-up ×",
                    "engine τ",
                    "TPOT p50 ms (baseline / draft)",
                ],
                "rows": rows,
            }
        ],
    }


def eval_summary(w: Path) -> dict[str, Any]:
    long_rows, tree_rows, out = [], [], {"long": {}, "trees": {}}
    for n in (512, 1024):
        r = _load(w / f"eval_{n}" / "report.json")
        if r is None:
            continue
        out["long"][f"n{n}"] = {"tau": round(r["tau"], 4), "lossless": r.get("lossless")}
        for b in r.get("by_reply_position") or []:
            out["long"][f"n{n}"][f"tau_{b['from']}_{b['to']}"] = round(b["tau"], 4)
            long_rows.append([str(n), f"{b['from']}–{b['to']}", f"{b['tau']:.3f}", str(b["tokens"])])
        long_rows.append([str(n), "all", f"{r['tau']:.3f}", str(r["tokens"])])
    chain = None
    trees = sorted((tuple(int(x) for x in p.parent.name.split("_")[2:]), p) for p in w.glob("eval_tree_*/report.json"))
    for (topk, steps, nodes), p in trees:
        r = json.loads(p.read_text())
        if topk == 1:
            chain = r["tau"]
        out["trees"][f"topk{topk}_steps{steps}_tokens{nodes}"] = {
            "tau": round(r["tau"], 4),
            "lossless": r.get("lossless"),
            "verify_steps": r.get("verify_steps"),
        }
        tree_rows.append([str(topk), str(steps), str(nodes), f"{r['tau']:.3f}", str(r.get("lossless")), r["tau"]])
    for row in tree_rows:
        row[-1] = f"{row[-1] / chain:.2f}" if chain else "—"
    return {
        "what": "issue #34: eagle3-eval of one draft on long replies (tau by reply position) and with tree drafts "
        "(topk / steps / draft tokens, SGLang's settings) next to chain-5; greedy, fp32, the 37 held-out prompts",
        **out,
        "tables": [
            {
                "title": "τ by position in the reply (chain k=5)",
                "header": ["new tokens", "reply positions", "τ", "tokens"],
                "rows": long_rows,
            },
            {
                "title": "Tree drafts against chain-5 (128 new tokens)",
                "header": ["topk", "steps", "draft tokens", "τ", "lossless", "× chain-5 τ"],
                "rows": tree_rows,
            },
        ],
    }


def eval_tau_on(outputs: Path, sent: set[tuple[str, int]]) -> tuple[float, int] | None:
    """eagle3-eval's tau over the (source, turn) pairs an engine was sent, from eval's per-turn
    ``outputs.jsonl`` (each turn's accepted count per verify step), and the turns it covers; None
    where eval has none of them."""
    mine = [r for r in read_jsonl(outputs) if (_where(r["source"]), r["turn"]) in sent]
    steps = [a for r in mine for a in r["accepted"]]
    return (1 + sum(steps) / len(steps), len(mine)) if steps else None


def _where(source: str) -> str:
    """A conversation's file name and line, without the directory (eval and the bench may name the
    same prompt file by different paths)."""
    return Path(source).name


def sent_turns(requests: Path, concurrency: int) -> set[tuple[str, int]]:
    """The (source, turn) pairs eagle3-bench sent the speculating engine at ``concurrency``."""
    return {
        (_where(r["source"]), r["turn"])
        for r in read_jsonl(requests)
        if r["engine"] == "spec" and r["concurrency"] == concurrency
    }


def sglang_trees(w_eval: Path, w_sglang: Path) -> dict[str, Any]:
    """SGLang's acceptance length (its bench per concurrency) beside eagle3-eval's tau, tree by tree,
    and each tree's against SGLang's chain-5 at the same concurrency."""
    out, found = {}, []
    for p in sorted(w_sglang.glob("bench_sglang_*/results.json")):
        topk, steps, nodes = tree = tuple(int(x) for x in p.parent.name.split("_")[2:])
        tree_dir = w_eval / f"eval_tree_{topk}_{steps}_{nodes}"
        ev = _load(tree_dir / "report.json")
        for row in json.loads(p.read_text())["rows"]:
            s, b = row.get("spec") or {}, row["baseline"]
            same = eval_tau_on(tree_dir / "outputs.jsonl", sent_turns(p.parent / "requests.jsonl", row["concurrency"]))
            v = out[f"topk{topk}_steps{steps}_tokens{nodes}_c{row['concurrency']}"] = {
                "engine_tau": round(s.get("mean_acceptance_length", float("nan")), 3),
                "eval_tau": round(ev["tau"], 3) if ev else None,
                # eval's tau over the very turns the engine was sent: the like-for-like comparison
                "eval_tau_same_turns": round(same[0], 3) if same else None,
                "same_turns": same[1] if same else None,
                "speedup": round(row["speedup"], 3),
                "baseline_tokens_per_s": round(b["output_tokens_per_s"], 1),
                "spec_tokens_per_s": round(s.get("output_tokens_per_s", float("nan")), 1),
            }
            found.append((tree, row["concurrency"], v))
    chains = {c: v["engine_tau"] for tree, c, v in found if tree[0] == 1}
    vs_eval = [
        [*map(str, tree), str(c), f"{v['engine_tau']:.3f}"]
        + (
            [f"{v['eval_tau_same_turns']:.3f} ({v['same_turns']})", f"{v['engine_tau'] / v['eval_tau_same_turns']:.3f}"]
            if v["eval_tau_same_turns"]
            else ["—", "—"]
        )
        + ([f"{v['eval_tau']:.3f}", f"{v['engine_tau'] / v['eval_tau']:.2f}"] if v["eval_tau"] else ["—", "—"])
        + [f"{v['speedup']:.2f}×"]
        for tree, c, v in found
    ]
    vs_chain = [[*map(str, tree), str(c), f"{v['engine_tau'] / chains[c]:.2f}"] for tree, c, v in found if c in chains]
    return {
        "sglang": out,
        "tables": [
            {
                "title": "SGLang's acceptance length against eagle3-eval's τ, same draft and tree settings",
                "header": [
                    "topk",
                    "steps",
                    "draft tokens",
                    "concurrency",
                    "SGLang τ",
                    "eval τ, same turns (turns)",
                    "SGLang / eval, same turns",
                    "eval τ, all its turns",
                    "SGLang / eval, all",
                    "SGLang speed-up",
                ],
                "rows": vs_eval,
            },
            {
                "title": "SGLang trees against its chain-5",
                "header": ["topk", "steps", "draft tokens", "concurrency", "× chain-5 τ"],
                "rows": vs_chain,
            },
        ],
    }


def graph_eval(w: Path) -> dict[str, Any]:
    """eagle3-eval decoder=graph: speculative against plain greedy, both graph-captured, per batch size."""
    out, rows = {}, []
    for p in sorted(w.glob("eval_graph_b*/report.json"), key=lambda p: int(p.parent.name[len("eval_graph_b") :])):
        r = json.loads(p.read_text())
        bs = int(p.parent.name[len("eval_graph_b") :])
        v = out[f"b{bs}"] = {
            "tau": round(r["tau"], 4),
            "speedup": round(r["speedup"], 3),
            "speculative_tokens_per_s": round(r["speculative_tokens_per_s"], 1),
            "greedy_tokens_per_s": round(r["greedy_tokens_per_s"], 1),
            "lossless": r.get("lossless"),
            "timed_greedy_equals_reference": r.get("timed_greedy_equals_reference"),
            "dtype": r.get("config", {}).get("dtype"),
        }
        rows.append(
            [
                str(bs),
                f"{v['tau']:.3f}",
                f"{v['greedy_tokens_per_s']:.0f}",
                f"{v['speculative_tokens_per_s']:.0f}",
                f"{v['speedup']:.2f}×",
                str(v["lossless"]),
            ]
        )
    return {
        "graph_eval": out,
        "tables": [
            {
                "title": "eagle3-eval decoder=graph: speculative (chain k=5) against plain greedy, both graph-captured",
                "header": ["batch", "τ", "greedy tokens/s", "speculative tokens/s", "speed-up", "lossless"],
                "rows": rows,
            }
        ],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("w", help="speedup_gpu.sh's W")
    p.add_argument("--bench-out")
    p.add_argument("--eval-out")
    p.add_argument("--sglang", help="the W of speedup_gpu.sh STEPS=sglang (its trees beside W's eval trees)")
    p.add_argument("--machine", default=None, help="the eval side's machine, as words")
    p.add_argument("--command", default=None, help="the command that produced W")
    p.add_argument("--note", default=None, help="what the reader must know about the run (shared GPU, ...)")
    a = p.parse_args(argv)
    w = Path(a.w)
    extra = {k: v for k, v in (("command", a.command), ("note", a.note)) if v}
    if a.bench_out:
        Path(a.bench_out).write_text(json.dumps({**bench_summary(w), **extra}, indent=1) + "\n")
    if a.eval_out:
        ev = eval_summary(w)
        ev = {"what": ev.pop("what"), "machine": a.machine, **extra, **ev}
        for part in ([sglang_trees(w, Path(a.sglang))] if a.sglang else []) + [graph_eval(w)]:
            ev["tables"] += part.pop("tables")
            ev.update(part)
        ev["tables"] = [t for t in ev["tables"] if t["rows"]]  # a step that did not run shows no table
        Path(a.eval_out).write_text(json.dumps(ev, indent=1) + "\n")


if __name__ == "__main__":
    main()
