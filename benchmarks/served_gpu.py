"""``source=served`` against real vLLM on one GPU, as one background job (run from the repository
root after staging: benchmarks/staging/gpu_stage.sh and benchmarks/staging/stage_vllm.sh install):

  1. ``smollm2``: the embedded target, the shipped synthesized conversations (SMOL_N); training with
     the target in the process (seeds 0 and 1: the noise) and fed by vLLM started by the run
     (``engine.launch=true``, seed 0), the same options: first-step loss, held-out simulated tau
     and accuracy per step, tokens/s;
  2. ``qwen3_moe``: the tiny qwen3_moe target saved as a directory (bf16), MOE_N of the same
     conversations cut at 512 tokens: the same comparison, seed 0;
  3. ``scale``: benchmarks/bench_served.py (8B and 30B-A3B shapes, in-process and served).

Every step runs under a time limit and never stops the next; $W/results.json is rewritten after
each, and $W/bundle/ holds results.json, log and logs.tgz for a polling call to copy back.

    W=/tmp/w50 setsid nohup python3 benchmarks/served_gpu.py >/tmp/w50.out 2>&1 </dev/null &

Variables (default): W (/tmp/w50), STEPS (smollm2,qwen3_moe,scale), SMOL_N (2048), MOE_N (512),
EPOCHS (2), SCALE_BUDGET (900), SCALE_CASES (llama8b,qwen3_30b_a3b), VLLM_ARGS (--enforce-eager),
FILES (/dev/shm/w50: the engine's state files in flight). On the CPU the same runs against the
stand-in vLLM (a ``vllm`` on PATH that runs tests/standin_engines.py) with small numbers:
    W=/tmp/w50 SMOL_N=64 MOE_N=32 EPOCHS=1 SCALE_ARGS=--small TARGET_DTYPE=float32 python3 ...
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
W = Path(os.environ.get("W", "/tmp/w50"))
STEPS = os.environ.get("STEPS", "smollm2,qwen3_moe,scale").split(",")
SMOL_N = int(os.environ.get("SMOL_N", "2048"))
MOE_N = int(os.environ.get("MOE_N", "512"))
EPOCHS = int(os.environ.get("EPOCHS", "2"))
VLLM_ARGS = os.environ.get("VLLM_ARGS", "--enforce-eager")
FILES = os.environ.get("FILES", "/dev/shm/w50")
DTYPE = os.environ.get("TARGET_DTYPE", "auto")  # float32 on the CPU dry run (the stand-in's)
PY = sys.executable
RESULTS: dict[str, Any] = {"steps": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def save() -> None:
    W.mkdir(parents=True, exist_ok=True)
    (W / "results.json").write_text(json.dumps(RESULTS, indent=1) + "\n")
    bundle = W / "bundle"
    bundle.mkdir(exist_ok=True)
    shutil.copy(W / "results.json", bundle / "results.json")
    if (W / "log").exists():
        shutil.copy(W / "log", bundle / "log")
    with tarfile.open(bundle / "logs.tgz", "w:gz") as tar:
        for f in sorted(W.rglob("*.log")) + sorted(W.rglob("metrics.jsonl")):
            if "bundle" not in f.parts and f.stat().st_size < 20 * 2**20:
                tar.add(f, arcname=str(f.relative_to(W)))


def step(name: str, seconds: float, cmd: list[str]) -> bool:
    """Run ``cmd`` (its output in $W/<name>.log) within ``seconds``; record status and time."""
    log = W / f"{name.replace('/', '_')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=seconds, cwd=REPO).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    RESULTS["steps"][name] = {"rc": rc, "seconds": round(time.monotonic() - start, 1)}
    if rc:
        RESULTS["steps"][name]["tail"] = log.read_text(errors="replace")[-2500:]
    print(f"   rc={rc} in {RESULTS['steps'][name]['seconds']} s", flush=True)
    save()
    return rc == 0


def summary(run: Path) -> dict[str, Any]:
    """First-step loss, the last evaluation, tokens/s and what fed the run, from its files."""
    if not (run / "metrics.jsonl").is_file():
        return {"missing": str(run)}
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "loss" in x]
    evals = [x for x in lines if "eval_tau" in x]
    ckpts = sorted((run / "checkpoints").glob("step*"), key=lambda p: int(p.name[4:]))
    state = json.loads((ckpts[-1] / "state.json").read_text()) if ckpts else {}
    out: dict[str, Any] = {
        "first_step": {k: train[0].get(k) for k in ("step", "loss", "acc")} if train else None,
        "steps": train[-1]["step"] if train else 0,
        "tokens_per_s_median": sorted(x.get("tokens_per_s", 0) for x in train)[len(train) // 2] if train else None,
        "final_eval": {k: evals[-1].get(k) for k in ("step", "eval_loss", "eval_acc", "eval_tau", "eval_tau_decoded")}
        if evals
        else None,
        "states_from": state.get("states_from"),
    }
    return out


def train_cmd(data: Path, target: str, out: Path, seed: int, source: str, extra: list[str]) -> list[str]:
    cmd = [
        PY, "-m", "eagle3_train.training.trainer", f"data={data}", f"target={target}", f"out={out}",
        "progress=false", f"source={source}", f"train.seed={seed}", f"train.epochs={EPOCHS}", "train.log_every=1",
        *extra,
    ]  # fmt: skip
    if source == "served":
        cmd += [
            "engine.launch=true", f"engine.engine_args='{VLLM_ARGS}'", f"engine.files_dir={FILES}/{out.name}",
            f"engine.dtype={DTYPE}", "engine.launch_timeout_s=600",
        ]  # fmt: skip
    elif DTYPE != "auto":
        cmd.append(f"online.dtype={DTYPE}")
    return cmd


def compare(name: str, runs: dict[str, Path]) -> None:
    """The served run beside the in-process runs: first-step loss and held-out tau differences,
    with the seed-to-seed difference of the in-process runs as the noise."""
    got = {k: summary(v) for k, v in runs.items()}
    table: dict[str, Any] = {"runs": got}
    try:
        ref, srv = got["online_seed0"], got["served_seed0"]
        table["first_step_loss_rel_diff"] = abs(srv["first_step"]["loss"] - ref["first_step"]["loss"]) / abs(
            ref["first_step"]["loss"]
        )
        table["eval_tau_diff_served_vs_online"] = srv["final_eval"]["eval_tau"] - ref["final_eval"]["eval_tau"]
        if "online_seed1" in got and got["online_seed1"].get("final_eval"):
            table["eval_tau_diff_seed1_vs_seed0"] = (
                got["online_seed1"]["final_eval"]["eval_tau"] - ref["final_eval"]["eval_tau"]
            )
        table["tokens_per_s_served_over_online"] = srv["tokens_per_s_median"] / ref["tokens_per_s_median"]
    except (KeyError, TypeError) as e:
        table["incomplete"] = f"{type(e).__name__}: {e}"
    RESULTS[name] = table
    save()


def smollm2() -> None:
    prep = W / "smol" / "prep"
    if not step(
        "smollm2/prepare",
        600,
        [PY, "-m", "data_prep.prepare", "target=embedded", "input=data_prep/prompts/synth_smollm2.jsonl.gz",
         f"out={prep}", f"limit={SMOL_N}", "progress=false"],
    ):  # fmt: skip
        return
    extra = [
        "online.draft_vocab_size=8192", "online.eval_fraction=0.05", "train.ttt_length=5", "train.lr=2e-3",
        "train.warmup_steps=20", "train.schedule=wsd", "train.max_tokens_per_batch=16384", "model.lm_head_init=target",
    ]  # fmt: skip
    runs = {}
    for source, seed in (("online", 0), ("served", 0), ("online", 1)):
        out = W / "smol" / f"{source}{seed}"
        step(f"smollm2/{source}_seed{seed}", 900, train_cmd(prep, "embedded", out, seed, source, extra))
        runs[f"{source}_seed{seed}"] = out
        compare("smollm2", runs)


def qwen3_moe() -> None:
    target = W / "moe" / "target"
    save_tiny = "import sys; from eagle3_train.targets.tiny import save_tiny; save_tiny(sys.argv[1], sys.argv[2])"
    if not step("qwen3_moe/save", 300, [PY, "-c", save_tiny, "tiny:qwen3_moe", str(target)]):
        return
    prep = W / "moe" / "prep"
    if not step(
        "qwen3_moe/prepare",
        600,
        [PY, "-m", "data_prep.prepare", f"target={target}", "input=data_prep/prompts/synth_smollm2.jsonl.gz",
         f"out={prep}", f"limit={MOE_N}", "max_length=512", "progress=false"],
    ):  # fmt: skip
        return
    extra = [
        "online.draft_vocab_size=256", "online.eval_fraction=0.1", "train.ttt_length=3", "train.lr=3e-3",
        "train.max_tokens_per_batch=8192",
    ]  # fmt: skip
    runs = {}
    for source, seed in (("online", 0), ("served", 0), ("online", 1)):
        out = W / "moe" / f"{source}{seed}"
        step(f"qwen3_moe/{source}_seed{seed}", 600, train_cmd(prep, str(target), out, seed, source, extra))
        runs[f"{source}_seed{seed}"] = out
        compare("qwen3_moe", runs)


def scale() -> None:
    out = W / "scale.json"
    budget = os.environ.get("SCALE_BUDGET", "900")
    cmd = [PY, "benchmarks/bench_served.py", "--out", str(out), "--budget", budget, f"--files-root={FILES}"]
    cmd += ["--cases", os.environ.get("SCALE_CASES", "llama8b,qwen3_30b_a3b")]
    cmd += os.environ.get("SCALE_ARGS", "").split()
    step("scale", float(budget) + 120, cmd)
    if out.is_file():
        RESULTS["scale"] = json.loads(out.read_text())
        save()


def main() -> None:
    W.mkdir(parents=True, exist_ok=True)
    (W / "done").unlink(missing_ok=True)
    for name in STEPS:
        try:
            {"smollm2": smollm2, "qwen3_moe": qwen3_moe, "scale": scale}[name]()
        except Exception as e:  # noqa: BLE001  (a broken step never stops the next)
            RESULTS["steps"][f"{name}/driver"] = {"error": f"{type(e).__name__}: {e}"}
            save()
    RESULTS["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    (W / "done").touch()


if __name__ == "__main__":
    main()
