"""Fault injection for the tests: a process that kills (or stops) itself at a chosen point.

``EAGLE3_FAULT_AT=<point>:<n>`` makes this process SIGKILL itself the ``n``-th time it passes
``fault_point("<point>")`` (``<point>:<n>:stop``: SIGSTOP instead, so a test can start a second
process on the same directory while the first holds it, then kill the first; ``<point>:<n>:int``:
SIGINT, a Ctrl-C at that very point). Unset, every point
is a dict lookup. The points, each placed after a unit of work or between two writes that a crash
could separate:

- ``write``: an atomic write (:mod:`eagle3_train.core.fileio`) whose temporary file is complete
  but not yet renamed: every record, chunk, state.json and manifest of every stage.
- ``shard``: a shard renamed into place, its record not yet written (dump, standardize).
- ``synth.chunk`` / ``regen.chunk``: a chunk of synthesized / regenerated conversations saved.
- ``train.step``: an optimizer step done, before it is logged or saved.
- ``eval.turn``: one user turn of every conversation decoded.
- ``export.swap``: the previous export moved aside, the new one not yet in its place.

The tests (tests/test_faults.py) kill every stage at varied points and check that the same
command, run again, finishes with the output of an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

FAULT_ENV = "EAGLE3_FAULT_AT"
_passed: Counter[str] = Counter()  # point -> times this process passed it while the variable named it


def fault_point(point: str) -> None:
    """SIGKILL (or SIGSTOP) this process if ``EAGLE3_FAULT_AT`` names ``point`` and this is its
    n-th passage; a no-op otherwise."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    name, _, rest = spec.partition(":")
    if name != point:
        return
    n, _, action = rest.partition(":")
    _passed[point] += 1
    if _passed[point] == int(n):
        os.kill(os.getpid(), {"stop": signal.SIGSTOP, "int": signal.SIGINT}.get(action, signal.SIGKILL))
