"""The lab's own code: result-making scripts and study harnesses of benchmarks/ (not the product's:
the product's tests under tests/ import nothing from here)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(LAB),
    str(LAB.parent),
]  # the lab's scripts import each other as top-level modules or as benchmarks.*


def test_speedup_results_sets_the_engines_tau_beside_evals_on_the_same_turns(tmp_path):
    """benchmarks/speedup_results.py: eval's tau over exactly the turns the bench sent the
    speculating engine at a concurrency, from eval's per-turn accepted counts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("speedup_results", os.path.join(str(LAB), "speedup_results.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    outputs = tmp_path / "outputs.jsonl"
    rows = [("p:1", 1, [2, 0, 1]), ("p:1", 2, [5, 5]), ("p:2", 1, [0, 0, 0, 3]), ("p:3", 1, [4])]
    outputs.write_text("".join(json.dumps({"source": s, "turn": t, "accepted": a}) + "\n" for s, t, a in rows))
    requests = tmp_path / "requests.jsonl"
    sent = [("baseline", 1, "p:3"), ("spec", 1, "p:1"), ("spec", 1, "p:2"), ("spec", 4, "p:3")]
    requests.write_text(
        "".join(json.dumps({"engine": e, "concurrency": c, "source": s, "turn": 1}) + "\n" for e, c, s in sent)
    )
    turns = mod.sent_turns(requests, 1)
    assert turns == {("p:1", 1), ("p:2", 1)}
    # the same prompt file named by another path in eval's outputs still matches
    moved = tmp_path / "moved.jsonl"
    moved.write_text(outputs.read_text().replace('"p:', '"/elsewhere/p:'))
    assert mod.eval_tau_on(moved, turns) == mod.eval_tau_on(outputs, turns)
    tau, n = mod.eval_tau_on(outputs, turns)
    assert n == 2 and tau == pytest.approx(1 + (2 + 0 + 1 + 0 + 0 + 0 + 3) / 7)  # p:1's second turn left out
    assert mod.eval_tau_on(outputs, {("p:9", 1)}) is None and mod.eval_tau_on(tmp_path / "none", turns) is None


