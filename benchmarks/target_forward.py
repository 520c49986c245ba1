"""The target's forward as online training runs it (``eagle3_train.core.capture.capture``: the aux
layers and the post-norm state, no lm_head), eager and with ``online.compile=true``'s compiled
decoder layers: seconds a micro-batch, host (until the call returns, nothing waited for) and wall
(the GPU done), and the first call's (the compilation); and, from one more call under
torch.profiler, the ops and kernel launches a micro-batch (as ``benchmarks/step_profile.py`` counts
them a training step, so the two can be read side by side).

    python3 -m benchmarks.target_forward --out benchmarks/results/target_forward_h100.json
    python3 -m benchmarks.target_forward --out /tmp/tf.json --device cpu --tokens 512 --seq 256 --iters 2

The target is the embedded SmolLM2-135M-Instruct (or ``--target``) in bf16 on the GPU; the
micro-batches are rows of ``--seq`` random token ids, ``--tokens`` in all (ours' recipe: 32,768).
Eager runs first in the process, then the same batches with the layers compiled.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.lab import sync
from benchmarks.result import Result, machine, this_command, today
from benchmarks.step_profile import summary
from eagle3_train.core.capture import capture, compile_layers
from eagle3_train.core.contract import default_aux_indices
from eagle3_train.targets import load_target

HEADER = ["layers", "tokens", "first call s", "host ms", "wall ms", "tokens/s", "aten ops", "kernel launches"]


def timed(model: object, ids: torch.Tensor, aux: list[int], iters: int) -> tuple[float, float, float]:
    """(first call's seconds, host seconds a call, wall seconds a call) over ``iters`` calls after two more."""
    with torch.no_grad():
        t = time.perf_counter()
        capture(model, ids, None, aux)
        sync(ids.device)
        first = time.perf_counter() - t
        for _ in range(2):
            capture(model, ids, None, aux)
        sync(ids.device)
        host = wall = 0.0
        for _ in range(iters):
            t = time.perf_counter()
            capture(model, ids, None, aux)
            host += time.perf_counter() - t
            sync(ids.device)
            wall += time.perf_counter() - t
    return first, host / iters, wall / iters


def counted(model: object, ids: torch.Tensor, aux: list[int]) -> tuple[int, int]:
    """(aten ops, kernel launches) of one call under torch.profiler, as step_profile's summary counts a step."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if ids.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.no_grad(), torch.profiler.profile(activities=acts) as prof:
        capture(model, ids, None, aux)
        sync(ids.device)
    one = summary(prof.key_averages(), 1, [])
    return int(one["ops_per_step"]), int(one["launches_per_step"])


def ints(text: str) -> list[int]:
    """A comma-separated list of integers (argparse names the option and the value it refuses)."""
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--target", default="embedded")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=ints, default=[8192, 32768], help="comma-separated tokens a micro-batch")
    p.add_argument("--seq", type=int, default=2048, help="tokens a row")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--aux", type=ints, help="comma-separated HF indices captured (default: the engines' [2, N//2, N-3])"
    )
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    cache = os.environ.get("EAGLE3_CACHE", "/tmp/e3cache")  # (where the GGUF target is converted once)
    target = load_target(a.target, cache_dir=cache, dtype="auto", device=str(dev))
    model = target.model.requires_grad_(False).eval()
    n = target.config.num_hidden_layers
    aux = a.aux or list(default_aux_indices(n))
    gen = torch.Generator().manual_seed(0)
    batches = {t: torch.randint(target.config.vocab_size, (t // a.seq, a.seq), generator=gen).to(dev) for t in a.tokens}
    rows = []
    for mode in ("eager", "compiled"):
        if mode == "compiled":
            compile_layers(model, "online.compile=true")
        for t, ids in batches.items():
            first, host, wall = timed(model, ids, aux, a.iters)
            ops, launches = counted(model, ids, aux)
            rows.append([mode, t, round(first, 3), round(host * 1e3, 2), round(wall * 1e3, 2), round(t / wall), ops,
                         launches])  # fmt: skip
            print(f"target_forward: {mode} {t} tokens: first {first:.2f} s, host {host * 1e3:.1f} ms, "
                  f"wall {wall * 1e3:.1f} ms, {ops} aten ops, {launches} launches", flush=True)  # fmt: skip
    Result(
        what="The target's forward as online training runs it (capture: aux layers and the post-norm state), "
        "eager against online.compile=true's compiled decoder layers, a micro-batch at a time",
        command=this_command("target_forward", argv),
        machine=machine(),
        date=today(),
        runs=f"one process; {a.iters} timed calls a row after three (the first: compilation), random ids, "
        f"rows of {a.seq} tokens; target {a.target}, aux {aux}",
        tables=[
            {
                "title": "A micro-batch's forward, eager and compiled",
                "header": HEADER,
                "rows": rows,
            }
        ],
    ).write(a.out)


if __name__ == "__main__":
    main()
