"""Issue #35's study table: every lever the issue names, what it did to the held-out τ and to the
minutes, read from the results files that measured it (never typed in), with the lever's verdict;
a lever not measured says why. Plus where τ stands against 3.5: the data scale and the acceptance
per position that τ 3.5 would need.

    python3 -m benchmarks.study35_table              # rewrites results/recipe_study35_summary.json

Each row compares two runs of one results file (or two files where only they differ in that lever;
the row's setting says what else differed). Differences under ``NOISE`` are not evidence: runs of
equal quality move τ on the 37 held-out prompts by a few hundredths.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "recipe_study35_summary.json"
NOISE = 0.05

Ref = tuple[str, str | None]  # (results file, variant or curve point; None: the file's own run)
STUDY16K = "recipe_study35_h200.json"  # offline, N=16384, 6 epochs, up to 7 trainings sharing one H200
STUDY4K = "recipe_study35_n4096_h200.json"  # the recipe online, N=4096, 6 epochs, 4 sharing one H200
STUDY8K = "recipe_study35_n8192_h200.json"  # the recipe online, N=8192, 6 epochs, 4 sharing one H200
WSD73K = "recipe_study35_wsd73k_h200.json"  # the recipe at its defaults (N=73728) with WSD, alone on one H200
SWEEP = "recipe_sweep_h200x2.json"  # offline, N=16384, 8 epochs, lr 3e-3, 4-5 trainings per H200

# (the group, lever, how it was measured, base run, lever run); runs None: not measured, and why
LEVERS: list[tuple[str, str, str, Ref | None, Ref | str]] = [
    (
        "data",
        "your prompts answered by the target, 8× (OWN_REPEATS=8)",
        "recipe online, N=4096 (+2240 rows: 50 % more steps)",
        (STUDY4K, "base"),
        (STUDY4K, "own_x8"),
    ),
    (
        "data",
        "your prompts answered by the target, 8× (OWN_REPEATS=8)",
        "recipe online, N=8192, both with WSD (+2240 rows: 26 % more steps)",
        (STUDY8K, "wsd"),
        (STUDY8K, "own_wsd"),
    ),
    (
        "data",
        "replies of 256 new tokens instead of 128",
        "recipe online, N=8192 (1.67× the loss tokens)",
        (STUDY8K, "base"),
        (STUDY8K, "replies_256"),
    ),
    (
        "data",
        "two-turn synthesized conversations",
        "recipe online, N=8192 (1.85× the loss tokens)",
        (STUDY8K, "base"),
        (STUDY8K, "turns_2"),
    ),
    (
        "data",
        "replies sampled at temperature 0.7 instead of greedy",
        "recipe online, N=8192",
        (STUDY8K, "base"),
        (STUDY8K, "sampled_0.7"),
    ),
    ("objective", "ttt 7 instead of 5", "offline, N=16384", (STUDY16K, "base"), (STUDY16K, "ttt_7")),
    (
        "objective",
        "step weights 1 instead of 0.8^j (train.loss_decay=1.0)",
        "recipe online, N=8192",
        (STUDY8K, "base"),
        (STUDY8K, "decay_1.0"),
    ),
    (
        "objective",
        "LK term mixed in (train.lk_weight=1.0)",
        "offline, N=16384",
        (STUDY16K, "base"),
        (STUDY16K, "lk_full"),
    ),
    (
        "objective",
        "loss only where the target is sure (train.min_target_prob=0.3)",
        "recipe online, N=4096",
        (STUDY4K, "base"),
        (STUDY4K, "sure_0.3"),
    ),
    ("objective", "label smoothing 0.1", "offline, N=16384", (STUDY16K, "base"), (STUDY16K, "smooth_0.1")),
    (
        "head",
        "draft vocab 16384 instead of 8192",
        "recipe, N=131072, 2 H200s (head_chunk 4096 → 32768 too)",
        ("recipe_graph_h200x2.json", None),
        ("recipe_vocab16k_h200x2.json", None),
    ),
    ("head", "draft vocab 32768 instead of 16384", "recipe online, N=8192", (STUDY8K, "base"), (STUDY8K, "vocab_32k")),
    (
        "head",
        "draft vocab the full 49152",
        "",
        None,
        "not measured (the lease's time went to the data levers): 16k → 32k did nothing at N=8192 (+0.012)",
    ),
    (
        "head",
        "lm_head from the target's rows instead of random",
        "offline, N=16384, 8k-token batches",
        (SWEEP, "r_b8k"),
        (SWEEP, "t_b8k"),
    ),
    (
        "head",
        "lm_head from the target's rows instead of random",
        "offline, N=16384, 32k-token batches",
        (SWEEP, "r_b32k"),
        (SWEEP, "n16384"),
    ),
    (
        "head",
        "lm_head frozen after 100 warm-up steps (train.lm_head_steps=100)",
        "recipe online, N=8192 (252 steps)",
        (STUDY8K, "base"),
        (STUDY8K, "lm_head_100"),
    ),
    (
        "head",
        "lm_head frozen throughout (model.freeze_lm_head)",
        "",
        None,
        "not measured (the lease's time went to the data levers): frozen after 100 of 252 steps did nothing (+0.002)",
    ),
    (
        "head",
        "MLP 3072 instead of the target's 1536",
        "offline, N=16384, random lm_head, 8k-token batches",
        (SWEEP, "r_b8k"),
        (SWEEP, "r_b8k_i3072"),
    ),
    (
        "head",
        "MLP 6144 instead of 3072",
        "recipe, N=131072, 2 H200s (with train.compile and faster synthesis)",
        ("recipe_vocab16k_h200x2.json", None),
        ("recipe_mlp6144_h200x2.json", None),
    ),
    (
        "schedule",
        "WSD instead of cosine (decay over the last 20 %)",
        "recipe online, N=4096",
        (STUDY4K, "base"),
        (STUDY4K, "wsd"),
    ),
    (
        "schedule",
        "WSD instead of cosine (decay over the last 20 %)",
        "recipe online, N=8192",
        (STUDY8K, "base"),
        (STUDY8K, "wsd"),
    ),
    (
        "schedule",
        "WSD instead of cosine (decay over the last 20 %)",
        "the recipe at its defaults, N=73728, alone on one H200 (two runs a day apart)",
        ("recipe_defaults_h200.json", None),
        (WSD73K, "wsd_73k"),
    ),
    ("schedule", "EMA of the weights (0.999)", "recipe online, N=4096", (STUDY4K, "base"), (STUDY4K, "ema_0.999")),
    (
        "schedule",
        "lr 1e-3 instead of 3e-3",
        "offline, N=16384, random lm_head, 8k-token batches",
        (SWEEP, "r_b8k"),
        (SWEEP, "r_b8k_lr1e-3"),
    ),
    (
        "schedule",
        "8k-token batches instead of 32k (4× the steps)",
        "offline, N=16384, random lm_head",
        (SWEEP, "r_b32k"),
        (SWEEP, "r_b8k"),
    ),
    (
        "schedule",
        "4k-token batches instead of 32k (8× the steps)",
        "offline, N=16384, random lm_head",
        (SWEEP, "r_b32k"),
        (SWEEP, "r_b4k"),
    ),
    (
        "scale",
        "twice the conversations on two GPUs (147456 instead of 73728)",
        "recipe online, 1 → 2 H200s",
        ("recipe_defaults_h200.json", None),
        ("recipe_parts_h200x2.json", None),
    ),
    (
        "stack",
        "two-turn conversations + your prompts 8× + WSD together",
        "recipe online, N=8192 (trained alone on the GPU)",
        (STUDY8K, "base"),
        (STUDY8K, "stack"),
    ),
    (
        "throughput",
        "train.compile of the layer's step-independent parts instead of the whole layer",
        "recipe, N=147456, 2 H200s",
        ("recipe_starter_h200x2.json", None),
        ("recipe_parts_h200x2.json", None),
    ),
]


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


def run_of(ref: Ref) -> dict[str, Any]:
    """The run a reference names: a file's variant, its curve point ``n<conversations>``, or the file itself."""
    data = load(ref[0])
    name = ref[1]
    if name is None:
        return data
    if name.startswith("n") and name[1:].isdigit():
        return next(p for p in data["curve"] if p["conversations"] == int(name[1:]))
    return next(v for v in data["variants"] if v["name"] == name)


