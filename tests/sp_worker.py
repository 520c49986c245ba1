"""Run by test_memory_parallel under torchrun (2 ranks, gloo): sequence-parallel TTT loss,
gradients and per-position hits, summed over the ranks, against the one-rank ones on the same head
and batch."""

import os

import torch
import torch.distributed as dist

from eagle3_train.training.parallel import apply_activation_checkpointing, apply_sequence_parallel, sequence_parallel
from eagle3_train.training.ttt import ttt_losses
from test_memory_parallel import DECAY, TTT, loss_and_grads, tiny_problem


def main() -> None:
    dist.init_process_group("gloo")
    sp = sequence_parallel(2)
    for t, head_chunk, checkpointing, rigged in (
        (13, 0, False, False),
        (16, 5, False, False),
        (9, 3, True, False),
        (15, 4, False, True),
    ):
        model, head, t2d, batch = tiny_problem(seed=t, t=t)
        if rigged:  # a random head hits nothing: make the draft always say draft token 0 (target id 1) and
            # the target say it at about half the positions, so the hits have a pattern to compare
            with torch.no_grad():
                model.lm_head.weight.zero_()
                head[1] = 10.0
                some = torch.rand(batch.last_hidden.shape[:2], generator=torch.Generator().manual_seed(t)) < 0.5
                batch.last_hidden[some] = batch.last_hidden[some].abs()
        hits = torch.zeros(TTT, *batch.input_ids.shape, dtype=torch.int32)
        loss, stats = ttt_losses(model, batch, head, t2d, TTT, DECAY, head_chunk=head_chunk, hits=hits)
        assert torch.equal(hits.sum((1, 2)).float(), stats[:, 0])  # the hits the statistics count
        want_loss, want_grads = loss_and_grads(model, loss)
        apply_sequence_parallel(model, sp)
        if checkpointing:
            apply_activation_checkpointing(model)
        shard_hits = torch.zeros_like(hits)
        shard_loss, shard_stats = ttt_losses(
            model, batch, head, t2d, TTT, DECAY, head_chunk=head_chunk, sp=sp, hits=shard_hits
        )
        got_loss, got_grads = loss_and_grads(model, shard_loss)
        for x in (got_loss, shard_stats, shard_hits, *got_grads):
            dist.all_reduce(x)
        assert torch.equal(shard_hits, hits) and (hits.any() or not rigged)
        torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(shard_stats[:, :3], stats[:, :3], atol=0, rtol=0)
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        print("sp ok", t, flush=True)
    dist.barrier()  # (no rank tears the group down while the other is still in it)
    dist.destroy_process_group()
    # every check is done: leave without the interpreter's teardown, where gloo's threads once aborted
    # rank 0 ("terminate called without an active exception") after both ranks had printed every case
    os._exit(0)


if __name__ == "__main__":
    main()
