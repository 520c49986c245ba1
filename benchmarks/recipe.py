"""A recipe end to end: ``eagle3-run recipe=NAME`` timed stage by stage, with its training's best
evaluation, eagle3-eval's τ (per category, and its speed-up over plain greedy) and the GPU memory
nvidia-smi saw.

    python3 -m benchmarks.recipe --run /tmp/rs --out benchmarks/results/run_smollm2_h200.json recipe=smollm2
    python3 -m benchmarks.recipe --run /tmp/rs --out F.json recipe=smollm2 prepare.synthesize=8192
    python3 -m benchmarks.recipe --from /tmp/rs --out F.json            # the results of a run that came back
    python3 -m benchmarks.recipe --run /tmp/demo --out /tmp/demo.json recipe=demo   # CPU

Everything after the options is passed to eagle3-run as it is (``out=`` is ``--run``). On a lent GPU
machine, start it as a session (benchmarks/session.sh: ``--gpu-trace ../smi.csv`` reads the memory
trace the session keeps beside its output).
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.result import Result, this_command


def peak_gpu_memory_mib(trace: Path) -> float | None:
    """The largest memory.used of nvidia-smi's CSV samples (timestamp, index, memory.used, ...)."""
    peaks = [float(r[2].split()[0]) for r in csv.reader(trace.open()) if len(r) > 2 and r[2].split()[0].isdigit()]
    return max(peaks, default=None)


def summarise(run: Path, trace: Path | None) -> dict[str, Any]:
    """The figures of one eagle3-run output directory."""
    stages = [json.loads(line) for line in (run / "run.jsonl").read_text().splitlines() if line.strip()]
    out: dict[str, Any] = {
        "stages_seconds": {s["stage"]: s["seconds"] for s in stages},
        "total_minutes": round(sum(s["seconds"] for s in stages) / 60, 2),
        "failed": [s["stage"] for s in stages if s.get("rc")],
    }
    best = run / "train" / "best.json"
    if best.is_file():
        out["train"] = {"best_eval_simulated_tau": round(json.loads(best.read_text())["eval_tau"], 3)}
    report = run / "eval" / "report.json"
    if report.is_file():
        r = json.loads(report.read_text())
        keep = ("tau", "k", "tokens", "verify_steps", "acceptance_per_position", "speedup", "lossless_counts", "dtype")
        out["eval"] = {k: r[k] for k in keep if k in r}
        out["eval"]["tau_by_category"] = {c: round(v["tau"], 3) for c, v in (r.get("categories") or {}).items()}
    if trace is not None and trace.is_file():
        out["peak_gpu_memory_mib"] = peak_gpu_memory_mib(trace)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--run", help="eagle3-run's output directory (its out=)")
    p.add_argument("--from", dest="from_", metavar="RUN", help="only the results, from a run's output directory")
    p.add_argument(
        "--gpu-trace", type=Path, help="nvidia-smi's CSV (timestamp, index, memory.used, ...) during the run"
    )
    p.add_argument("overrides", nargs="*", help="eagle3-run's overrides: recipe=NAME and the rest")
    a = p.parse_args(argv)
    if not (a.run or a.from_) or (a.run and not a.overrides):
        p.error("--run with eagle3-run's overrides (recipe=NAME ...), or --from RUN")
    run = Path(a.from_ or a.run)
    command = this_command("recipe", argv)
    if a.run:
        cmd = [sys.executable, "-m", "eagle3_train.run", *a.overrides, f"out={run}"]
        print("==", shlex.join(cmd), flush=True)
        start = time.monotonic()
        rc = subprocess.run(cmd).returncode
        print(f"== eagle3-run: exit {rc} after {time.monotonic() - start:.0f} s", flush=True)
    figures = summarise(run, a.gpu_trace)
    recipe = next((o.split("=", 1)[1] for o in a.overrides if o.startswith("recipe=")), "?")
    Result(what=f"eagle3-run recipe={recipe} end to end: stage times, training's best evaluation, eagle3-eval's τ",
           command=command, figures={"overrides": a.overrides, **figures}).write(a.out)  # fmt: skip


if __name__ == "__main__":
    main()
