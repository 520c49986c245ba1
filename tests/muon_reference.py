"""torch's own Muon and AdamW stepping given gradients: the independent reference that ours' Muon
(DeepSpeed's, through ``build_engine``) is checked against, by tests/test_muon.py on the CPU and by
benchmarks/muon_check.py on any device."""

from typing import Any

import torch


def matrices(model: torch.nn.Module) -> set[str]:
    """What Muon should take: the trained matrices other than lm_head (the embeddings are frozen)."""
    return {n for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2 and "lm_head" not in n}


def reference_steps(model: torch.nn.Module, grads: list[dict[str, torch.Tensor]], lrs: list[float],
                    opt: dict[str, Any]) -> None:  # fmt: skip
    """torch.optim.Muon (Nesterov, 5 Newton-Schulz steps, its original shape scale) on the matrices and
    torch.optim.AdamW on the rest, no weight decay, each step at the trainer's schedule factor ``lrs``
    times ``opt``'s peak lrs (``muon_lr``, ``lr``), ``muon_momentum`` and ``betas``."""
    named = dict(model.named_parameters())
    mat = matrices(model)
    muon = torch.optim.Muon([named[n] for n in sorted(mat)], lr=opt["muon_lr"], momentum=opt["muon_momentum"],
                            weight_decay=0.0, nesterov=True, ns_steps=5)  # fmt: skip
    rest = [n for n, p in named.items() if p.requires_grad and n not in mat]
    adam = torch.optim.AdamW([named[n] for n in rest], lr=opt["lr"], betas=tuple(opt["betas"]), weight_decay=0.0)
    for g, factor in zip(grads, lrs):
        for n, p in named.items():
            if p.requires_grad:
                p.grad = g[n].float().clone()
        for group in muon.param_groups:
            group["lr"] = opt["muon_lr"] * factor
        for group in adam.param_groups:
            group["lr"] = opt["lr"] * factor
        muon.step()
        adam.step()
