"""Where eagle3-prepare's tokenising time goes with many processes (issue #13: 131,072 synthesized
conversations took 41 s in 13 processes on the GPU machine, the first slice back after 39 s, while
one process needs ~90 s in all). Times, on the machine it runs on: importing data_prep.prepare in a
fresh interpreter; starting W spawned processes that import it (an empty task each); Preparer.render
of N conversations in one process (a 1/W share, scaled) and in W (tokenize_workers=W, the bar's
first and last updates). Not part of the test suite.

    python3 benchmarks/bench_tokenize.py --n 131072 --workers 13 --out /tmp/tok.json  # EAGLE3_CACHE set
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from common import FILLER_WORDS


def _nothing(_: int) -> None:
    return None


def conversations(n: int) -> list:
    from data_prep.conversations import Conversation

    rng = random.Random(0)
    text = lambda k: " ".join(rng.choices(FILLER_WORDS, k=k))  # noqa: E731
    return [
        Conversation([{"role": "user", "content": text(25)}, {"role": "assistant", "content": text(90)}], f"bench[{i}]")
        for i in range(n)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--workers", type=int, default=13)
    ap.add_argument("--target", default="embedded")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import os

    out: dict = {"n": a.n, "workers": a.workers, "target": a.target, "cpus": len(os.sched_getaffinity(0))}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import data_prep.prepare"], check=True)
    out["import_s"] = round(time.perf_counter() - t, 2)
    for method in ("spawn", "forkserver"):
        t = time.perf_counter()
        with ProcessPoolExecutor(
            a.workers,
            mp_context=multiprocessing.get_context(method),
            initializer=__import__,
            initargs=("data_prep.prepare",),
        ) as pool:
            list(pool.map(_nothing, range(a.workers)))
        out[f"pool_start_{method}_s"] = round(time.perf_counter() - t, 2)

    from data_prep.prepare import PrepareConfig, Preparer

    convs = conversations(a.n)
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (1, a.workers):
            prep = Preparer(
                PrepareConfig(
                    target=a.target,
                    cache_dir=os.environ.get("EAGLE3_CACHE"),
                    input="unused",
                    out=f"{tmp}/p{workers}",
                    tokenize_workers=workers,
                    progress=False,
                    device="cpu",
                )
            )
            share = convs if workers > 1 else convs[: a.n // a.workers]
            t = time.perf_counter()
            rows, _ = prep.render(share)
            out[f"render_{workers}_s"] = round(time.perf_counter() - t, 2)
            assert len(rows) == len(share)
        out["render_1_scaled_s"] = round(out["render_1_s"] * a.workers, 1)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
