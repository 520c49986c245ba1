"""The training-time test (TTT) loss of one micro-batch: the draft unrolled ``ttt_length`` steps,
each step's soft cross-entropy against the target's distribution (the pure pieces live in
:mod:`eagle3_train.training.objective`)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from eagle3_train.core.errors import ConfigError
from eagle3_train.model import Eagle3Draft
from eagle3_train.training.data import Batch
from eagle3_train.training.objective import (
    Objective,
    correct_predictions,
    head_loss,
    mixed_loss,
    step_weights,
    target_distribution,
)
from eagle3_train.training.parallel import (
    SequenceParallel,
)

logger = logging.getLogger(__name__)


def ttt_losses(
    model: Eagle3Draft,
    batch: Batch,
    lm_head: torch.Tensor,
    t2d: torch.Tensor,
    ttt_length: int,
    decay: float,
    target: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    head_chunk: int = 0,
    sp: SequenceParallel | None = None,
    compiled_head: bool = False,
    hits: torch.Tensor | None = None,
    objective: Objective | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted TTT loss of one micro-batch, and per-step statistics [ttt_length, 4] (hits,
    in-vocab, counted, loss; see :func:`correct_predictions`) left on the device, so the step never
    waits for the GPU.

    Step j at position t predicts token t+2+j; its target is the target's distribution at t+1+j.
    A position is counted when that token exists and is loss-masked; it enters the loss only when
    the target's argmax at t+1+j is also in the draft vocab (otherwise it is a miss). ``target`` is
    that distribution when already known (probs [B, T, V_draft], argmax [B, T], in_draft [B, T]);
    otherwise it is computed from ``last_hidden``. ``head_chunk`` > 0 fuses the draft lm_head with
    the loss (:func:`head_loss`, that many positions at a time, through torch.compile with
    ``compiled_head``; 0: whole logits).

    ``hits`` ([ttt_length, B, T], bool or integer; given for eval's decode walk) receives at [j, b, t]
    whether step j's draft at position t was right (a hit as the statistics count it); a shard
    writes its own positions only, so a group's buffers add up to the whole rows'.

    With ``sp`` this rank runs its shard of every row's positions (rows padded to a multiple of the
    group): the target distribution only where the shard's steps read it, each step's loss over the
    whole rows' count of loss positions, so the group's losses add up to the one-rank loss; the
    statistics are the shard's (they add up over the group as well).

    ``objective`` (default: the plain soft cross-entropy) shapes each step's loss: the LK share,
    the target's smoothing, and the positions it leaves out where the target is unsure (those
    still count in the statistics, which always measure the draft against the target's argmax).
    """
    sp = sp or SequenceParallel(None, 0, 1)
    objective = objective or Objective()
    batch, padded = _pad_positions(batch, target, sp.size)
    b, t = batch.input_ids.shape
    h = batch.last_hidden.shape[-1]
    dev = batch.input_ids.device
    start, stop = sp.span(t)
    lo, hi = start, min(stop + ttt_length, t)  # target positions the shard's steps read (but lo itself)
    if padded is None:
        probs, argmax, in_draft = target_distribution(batch.last_hidden[:, lo:hi].reshape(-1, h), lm_head, t2d)
        probs, argmax, in_draft = probs.view(b, hi - lo, -1), argmax.view(b, hi - lo), in_draft.view(b, hi - lo)
    else:
        probs, argmax, in_draft = (x[:, lo:hi] for x in padded)
    top = probs.max(-1).values if objective.min_target_prob > 0 else None  # [B, hi - lo]
    positions = torch.arange(t, device=dev)
    # step j: the shard's first n positions (start..start+n-1) have a token 2+j further on
    steps = []
    for j in range(ttt_length):
        n = max(0, min(stop, t - 2 - j) - start)
        q, p = slice(start + 1 + j - lo, start + 1 + j - lo + n), slice(start + 2 + j, start + 2 + j + n)
        counted = ((positions[None, p] < batch.lengths[:, None]) & batch.loss_mask[:, p]).reshape(-1)
        mask = objective.loss_mask(None if top is None else top[:, q], counted.view(b, n) & in_draft[:, q]).reshape(-1)
        steps.append((n, q, counted, mask))
    counts = sp.all_reduce(torch.stack([mask.sum() for *_, mask in steps]))  # loss positions of step j, whole rows
    total = torch.zeros((), device=dev)
    stats = torch.zeros(ttt_length, 4, device=dev)
    weights = step_weights(ttt_length, decay)
    # every step enters the loss, also with no position on this shard: the sequence-parallel
    # backward runs the same collectives on every rank
    for j, out in enumerate(model.unroll(batch.aux_hidden[:, start:stop], batch.input_ids, ttt_length, start)):
        n, q, counted, mask = steps[j]
        target_probs = objective.smooth(probs[:, q].reshape(b * n, probs.shape[-1]))  # [B*n, V_draft]
        if head_chunk:
            loss, pred = head_loss(
                model.norm(out[:, :n]).reshape(b * n, h),
                model.lm_head.weight,
                target_probs,
                mask,
                counts[j],
                head_chunk,
                compiled_head,
                objective.lk_weight,
            )
        else:
            logits = model.logits(out[:, :n]).reshape(b * n, probs.shape[-1])  # [B*n, V_draft]
            loss = mixed_loss(logits, target_probs, mask, counts[j], objective.lk_weight)
            pred = logits.argmax(-1)
        total = total + weights[j] * loss
        stats[j, :3] = correct_predictions(pred, argmax[:, q].reshape(-1), counted)
        if hits is not None:
            right = (pred == argmax[:, q].reshape(-1)) & (argmax[:, q].reshape(-1) >= 0) & counted  # [B*n]
            m = max(0, min(n, hits.shape[2] - start))  # padded positions are never hits
            hits[j, :, start : start + m] = right.view(b, n)[:, :m]
        stats[j, 3] = loss.detach()
    return total, stats


