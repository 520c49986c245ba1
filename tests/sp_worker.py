"""Run by test_memory_parallel under torchrun (2 ranks, gloo): sequence-parallel TTT loss and
gradients, summed over the ranks, against the one-rank loss on the same head and batch."""

import torch
import torch.distributed as dist

from eagle3_train.parallel import apply_activation_checkpointing, apply_sequence_parallel, sequence_parallel
from eagle3_train.trainer import ttt_losses
from test_memory_parallel import DECAY, TTT, loss_and_grads, tiny_problem


def main() -> None:
    dist.init_process_group("gloo")
    sp = sequence_parallel(2)
    for t, head_chunk, checkpointing in ((13, 0, False), (16, 5, False), (9, 3, True)):
        model, head, t2d, batch = tiny_problem(seed=t, t=t)
        loss, stats = ttt_losses(model, batch, head, t2d, TTT, DECAY, head_chunk=head_chunk)
        want_loss, want_grads = loss_and_grads(model, loss)
        apply_sequence_parallel(model, sp)
        if checkpointing:
            apply_activation_checkpointing(model)
        shard_loss, shard_stats = ttt_losses(model, batch, head, t2d, TTT, DECAY, head_chunk=head_chunk, sp=sp)
        got_loss, got_grads = loss_and_grads(model, shard_loss)
        for x in (got_loss, shard_stats, *got_grads):
            dist.all_reduce(x)
        torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(shard_stats[:, :3], stats[:, :3], atol=0, rtol=0)
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        print("sp ok", t, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