def tau(run: dict[str, Any], length: int = 128) -> float | None:
    if length == 128:
        return run.get("eval", {}).get("tau")
    return run.get("eval_long", {}).get(str(length), {}).get("tau")


def train_seconds(run: dict[str, Any]) -> float | None:
    """Training's wall seconds: a study's ``train.wall_s``, else the recipe's train stage."""
    if "wall_s" in run.get("train", {}):
        return float(run["train"]["wall_s"])
    if "stages_s" in run:
        return float(run["stages_s"]["train"])
    return next((float(t["seconds"]) for t in run.get("timings", []) if t["stage"] == "train"), None)


def verdict(delta: float, s0: float | None, s1: float | None, group: str) -> str:
    """Helped / hurt / no difference by τ; a throughput lever by its training time too."""
    by_tau = "helped" if delta >= NOISE else "hurt" if delta <= -NOISE else f"no difference (within ±{NOISE})"
    if group == "throughput" and s0 and s1:
        return f"training {s0 / s1:.2f}× as fast; τ: {by_tau}"
    return by_tau


def lever_rows() -> list[list[str]]:
    rows = []
    for group, lever, setting, base_ref, lever_ref in LEVERS:
        if base_ref is None or isinstance(lever_ref, str):
            rows.append([group, lever, "—", "—", "—", "—", "—", "—", "—", str(lever_ref)])
            continue
        base, run = run_of(base_ref), run_of(lever_ref)
        t0, t1 = tau(base), tau(run)
        assert t0 is not None and t1 is not None, (base_ref, lever_ref)
        long0, long1 = tau(base, 512), tau(run, 512)
        s0, s1 = train_seconds(base), train_seconds(run)
        n0, n1 = base.get("train", {}).get("steps"), run.get("train", {}).get("steps")
        files = base_ref[0] if base_ref[0] == lever_ref[0] else f"{base_ref[0]}, {lever_ref[0]}"
        rows.append(
            [
                group,
                lever,
                setting,
                f"{t0:.3f} → {t1:.3f}",
                f"{t1 - t0:+.3f}",
                f"{long1 - long0:+.3f}" if long0 is not None and long1 is not None else "—",
                f"{s0:.0f} → {s1:.0f}" if s0 is not None and s1 is not None else "—",
                f"{n0} → {n1}" if n0 and n1 else "—",
                files,
                verdict(t1 - t0, s0, s1, group),
            ]
        )
    return rows


