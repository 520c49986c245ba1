"""The EAGLE-3 objective (DESIGN §4) as pure functions of tensors.

The target distribution at a position is the softmax of the target's logits (its frozen lm_head
on ``last_hidden``) restricted to the draft vocab and renormalised. A position enters the loss only
when its token is loss-masked and the target's argmax (over the full vocab) lies in the draft vocab.
The loss of TTT step j is the soft cross-entropy, weighted ``decay**j``.

Accuracy counts every loss-masked position: one whose target argmax lies outside the draft vocab
is a miss, since the draft can never propose that token (the reference EAGLE-3 divides by the loss
mask too). This is the figure whose simulated acceptance length predicts eagle3-eval's. The
accuracy over in-vocab positions only (``acc_in_vocab``) is kept as a second figure: it isolates
how well the head learns what it can express from how much the draft vocab covers.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def target_distribution(
    last_hidden: torch.Tensor, lm_head_weight: torch.Tensor, t2d: torch.Tensor, chunk: int = 4096
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target probabilities over the draft vocab, in chunks of tokens (the full-vocab logits of a
    chunk are the only [*, V_target] tensor that exists at a time).

    Args:
        last_hidden: [N, H] post-norm final states (the target lm_head's input).
        lm_head_weight: [V_target, H] the target's lm_head.
        t2d: bool [V_target], the draft vocab (its ids ascending = draft order).

    Returns:
        probs [N, V_draft] (fp32), argmax_draft [N] (draft index of the target argmax, -1 when it is
        outside the draft vocab), in_draft bool [N].
    """
    draft_of_target = torch.cumsum(t2d.long(), 0) - 1  # target id -> draft index, where t2d
    draft_ids = t2d.nonzero().squeeze(1)  # [V_draft] target ids, ascending
    probs, argmax = [], []
    with torch.no_grad():
        for start in range(0, last_hidden.shape[0], chunk):
            logits = last_hidden[start : start + chunk] @ lm_head_weight.T  # [n, V_target], model dtype
            top = logits.argmax(-1)
            probs.append(torch.softmax(logits.index_select(1, draft_ids).float(), dim=-1))
            argmax.append(torch.where(t2d[top], draft_of_target[top], torch.full_like(top, -1)))
    p = torch.cat(probs) if probs else last_hidden.new_zeros(0, int(t2d.sum()), dtype=torch.float32)
    a = torch.cat(argmax) if argmax else torch.zeros(0, dtype=torch.long, device=last_hidden.device)
    return p, a, a >= 0


def soft_cross_entropy(draft_logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over counted positions of ``-sum_v p(v) log q(v)``; 0 when none counts.

    Args:
        draft_logits: [N, V_draft]; target_probs: [N, V_draft]; mask: bool [N].
    """
    logq = F.log_softmax(draft_logits.float(), dim=-1)
    per_position = -(target_probs * logq).sum(-1)
    n = mask.sum()
    return (per_position * mask).sum() / n.clamp(min=1)


def correct_predictions(draft_logits: torch.Tensor, argmax_draft: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[hits, in_vocab, counted] (float tensor, on the logits' device) over the positions of ``mask``.

    counted: the masked positions; in_vocab: those whose target argmax is in the draft vocab
    (``argmax_draft >= 0``); hits: those where the draft's argmax is the target's argmax. Both are
    draft-vocab indices, so comparing them is comparing target ids through d2t, and an out-of-vocab
    position (-1) is never a hit. Honest accuracy is hits / counted, ``acc_in_vocab`` hits / in_vocab.

    Args:
        draft_logits: [N, V_draft]; argmax_draft: [N] (-1: outside the draft vocab); mask: bool [N].
    """
    in_vocab = mask & (argmax_draft >= 0)
    hit = (draft_logits.argmax(-1) == argmax_draft) & in_vocab
    return torch.stack([hit.sum(), in_vocab.sum(), mask.sum()]).float()


def accuracies(counts: np.ndarray) -> tuple[list[float], list[float]]:
    """Per-step (honest accuracy, accuracy over in-vocab positions) from [steps, 3] counts of
    :func:`correct_predictions`; 0 where nothing counted."""
    honest = [float(h / n) if n else 0.0 for h, _, n in counts]
    in_vocab = [float(h / v) if v else 0.0 for h, v, _ in counts]
    return honest, in_vocab


def step_weights(ttt_length: int, decay: float) -> list[float]:
    """Loss weight of each TTT step: ``decay**j``."""
    return [decay**j for j in range(ttt_length)]


def acceptance_length(accuracies: list[float]) -> float:
    """Simulated acceptance length of a chain: ``1 + a0 + a0*a1 + ...`` (the 1 is the token the
    target always adds), from per-step accuracies."""
    total, run = 1.0, 1.0
    for a in accuracies:
        run *= a
        total += run
    return total
