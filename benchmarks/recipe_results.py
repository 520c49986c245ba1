"""One recipe run (benchmarks/smollm2_synth.sh, offline or online) as a results JSON: stage
times, the data, training's evaluations and throughput, eagle3-eval's report, the synthesis figures
and the GPU use sampled beside it (recipe_big_gpu.sh's gpu.csv).

    python3 -m benchmarks.recipe_results RUN_DIR results.json [--what "..."] [--machine "..."] [--gpu-csv gpu.csv]
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any

from benchmarks.scaling_results import collect, read_jsonl


def gpu_use(path: Path) -> dict[str, Any]:
    """Mean utilisation and peak memory per GPU from ``nvidia-smi --format=csv -l`` samples."""
    rows: dict[str, list[tuple[float, float]]] = {}
    with path.open() as f:
        for r in csv.reader(f):
            if len(r) < 4 or not r[1].strip().isdigit():
                continue  # the header, or a cut line
            util, mem = (float(x.strip().split()[0]) for x in r[2:4])
            rows.setdefault(r[1].strip(), []).append((util, mem))
    return {
        gpu: {
            "samples": len(v),
            "mean_util_pct": round(sum(u for u, _ in v) / len(v), 1),
            "peak_mem_mib": max(m for _, m in v),
        }
        for gpu, v in rows.items()
    }


def recipe(run: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"timings": read_jsonl(run / "timings.jsonl")}
    out["total_s"] = round(sum(t["seconds"] for t in out["timings"]), 1)
    prepared = run / "prepared" / "manifest.json"
    if prepared.is_file():
        m = json.loads(prepared.read_text())
        out["prepared"] = m["counts"] | {
            "synthesis": m.get("regeneration", {}).get("synthesis", m["counts"].get("synthesis")),
            "tokenize": m.get("tokenize"),
        }
    out |= collect(run, run / "std")
    train = run / "train" / "manifest.json"
    if train.is_file():
        m = json.loads(train.read_text())
        out["train_options"] = {k: m["config"][k] for k in ("train", "model", "source") if k in m["config"]}
    report = run / "eval" / "report.json"
    if report.is_file():
        r = json.loads(report.read_text())
        out["eval"] = out.get("eval", {}) | {"categories": r.get("categories"), "speedup": r.get("speedup")}
    for extra in ("eval_bf16", "eval_fresh"):  # recipe_gap.sh
        if (run / extra / "report.json").is_file():
            r = json.loads((run / extra / "report.json").read_text())
            out[extra] = {k: r.get(k) for k in ("tau", "acceptance_per_position", "lossless", "verify_steps")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("json_out")
    ap.add_argument("--what", default="")
    ap.add_argument("--machine", default="")
    ap.add_argument("--gpu-csv", default="")
    a = ap.parse_args()
    result = {"what": a.what, "machine": a.machine} | recipe(Path(a.run))
    if a.gpu_csv and Path(a.gpu_csv).is_file():
        result["gpu_use"] = gpu_use(Path(a.gpu_csv))
    Path(a.json_out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result.get(k) for k in ("total_s", "eval")}, indent=1)[:2000])


if __name__ == "__main__":
    main()
