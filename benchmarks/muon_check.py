"""Does ours' Muon (DeepSpeed's, through ``build_engine``) step a full-size draft as torch's own Muon
would, on this machine's device? tests/test_muon.py checks it on the CPU with a tiny draft; this runs
the same comparison with the smollm2 recipe's head (H 576, 9/3 heads, MLP 6144, draft vocab 16,384,
EAGLE-3.1) on the GPU, where DeepSpeed compiles its update and runs its Newton-Schulz iteration in
fp16, with gradients shaped as a draft's are (small and nearly low-rank) as well as random ones.

    python3 benchmarks/muon_check.py [--out muon_check.json]

Prints, per matrix, |got - want| / |want| and |got| / |want| of the weights' change after three
steps (want: torch.optim.Muon, original shape scale, and torch.optim.AdamW, fp32, on the same
gradients and the trainer's schedule)."""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from eagle3_train.core.dist import init_distributed  # noqa: E402
from eagle3_train.model.draft import DraftConfig, Eagle3Draft  # noqa: E402
from eagle3_train.training.config import DeepSpeedConfig, TrainConfig, lr_factor  # noqa: E402
from eagle3_train.training.parallel import build_engine, scheduled_lr  # noqa: E402
from muon_reference import matrices, reference_steps  # noqa: E402
from train_options import train_sections  # noqa: E402

# grad_clip: the trainer's default, so the check steps what a run steps (with 0 it missed DeepSpeed
# clipping Muon's orthogonalized update: muon_check_clip_cpu.json)
OPT = {"lr": 2e-3, "muon_lr": 0.02, "muon_momentum": 0.95, "betas": [0.9, 0.95], "grad_clip": 0.5}
STEPS = 3


def smollm2_draft(dtype: torch.dtype, device: torch.device) -> Eagle3Draft:
    from transformers import LlamaConfig

    target = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=6144,
                         vocab_size=49152, rms_norm_eps=1e-5, max_position_embeddings=8192, rope_theta=100000.0)  # fmt: skip
    cfg = DraftConfig.from_target(target, num_aux=3, draft_vocab_size=16384)
    cfg.fc_norm = cfg.norm_output = True  # (EAGLE-3.1, as model.variant=eagle3.1 sets them)
    return Eagle3Draft(cfg).to(device=device, dtype=dtype)


def gradients(named: dict, trained: list[str], kind: str, gen: torch.Generator, device) -> list[dict]:
    """``random``: N(0, 1) everywhere; ``draft``: each matrix rank 8 at 1e-4 plus noise at 1e-7 (a
    draft's gradients are small and dominated by few directions)."""
    out = []
    for _ in range(STEPS):
        g = {}
        for n in trained:
            shape = named[n].shape
            if kind == "random" or len(shape) < 2:
                g[n] = torch.randn(shape, generator=gen) * (1.0 if kind == "random" else 1e-4)
            else:
                low = torch.randn(shape[0], 8, generator=gen) @ torch.randn(8, shape[1], generator=gen)
                g[n] = low * 1e-4 / 8**0.5 + torch.randn(shape, generator=gen) * 1e-7
        out.append({n: t.to(device) for n, t in g.items()})
    return out


def check(kind: str, zero: int, dtype: torch.dtype, device: torch.device) -> dict:
    torch.manual_seed(0)
    draft = smollm2_draft(dtype, device)
    reference = copy.deepcopy(draft).float()
    named = dict(draft.named_parameters())
    trained = [n for n, p in named.items() if p.requires_grad]
    start = {n: named[n].detach().float().clone() for n in trained}
    grads = gradients(named, trained, kind, torch.Generator().manual_seed(1), device)
    o = train_sections(optimizer="muon", warmup_steps=1, schedule="linear", **OPT)
    cfg = TrainConfig(data="d", out="o", **o, deepspeed=DeepSpeedConfig(zero_stage=zero))
    engine = build_engine(draft, cfg, dtype, device, 10)
    factors = []
    for g in grads:
        factors.append(scheduled_lr(engine) / OPT["lr"])
        engine.backward(sum((p * g[n].to(dtype)).sum() for n, p in draft.named_parameters() if p.requires_grad))
        engine.step()
    assert factors == [lr_factor(s, 10, cfg.optim) for s in range(STEPS)], factors
    reference_steps(reference, grads, factors, OPT)
    ref, mat = dict(reference.named_parameters()), matrices(reference)
    rows = {}
    for n in trained:
        want, got = ref[n].detach() - start[n], named[n].detach().float() - start[n]
        rows[n] = {"muon": n in mat, "rel_err": float((got - want).norm() / want.norm()),
                   "norm_ratio": float(got.norm() / want.norm())}  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="muon_check.json")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    init_distributed(device.type, always=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    got = {}
    for kind in ("random", "draft"):
        rows = check(kind, 1, dtype, device)
        got[kind] = rows
        for n, r in rows.items():
            if r["muon"] or "lm_head" in n:
                print(f"{kind:6s} {n:40s} rel_err {r['rel_err']:.3f}  |got|/|want| {r['norm_ratio']:.3f}", flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    Path(a.out).write_text(json.dumps({"device": name, "dtype": str(dtype), "zero": 1, "opt": OPT, "rows": got},
                                      indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