def constant_acceptance_for(target_tau: float, k: int) -> float:
    """The acceptance a, the same at every chain position, for which 1 + a + a² + … + a^k = target_tau."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a**i for i in range(k + 1)) < target_tau else (lo, a)
    return (lo + hi) / 2


def scale_rows() -> list[list[str]]:
    """τ against the data: the sweep's curve (offline, 8 epochs) and the recipe at its defaults."""
    sweep = load(SWEEP)
    rows = [
        [
            f"{p['conversations']}",
            "offline, 8 epochs, 1 of 4-5 sharing an H200",
            f"{p['eval']['tau']:.3f}",
            f"{p['train']['wall_s']}",
            SWEEP,
        ]
        for p in sweep["curve"]
    ]
    for ref, n in ((STUDY4K, 4096), (STUDY8K, 8192)):
        base = run_of((ref, "base"))
        rows.append(
            [
                str(n),
                "the recipe online, 6 epochs, 1 of 4 sharing an H200",
                f"{tau(base):.3f}",
                f"{train_seconds(base):.0f}",
                ref,
            ]
        )
    for ref, n, how in (
        (("recipe_defaults_h200.json", None), 73728, "the recipe online, 6 epochs, cosine, 1 H200"),
        ((WSD73K, "wsd_73k"), 73728, "the recipe online, 6 epochs, WSD, 1 H200"),
        (("recipe_parts_h200x2.json", None), 147456, "the recipe online, 6 epochs, cosine, 2 H200s"),
    ):
        d = run_of(ref)
        total = d["total_s"]
        rows.append([str(n), how, f"{tau(d):.3f}", f"{train_seconds(d):.0f} (end to end {total / 60:.1f} min)", ref[0]])
    return rows


