"""The speed-up projection (eagle3_train.evaluation.projection) against cases worked by hand."""

import pytest

from eagle3_train.core.errors import ConfigError
from eagle3_train.evaluation.projection import (
    StepTimes,
    break_even_tau,
    calibrated,
    cycle_overhead_from_served,
    cycle_s,
    project,
    speedup,
)


def test_hand_computed_cases():
    # tau 3 over k 5: a cycle of 12 ms + 5 x 1 ms = 17 ms writes 3 tokens; alone a token takes 10 ms
    assert cycle_s(5, 0.012, 0.001) == pytest.approx(0.017)
    assert speedup(3.0, 5, 0.010, 0.012, 0.001) == pytest.approx(30 / 17)
    # the probe: vLLM eager SmolLM2-135M, tau 1.78 at k 5; a draft step a tenth of a target step
    # and verify as cheap as a step (launch-bound): 1.78 / 1.5 = 1.187
    assert speedup(1.78, 5, 0.016, 0.016, 0.0016) == pytest.approx(1.78 / 1.5)
    # nothing accepted: one token per cycle, always a loss
    assert speedup(1.0, 3, 0.010, 0.010, 0.001) == pytest.approx(10 / 13)
    # a per-cycle overhead lengthens the cycle
    assert speedup(4.0, 4, 0.020, 0.022, 0.002, cycle_overhead_s=0.002) == pytest.approx(0.080 / 0.032)
    # where the draft starts to pay, and the tau that 2x needs
    assert break_even_tau(5, 0.010, 0.012, 0.001) == pytest.approx(1.7)
    assert break_even_tau(5, 0.010, 0.012, 0.001, wanted=2.0) == pytest.approx(3.4)
    assert speedup(1.7, 5, 0.010, 0.012, 0.001) == pytest.approx(1.0)


def test_short_replies_count_the_prefill_token():
    # 13 tokens: the prefill's, then 12 in 3 cycles of tau 4; 13 x 30 ms against 30 + 3 x 48 ms
    assert speedup(4.0, 4, 0.03, 0.036, 0.003, reply_tokens=13) == pytest.approx(0.39 / 0.174)
    assert speedup(4.0, 4, 0.03, 0.036, 0.003, reply_tokens=1) == pytest.approx(1.0)  # nothing to draft
    long = speedup(4.0, 4, 0.03, 0.036, 0.003, reply_tokens=10**7)
    assert long == pytest.approx(speedup(4.0, 4, 0.03, 0.036, 0.003), rel=1e-6)  # the long-reply limit


def test_project_rows_per_batch():
    rows = project([StepTimes(1, 0.010, 0.011, 0.001), StepTimes(64, 0.020, 0.060, 0.004)], tau=3.0, k=4)
    one, many = rows
    assert one["baseline_tokens_per_s"] == pytest.approx(100) and one["spec_tokens_per_s"] == pytest.approx(3 / 0.015)
    assert one["speedup"] == pytest.approx(2.0) and one["break_even_tau"] == pytest.approx(1.5)
    # at batch 64 the verify of 5 tokens a sequence is 3x a step: the draft loses
    assert many["baseline_tokens_per_s"] == pytest.approx(3200) and many["spec_tokens_per_s"] == pytest.approx(
        64 * 3 / 0.076
    )
    assert many["speedup"] == pytest.approx(3 * 0.020 / 0.076) and many["speedup"] < 1
    assert many["break_even_tau"] == pytest.approx(3.8)


@pytest.mark.parametrize(
    "args, message",
    [
        ((0.5, 5, 0.01, 0.01, 0.001), r"tau \(tokens per cycle\) must be in \[1, k \+ 1\] = \[1, 6\], got 0.5"),
        ((7.0, 5, 0.01, 0.01, 0.001), r"must be in \[1, k \+ 1\] = \[1, 6\], got 7.0"),
        ((2.0, 0, 0.01, 0.01, 0.001), r"k \(draft tokens per cycle\) must be >= 1, got 0"),
        ((2.0, 5, 0.0, 0.01, 0.001), r"step times must be positive .*'target_step_s': 0.0"),
        ((2.0, 5, 0.01, float("nan"), 0.001), r"step times must be positive .*'verify_s': nan"),
    ],
)
def test_impossible_inputs_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        speedup(*args)


def test_the_engine_overhead_read_off_a_served_speedup():
    """t_O recovered from a speed-up that a known overhead produced; an engine cheaper than the
    forwards gives a negative t_O, clamped when projecting; a batch size without its own figure takes
    the nearest one's."""
    t = StepTimes(1, 0.010, 0.012, 0.001, cycle_overhead_s=0.0005)
    measured = speedup(2.5, 5, 0.010, 0.012, 0.001, cycle_overhead_s=0.0005 + 0.004)
    assert cycle_overhead_from_served(measured, 2.5, 5, t) == pytest.approx(0.004)
    # by hand: 2 x 10 ms / 1.0 = 20 ms a cycle, less 12 + 5 x 1 + 0.5 ms of forwards
    assert cycle_overhead_from_served(1.0, 2.0, 5, t) == pytest.approx(0.0025)
    assert cycle_overhead_from_served(2.0, 3.0, 5, t) == pytest.approx(0.015 - 0.0175)  # < 0
    rows = [StepTimes(1, 0.01, 0.012, 0.001), StepTimes(8, 0.01, 0.012, 0.001), StepTimes(64, 0.02, 0.05, 0.002)]
    got = calibrated(rows, {1: 0.002, 16: -0.001})
    assert [r.cycle_overhead_s for r in got] == pytest.approx([0.002, 0.002, 0.0])  # 8 -> 1 (nearer), 64 -> 16
    assert [r.target_step_s for r in got] == [r.target_step_s for r in rows]
    assert calibrated(rows[:1], {1: 0.002, 3: 0.004})[0].cycle_overhead_s == pytest.approx(0.002)
    assert calibrated([StepTimes(2, 0.01, 0.012, 0.001)], {1: 0.001, 3: 0.003})[0].cycle_overhead_s == pytest.approx(
        0.003
    )  # a tie goes to the larger batch
    with pytest.raises(ConfigError, match="no engine overhead given"):
        calibrated(rows, {})
    with pytest.raises(ConfigError, match="measured speed-up must be > 0"):
        cycle_overhead_from_served(0.0, 2.0, 5, t)
    with pytest.raises(ConfigError, match=r"tau in \[1, k \+ 1\]"):
        cycle_overhead_from_served(1.0, 7.0, 5, t)
