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


def bench_module():
    """tests/benchmarks/bench_projection.py (a script, not a package module)."""
    import importlib.util
    import sys
    from pathlib import Path

    if "bench_projection" not in sys.modules:
        path = Path(__file__).resolve().parent / "benchmarks" / "bench_projection.py"
        spec = importlib.util.spec_from_file_location("bench_projection", path)
        sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
        spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules["bench_projection"]


def test_the_benchs_blocks_compute_what_they_time():
    """The timed MoE block sends each token to its top experts, weighted by their softmax; the
    grouped attention of k + 1 new tokens equals per-head attention with repeated keys, each new
    token seeing the context and the new tokens up to itself."""
    import torch
    import torch.nn.functional as F

    bench = bench_module()
    torch.manual_seed(0)
    s = bench.SMOKE["tiny_moe"]
    layer = bench.Layer(s, torch.device("cpu"), torch.float32)
    h = torch.randn(2, 3, s.hidden)
    ref = torch.zeros_like(h)
    for b in range(2):
        for t in range(3):
            top = (h[b, t] @ layer.router).topk(s.experts_per_token)
            for w, e in zip(torch.softmax(top.values, -1), top.indices):
                g, u = (h[b, t] @ layer.gate_up[e]).chunk(2)
                ref[b, t] += w * ((F.silu(g) * u) @ layer.down[e])
    torch.testing.assert_close(layer.mlp(h), ref)
    # the target's layers route to experts of the shape's width; only the draft's dense MLP takes
    # draft_intermediate (a target built at the draft's width ran a Qwen3-MoE shape out of memory)
    target = bench.Model(s, 2, torch.device("cpu"), torch.float32)
    draft = bench.Model(s, 1, torch.device("cpu"), torch.float32, draft=True)
    assert all(x.moe and x.gate_up.shape == (s.experts, s.hidden, 2 * s.intermediate) for x in target.layers)
    assert not draft.layers[0].moe and draft.layers[0].gate_up.shape == (s.hidden, 2 * s.draft_intermediate)

    dense = bench.Layer(bench.SMOKE["tiny_dense"], torch.device("cpu"), torch.float32)
    B, T, C, d, kv, heads = 2, 3, 5, 16, 2, 4
    x = torch.randn(B, T, 64)
    cache = torch.randn(2, B, kv, C + T, d)
    cos, sin = torch.randn(T, d), torch.randn(T, d)
    mask = torch.arange(C + T)[None] <= C + (torch.arange(2 * T) % T)[:, None]  # as Model.step builds it
    got = dense(x, x, cache, C, cos, sin, mask)
    q, _, _ = (bench.rms(x, dense.ln1) @ dense.qkv).split([heads * d, kv * d, kv * d], -1)
    q = bench.rope(q.view(B, T, heads, d).transpose(1, 2), cos, sin)
    keys, values = cache[0].repeat_interleave(2, 1), cache[1].repeat_interleave(2, 1)  # [B, heads, C+T, d]
    causal = torch.arange(C + T)[None] <= C + torch.arange(T)[:, None]
    a = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal).transpose(1, 2).reshape(B, T, heads * d)
    h = x + a @ dense.o
    torch.testing.assert_close(got, h + dense.mlp(bench.rms(h, dense.ln2)))


def test_bench_projection_smoke_mode(tmp_path):
    """The CPU smoke run writes its results, scales a target built with fewer layers by layers,
    and its projection is the projection of its own measured rows."""
    import json

    bench = bench_module()
    results = bench.main(["--smoke", "--out", str(tmp_path / "p.json"), "--replays", "1", "--repeats", "1"])
    assert json.loads((tmp_path / "p.json").read_text()) == results
    assert {"what", "machine", "command", "date", "settings", "shapes"} <= set(results)
    assert set(results["shapes"]) == {"tiny_dense", "tiny_moe"}
    for shape in results["shapes"].values():
        assert "error" not in shape, shape
        times = shape["times"]
        assert [t["batch"] for t in times] == [1, 4] and all(
            t[k] > 0 for t in times for k in ("target_step_s", "verify_s")
        )
        rows = [
            StepTimes(t["batch"], t["target_step_s"], t["verify_s"], t["draft_step_s"], t["cycle_overhead_s"])
            for t in times
        ]
        assert shape["projection"] == {str(tau): project(rows, tau, 5) for tau in (1.78, 2.5, 3.5)}
    dense = results["shapes"]["tiny_dense"]
    assert dense["scaled"] and dense["layers_built"] == 2 and not results["shapes"]["tiny_moe"]["scaled"]
    for t in dense["times"]:  # 4 layers from 2 built: head + 4 x per layer
        for key in ("target_step_s", "verify_s"):
            assert t[key] == pytest.approx(t[f"{key}_head"] + 4 * (t[f"{key}_built"] - t[f"{key}_head"]) / 2)


def test_bench_projection_reads_the_engines_overhead_off_a_served_bench(tmp_path):
    """--from/--served: a bench whose speed-ups an engine with a known per-cycle cost would give is
    read back to that cost per concurrency, and every shape is projected again with it added."""
    import json

    bench = bench_module()
    proj = bench.main(["--smoke", "--out", str(tmp_path / "p.json"), "--replays", "1", "--repeats", "1"])
    name = next(iter(proj["shapes"]))
    extra = {1: 0.004, 4: 0.002}  # seconds per cycle beyond the forwards, per concurrency
    rows = []
    for t in proj["shapes"][name]["times"]:
        tau = 2.5
        s = speedup(
            tau, 5, t["target_step_s"], t["verify_s"], t["draft_step_s"], t["cycle_overhead_s"] + extra[t["batch"]]
        )
        rows.append(
            {"concurrency": t["batch"], "temperature": 0.0, "speedup": s, "spec": {"mean_acceptance_length": tau}}
        )
    rows.append({"concurrency": 1, "temperature": 0.7, "speedup": 9.0, "spec": {"mean_acceptance_length": 2.0}})
    served = {"config": {"num_speculative_tokens": 5}, "rows": rows, "date": "d", "command": "eagle3-bench"}
    (tmp_path / "b.json").write_text(json.dumps(served))
    out = tmp_path / "s.json"
    res = bench.main(["--from", str(tmp_path / "p.json"), "--served", str(tmp_path / "b.json"), "--served-shape", name,
                      "--taus", "2.5", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == res
    assert {c: v["engine_overhead_ms"] for c, v in res["calibration"].items()} == pytest.approx(
        {"c1": 4.0, "c4": 2.0}, abs=1e-3
    )  # the sampled row is not read
    assert res["projected_with_engine_overhead"][name]["tau_2.5"] == pytest.approx(
        {f"b{r['concurrency']}": round(r["speedup"], 3) for r in rows[:2]}, abs=1e-3
    )  # the served shape, projected with its own overhead, gives back the measured speed-ups
    with pytest.raises(SystemExit):
        bench.main(["--from", str(tmp_path / "p.json"), "--out", str(out)])  # --served missing