def gap() -> dict[str, Any]:
    """Where the recipe's draft (its defaults: WSD) stands against τ 3.5: its acceptance per position, held
    out and on its own eval split, beside the constant acceptance that 3.5 needs at k=5; what a doubling of
    the data bought (the last doubling: the recipe with cosine on one GPU, then on two)."""
    d = run_of((WSD73K, "wsd_73k"))
    cosine = load("recipe_defaults_h200.json")
    need = constant_acceptance_for(3.5, 5)
    pairs = [(SWEEP, "n2048", "n4096"), (SWEEP, "n4096", "n8192"), (SWEEP, "n8192", "n16384")]
    per_doubling = {
        f"{a[1:]} → {b[1:]} ({f})": round(tau(run_of((f, b))) - tau(run_of((f, a))), 3) for f, a, b in pairs
    }
    two = load("recipe_parts_h200x2.json")  # twice the conversations, the same optimizer steps on 2 GPUs
    last = two["eval"]["tau"] - cosine["eval"]["tau"]
    per_doubling["73728 → 147456 (the recipe, 1 → 2 H200s)"] = round(last, 3)
    # a data lever that adds tokens against as many more tokens of one-turn conversations (the sweep's last doubling)
    doubling = per_doubling[f"8192 → 16384 ({SWEEP})"]
    base8 = run_of((STUDY8K, "base"))
    shape = {}
    for name in ("turns_2", "replies_256"):
        v = run_of((STUDY8K, name))
        ratio = v["prepared"]["loss_tokens"] / base8["prepared"]["loss_tokens"]
        shape[name] = {
            "loss_tokens_vs_base": round(ratio, 2),
            "delta_tau": round(tau(v) - tau(base8), 3),
            "as_many_more_one_turn_conversations_would_give": round(doubling * math.log2(ratio), 3),
        }
    return {
        "held_out_tau": d["eval"]["tau"],
        "held_out_acceptance_per_position": d["eval"]["acceptance_per_position"],
        "held_out_tau_512_new_tokens": tau(d, 512),
        "held_out_tau_512_by_reply_position": {
            f"{b['from']}-{b['to']}": {"tau": round(b["tau"], 3), "tokens": b["tokens"]}
            for b in d["eval_long"]["512"]["by_reply_position"]
        },
        "end_to_end_minutes": round(d["total_s"] / 60, 1),
        "eval_split_simulated_tau": d["train"]["best_eval_tau"],
        "eval_split_acceptance_per_position": d["train"]["eval_acc_at_best"],
        "acceptance_at_every_position_for_tau_3.5": round(need, 4),
        "tau_gain_per_doubling_of_the_data": per_doubling,
        "doublings_to_3.5_at_the_last_gain": round((3.5 - d["eval"]["tau"]) / last, 1),
        f"data_levers_against_more_conversations ({STUDY8K})": shape,
        f"stack_against_its_parts ({STUDY8K})": {
            "stack": round(tau(run_of((STUDY8K, "stack"))) - tau(base8), 3),
            "turns_2 + own_wsd, each alone": round(
                tau(run_of((STUDY8K, "turns_2"))) + tau(run_of((STUDY8K, "own_wsd"))) - 2 * tau(base8), 3
            ),
        },
        "from": f"{WSD73K} (the recipe at its defaults); the last doubling's gain from recipe_defaults_h200.json "
        "and recipe_parts_h200x2.json (both cosine), applied to the WSD run's τ",
    }


def summary() -> dict[str, Any]:
    return {
        "what": "issue #35's study table, read from the results files named in each row (benchmarks/study35_table.py); "
        "each lever against its own base in the same results file or between two recipe runs that the setting names; "
        f"eagle3-eval chain k=5, greedy, fp32 on the 37 held-out prompts; single runs; |Δ τ| under {NOISE} is not evidence",
        "machine": "as each named results file says (one or two NVIDIA H200s)",
        "command": "python3 -m benchmarks.study35_table",
        "gap_to_3.5": gap(),
        "tables": [
            {
                "title": "Issue #35's levers, one at a time (τ at 128 new tokens; training seconds while sharing the GPU where the setting says so)",
                "header": [
                    "group",
                    "lever",
                    "measured as",
                    "τ base → with",
                    "Δ τ (128)",
                    "Δ τ (512)",
                    "training s",
                    "optimizer steps",
                    "results",
                    "verdict",
                ],
                "rows": lever_rows(),
            },
            {
                "title": "τ against the data (held-out prompts)",
                "header": ["conversations", "how", "τ", "training s", "results"],
                "rows": scale_rows(),
            },
        ],
    }


def main() -> None:
    OUT.write_text(json.dumps(summary(), indent=1, ensure_ascii=False) + "\n")
    for row in summary()["tables"][0]["rows"]:
        print(" | ".join(row))


if __name__ == "__main__":
    main()
