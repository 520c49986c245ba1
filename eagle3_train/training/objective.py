"""The EAGLE-3 objective (docs/concepts/draft-head.md) as pure functions of tensors.

The target distribution at a position is the softmax of the target's logits (its frozen lm_head
on ``last_hidden``) restricted to the draft vocab and renormalised. A position enters the loss only
when its token is loss-masked and the target's argmax (over the full vocab) lies in the draft vocab.
The loss of TTT step j is the soft cross-entropy, weighted ``decay**j``; :class:`Objective` can mix
in the LK term ``-log sum_v min(p_v, q_v)`` (minus the log of the acceptance rate of speculative
sampling, which the draft's distribution q earns against the target's p), smooth the target
distribution, and leave out positions where the target itself is unsure.

Accuracy counts every loss-masked position: one whose target argmax lies outside the draft vocab
is a miss, since the draft can never propose that token (the reference EAGLE-3 divides by the loss
mask too). This is the figure whose simulated acceptance length predicts eagle3-eval's. The
accuracy over in-vocab positions only (``acc_in_vocab``) is kept as a second figure: it isolates
how well the head learns what it can express from how much the draft vocab covers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from eagle3_train.core.errors import ConfigError

ALPHA_FLOOR = 1e-6  # -log of an acceptance rate is taken at no less than this (a draft far off the target)


@dataclass(frozen=True)
class Objective:
    """What the TTT loss of one step is (``objective.lk_weight``, ``objective.label_smoothing``,
    ``objective.min_target_prob``); the default is the plain soft cross-entropy."""

    lk_weight: float = 0.0  # w: the loss is (1 - w) * soft cross-entropy + w * -log sum_v min(p_v, q_v)
    label_smoothing: float = 0.0  # e: the target distribution is (1 - e) p + e / V_draft
    min_target_prob: float = 0.0
    """a position enters the loss only where the target's top probability (over the draft vocab) reaches this"""

    def __post_init__(self) -> None:
        for name in ("lk_weight", "label_smoothing", "min_target_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"objective.{name} must be in [0, 1], got {getattr(self, name)}")

    def loss_mask(self, top: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """The positions of ``mask`` [...] that enter the loss: without those whose top target
        probability (``top`` [...], the max of the target distribution over the draft vocab; only
        read when ``min_target_prob`` > 0) is below ``min_target_prob``."""
        if self.min_target_prob == 0:
            return mask
        assert top is not None
        return mask & (top >= self.min_target_prob)

    def smooth(self, probs: torch.Tensor) -> torch.Tensor:
        """The target probabilities [..., V] the loss compares the draft with."""
        if self.label_smoothing == 0:
            return probs
        return probs * (1 - self.label_smoothing) + self.label_smoothing / probs.shape[-1]


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


def soft_cross_entropy(
    draft_logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor, count: torch.Tensor | None = None
) -> torch.Tensor:
    """``sum`` over the positions of ``mask`` of ``-sum_v p(v) log q(v)``, over ``count`` (default:
    how many positions ``mask`` has, i.e. the mean); 0 when none counts.

    Args:
        draft_logits: [N, V_draft]; target_probs: [N, V_draft]; mask: bool [N].
        count: the denominator, when the positions are a shard of a longer sequence (sequence
            parallelism: every shard divides by the whole sequence's count).
    """
    logq = F.log_softmax(draft_logits.float(), dim=-1)
    per_position = -(target_probs * logq).sum(-1)
    n = mask.sum() if count is None else count
    return (per_position * mask).sum() / n.clamp(min=1)


def lk_loss(
    draft_logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor, count: torch.Tensor | None = None
) -> torch.Tensor:
    """``sum`` over the positions of ``mask`` of ``-log sum_v min(p_v, q_v)`` (q: the draft's
    softmax; the sum is the chance that speculative sampling accepts the draft's token), over
    ``count`` as in :func:`soft_cross_entropy`; 0 when none counts.

    Args:
        draft_logits: [N, V_draft]; target_probs: [N, V_draft]; mask: bool [N].
    """
    q = torch.softmax(draft_logits.float(), dim=-1)
    per_position = -torch.log(torch.minimum(q, target_probs).sum(-1).clamp(min=ALPHA_FLOOR))
    n = mask.sum() if count is None else count
    return (per_position * mask).sum() / n.clamp(min=1)


def mixed_loss(
    draft_logits: torch.Tensor,
    target_probs: torch.Tensor,
    mask: torch.Tensor,
    count: torch.Tensor | None = None,
    lk_weight: float = 0.0,
) -> torch.Tensor:
    """``(1 - lk_weight) *`` :func:`soft_cross_entropy` ``+ lk_weight *`` :func:`lk_loss` (each
    term computed only when its weight is not 0)."""
    loss = torch.zeros((), device=draft_logits.device)
    if lk_weight < 1:
        loss = loss + (1 - lk_weight) * soft_cross_entropy(draft_logits, target_probs, mask, count)
    if lk_weight > 0:
        loss = loss + lk_weight * lk_loss(draft_logits, target_probs, mask, count)
    return loss


def head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target_probs: torch.Tensor,
    mask: torch.Tensor,
    count: torch.Tensor | None = None,
    chunk: int = 4096,
    compiled: bool = False,
    lk_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`soft_cross_entropy` of the logits ``hidden @ weight.T`` without keeping them: the
    draft lm_head and the loss fused, ``chunk`` positions at a time.

    The gradient is computed with the loss, chunk by chunk (d loss / d logits = (softmax * sum p
    - p) * mask / count, then ``@ weight`` and ``.T @ hidden``), and only d hidden [N, H] and
    d weight [V, H] are kept until backward, which scales them by the incoming gradient. So no
    [N, V] tensor outlives its chunk and nothing is recomputed: the same three matmuls as the
    unfused head, and the largest temporaries are a few [chunk, V] fp32 tensors. Works only where
    the loss enters backward linearly, as every weighted sum of losses does.

    Args:
        hidden: [N, H] the lm_head's input (the draft's ``norm`` output); weight: [V_draft, H].
        target_probs: [N, V_draft]; mask: bool [N]; count: as in :func:`soft_cross_entropy`.
        chunk: positions per chunk.
        compiled: run each chunk's elementwise and reduction work (:func:`_chunk_terms`) through
            torch.compile. Unfused, it passes over [chunk, V] fp32 tensors about twenty times (the
            head's cost grows with the draft vocab); fused, a few times. The matmuls are the same.
        lk_weight: the share of the LK term, as in :func:`mixed_loss` (its gradient is fused too).

    Returns:
        the loss (a scalar with gradient to ``hidden`` and ``weight``), and the draft's argmax [N].
    """
    n = mask.sum() if count is None else count
    scale = mask / n.clamp(min=1)  # [N] each position's weight in the loss
    need = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    terms = _compiled_chunk_terms() if compiled else _chunk_terms
    return _HeadLoss.apply(hidden, weight, target_probs, scale, chunk, need, functools.partial(terms, lk=lk_weight))


def _chunk_terms(
    logits: torch.Tensor, p: torch.Tensor, w: torch.Tensor, grad: bool, lk: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's loss sum, argmax [n] and, with ``grad``, d loss / d logits [n, V] (logits' dtype),
    from the draft logits [n, V], the target probabilities [n, V] (fp32), the weights [n] and the
    LK share ``lk``.

    With q = softmax(z): d/dz of -sum_v p_v log q_v is q * sum_v p_v - p; with m_v = [q_v < p_v],
    alpha = sum_v min(p_v, q_v) and s = sum_v m_v q_v, d/dz of -log alpha is -(m q - q s) / alpha."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    if lk == 0:  # the plain soft cross-entropy, in place: the fewest passes over [n, V]
        loss = (w * -(p * logq).sum(-1)).sum()
        g0 = ((logq.exp_() * p.sum(-1, keepdim=True) - p) * w[:, None]).to(logits.dtype) if grad else None
        return loss, logits.argmax(-1), g0
    q = logq.exp()
    raw = torch.minimum(q, p).sum(-1)  # alpha, the acceptance rate, before its floor
    alpha = raw.clamp(min=ALPHA_FLOOR)
    per_row = (1 - lk) * -(p * logq).sum(-1) - lk * torch.log(alpha)
    if not grad:
        return (w * per_row).sum(), logits.argmax(-1), None
    mq = q * (q < p)
    # the LK part is 0 where the floor holds the loss constant, as autograd through the clamp gives
    g = (1 - lk) * (q * p.sum(-1, keepdim=True) - p) - (lk * (raw >= ALPHA_FLOOR) / alpha)[:, None] * (
        mq - q * mq.sum(-1, keepdim=True)
    )
    return (w * per_row).sum(), logits.argmax(-1), (g * w[:, None]).to(logits.dtype)


@functools.cache
def _compiled_chunk_terms() -> Any:
    return torch.compile(_chunk_terms, dynamic=True)  # chunk lengths vary: one graph per ``grad``


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, probs, scale, chunk, need, terms):
        grad_hidden = torch.empty_like(hidden) if need and hidden.requires_grad else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if need and weight.requires_grad
            else None
        )
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        pred = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            x = hidden[s : s + chunk]
            # g: d loss / d logits [n, V]
            part, pred[s : s + chunk], g = terms(
                x @ weight.T,
                probs[s : s + chunk],
                scale[s : s + chunk],
                grad_hidden is not None or grad_weight is not None,
            )
            loss += part
            if g is None:
                continue
            if grad_hidden is not None:
                grad_hidden[s : s + chunk] = g @ weight
            if grad_weight is not None:
                grad_weight += g.T @ x
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    def backward(ctx, grad_loss, _grad_pred):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = lambda g: None if g is None else g * grad_loss.to(g.dtype)  # noqa: E731
        return scale(grad_hidden), scale(grad_weight), None, None, None, None, None


def correct_predictions(draft_pred: torch.Tensor, argmax_draft: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[hits, in_vocab, counted] (float tensor, on the predictions' device) over the positions of ``mask``.

    counted: the masked positions; in_vocab: those whose target argmax is in the draft vocab
    (``argmax_draft >= 0``); hits: those where the draft's argmax is the target's argmax. Both are
    draft-vocab indices, so comparing them is comparing target ids through d2t, and an out-of-vocab
    position (-1) is never a hit. Honest accuracy is hits / counted, ``acc_in_vocab`` hits / in_vocab.

    Args:
        draft_pred: [N] the draft's argmax (draft-vocab index); argmax_draft: [N] (-1: outside the
            draft vocab); mask: bool [N].
    """
    in_vocab = mask & (argmax_draft >= 0)
    hit = (draft_pred == argmax_draft) & in_vocab
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


def decode_walk(hits: np.ndarray, answer: np.ndarray) -> tuple[int, int]:
    """Tokens and verify steps of chain decoding over one row's replies, counted as eagle3-eval
    counts them (τ = tokens / steps), from the teacher-forced hits of the TTT steps.

    With the tokens known up to position s+1, a verify step drafts positions s+2, s+3, ...; its
    j-th draft is what TTT step j predicts at position s (``hits[j, s]``), and it sees the inputs
    decoding would while every earlier draft is right. The step accepts the leading hits (at most
    k, not past the reply) and the target adds one token: s moves on by accepted + 1. Each run of
    answer positions is one reply, whose first token comes from the prefill and whose last (its end
    of turn) from the target, since eagle3-eval never accepts an end-of-turn draft. Unlike
    :func:`acceptance_length`, which scores every start position alike, this visits positions as
    decoding does: more often where drafts fail.

    Args:
        hits: bool [k, T], step j's draft at position t (predicting token t+2+j) is right;
        answer: bool [T], the row's loss-masked positions.
    """
    k, t_len = hits.shape
    tokens = steps = 0
    t = 0
    while t < t_len:
        if not answer[t]:
            t += 1
            continue
        end = t
        while end < t_len and answer[end]:
            end += 1
        s = max(t - 1, 0)  # the reply's first token, at t, is the prefill's
        while s + 2 < end:
            n = 0  # the reply's last position (its end of turn) is never a draft eval accepts
            while n < k and s + 2 + n < end - 1 and hits[n, s]:
                n += 1
            tokens, steps, s = tokens + n + 1, steps + 1, s + n + 1
        t = end
    return tokens, steps


def acceptance_length(accuracies: list[float]) -> float:
    """Simulated acceptance length of a chain: ``1 + a0 + a0*a1 + ...`` (the 1 is the token the
    target always adds), from per-step accuracies."""
    total, run = 1.0, 1.0
    for a in accuracies:
        run *= a
        total += run
    return total
