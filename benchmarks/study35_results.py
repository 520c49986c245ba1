"""Collect benchmarks/study35_gpu.sh's runs into one results JSON: a row per variant (the recipe
with one lever changed) and the table the docs show, each against the study's ``base``.

    python3 -m benchmarks.study35_results W NAME...      # writes W/study35.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.recipe_results import recipe


def _text(path: Path) -> str:
    return path.read_text().strip() if path.is_file() else ""


def variant(w: Path, name: str) -> dict[str, Any]:
    """One variant's run: what it changed (``change``), whose synthesis it trained on (``from``, empty:
    its own), and :func:`recipe`'s figures (stage times, data, training, eval and the longer evals)."""
    run = w / name
    row: dict[str, Any] = {"name": name, "change": _text(run / "change.txt") or "—", "from": _text(run / "from.txt")}
    if (w / f"{name}.failed").is_file():
        row["failed"] = f"the recipe failed: see {name}.log"
    return row | recipe(run)


def _stage(v: dict[str, Any], stage: str) -> str:
    return next((f"{t['seconds']:.0f}" for t in v.get("timings", []) if t["stage"] == stage), "—")


def table(variants: list[dict[str, Any]]) -> dict[str, Any]:
    """A row per variant: its change, τ at 128 and at each longer reply length and the difference from
    ``base`` (the variant of that name, if any), the simulated τ on its eval split, its minutes."""
    base = next((v for v in variants if v["name"] == "base"), {})
    longs = sorted({n for v in variants for n in v.get("eval_long", {})}, key=int)

    def taus(v: dict[str, Any]) -> list[float | None]:
        return [v.get("eval", {}).get("tau"), *(v.get("eval_long", {}).get(n, {}).get("tau") for n in longs)]

    rows = []
    for v in variants:
        mine, base_taus = taus(v), taus(base)
        deltas = [f"{a - b:+.3f}" if a is not None and b is not None else "—" for a, b in zip(mine, base_taus)]
        tr = v.get("train", {})
        rows.append(
            [
                v["name"],
                v["change"] + (f" (on the synthesis of {v['from']})" if v["from"] else ""),
                *(f"{t:.3f}" if t is not None else "—" for t in mine),
                *deltas,
                f"{tr['best_eval_tau']:.3f}" if "best_eval_tau" in tr else "—",
                _stage(v, "synthesize") if not v["from"] else "(shared)",
                _stage(v, "train"),
                str(tr.get("median_tokens_per_s", "—")),
                str(v.get("eval", {}).get("lossless", v.get("failed", "—"))),
            ]
        )
    lengths = ["128", *longs]
    return {
        "title": "Issue #35's levers: the one-GPU recipe with one thing changed (eagle3-eval chain k=5, greedy, fp32, held-out prompts)",
        "header": [
            "variant",
            "change",
            *(f"τ ({n} new tokens)" for n in lengths),
            *(f"Δ τ vs base ({n})" for n in lengths),
            "simulated τ (eval split)",
            "synthesis s",
            "training s",
            "median tokens/s",
            "lossless",
        ],
        "rows": rows,
    }


def main() -> None:
    w, names = Path(sys.argv[1]), sys.argv[2:]
    variants = [variant(w, name) for name in names]
    out = {
        "what": "issue #35's study (benchmarks/study35_gpu.sh)",
        "variants": variants,
        "tables": [table(variants)],
    }
    (w / "study35.json").write_text(json.dumps(out, indent=1) + "\n")
    for row in out["tables"][0]["rows"]:
        print(" | ".join(row))


if __name__ == "__main__":
    main()