def _pad_positions(
    batch: Batch, target: tuple[torch.Tensor, ...] | None, multiple: int
) -> tuple[Batch, tuple[torch.Tensor, ...] | None]:
    """Rows right-padded to a multiple of ``multiple`` positions (``lengths`` unchanged: the
    padding never counts), the target distribution with them."""
    extra = -batch.input_ids.shape[1] % multiple
    if not extra:
        return batch, target
    pad = lambda x: torch.cat([x, x.new_zeros(x.shape[0], extra, *x.shape[2:])], dim=1)  # noqa: E731
    batch = Batch(
        pad(batch.aux_hidden),
        pad(batch.last_hidden),
        pad(batch.input_ids),
        pad(batch.loss_mask),
        batch.lengths,
        batch.sample_ids,
    )
    return batch, None if target is None else tuple(pad(x) for x in target)


class TargetCache:
    """The target distribution per sample (``runtime.cache_target_gb``), computed the first time a
    sample is seen. On a CPU the target lm_head over the full vocab is ~40 % of a step; with the
    cache only the first epoch pays it. Each sample is computed alone, so the values never depend
    on batching.

    Args:
        lm_head: the frozen target lm_head [V, H].
        t2d: the draft-vocab mask over target ids [V].
        draft_vocab_size: V_draft.
    """

    def __init__(self, lm_head: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int):
        self.lm_head, self.t2d, self.size = lm_head, t2d, draft_vocab_size
        self.samples: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def build(
        cls,
        limit_gb: float,
        train_split: Any,
        eval_split: Any,
        lm_head: torch.Tensor,
        t2d: torch.Tensor,
        draft_vocab_size: int,
    ) -> TargetCache | None:
        """A cache when ``limit_gb`` > 0 holds every sample of both splits, None when it is 0; a
        limit too small is refused rather than silently recomputing."""
        if limit_gb <= 0:
            return None
        tokens = int(train_split.length.sum() + eval_split.length.sum())
        need = tokens * draft_vocab_size * 4 / 2**30  # fp32 probabilities
        if need > limit_gb:
            raise ConfigError(
                f"runtime.cache_target_gb={limit_gb} is too small: the target distribution of {tokens} tokens "
                f"over {draft_vocab_size} draft tokens needs {need:.2f} GiB (set 0 to recompute instead)"
            )
        logger.info(f"caching the target distribution per sample (up to {need:.2f} GiB)")
        return cls(lm_head, t2d, draft_vocab_size)

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's (probs [B, T, V_draft], argmax [B, T], in_draft [B, T])."""
        b, t = batch.input_ids.shape
        dev = batch.input_ids.device
        probs = torch.zeros(b, t, self.size, device=dev)
        argmax = torch.full((b, t), -1, dtype=torch.long, device=dev)
        in_draft = torch.zeros(b, t, dtype=torch.bool, device=dev)
        for i, (sample, n) in enumerate(zip(batch.sample_ids.tolist(), batch.lengths.tolist(), strict=True)):
            if sample not in self.samples:
                self.samples[sample] = target_distribution(batch.last_hidden[i, :n], self.lm_head, self.t2d)
            probs[i, :n], argmax[i, :n], in_draft[i, :n] = self.samples[sample]
        return probs, argmax, in_draft
