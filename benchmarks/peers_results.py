"""The side-by-side with the peer frameworks, from what ``benchmarks/peers_gpu.sh poll`` brought back:

    python3 benchmarks/peers_results.py DIR benchmarks/results/peers_modelopt_h200.json \\
        --machine "1 x NVIDIA H200 (device tool), ..." --date 2026-12-05

Per framework run: the conversations and tokens it trained on, the seconds of each phase (data and
states, training with its model load and compile, export, eval), its steady training rate, the GPU
memory peak during training (nvidia-smi every 2 s: the whole device, the target included), the
draft's size, and eagle3-eval's figures on the held-out prompts and MT-bench (chain k=5, greedy,
fp32, lossless-checked). The docs page "Against the peers" is generated from the JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

TITLES = {
    "modelopt": "NVIDIA ModelOpt 0.47.0: its EAGLE-3 example and recipe, defaults",
    "speculators": "speculators 0.9.0: its CLI, defaults",
    "specforge": "SpecForge 0.2.0: its trainer and export, defaults, on HF-captured features (its SGLang 0.5.14 capture does not import on the image)",
    "ours_same_data": "eagle3_train: the smollm2 recipe, the same conversations, one epoch",
    "ours_same_minutes": "eagle3_train: the smollm2 recipe, the same training minutes, the whole set",
    "ours_same_data_small_batches": "eagle3_train: the smollm2 recipe with 8,192-token batches, the same conversations, one epoch",
    "ours_same_data_more_steps": "eagle3_train: the smollm2 recipe with train.min_steps=400, the same conversations, one epoch",
}


def phases(d: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (d / "phases.jsonl").read_text().splitlines() if line.strip()]


def memory_trace(d: Path) -> list[tuple[float, int]]:
    """(epoch seconds, MiB used) from nvidia-smi's csv (its timestamps in the machine's time, UTC)."""
    out = []
    path = d / "smi.csv"
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        m = re.match(r"\s*(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d+),\s*(\d+) MiB", line)
        if m:
            t = datetime.strptime(m.group(1), "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
            out.append((t, int(m.group(2))))
    return out


def peak(trace: list[tuple[float, int]], start: float, end: float) -> int | None:
    inside = [mib for t, mib in trace if start <= t <= end]
    return max(inside) if inside else None


def trainer_rate(log: str, name: str) -> dict[str, float] | None:
    """HF Trainer's final metrics of run ``name`` (the last ``train_runtime`` line after its marker)."""
    part = log.split(f"peers_gpu: {name} train done")[0].rsplit(" train done", 1)[-1]  # this run's part
    found = re.findall(r"'train_runtime': '?([0-9.]+)'?, 'train_samples_per_second': '?([0-9.]+)'?", part)
    if not found:
        return None
    runtime, per_s = map(float, found[-1])
    return {"train_runtime_s": runtime, "samples_per_s": per_s}


def trainer_curve(log: str) -> list[dict[str, float]]:
    """HF Trainer's logged rows (every ``logging_steps``) with the step and the seconds into training
    that its progress bar showed last before each: loss, lr and the first three positions' accuracy."""
    out = []
    bar = re.compile(r"(\d+)/(\d+) \[(?:(\d+):)?(\d+):(\d\d)")
    row = re.compile(r"\{'loss': [^}]*\}")
    last: tuple[int, int] | None = None
    for m in re.finditer(f"{bar.pattern}|{row.pattern}", log):
        if m.group(0).startswith("{"):
            if last is None:
                continue
            fields = dict(re.findall(r"'([^']+)': '?([0-9.e+-]+)'?", m.group(0)))
            out.append(
                {
                    "step": last[0],
                    "seconds": last[1],
                    "loss": float(fields["loss"]),
                    "lr": float(fields.get("learning_rate", "nan")),
                    "acc": [
                        float(fields[f"train_acc/parallel_0_step_{i}"])
                        for i in range(3)
                        if f"train_acc/parallel_0_step_{i}" in fields
                    ],
                }
            )
        else:
            h, mi, sec = int(m.group(3) or 0), int(m.group(4)), int(m.group(5))
            last = (int(m.group(1)), 3600 * h + 60 * mi + sec)
    return out


def speculators_training(text: str) -> str:
    """speculators' log without its validation runs (their bar also reads 'Epoch N')."""
    return re.sub(r"Validation epoch \d+/\d+ started.*?(?:Validation epoch \d+/\d+ completed|\Z)", "", text, flags=re.S)


