"""The speed-up speculative decoding should buy, predicted from measured step times
(docs/guide/bench.md, "The projection").

The model. Without a draft, an engine decoding a batch of B sequences writes one token per sequence
per target step: ``B / t_T(B)`` tokens/s. With a chain draft of ``k`` tokens, one *cycle* is ``k``
draft steps and one target forward that verifies the ``k + 1`` positions of every sequence at once,
and it writes on average ``tau`` tokens per sequence (the accepted draft tokens plus the target's
own; the engines' "mean acceptance length"): ``B * tau / (t_V(B) + k * t_D(B))`` tokens/s. So

    speed-up(B) = tau * t_T(B) / (t_V(B) + k * t_D(B) + t_O(B))

with ``t_O`` whatever a cycle costs beyond its forwards (acceptance, sampling, bookkeeping; 0 unless
measured). Its assumptions: every sequence of the batch steps in lockstep (no prefill interleaved,
no sequence waiting); ``tau`` is the same at every batch size and the mean over cycles (the ratio of
total tokens to total cycles, as the engines count it); the host keeps the GPU busy (an engine whose
step is launch-bound, eager serving of a small target, runs slower than its forwards and gains less).
An engine's cycle costs more than its forwards (its sampler, the draft's input preparation, the
scheduler): ``cycle_overhead_from_served`` reads that ``t_O`` off a served speed-up measured at a
known ``tau`` (``eagle3-bench``), in the units of the step times given, so that another shape can be
projected with the engine's own per-cycle cost. It is the long-reply limit: a reply's first token
comes from the prefill, not from a cycle. For
replies of n tokens, with the prefill costed as one target step, the baseline takes ``n * t_T`` and
the draft ``t_T + (n - 1) / tau * cycle`` (``reply_tokens=n``), which tends to the above as n grows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from eagle3_train.core.errors import ConfigError


@dataclass(frozen=True)
class StepTimes:
    """Measured times, in seconds, of one batch size.

    Args:
        batch: sequences decoded together (B).
        target_step_s: one target forward over one new token of each sequence, t_T(B).
        verify_s: one target forward over k + 1 new tokens of each sequence, t_V(B).
        draft_step_s: one draft forward over one new token of each sequence, t_D(B).
        cycle_overhead_s: what a cycle costs beyond its forwards, t_O(B).
    """

    batch: int
    target_step_s: float
    verify_s: float
    draft_step_s: float
    cycle_overhead_s: float = 0.0


def speedup(
    tau: float,
    k: int,
    target_step_s: float,
    verify_s: float,
    draft_step_s: float,
    cycle_overhead_s: float = 0.0,
    reply_tokens: int | None = None,
) -> float:
    """``tau * t_T / (t_V + k * t_D + t_O)``: the tokens/s with a chain draft of ``k`` tokens that
    accepts ``tau`` tokens per cycle (the target's own included), over the tokens/s without one.
    With ``reply_tokens`` = n, for replies of n tokens whose first comes from the prefill:
    ``n * t_T / (t_T + (n - 1) / tau * cycle)``."""
    if k < 1:
        raise ConfigError(f"k (draft tokens per cycle) must be >= 1, got {k}")
    if not 1.0 <= tau <= k + 1:
        raise ConfigError(f"tau (tokens per cycle) must be in [1, k + 1] = [1, {k + 1}], got {tau}")
    times = {"target_step_s": target_step_s, "verify_s": verify_s, "draft_step_s": draft_step_s}
    bad = {name: t for name, t in times.items() if not t > 0} | (
        {"cycle_overhead_s": cycle_overhead_s} if not cycle_overhead_s >= 0 else {}
    )
    if bad:
        raise ConfigError(f"step times must be positive (the overhead >= 0), got {bad}")
    cycle = cycle_s(k, verify_s, draft_step_s, cycle_overhead_s)
    if reply_tokens is None:
        return tau * target_step_s / cycle
    if reply_tokens < 1:
        raise ConfigError(f"reply_tokens must be >= 1, got {reply_tokens}")
    n = reply_tokens
    return n * target_step_s / (target_step_s + (n - 1) / tau * cycle)


def cycle_s(k: int, verify_s: float, draft_step_s: float, cycle_overhead_s: float = 0.0) -> float:
    """One draft-and-verify cycle: ``t_V + k * t_D + t_O``."""
    return verify_s + k * draft_step_s + cycle_overhead_s


def break_even_tau(
    k: int,
    target_step_s: float,
    verify_s: float,
    draft_step_s: float,
    cycle_overhead_s: float = 0.0,
    wanted: float = 1.0,
) -> float:
    """The tokens per cycle at which the draft buys ``wanted`` x (1: where it starts to pay);
    above ``k + 1`` no draft of ``k`` tokens can reach it."""
    return wanted * cycle_s(k, verify_s, draft_step_s, cycle_overhead_s) / target_step_s


def cycle_overhead_from_served(measured_speedup: float, tau: float, k: int, times: StepTimes) -> float:
    """The per-cycle cost ``t_O`` beyond the forwards that a served speed-up implies: solving
    ``measured = tau * t_T / (t_V + k * t_D + t_O)`` for ``t_O``, with the forwards' times ``times``
    (its own ``cycle_overhead_s`` counted as part of the forwards). The engine's step is taken to be
    ``t_T`` (its tokens/s ratio fixes the cycle relative to its own decode step; an engine whose
    decode step differs from ``t_T`` scales both alike). Negative where the engine's cycle is
    cheaper than the forwards measured here; ``calibrated`` clamps it at 0."""
    if not measured_speedup > 0:
        raise ConfigError(f"the measured speed-up must be > 0, got {measured_speedup}")
    if k < 1 or not 1.0 <= tau <= k + 1:
        raise ConfigError(f"need k >= 1 and tau in [1, k + 1], got k={k}, tau={tau}")
    cycle = tau * times.target_step_s / measured_speedup
    return cycle - cycle_s(k, times.verify_s, times.draft_step_s, times.cycle_overhead_s)


def nearest_batch(batches: Iterable[int], batch: int) -> int:
    """The batch size of ``batches`` nearest to ``batch`` (the larger on a tie)."""
    return min(batches, key=lambda b: (abs(b - batch), -b))


def calibrated(times: list[StepTimes], overhead_s: dict[int, float]) -> list[StepTimes]:
    """``times`` with an engine's per-cycle cost added to each batch size's ``cycle_overhead_s``:
    ``overhead_s[batch]`` (clamped at 0), or for a batch size it lacks, that of the nearest batch size
    it has (the larger on a tie)."""
    if not overhead_s:
        raise ConfigError("no engine overhead given: measure one with eagle3-bench (cycle_overhead_from_served)")
    out = []
    for t in times:
        extra = max(0.0, overhead_s[nearest_batch(overhead_s, t.batch)])
        out.append(StepTimes(t.batch, t.target_step_s, t.verify_s, t.draft_step_s, t.cycle_overhead_s + extra))
    return out


def project(times: list[StepTimes], tau: float, k: int) -> list[dict[str, Any]]:
    """Per batch size: tokens/s without and with the draft, the speed-up, and the tau at which
    the draft starts to pay."""
    rows = []
    for t in times:
        cycle = cycle_s(k, t.verify_s, t.draft_step_s, t.cycle_overhead_s)
        rows.append(
            {
                "batch": t.batch,
                "tau": tau,
                "k": k,
                "baseline_tokens_per_s": t.batch / t.target_step_s,
                "spec_tokens_per_s": t.batch * tau / cycle,
                "speedup": speedup(tau, k, t.target_step_s, t.verify_s, t.draft_step_s, t.cycle_overhead_s),
                "break_even_tau": break_even_tau(k, t.target_step_s, t.verify_s, t.draft_step_s, t.cycle_overhead_s),
            }
        )
    return rows
