"""Compare dumps of the same prepared data, sample by sample (e.g. backend=hf against vllm/sglang).

    python benchmarks/compare_dumps.py runs/q/dump_hf runs/q/dump_vllm [more dumps ...]

For every dump after the first and every key both hold, prints the largest absolute difference
and the relative error ||a - b|| / ||a|| over the samples both hold (ids and masks: the share of
identical samples). Engines compute in their own kernels, so small bf16-level differences are expected; a wrong layer
shows as a relative error near 1 or more.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from eagle3_train.core.contract import read_manifest
from eagle3_train.core.formats import iter_samples, read_shard
from eagle3_train.core.storage import decode


def samples(dump: Path, ids: set[int] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """The stored samples of ``dump`` by sample id (only ``ids``, when given)."""
    out = {}
    for shard in sorted((dump / "shards").glob("*.safetensors")):
        t = decode(read_shard(shard))  # fp8 storage: the states read back
        for sid, sl in iter_samples(t):
            if ids is None or sid in ids:
                out[sid] = {k: v[sl].clone() for k, v in t.items() if k not in ("cu_seqlens", "sample_ids")}
    return out


def compare(a: Path, b: Path, ids: set[int] | None = None) -> dict[str, dict[str, float]]:
    """Per key: the largest absolute difference and the relative L2 error over the samples both
    dumps hold (only ``ids``, when given); ids and masks: the share of identical samples."""
    sa, sb = samples(a, ids), samples(b, ids)
    common = sorted(set(sa) & set(sb))
    report: dict[str, dict[str, float]] = {}
    keys = sorted(set(sa[common[0]]) & set(sb[common[0]])) if common else []
    for key in keys:
        if key in ("input_ids", "loss_mask"):
            report[key] = {"identical_samples": sum(torch.equal(sa[s][key], sb[s][key]) for s in common) / len(common)}
            continue
        diff2 = ref2 = 0.0
        worst = 0.0
        for s in common:
            x, y = sa[s][key].double(), sb[s][key].double()
            diff2 += (x - y).pow(2).sum().item()
            ref2 += x.pow(2).sum().item()
            worst = max(worst, (x - y).abs().max().item())
        report[key] = {"max_abs": worst, "rel_l2": (diff2 / max(ref2, 1e-30)) ** 0.5}
    report["samples"] = {"first": len(sa), "second": len(sb), "common": len(common)}
    return report


def main(paths: list[str]) -> None:
    dumps = [Path(p) for p in paths]
    for d in dumps:
        read_manifest(d, "dump")  # a finished dump
    for other in dumps[1:]:
        print(f"{dumps[0]}  vs  {other}")
        for key, stats in compare(dumps[0], other).items():
            print(f"  {key:14s} " + "  ".join(f"{k}={v:.3g}" for k, v in stats.items()))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1:])
