"""Condense the ``results.json`` files of benchmarks/families_gpu.py runs into one engine's
results page file (``benchmarks/results/families_<engine>_<machine>.json``), the rows the docs
generator reads (docs/gen_pages.py: families_measured).

    python benchmarks/families_results.py ENGINE OUT.json RUN.json [RUN.json ...] \
        [--keep OLD.json] [--meta META.json]

Runs are merged step by step in the order given (a later run's step replaces an earlier one's: a
family re-run alone after a failure, an engine served by a second process over the first run's
directories). ``--keep`` carries over the rows of families that none of the runs served with ENGINE,
each marked with the date of the file it came from. ``--meta`` supplies the top-level fields (what,
machine, command, runs, notes ...), which are written as given.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _res(steps: dict, key: str) -> dict:
    return (steps.get(key) or {}).get("result") or {}


def family_row(steps: dict, fam: str, engine: str) -> dict | None:
    """One family's figures for ENGINE, or None when the engine did not serve it in these runs."""
    served = _res(steps, f"{fam}/{engine}_export_served")
    if not served:
        return None
    e32, e16, sh = (_res(steps, f"{fam}/eval_{v}") for v in ("export_float32", "export_bfloat16", "shifted_float32"))
    shifted = _res(steps, f"{fam}/{engine}_shifted_served")
    cmp = _res(steps, f"{fam}/compare_{engine}")
    tau16, served_tau = e16.get("tau"), served.get("mean_acceptance_length")
    row = {
        "eval_tau_fp32": e32.get("tau"),
        "eval_lossless_fp32": e32.get("lossless"),
        "eval_tau_bf16": tau16,
        "eval_acceptance_per_position_bf16": e16.get("acceptance_per_position"),
        "eval_captured_hf_indices": e32.get("captured_hf_indices"),
        "eval_tau_shifted_fp32": sh.get("tau"),
        f"{engine}_mean_acceptance_length": served_tau,
        f"{engine}_conditional_acceptance_per_position": served.get("conditional_acceptance_per_position"),
        f"{engine}_drafts": served.get("drafts"),
        f"{engine}_requests": served.get("requests"),
        f"{engine}_vs_eval_bf16_relative": (served_tau / tau16 - 1) if served_tau and tau16 else None,
        f"{engine}_shifted_mean_acceptance_length": shifted.get("mean_acceptance_length"),
        "check_exit": {v: (steps.get(f"{fam}/check_{v}") or {}).get("rc") for v in ("export", "shifted", "nod2t")},
    }
    if cmp:
        row[f"{engine}_dump_vs_hf_rel_l2"] = {
            k: v["rel_l2"] for k, v in cmp.items() if isinstance(v, dict) and "rel_l2" in v
        }
        row[f"{engine}_dump_token_ids_identical"] = (cmp.get("input_ids") or {}).get("identical_samples")
    if served.get("warnings"):
        row[f"{engine}_warnings"] = served["warnings"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine")
    p.add_argument("out", type=Path)
    p.add_argument("runs", type=Path, nargs="+")
    p.add_argument("--keep", type=Path)
    p.add_argument("--meta", type=Path)
    a = p.parse_args()
    steps: dict = {}
    fams: list[str] = []
    for run in a.runs:
        data = json.loads(run.read_text())
        steps.update(data["steps"])
        fams += [f for f in data.get("variables", {}).get("FAMILIES", []) if f not in fams]
    families = {f: r for f in fams if (r := family_row(steps, f, a.engine))}
    out = json.loads(a.meta.read_text()) if a.meta else {}
    if a.keep and a.keep.is_file():
        old = json.loads(a.keep.read_text())
        for f, r in (old.get("families") or {}).items():
            if f not in families:
                families[f] = {**r, "run_date": r.get("run_date") or old.get("date")}
    out["families"] = dict(sorted(families.items()))
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{a.out}: {', '.join(out['families'])}")


if __name__ == "__main__":
    main()
