"""Threads that run torch ops beside the main one (standardize's shard workers, the dump's writers,
training's prefetcher) start after :func:`settle_torch_threads`."""

from __future__ import annotations

import torch


def settle_torch_threads() -> None:
    """Have torch (re)build its CPU thread pool now, in the calling thread. In a process forked from
    one that had used the pool, torch rebuilds it on first use, and two threads doing so at once can
    find none: ``Invalid thread pool!`` (seen once, from a torch.cat in a standardize worker of a
    forked test child). Setting the thread count to what it is rebuilds it here, once."""
    torch.set_num_threads(torch.get_num_threads())