def speculators_loop_s(text: str) -> int | None:
    """The seconds of speculators' training loop: each training epoch's last bar (None: no bar)."""
    bars = {
        int(e): 3600 * int(h) + 60 * int(m) + int(sec)
        for e, h, m, sec in re.findall(
            r"Epoch (\d+)\s+\d+%\s+\S+\s+\d+/\d+\s+\[\s*(\d+):(\d\d):(\d\d)", speculators_training(text)
        )
    }
    return sum(bars.values()) if bars else None


def speculators_steady(text: str, key: str) -> float | None:
    """The median of a per-step figure speculators logs (``profile/KEY=``) after the first tenth of the
    steps (compilation left out); None: fewer than 4 steps logged it."""
    values = [float(x) for x in re.findall(rf"profile/{key}=([0-9.e+-]+)", speculators_training(text))]
    return statistics.median(values[max(1, len(values) // 10) :]) if len(values) >= 4 else None


def speculators_log(text: str) -> dict[str, float]:
    """speculators' own training log: the steps it ran, its loop's seconds, and its steady rate (per-step
    time and tokens/s)."""
    out: dict[str, float] = {}
    if (loop := speculators_loop_s(text)) is not None:
        out["loop_s"] = loop
    if steps := re.findall(r"global_step=(\d+)", speculators_training(text)):
        out["steps"] = max(map(int, steps)) + 1
    for key, name in (("step_ms", "steady_step_ms"), ("tokens_per_s", "steady_tokens_per_s")):
        if (value := speculators_steady(text, key)) is not None:
            out[name] = round(value, 1)
    return out


def cell(v: Any) -> Any:
    """A table cell: a figure not measured as a dash, a long float to three places."""
    if v is None or v == "":
        return "—"
    return round(v, 3) if isinstance(v, float) else v


BUDGETS = {  # ours' run -> the budget it shares with each peer run of the session
    "ours_same_minutes": "the peer's training-loop minutes (ours over the whole set)",
    "ours_same_data": "the same conversations, one epoch (the recipe's batches)",
    "ours_same_data_small_batches": "the same conversations, one epoch (8,192-token batches)",
    "ours_same_data_more_steps": "the same conversations, one epoch (train.min_steps=400)",
}


def verdict(runs: dict[str, dict]) -> list[dict]:
    """The verdict table: each peer against each of ours' runs, held-out tau by eval and by vLLM, and by how
    much ours is ahead (negative: behind). Empty where the session has no peer or none of ours."""
    peers = [fw for fw in runs if not fw.startswith("ours")]

    def diff(ours: Any, peer: Any) -> Any:
        return round(ours - peer, 2) if isinstance(ours, float) and isinstance(peer, float) else None

    rows = []
    for peer in peers:
        for ours, budget in BUDGETS.items():
            if ours not in runs:
                continue
            p, o = runs[peer], runs[ours]
            pt, ot = (p.get("eval_heldout") or {}).get("tau"), (o.get("eval_heldout") or {}).get("tau")
            pv, ov = p.get("vllm_acceptance_length"), o.get("vllm_acceptance_length")
            rows.append([cell(x) for x in (budget, peer, pt, ours, ot, diff(ot, pt), pv, ov, diff(ov, pv))])
    if not rows:
        return []
    header = ["budget", "peer", "peer tau", "ours", "ours tau", "ours ahead by", "peer vLLM", "ours vLLM", "ahead by"]
    title = "Verdict: held-out tau by eagle3-eval (vLLM's rule) and vLLM's served acceptance length"
    return [{"title": title, "header": header, "rows": rows}]


def session_numbers(d: Path) -> dict[str, float]:
    text = (d / "session.txt").read_text() if (d / "session.txt").is_file() else ""
    out: dict[str, float] = {}
    if m := re.search(r"ModelOpt ran ([0-9.]+) steps/s in its probe: (\d+) steps", text):
        out["modelopt_probe_steps_per_s"], out["modelopt_steps"] = float(m.group(1)), int(m.group(2))
    if m := re.search(r"speculators ran ([0-9.]+) steps/s in its probe: (\d+) steps \(one epoch of (\d+)", text):
        out["speculators_probe_steps_per_s"], out["speculators_steps"] = float(m.group(1)), int(m.group(2))
        out["speculators_conversations"] = int(m.group(3))
    if m := re.search(r"trained ([0-9.]+) s: ours (\d+) steps over (\d+) conversations", text):  # (before max_minutes)
        out["ours_same_minutes_steps"], out["all_conversations"] = int(m.group(2)), int(m.group(3))
    if m := re.search(r"trained ([0-9.]+) s \(([0-9.]+) minutes of loop\): ours for [0-9.]+ minutes over (\d+)", text):
        out["peer_loop_minutes"], out["all_conversations"] = float(m.group(2)), int(m.group(3))
    if m := re.search(r"ModelOpt for speculators' ([0-9.]+) s of loop at ([0-9.]+) steps/s: (\d+) steps", text):
        out["speculators_loop_s"], out["modelopt_steps_per_s_assumed"] = float(m.group(1)), float(m.group(2))
        out["modelopt_steps"] = int(m.group(3))
    if "speculators' fused loss did not compile" in text:
        out["speculators_retried_with_eager_loss"] = 1
    if "speculators' compiled forward failed in torch's compiler" in text:
        out["speculators_forward_not_compiled"] = 1  # its forward ran eager (TORCHDYNAMO_DISABLE=1): slower
    return out


def eval_figures(d: Path, fw: str, prompts: str) -> dict[str, Any] | None:
    from eagle3_train.evaluation.reports import read_eval_report  # (the log readers above need no package)

    path = d / f"{fw}_eval_{prompts}_report.json"
    if not path.is_file():
        return None
    r = read_eval_report(path)
    return {
        "tau": round(r.tau, 3),
        "prompts": r.prompts,
        "acceptance_per_position": [round(a, 3) for a in r.acceptance_per_position],
        "lossless": r.lossless,
        "captured_hf_indices": r.captured_hf_indices,
        "engine_rule": r.engine,
        "warnings": len(r.warnings),
    }


def framework(d: Path, fw: str, ph: list[dict], trace: list, log: str, sizes: dict[str, int]) -> dict[str, Any]:
    mine = {p["phase"]: p for p in ph if p["fw"] == fw and not p.get("rc")}
    out: dict[str, Any] = {"what": TITLES.get(fw, fw)}
    out["seconds"] = {name: p["seconds"] for name, p in mine.items()}
    failed = [
        {"phase": p["phase"], "seconds": p["seconds"], "rc": p["rc"]} for p in ph if p["fw"] == fw and p.get("rc")
    ]
    if failed:  # (a retry's success is in seconds; what failed before it, here)
        out["failed_phases"] = failed
    if "train" in mine:
        out["train_peak_gpu_mib"] = peak(trace, mine["train"]["start"], mine["train"]["end"])
    out["draft_bytes"] = sizes.get(fw)
    manifest = d / f"{fw}_run_prepared_manifest.json"
    if manifest.is_file():
        counts = json.loads(manifest.read_text())["counts"]
        out["conversations"], out["dataset_tokens"] = counts["rows_written"], counts["tokens"]
    metrics = d / f"{fw}_run_train_metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
        out["steps"] = max((r["step"] for r in rows), default=None)
        out["steady_tokens_per_s"] = round(statistics.median(rates)) if rates else None
        if loops := [r["loop_s"] for r in rows if "loop_s" in r]:
            out["loop_s"] = max(loops)  # (our trainer's loop: compile and in-loop evaluations included)
        for key in ("gpu_peak_alloc_gib", "gpu_peak_reserved_gib"):  # the trainer's own view of its memory
            if peaks := [r[key] for r in rows if key in r]:
                out["train_" + key] = max(peaks)
    if (rate := trainer_rate(log, fw)) is not None:
        out.update(rate)
    own = d / f"{fw}_train.log"
    if fw.startswith("speculators") and own.is_file():
        out.update(speculators_log(own.read_text(errors="replace")))
    out["eval_heldout"] = eval_figures(d, fw, "heldout")
    out["eval_mtbench"] = eval_figures(d, fw, "mtbench")
    served = d / f"{fw}_served_report.json"
    if served.is_file():
        from eagle3_train.evaluation.reports import read_served_report

        sr = read_served_report(served)
        out["vllm_acceptance_length"] = sr.mean_acceptance_length
    if (d / f"{fw}_eval_heldout_as_trained_report.json").is_file():
        out["eval_heldout_as_trained"] = eval_figures(d, fw, "heldout_as_trained")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--command", default="bash benchmarks/peers_gpu.sh start session_modelopt 300")
    ap.add_argument("--note", default="", help="what the figures do and do not show")
    ap.add_argument(
        "--curve",
        action="append",
        default=[],
        metavar="NAME=LOG[=WHAT]",
        help="a further peer run's HF Trainer log (e.g. one stopped before its export): its logged curve",
    )
    a = ap.parse_args()
    d = a.dir
    ph = phases(d)
    trace = memory_trace(d)
    log = (d / "log").read_text() if (d / "log").is_file() else ""
    sizes = {}
    if (d / "draft_bytes.txt").is_file():
        for line in (d / "draft_bytes.txt").read_text().splitlines():
            name, _, n = line.partition(" ")
            if n.strip().isdigit():
                sizes[name] = int(n)
    order = [fw for fw in TITLES if any(p["fw"] == fw for p in ph)]
    runs = {fw: framework(d, fw, ph, trace, log, sizes) for fw in order}
    session = session_numbers(d)
    if "modelopt_steps" in session and "modelopt" not in runs:  # planned, then the device time ran out
        session["modelopt_steps_planned_not_run"] = session.pop("modelopt_steps")
    if "speculators" in runs and "speculators_steps" in session:
        runs["speculators"]["steps"] = session["speculators_steps"]
        runs["speculators"]["conversations"] = session["speculators_conversations"]
    loaded = re.search(r"speculators\.data_generation\.preprocessing - INFO -\s+Loaded (\d+) samples", log)
    if "speculators" in runs and "conversations" not in runs["speculators"] and loaded:
        runs["speculators"]["conversations"] = int(loaded.group(1))  # (its data step's own count)
    if "modelopt" in runs and "modelopt_steps" in session:
        runs["modelopt"]["steps"] = runs["modelopt"]["conversations"] = session["modelopt_steps"]
        same = runs.get("ours_same_data", {})
        if (
            same.get("dataset_tokens")
            and same.get("conversations") == session["modelopt_steps"]
            and runs["modelopt"].get("train_runtime_s")
        ):
            # the same conversations, one epoch (batch 1, each padded to 512 tokens; the rate counts real tokens)
            runs["modelopt"]["dataset_tokens"] = same["dataset_tokens"]
            runs["modelopt"]["steady_tokens_per_s"] = round(
                same["dataset_tokens"] / runs["modelopt"]["train_runtime_s"]
            )

    def tau(r: dict, key: str) -> Any:
        return (r.get(key) or {}).get("tau")

    rows = [
        [
            cell(x)
            for x in (
                fw,
                r.get("conversations"),
                r.get("steps"),
                r["seconds"].get("prepare")
                or (r["seconds"].get("data", 0) + r["seconds"].get("states", 0))
                or "online",
                r["seconds"].get("train"),
                r.get("loop_s") or r.get("train_runtime_s") or "",
                r.get("steady_tokens_per_s"),
                r.get("train_peak_gpu_mib"),
                round(r["draft_bytes"] / 2**20, 1) if r.get("draft_bytes") else None,
                tau(r, "eval_heldout"),
                tau(r, "eval_heldout_as_trained") or "",
                tau(r, "eval_mtbench"),
                r.get("vllm_acceptance_length") or "",
                (r.get("eval_heldout") or {}).get("lossless"),
            )
        ]
        for fw, r in runs.items()
    ]
    curves = {}
    for spec in a.curve:
        name, path, *what = spec.split("=", 2)
        curves[name] = {"what": what[0] if what else name, "log_rows": trainer_curve(Path(path).read_text())}
    rules = sorted(
        {e["engine_rule"] for r in runs.values() for e in (r.get("eval_heldout"), r.get("eval_mtbench")) if e}
    )
    result = {
        "what": "The same target (SmolLM2-135M-Instruct), the same synthesized conversations and one GPU through "
        "each framework's own EAGLE-3 training with its defaults, then one yardstick: eagle3-eval (chain k=5, "
        f"greedy, fp32, lossless-checked, engine rule {' and '.join(rules) or 'sglang'}) on the shipped held-out "
        "prompts and MT-bench (both turns)",
        "machine": a.machine,
        "date": a.date,
        "runs": "single run each",
        "command": a.command,
        "session": session,
        "note": a.note,
        "frameworks": runs,
        "curves": curves,
        "tables": verdict(runs)
        + [
            {
                "title": "Side by side (seconds: wall clock of each phase; training includes model load and compile)",
                "header": [
                    "run",
                    "conversations",
                    "steps",
                    "data s",
                    "train s",
                    "loop s (its own log)",
                    "tokens/s",
                    "peak GPU MiB",
                    "draft MiB",
                    "tau held-out",
                    "tau held-out as trained",
                    "tau MT-bench",
                    "vLLM acceptance length (held-out)",
                    "lossless",
                ],
                "rows": rows,
            }
        ]
        + [
            {
                "title": f"{c['what']}: its own training log (seconds into training by its progress bar)",
                "header": ["step", "seconds", "loss", "lr", "train accuracy, draft positions 1-3"],
                "rows": [[r["step"], r["seconds"], r["loss"], r["lr"], r["acc"]] for r in c["log_rows"]],
            }
            for c in curves.values()
        ],
    }
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
