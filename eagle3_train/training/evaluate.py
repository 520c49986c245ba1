"""The eval split's figures during training: per-step accuracy, loss and simulated acceptance
length, honest and over in-vocab positions only, the decode walk's τ and the draft vocab's coverage
(the pure pieces live in :mod:`eagle3_train.training.objective`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from eagle3_train.core.dist import all_gather_objects
from eagle3_train.training.data import Batch, ShardSplit, Source, plan_epoch
from eagle3_train.training.metrics import walk_counts
from eagle3_train.training.objective import acceptance_length, accuracies
from eagle3_train.training.parallel import SequenceParallel

# (batch, hits [k, B, T] to fill) -> (the batch's loss, per-step counts [k, >=3])
Losses = Callable[[Batch, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def evaluate_split(
    split: ShardSplit | Any,
    source: Source,
    losses: Losses,
    step: int,
    ttt_length: int,
    max_tokens: int,
    data_rank: int,
    world: int,
    sp: SequenceParallel,
) -> dict[str, Any]:
    """The figures of ``split`` at training step ``step``, summed over all ranks (collective: every
    rank calls it). ``eval_vocab_coverage``: the share of counted positions whose target argmax is
    in the draft vocab (step 0's ceiling of ``eval_acc[0]``).

    Args:
        split: the eval split (``length``: sample lengths; ``batch(indices)``: a host batch).
        source: where the split's batches go to the device (``device_batches``).
        losses: the TTT loss of a batch, filling its ``hits``.
        ttt_length: the TTT steps the losses unroll (``objective.ttt_length``).
        max_tokens: each batch's budget of padded tokens (``loop.max_tokens_per_batch``).
        data_rank, world: this rank's place among the data-parallel ranks and their number.
        sp: the sequence-parallel group (its shards add up to one batch).
    """
    counts = np.zeros((ttt_length, 3), dtype=np.int64)
    loss_sum, n = 0.0, 0
    walk = np.zeros(2, dtype=np.int64)  # decode walk: tokens, verify steps
    if len(split):
        batches = plan_epoch(split.length, max_tokens, 0, 0)
        mine = batches[data_rank::world]
        # every rank runs as many forwards (ZeRO-3 gathers parameters collectively); a rank short of
        # batches repeats its first one without counting it
        rounds = -(-len(batches) // world)
        host = (split.batch(mine[r] if r < len(mine) else batches[0]) for r in range(rounds))
        for r, batch in enumerate(source.device_batches(host)):
            hits = torch.zeros(ttt_length, *batch.input_ids.shape, dtype=torch.int32, device=batch.input_ids.device)
            loss, stats = losses(batch, hits)
            hits = sp.all_reduce(hits)  # each shard wrote its own positions
            if r < len(mine):
                counts += stats[:, :3].cpu().numpy().astype(np.int64)
                loss_sum += float(loss)
                n += sp.rank == 0  # a sequence-parallel group's shards add up to one batch
                if sp.rank == 0:
                    walk += walk_counts(batch, hits)
    gathered = all_gather_objects((counts, loss_sum, n, walk))
    counts = sum(g[0] for g in gathered)
    loss_sum, n = sum(g[1] for g in gathered), sum(g[2] for g in gathered)
    tokens, steps = sum(g[3] for g in gathered)
    acc, acc_in_vocab = accuracies(counts)
    return {
        "step": step,
        "eval_loss": loss_sum / max(n, 1),
        "eval_acc": acc,
        "eval_tau": acceptance_length(acc),
        "eval_tau_decoded": float(tokens / steps) if steps else 0.0,
        "eval_acc_in_vocab": acc_in_vocab,
        "eval_tau_in_vocab": acceptance_length(acc_in_vocab),
        "eval_vocab_coverage": float(counts[0, 1] / counts[0, 2]) if counts[0, 2] else 0.0,
    }