def test_study35_results_sets_each_lever_against_base(tmp_path):
    """benchmarks/study35_results.py: each variant's tau at every reply length beside base's, the
    change it made, and whose synthesis it trained on; a failed variant says so."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("study35_results", os.path.join(str(LAB), "study35_results.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def run(name, change, source, taus, synth_s):
        d = tmp_path / name
        (d / "train").mkdir(parents=True)
        (d / "change.txt").write_text(change + "\n")
        (d / "from.txt").write_text(source + "\n")
        stages = [("synthesize", synth_s), ("train", 100.0)]
        (d / "timings.jsonl").write_text("".join(json.dumps({"stage": s, "seconds": t}) + "\n" for s, t in stages))
        evals = [
            {"step": 10, "eval_tau": taus[0] + 0.1, "eval_acc": [0.5] * 5},
            {"step": 5, "eval_tau": 1.0, "eval_acc": [0.1] * 5},
        ]
        (d / "train" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in evals))
        for sub, tau in (("eval", taus[0]), ("eval_512", taus[1])):
            (d / sub).mkdir()
            report = {"tau": tau, "acceptance_per_position": [0.5] * 5, "lossless": "identical"}
            (d / sub / "report.json").write_text(json.dumps(report))

    run("base", "—", "", (2.0, 2.1), 130.0)
    run("own_x8", "OWN_REPEATS=8", "base", (2.25, 2.05), 0.5)
    (tmp_path / "wsd").mkdir()
    (tmp_path / "wsd" / "change.txt").write_text("TRAIN_EXTRA=train.schedule=wsd\n")
    (tmp_path / "wsd.failed").touch()
    variants = [mod.variant(tmp_path, n) for n in ("base", "own_x8", "wsd")]
    t = mod.table(variants)
    assert t["header"][2:6] == ["τ (128 new tokens)", "τ (512 new tokens)", "Δ τ vs base (128)", "Δ τ vs base (512)"]
    rows = {r[0]: r for r in t["rows"]}
    assert rows["base"][2:7] == ["2.000", "2.100", "+0.000", "+0.000", "2.100"]
    assert rows["base"][7] == "130"
    assert rows["own_x8"][1] == "OWN_REPEATS=8 (on the synthesis of base)"
    assert rows["own_x8"][2:6] == ["2.250", "2.050", "+0.250", "-0.050"] and rows["own_x8"][7] == "(shared)"
    assert rows["wsd"][2:6] == ["—"] * 4 and "failed" in rows["wsd"][-1]


def test_study35_gpu_plan_carries_the_synthesis_a_variant_trains_on(tmp_path):
    """benchmarks/study35_gpu.sh PLAN=1: a variant trained on another's synthesis gets that synthesis's
    settings (through a chain of FROMs) ahead of its own change, and nothing of its training levers; bad
    lines (not VAR=value, a FROM naming no variant, a FROM loop) are refused naming the line, before anything runs."""
    script = os.path.join(str(LAB), "study35_gpu.sh")
    root = str(LAB.parent)

    def plan(variants):
        env = dict(os.environ, PLAN="1", W=str(tmp_path / "ws"), VARIANTS=variants)
        return subprocess.run(["bash", script], cwd=root, env=env, capture_output=True, text=True, timeout=60)

    lines = [
        "base||",
        "turns_2|PREPARE_EXTRA=synth.turns=2;NEW_TOKENS=256|",
        "wsd|TRAIN_EXTRA=train.schedule=wsd|turns_2",
        "stack|OWN_REPEATS=8;TRAIN_EXTRA=train.ema_decay=0.999|wsd",
        "vocab|DRAFT_VOCAB=32768|base",
    ]
    r = plan("\n".join(lines))
    assert r.returncode == 0, r.stderr
    got = {line.split("|")[0]: line.split("|")[1] for line in r.stdout.splitlines()}
    assert got["base"] == "" and got["vocab"] == "DRAFT_VOCAB=32768"
    assert got["wsd"] == "PREPARE_EXTRA=synth.turns=2;NEW_TOKENS=256;TRAIN_EXTRA=train.schedule=wsd"
    # two FROMs up: turns_2's synthesis, not wsd's schedule
    assert got["stack"] == "PREPARE_EXTRA=synth.turns=2;NEW_TOKENS=256;OWN_REPEATS=8;TRAIN_EXTRA=train.ema_decay=0.999"
    assert not (tmp_path / "ws" / "log").exists()  # nothing ran

    for bad, says in (
        (["base||", "a|EPOCHS 9|base"], "variant line 2 (a): change 'EPOCHS 9' is not VAR=value"),
        (["base||", "a|EPOCHS=9|nope"], "variant line 2 (a): FROM 'nope' names no variant"),
        (["a|EPOCHS=9|b", "b|EPOCHS=8|a"], "variant line 1 (a): FROM loops back through 'a'"),
    ):
        r = plan("\n".join(bad))
        assert r.returncode == 2 and says in r.stderr, r.stderr


def test_study35_table_is_read_from_the_results_and_up_to_date():
    """benchmarks/study35_table.py: the committed summary is what the results files give today,
    each measured row's Δ is the difference of the two runs' own τ, and the acceptance that τ 3.5 needs
    solves 1 + a + … + a^5 = 3.5."""
    import study35_table as t

    summary = t.summary()
    assert json.loads(t.OUT.read_text()) == json.loads(json.dumps(summary, ensure_ascii=False))
    rows = summary["tables"][0]["rows"]
    assert len(rows) == len(t.LEVERS)
    study = json.loads((t.RESULTS / t.STUDY16K).read_text())
    by_name = {v["name"]: v["eval"]["tau"] for v in study["variants"] if "tau" in v.get("eval", {})}
    ttt = next(r for r in rows if r[1] == "ttt 7 instead of 5")
    assert ttt[4] == f"{by_name['ttt_7'] - by_name['base']:+.3f}"
    assert all(r[3] == "—" and r[-1].startswith("not measured") for r in rows if r[2] == "—")
    # where τ stands is the recipe at its defaults (WSD), at 128 and 512 new tokens, from its own file
    wsd = json.loads((t.RESULTS / t.WSD73K).read_text())["variants"][0]
    gap = summary["gap_to_3.5"]
    assert (
        gap["held_out_tau"] == wsd["eval"]["tau"]
        and gap["held_out_tau_512_new_tokens"] == wsd["eval_long"]["512"]["tau"]
    )
    a = t.constant_acceptance_for(3.5, 5)
    assert sum(a**i for i in range(6)) == pytest.approx(3.5, abs=1e-9) and 0.7 < a < 0.85
    assert t.constant_acceptance_for(6.0, 5) == pytest.approx(1.0, abs=1e-9)


def test_target_repetition_counts_each_reply_position_once():
    """benchmarks/target_repetition.py: per bucket, the share of reply tokens closing a repeated run
    of 8 (a reply that runs its first 8 tokens again repeats at its 16th token only), and the replies
    that ran out of tokens."""
    from target_repetition import repetition

    loop, fresh = [1, 2, 3, 4, 5, 6, 7, 8] * 2, list(range(20, 30))
    got = repetition([loop, fresh], 1, 4)
    assert got["replies"] == 2 and got["reply_tokens"] == 26 and got["replies_cut_at_max_new_tokens"] == 1
    assert [(b["from"], b["to"], b["tokens"], b["repeated_share"]) for b in got["by_reply_position"]] == [
        (0, 4, 8, 0.0),
        (4, 8, 8, 0.0),
        (8, 16, 10, 0.1),
    ]


from eagle3_train.evaluation.projection import StepTimes, project, speedup  # noqa: E402


def bench_module():
    """benchmarks/bench_projection.py (a script, not a package module)."""
    import importlib.util
    import sys

    if "bench_projection" not in sys.modules:
        path = LAB / "bench_projection.py"
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
    # Tiny shapes time a layer in microseconds, and the other test process's stalls can make the 2 layers
    # built read faster than the head alone (a negative scaled time, refused by the projection): up to
    # three runs, the first whose shapes all timed is checked (the timings' noise, not the code's logic)
    for _ in range(3):
        results = bench.main(["--smoke", "--out", str(tmp_path / "p.json"), "--replays", "3", "--repeats", "3"])
        if not any("error" in shape for shape in results["shapes"].values()):
            break
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


def test_a_staging_part_still_fits_in_one_device_call_beside_the_working_tree():
    """A device call carries at most 64 MiB: the tracked tree plus the carried part. The vLLM parts were
    60 MiB until the tree passed 4 MiB and three of four calls were refused; a part's size leaves room."""
    import re

    ls = subprocess.run(["git", "ls-files", "-z"], cwd=LAB.parent, capture_output=True)
    if ls.returncode != 0:
        pytest.skip("not a git checkout")
    tree = sum(
        (LAB.parent / f).stat().st_size for f in ls.stdout.decode().split("\0") if f and (LAB.parent / f).is_file()
    )
    for script in ("stage_vllm.sh", "stage_sglang.sh"):
        part_mib = int(re.search(r"^part_mib=\$\{PART_MIB:-(\d+)\}", (LAB / "staging" / script).read_text(), re.M)[1])
        assert tree + part_mib * 2**20 <= 62 * 2**20, (script, tree)  # (2 MiB for the tree's growth between packs)


def test_every_lab_script_finds_the_repository_root():
    """A script's ``Path(__file__).resolve().parents[N]`` names the repository (it holds pyproject.toml):
    the lab moved up a floor once, and scripts counting from the old place read files that are not there."""
    import re

    for script in sorted(LAB.glob("*.py")):
        for n in re.findall(r"Path\(__file__\)\.resolve\(\)\.parents\[(\d+)\]", script.read_text()):
            root = script.resolve().parents[int(n)]
            assert (root / "pyproject.toml").is_file(), f"{script.name}: parents[{n}] is {root}, not the repository"


