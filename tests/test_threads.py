"""eagle3_train.core.threads: threads of a forked process running torch ops at once (standardize's
workers in a fault test's child). Without settle_torch_threads some such children fail with torch's
"Invalid thread pool!" (benchmarks/results/fork_threads_cpu2.json)."""

from __future__ import annotations

import pytest

from fork_threads import forked_failures


@pytest.mark.slow
def test_threads_of_a_forked_process_find_torch_thread_pool():
    assert forked_failures(40, settle=True) == 0
