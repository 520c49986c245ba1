"""Collect the data-scaling curve and the options table (benchmarks/scaling_curve.sh) into a
results JSON and a PNG.

    python3 -m benchmarks.scaling_results RUN_DIR results.json curve.png [--what "..."]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def collect(d: Path, std: Path) -> dict[str, Any]:
    """One run: data size, training's last evaluation and best, eagle3-eval's report."""
    out: dict[str, Any] = {}
    if (d / "overrides.txt").is_file():
        out["overrides"] = " ".join((d / "overrides.txt").read_text().split())
    if (std / "manifest.json").is_file():
        c = json.loads((std / "manifest.json").read_text())["counts"]
        out["data"] = {k: c[k] for k in ("train_samples", "eval_samples", "train_tokens") if k in c}
    metrics = read_jsonl(d / "train" / "metrics.jsonl")
    evals = [m for m in metrics if "eval_tau" in m]
    if evals:
        best = max(evals, key=lambda m: m["eval_tau"])
        out["train"] = {
            "steps": max(m.get("step", 0) for m in metrics),
            "last_eval_tau": round(evals[-1]["eval_tau"], 4),
            "best_eval_tau": round(best["eval_tau"], 4),
            "best_step": best["step"],
            "eval_acc_at_best": [round(a, 4) for a in best["eval_acc"]],
            "eval_curve": [[m["step"], round(m["eval_tau"], 3)] for m in evals],
        }
        if "eval_tau_decoded" in best:  # the decode walk (runs since 2026-11-30)
            out["train"]["best_eval_tau_decoded"] = round(best["eval_tau_decoded"], 4)
        rates = sorted(m["tokens_per_s"] for m in metrics if "tokens_per_s" in m)
        if rates:
            out["train"]["median_tokens_per_s"] = round(rates[len(rates) // 2])
        if (d / "train_s").is_file():
            out["train"]["wall_s"] = int((d / "train_s").read_text())
        if (d / "train.log").is_file() and "stopped by TRAIN_TIMEOUT" in (d / "train.log").read_text(errors="replace"):
            out["train"]["stopped_by_timeout"] = True
    report = d / "eval" / "report.json"
    if report.is_file():
        r = json.loads(report.read_text())
        out["eval"] = {
            "tau": round(r["tau"], 4),
            "acceptance_per_position": [round(a, 4) for a in r["acceptance_per_position"]],
            "lossless": r.get("lossless"),
            "verify_steps": r.get("verify_steps"),
        }
    for long in sorted(d.glob("eval_*/report.json"), key=lambda p: int(p.parent.name.split("_")[1])):
        r = json.loads(long.read_text())  # EVAL_LONG: the same draft on longer replies
        out.setdefault("eval_long", {})[long.parent.name.split("_")[1]] = {
            "tau": round(r["tau"], 4),
            "lossless": r.get("lossless"),
            "by_reply_position": r.get("by_reply_position"),
        }
    if not report.is_file() and (d / "export.log").is_file() and "error" in (d / "export.log").read_text():
        out["eval"] = {"export_refused": (d / "export.log").read_text().strip().splitlines()[-1][:300]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("json_out")
    ap.add_argument("png_out")
    ap.add_argument("--what", default="")
    ap.add_argument("--machine", default="")
    ap.add_argument("--note", default="", help="what the reader must know about the run")
    ap.add_argument("--not-run", action="append", default=[], help="NAME=why: a variant that did not train")
    args = ap.parse_args()
    run = Path(args.run)
    curve, variants = [], []
    for d in sorted((run / "curve").iterdir()):
        if not d.is_dir() or d.name.startswith("std_"):
            continue
        if d.name.startswith("n") and d.name[1:].isdigit():
            curve.append({"conversations": int(d.name[1:])} | collect(d, run / "curve" / f"std_{d.name[1:]}"))
        else:
            variants.append({"name": d.name} | collect(d, run / "curve" / f"std_{_variant_n(run)}"))
    if (run / "eval" / "report.json").is_file():  # the recipe's own run: the largest point
        n = json.loads((run / "prepared" / "manifest.json").read_text())["counts"]["rows_written"]
        curve.append({"conversations": n, "recipe_run": True} | collect(run, run / "std"))
    curve.sort(key=lambda p: p["conversations"])
    result = {
        "what": args.what,
        "machine": args.machine,
        "curve": curve,
        "variants": variants,
        "timings": read_jsonl(run / "timings.jsonl"),
    }
    if args.note:
        result["note"] = args.note
    if variants:
        result["tables"] = [variants_table(variants, dict(x.split("=", 1) for x in args.not_run))]
    Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    plot(curve, Path(args.png_out))
    for p in curve:
        print(p["conversations"], p.get("eval", {}).get("tau"), p.get("train", {}).get("best_eval_tau"))
    for v in variants:
        print(v["name"], v.get("eval", {}).get("tau"), v.get("train", {}).get("best_eval_tau"))


def variants_table(variants: list[dict], not_run: dict[str, str]) -> dict[str, Any]:
    """One row per variant: what it changes from ``base`` (the variant of no overrides of its own,
    if any), eagle3-eval's tau at 128 and at the longer reply lengths, the difference from base, and
    training's figures; a variant that did not train says why."""
    base = next((v for v in variants if v["name"] == "base"), None)
    base_words = set((base or {}).get("overrides", "").split())
    longs = sorted({n for v in variants for n in v.get("eval_long", {})}, key=int)
    rows = []
    for v in variants:
        own = " ".join(w for w in v.get("overrides", "").split() if w not in base_words) or "—"
        tau = v.get("eval", {}).get("tau")
        if tau is None:
            why = not_run.get(v["name"], "did not train or evaluate (see its train.log)")
            rows.append([v["name"], own, *(["—"] * (len(longs) + 5)), why])
            continue
        delta = f"{tau - base['eval']['tau']:+.3f}" if base and base.get("eval", {}).get("tau") else "—"
        tr = v.get("train", {})
        rows.append(
            [
                v["name"],
                own,
                f"{tau:.3f}",
                *(f"{v['eval_long'][n]['tau']:.3f}" if n in v.get("eval_long", {}) else "—" for n in longs),
                delta,
                f"{tr['best_eval_tau']:.3f}" if "best_eval_tau" in tr else "—",
                str(tr.get("wall_s", "—")),
                str(tr.get("median_tokens_per_s", "—")),
                str(v.get("eval", {}).get("lossless")),
            ]
        )
    return {
        "title": "Options, one at a time on the same data (eagle3-eval chain k=5, greedy, fp32, held-out prompts)",
        "header": [
            "variant",
            "overrides beyond base",
            "τ (128 new tokens)",
            *(f"τ ({n} new tokens)" for n in longs),
            "Δ τ vs base (128)",
            "simulated τ (eval split)",
            "training s",
            "median tokens/s",
            "lossless",
        ],
        "rows": rows,
    }


def _variant_n(run: Path) -> str:
    """The n of the variants: the standardized copy that no curve point uses, else the largest."""
    stds = sorted(int(p.name[4:]) for p in (run / "curve").glob("std_*") if p.is_dir())
    points = {int(p.name[1:]) for p in (run / "curve").glob("n*") if p.name[1:].isdigit()}
    rest = [n for n in stds if n not in points]
    return str(rest[0] if rest else stds[-1])


def plot(curve: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(p["conversations"], p["eval"]["tau"]) for p in curve if "tau" in p.get("eval", {})]
    sim = [(p["conversations"], p["train"]["best_eval_tau"]) for p in curve if "train" in p]
    fig, ax = plt.subplots(figsize=(6, 4))
    if pts:
        ax.plot(*zip(*pts), "o-", label="eagle3-eval tau (held-out prompts, k=5, greedy)")
    if sim:
        ax.plot(*zip(*sim), "s--", alpha=0.6, label="simulated tau (training eval split)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("synthesized conversations")
    ax.set_ylabel("tokens per verify step (tau)")
    ax.set_title("SmolLM2-135M-Instruct: draft quality vs data")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
