"""Shared by the benchmarks: the measured matmul rate every efficiency figure is a fraction of."""

from __future__ import annotations

import time

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
