"""Where ours' training step goes: eagle3-train as the command runs it (its own options), with its
optimizer steps ``--warmup``+1 .. ``--warmup``+``--steps`` under torch.profiler. Writes what the
host and the device spent a step, the kernels launched and ops run a step, each step's wall time,
and the ops that took the most host and device time (the profiler's whole tables beside the
results file, as ``<name>.host.txt`` and ``<name>.device.txt``); a step whose host time exceeds its
device time is bound by the launches, not by the GPU.

    python3 -m benchmarks.step_profile --out results/step_profile_h100.json [--warmup 30] [--steps 20] [--stacks 6] -- ++target=embedded ++data=... ...

The options after ``--`` are eagle3-train's (``eagle3-run ... --cfg job`` prints a recipe's);
``loop.max_steps`` is set to the steps profiled, so the run ends there (its final evaluation and
checkpoint come after the profile). Asked by the peers' side-by-side: at 8k-token batches ours' step
took about 0.2 s on an H100, as at 32k (benchmarks/results/batch_probe_h100.json), with cuDNN's
attention on; with it off (the default since), 0.115 s at 8k, 0.119 s at 16k and 0.224 s at 32k
(benchmarks/results/step_ab_batch_h100.json, step_ab_cudnn_h100.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.result import Result, this_command

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def on_device(e: Any) -> bool:
    """A kernel's own event, as the profiler's table totals them: not an op's share of its kernels
    (counted again on the kernel) nor a user annotation's range (``ProfilerStep*``)."""
    return getattr(e.device_type, "name", "CPU") != "CPU" and not getattr(e, "is_user_annotation", False)


def median_gap(ends: list[float]) -> float | None:
    gaps = sorted(b - a for a, b in zip(ends, ends[1:]))
    return round(gaps[len(gaps) // 2], 4) if gaps else None


def summary(events: Any, steps: int, walls: list[float], before: list[float] | None = None) -> dict[str, Any]:
    """Per step: the host's own time in every op, the device's in every kernel, the launches, and
    the wall between steps (the median of the profiled ones; ``before``: the ends of the last
    warm-up steps, whose wall the profiler's own recording does not slow)."""
    per = lambda x: round(x / 1e6 / steps, 4)  # noqa: E731  (the profiler's microseconds -> s a step)
    return {
        "steps_profiled": steps,
        "host_s_per_step": per(sum(e.self_cpu_time_total for e in events)),
        "device_s_per_step": per(sum(e.self_device_time_total for e in events if on_device(e))),
        "launches_per_step": round(sum(e.count for e in events if e.key in LAUNCHES) / steps, 1),
        "ops_per_step": round(sum(e.count for e in events if e.key.startswith("aten::")) / steps, 1),
        # the host's time within the step in no op (Python, the autograd engine, hooks): the step's range's own
        "host_outside_ops_s_per_step": per(
            sum(e.self_cpu_time_total for e in events if e.key.startswith("ProfilerStep"))
        ),
        # the host's time in attention's ops, whichever kernel ran it (cuDNN builds a graph per new shape)
        "attention_host_s_per_step": per(
            sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::") and "attention" in e.key)
        ),
        "wall_s_per_step": median_gap(walls),
        "wall_s_per_step_unprofiled": median_gap(before or []),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="the results file (its whole profiler tables beside it)")
    p.add_argument("--warmup", type=int, default=30, help="steps before the profile (compilation, the allocator)")
    p.add_argument("--steps", type=int, default=20, help="steps profiled")
    p.add_argument("--stacks", type=int, default=0,
                   help="also record Python stacks and write the host's time by the innermost N frames "
                   "(<out>.stacks.txt; slows the profiled steps)")  # fmt: skip
    p.add_argument("overrides", nargs="*", help="eagle3-train's options")
    a = p.parse_args(argv)
    if a.warmup < 2 or a.steps < 2:
        p.error("--warmup and --steps must be at least 2")

    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from eagle3_train.core.cli import compose
    from eagle3_train.training.config import TrainConfig
    from eagle3_train.training.trainer import Trainer

    cfg = compose("train", a.overrides, TrainConfig)
    assert cfg is not None
    if (run_dir := Path(cfg.out).expanduser()).is_dir() and any(run_dir.iterdir()):
        # (the trainer would resume the run there, and a finished one makes no step to profile)
        raise SystemExit(
            f"step_profile: out={cfg.out} already holds a run, which the trainer would resume: give an empty out="
        )
    cfg.loop.max_steps = a.warmup + a.steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, schedule=schedule(wait=a.warmup - 1, warmup=1, active=a.steps),
                   with_stack=a.stacks > 0)  # fmt: skip
    ends: list[float] = []  # the end of every step
    step, done = Trainer.train_step, [0]

    def profiled_step(self: Trainer, batches: Any) -> dict[str, Any]:
        out = step(self, batches)
        done[0] += 1
        ends.append(time.perf_counter())
        prof.step()
        return out

    Trainer.train_step = profiled_step  # type: ignore[method-assign]
    with prof:
        trainer = Trainer(cfg)
        try:
            trainer.run()
        finally:
            trainer.close()
    events = prof.key_averages()
    # the profiled steps' walls from the last warm-up step's end; unprofiled: the warm-up's second half
    figures = summary(events, a.steps, ends[a.warmup - 1 : a.warmup + a.steps], ends[a.warmup // 2 : a.warmup - 1])
    cuda = torch.cuda.is_available()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tables = [top(events, "self_cpu_time_total", a.steps, "host")] + ([top(events, "self_device_time_total", a.steps,
              "device")] if cuda else [])  # fmt: skip
    Result(
        what=f"ours' training step under torch.profiler: {a.steps} optimizer steps after {a.warmup} of warm-up, "
        "the host's and the device's time a step, kernels launched and ops run a step, and the ops that took the most",
        command=this_command("step_profile", argv),
        figures=figures,
        tables=tables,
    ).write(out)
    (out.with_suffix(".host.txt")).write_text(events.table(sort_by="self_cpu_time_total", row_limit=80))
    if cuda:
        (out.with_suffix(".device.txt")).write_text(events.table(sort_by="self_device_time_total", row_limit=80))
    if a.stacks:
        by_stack = prof.key_averages(group_by_stack_n=a.stacks)
        (out.with_suffix(".stacks.txt")).write_text(by_stack.table(sort_by="self_cpu_time_total", row_limit=60))
    print(json.dumps(figures))


def top(events: Any, key: str, steps: int, side: str, n: int = 25) -> dict[str, Any]:
    """The ``n`` ops that took the most of ``side``'s time, a step each."""
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:n]
    return {
        "title": f"The ops that took the most {side} time, per step",
        "header": ["op", "calls", "host ms (self)", "device ms (self)"],
        "rows": [
            [
                e.key,
                round(e.count / steps, 1),
                round(e.self_cpu_time_total / 1e3 / steps, 3),
                round(e.self_device_time_total / 1e3 / steps, 3),
            ]
            for e in rows
        ],
    }


if __name__ == "__main__":
    main()
