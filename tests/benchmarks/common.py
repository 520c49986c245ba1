"""Shared by the benchmarks: the measured matmul rate every efficiency figure is a fraction of, and
running one case in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype) -> float:
    """Dense matmul FLOP/s measured here: mean of 10 n^3 products after 3 warm-ups."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * n**3 / (time.perf_counter() - start)


def run_isolated(cmd: list[str], part: Path, seconds: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` in its own process group for at most ``seconds``. Its result is the JSON it left
    in ``part`` (whatever it wrote before failing, so a crash or an out-of-memory loses only what
    came after), with the wall time, and the error and the output's tail if it failed."""
    part.unlink(missing_ok=True)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=seconds)
        error = None if proc.returncode == 0 else f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        error = f"stopped after {seconds:.0f} s"
    result = json.loads(part.read_text()) if part.is_file() else {}
    part.unlink(missing_ok=True)
    result["wall_s"] = time.monotonic() - start
    if error:
        result.update(error=error, output_tail=output[-3000:])
    return result
