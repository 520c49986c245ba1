"""benchmarks/results/reasoning_h200.json from the files benchmarks/reasoning_gpu.py left
(results.json, the eval and served-acceptance reports, the prepared manifest), kept under
benchmarks/results/raw/reasoning_h200/:

    python3 benchmarks/reasoning_results.py benchmarks/results/raw/reasoning_h200 \
        --out benchmarks/results/reasoning_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def build(raw: Path) -> dict[str, Any]:
    run = json.loads((raw / "results.json").read_text())
    prep = json.loads((raw / "prepare_manifest.json").read_text())
    rows, figures = [], {}
    for flags in ("on", "off"):
        ev = json.loads((raw / f"eval_{flags}.json").read_text())
        sv = json.loads((raw / f"served_{flags}.json").read_text())
        region = ev["by_region"] or {}
        figures[f"thinking_{flags}"] = {
            "chat_template_kwargs": sv["chat_template_kwargs"],
            "eval_tau": ev["tau"],
            "eval_tau_inside_reasoning": (region.get("reasoning") or {}).get("tau"),
            "eval_tau_in_answer": (region.get("answer") or {}).get("tau"),
            "eval_lossless": ev["lossless"],
            "eval_lossless_counts": ev["lossless_counts"],
            "engine_mean_acceptance_length": sv["mean_acceptance_length"],
            "engine_over_eval": sv["mean_acceptance_length"] / ev["tau"],
            "prompts": ev["prompts"],
            "eval_tokens": ev["tokens"],
            "engine_tokens": sv["completion_tokens"],
            "warned": bool(ev["warnings"]) and bool(sv["warnings"]),
        }
        f = figures[f"thinking_{flags}"]
        rows.append(
            [
                json.dumps(f["chat_template_kwargs"]),
                "yes" if flags == "on" else "no (flipped)",
                f"{f['eval_tau']:.3f}",
                f"{f['engine_mean_acceptance_length']:.3f}",
                f"{f['engine_over_eval'] - 1:+.1%}",
                ev["lossless"],
                "yes" if f["warned"] else "no",
            ]
        )
    on, off = figures["thinking_on"], figures["thinking_off"]
    return {
        "what": "a draft trained on SmolLM2 under a thinking-style chat template (per-turn renders, flags "
        "{enable_thinking: true}) served by vLLM with the same template: engine acceptance beside eagle3-eval's tau, "
        "with the training flags and with them flipped",
        "machine": "1 x NVIDIA H200 (device tool), torch 2.11.0+cu130, transformers 5.17.0, vLLM 0.26.0 (--enforce-eager)",
        "date": "2026-12-04",
        "runs": "single run",
        "command": "W=/tmp/w51 python3 benchmarks/reasoning_gpu.py (N=1024 conversations, 5 epochs, 48 eval "
        "conversations, 128 new tokens, k=4)",
        "template": "benchmarks/templates/smollm2_thinking.jinja",
        "prepared": {
            "conversations": prep["counts"]["rows_read"],
            "samples": prep["counts"]["rows_written"],
            "per_turn": prep["counts"].get("per_turn"),
            "regeneration": prep.get("regeneration"),
            "chat_template_kwargs": prep["target"].get("chat_template_kwargs"),
        },
        "steps_seconds": {k: v["seconds"] for k, v in run["steps"].items()},
        "figures": figures,
        "engine_within_3pct_of_eval_with_training_flags": abs(on["engine_over_eval"] - 1) <= 0.03,
        "flipped_flags_tau_change": {
            "eval": off["eval_tau"] - on["eval_tau"],
            "engine": off["engine_mean_acceptance_length"] - on["engine_mean_acceptance_length"],
        },
        "notes": [
            "SmolLM2 never closes the <think> its prompt opens: every generated token counts as reasoning with the "
            "flags on and as answer with them off (eval's tau split), and replies cut at regen.max_new_tokens are "
            "cut inside the reasoning (kept: regen.cut_in_reasoning=keep, counted)",
            "the shipped synthesized conversations are single-turn, so each is one per-turn sample; multi-turn "
            "history rewriting is covered by the CPU fixtures of six template families (tests/test_reasoning.py)",
            "flipping the flags changed nothing measurable here: SmolLM2 writes the same kind of prose after "
            "'<think>\\n' as after an empty think block, and the draft (tau 1.34) learnt that prose, not the block",
        ],
        "tables": [
            {
                "title": "Engine acceptance (vLLM 0.26.0) beside eval, SmolLM2 under a thinking template, draft trained "
                "with enable_thinking=true",
                "header": [
                    "served flags",
                    "as trained",
                    "eval tau",
                    "engine acceptance length",
                    "engine - eval",
                    "eval lossless",
                    "mismatch warned",
                ],
                "rows": rows,
            }
        ],  # fmt: skip
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", type=Path)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    a.out.write_text(json.dumps(build(a.raw), indent=1) + "\n")


if __name__ == "__main__":
    main()
