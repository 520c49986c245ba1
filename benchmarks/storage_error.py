"""How much a compact storage changes what training sees: bf16, fp8 e4m3 and int8 (both with one
scale per token and layer), measured against a dump's float32 states. Not part of the test suite;
the numbers behind the choice of fp8 (README: "Compact storage").

    python benchmarks/storage_error.py --dump runs/demo/dump --target embedded \
        --draft runs/demo/export --out benchmarks/results/storage_error_cpu.json
    python benchmarks/storage_error.py --small     # the tiny target, a dump made here

For each storage: per stored layer, the relative L2 error ||x - x'|| / ||x|| and the share of
elements off by more than 10 % of their own size; the draft's ``fc`` output (the exported draft's
``fc`` with ``--draft``, else a random one) as relative L2 error; the target's next-token
distribution from ``last_hidden`` (the training target): top-1 agreement and mean KL; with
``--draft``, the draft's step-0 logits: top-1 agreement and mean KL. fp8 and int8 are quantized
from the bf16 states, as a bf16 dump would store them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from eagle3_train.core.formats import iter_samples, read_shard
from eagle3_train.core.storage import dequantize, quantize


def int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """int8 with one scale per token (amax / 127): the alternative fp8 was chosen over."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(1e-30)
    return (x / scale).round().clamp(-127, 127) * scale


STORAGES = {
    "bf16": lambda x: x.bfloat16().float(),
    "fp8": lambda x: dequantize(*quantize(x.bfloat16()), torch.float32),
    "int8": lambda x: int8_round_trip(x.bfloat16().float()),
}


def load_states(dump: Path, max_tokens: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], dict]:
    """The first ``max_tokens`` tokens of a dump (whole samples) as float32, and the samples' ids."""
    manifest = json.loads((dump / "manifest.json").read_text())
    keys = [f"hidden.{k}" for k in manifest["capture"]["aux_indices"]] + ["last_hidden"]
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    samples: list[torch.Tensor] = []
    tokens = 0
    for shard in sorted((dump / "shards").glob("*.safetensors")):
        t = read_shard(shard)
        for _, sl in iter_samples(t):
            if tokens >= max_tokens:
                break
            for k in keys:
                parts[k].append(t[k][sl].float())
            samples.append(t["input_ids"][sl].long())
            tokens += sl.stop - sl.start
    return {k: torch.cat(v) for k, v in parts.items()}, samples, manifest


class Agreement:
    """Top-1 agreement and mean KL(p || p') of two softmaxes, accumulated chunk by chunk (a
    [tokens, V] logit tensor of a real vocab does not fit in memory at once)."""

    def __init__(self) -> None:
        self.same = self.kl = self.n = 0.0

    def add(self, exact: torch.Tensor, approx: torch.Tensor) -> None:
        p, q = torch.log_softmax(exact.float(), -1), torch.log_softmax(approx.float(), -1)
        self.kl += float((p.exp() * (p - q)).sum())
        self.same += float((exact.argmax(-1) == approx.argmax(-1)).sum())
        self.n += exact.shape[0]

    def result(self) -> dict[str, float]:
        return {"top1_agreement": self.same / self.n, "mean_kl": self.kl / self.n}


def relative(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / x.norm())


@torch.no_grad()
def measure(
    states: dict[str, torch.Tensor],
    samples: list[torch.Tensor],
    head: torch.Tensor,
    fc: torch.Tensor,
    draft: Any,
    chunk: int = 1024,
) -> dict[str, Any]:
    aux_keys = [k for k in states if k != "last_hidden"]
    exact_aux = torch.cat([states[k] for k in aux_keys], dim=1)
    head = head.float()
    report: dict[str, Any] = {}
    for name, round_trip in STORAGES.items():
        back = {k: round_trip(v) for k, v in states.items()}
        aux = torch.cat([back[k] for k in aux_keys], dim=1)
        target = Agreement()
        for i in range(0, len(aux), chunk):
            target.add(states["last_hidden"][i : i + chunk] @ head.T, back["last_hidden"][i : i + chunk] @ head.T)
        r: dict[str, Any] = {
            "relative_l2": {k: relative(states[k], back[k]) for k in states},
            "share_off_by_10pct": {
                k: float(((states[k] - back[k]).abs() > 0.1 * states[k].abs()).float().mean()) for k in states
            },
            "fc_relative_l2": relative(exact_aux @ fc.T, aux @ fc.T),
            "target_next_token": target.result(),
        }
        if draft is not None:
            step0, start = Agreement(), 0
            for ids in samples:  # each sample run on its own
                n = len(ids)
                step0.add(
                    draft_logits(draft, exact_aux[start : start + n], ids),
                    draft_logits(draft, aux[start : start + n], ids),
                )
                start += n
            r["draft_step0"] = step0.result()
        report[name] = r
    return report


def draft_logits(draft: Any, aux: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The draft's step-0 logits of one sample: [n, V_draft]."""
    return draft.logits(next(draft.unroll(aux[None], ids[None], 1)))[0]


def small_dump(root: Path) -> Path:
    """A dump of the tiny target on 24 short conversations (for --small)."""
    from data_prep.dump import CaptureConfig, DumpConfig, Dumper
    from data_prep.prepare import PrepareConfig, Preparer

    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i} " * (3 + i % 5)},
                {"role": "assistant", "content": "an answer " * (5 + i % 7)},
            ]
        }
        for i in range(24)
    ]
    (root / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    Preparer(PrepareConfig(target="tiny", input=str(root / "in.jsonl"), out=str(root / "p"), progress=False)).run()
    Dumper(
        DumpConfig(
            target="tiny",
            data=str(root / "p"),
            out=str(root / "d"),
            dtype="float32",
            progress=False,
            capture=CaptureConfig(aux_indices=[1, 2, 3]),
        )
    ).run()
    return root / "d"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dump", help="a float32 dump (eagle3-dump dtype=float32)")
    p.add_argument("--target", default="embedded", help="the dump's target (its lm_head)")
    p.add_argument("--draft", default=None, help="an exported draft of this target and capture (its fc and logits)")
    p.add_argument("--max-tokens", type=int, default=20000)
    p.add_argument("--cache-dir", default=os.environ.get("EAGLE3_CACHE"))
    p.add_argument("--out", default=None, help="results JSON")
    p.add_argument("--small", action="store_true", help="the tiny target on a dump made here")
    a = p.parse_args()
    from eagle3_train.targets import load_target, load_target_tensors

    with tempfile.TemporaryDirectory() as tmp:
        dump = small_dump(Path(tmp)) if a.small else Path(a.dump)
        target = "tiny" if a.small else a.target
        states, samples, manifest = load_states(dump, a.max_tokens)
    _, tensors = load_target_tensors(target, ("head",), cache_dir=a.cache_dir)
    draft = None
    if a.draft:
        from eagle3_train.evaluation.eval import load_draft

        draft, _ = load_draft(Path(a.draft), load_target(target, cache_dir=a.cache_dir))
        draft = draft.float()
        fc = draft.fc.weight.detach()
    else:
        width = sum(1 for k in states if k != "last_hidden") * states["last_hidden"].shape[1]
        fc = torch.nn.Linear(width, states["last_hidden"].shape[1], bias=False).weight.detach()
    report = {
        "dump": str(dump),
        "target": target,
        "tokens": int(states["last_hidden"].shape[0]),
        "capture": manifest["capture"]["aux_indices"],
        "fc": "exported draft" if draft else "random",
        "storages": measure(states, samples, tensors["head"], fc, draft),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
