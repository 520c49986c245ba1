"""eagle3_train.core.threads: threads of a forked process running torch ops at once (standardize's
workers in a fault test's child). Without settle_torch_threads, 33 of 100 such children failed here
with torch's "Invalid thread pool!" (torch 2.13 CPU, 2 cores)."""

from __future__ import annotations

import os
import threading

import torch

from eagle3_train.core.threads import settle_torch_threads


def _child(a: torch.Tensor) -> int:
    """In the forked child: settle, then four threads concatenate at once; 1 if any failed."""
    settle_torch_threads()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            torch.cat([a, a]).sum()  # large enough to run on the intra-op pool
        except BaseException as e:  # noqa: BLE001 (the child reports any failure by its exit status)
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 1 if errors else 0


def test_threads_of_a_forked_process_find_torch_thread_pool():
    torch.set_num_threads(torch.get_num_threads())  # a count set in the parent (as DeepSpeed or a user does)
    a = torch.randn(4, 65536)
    torch.cat([a, a]).sum()  # the parent's pool in use before the fork
    failed = 0
    for _ in range(40):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(a)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        failed += status != 0
    assert failed == 0
