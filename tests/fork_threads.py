"""Threads of a forked process running torch ops at once, with and without
:func:`eagle3_train.core.threads.settle_torch_threads` first: how many forked children fail with torch's
"Invalid thread pool!" (a process forked from one that used torch's CPU pool rebuilds it on first use,
and two threads doing so at once can find none). tests/test_threads.py runs the settled case.

    python3 -m tests.fork_threads --children 100 --out F.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
from datetime import date
from pathlib import Path

import torch

from eagle3_train.core.threads import settle_torch_threads


def _child(a: torch.Tensor, settle: bool, threads: int) -> int:
    """In the forked child: (settle,) then ``threads`` threads concatenate at once; 1 if any failed."""
    if settle:
        settle_torch_threads()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            torch.cat([a, a]).sum()  # large enough to run on the intra-op pool
        except BaseException as e:  # noqa: BLE001 (the child reports any failure by its exit status)
            errors.append(e)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return 1 if errors else 0


def forked_failures(children: int, settle: bool, threads: int = 4) -> int:
    """How many of ``children`` forked processes, each running ``threads`` torch threads at once, fail."""
    torch.set_num_threads(torch.get_num_threads())  # a count set in the parent (as DeepSpeed or a user does)
    a = torch.randn(4, 65536)
    torch.cat([a, a]).sum()  # the parent's pool in use before the fork
    failed = 0
    for _ in range(children):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(a, settle, threads)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        failed += status != 0
    return failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--children", type=int, default=100)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    result = {
        "what": "forked children (4 threads each running torch.cat at once) that fail with torch's 'Invalid thread "
        "pool!', without and with eagle3_train.core.threads.settle_torch_threads() in the child first",
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}",
        "command": f"python3 -m tests.fork_threads --children {a.children} --out {a.out}",
        "date": date.today().isoformat(),
        "runs": "single run of each",
        "children": a.children,
        "failed_without_settle": forked_failures(a.children, settle=False),
        "failed_with_settle": forked_failures(a.children, settle=True),
    }
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
