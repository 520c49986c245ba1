"""eagle3-bench against stand-in engines (tests/standin_engines.py) whose replies are scripted (no
model runs), whose drafts accept a known count, and which, when asked, answer as late as a simulated
engine of given step times would: the report's fields, the requests and tokens of each level, the
concurrency the engine saw, the speed-up from the two measured rates, and the projection."""

import json
import os
import socket
import subprocess
import sys

import pytest

from eagle3_train.core.errors import ConfigError
from eagle3_train.engines.http import EngineError
from eagle3_train.evaluation import projection
from eagle3_train.evaluation.bench import Bench, BenchConfig, Request, percentile, stalled
from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer
from standin_engines import SimulatedSteps, StandinVllm

K = 3  # draft tokens per step
ACCEPT = 2  # each draft accepts this many (the last: what is left of the reply)
ROWS = [
    {"category": "math", "messages": [{"role": "user", "content": "two plus two"}]},
    {"category": "chat", "turns": ["hello there", "and again"]},  # MT-bench shape: only the first turn is sent
    {"category": "code", "messages": [{"role": "user", "content": "write a loop"}]},
]


def script(prompt, max_new):
    """A reply of 4..10 byte tokens that depends on the prompt (never an end-of-turn token)."""
    n = 4 + sum(prompt) % 7
    return [97 + (sum(prompt) + i) % 26 for i in range(n)]


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(), build_tiny_tokenizer()


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def servers(tiny, **kw):
    """A stand-in serving the target alone, and one serving it with a draft of K tokens."""
    model, tokenizer = tiny
    kw = {"tokenizer": tokenizer, "scripted": script} | kw
    spec = {"method": "eagle3", "model": "unused-with-accept-each", "num_speculative_tokens": K}
    return StandinVllm(model, **kw), StandinVllm(model, speculative=spec, accept_each=ACCEPT, **kw)


def bench(baseline, spec, prompts, out, **kw):
    cfg = BenchConfig(
        baseline_url=baseline.url,
        spec_url=spec.url,
        prompts=str(prompts),
        out=str(out),
        **{
            "concurrency": [1, 3],
            "min_requests": 4,
            "requests_per_slot": 2,
            "max_new_tokens": 12,
            "warmup_requests": 2,
            "settle_s": 0.01,
        }
        | kw,
    )
    return Bench(cfg).run()


def expected_replies(tokenizer, n):
    """The scripted reply lengths of the first ``n`` conversations sent (the file repeated)."""
    firsts = [r["messages"] if "messages" in r else [{"role": "user", "content": r["turns"][0]}] for r in ROWS]
    ids = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for m in firsts
    ]
    return [len(script(ids[i % len(ids)], 12)) for i in range(n)]


def test_report_levels_tokens_concurrency_and_speedup(tiny, prompts, tmp_path):
    steps = SimulatedSteps(0.004, 0.005, 0.001)  # replies take >= 20 ms: requests of a level overlap
    baseline, spec = servers(tiny, steps=steps)
    with baseline, spec:
        report = bench(baseline, spec, prompts, tmp_path / "out")
    tokenizer = tiny[1]
    # the fields
    assert {"what", "machine", "command", "date", "engine", "settings", "rows", "warnings", "config"} <= set(report)
    assert report["engine"]["name"] == "vllm" and report["engine"]["spec"]["version"] == "0.0.0+standin"
    assert report["engine"]["baseline"]["model"] == "standin-model" and report["engine"]["spec"]["started_here"] is None
    assert report["settings"]["conversations"] == 3 and report["settings"]["conversations_per_level"] == {
        "1": 4,
        "3": 6,
    }
    assert [r["concurrency"] for r in report["rows"]] == [1, 3] and report["warnings"] == []
    # requests and tokens per level: the script's replies, counted as the stand-ins generated them
    # the warm-up: before each level, max(2, its concurrency) requests at its concurrency
    warm = report["engine"]["baseline"]["warmup"]
    assert warm == {
        "requests": 2 + 3,
        "completion_tokens": sum(expected_replies(tokenizer, 2)) + sum(expected_replies(tokenizer, 3)),
    }
    for row, n in zip(report["rows"], (4, 6)):
        lengths = expected_replies(tokenizer, n)
        for side in ("baseline", "spec"):
            figs = row[side]
            assert figs["requests"] == n and figs["completion_tokens"] == sum(lengths)
            assert figs["output_tokens_per_s"] == pytest.approx(figs["completion_tokens"] / figs["seconds"])
            # per request: its latency over its tokens; the slowest per token is the shortest reply
            assert figs["time_per_output_token_s"]["p90"] <= figs["latency_s"]["p90"] / min(lengths)
        assert row["speedup"] == pytest.approx(
            row["spec"]["output_tokens_per_s"] / row["baseline"]["output_tokens_per_s"]
        )
        # each reply: its first token from the prefill, then drafts of ACCEPT + 1 tokens, the last cut
        drafts = sum(-(-(t - 1) // (ACCEPT + 1)) for t in lengths)
        assert row["spec"]["drafts"] == drafts and row["spec"]["accepted_tokens"] == sum(lengths) - n - drafts
        assert row["spec"]["mean_acceptance_length"] == pytest.approx((sum(lengths) - n) / drafts)
    for server, side in ((baseline, "baseline"), (spec, "spec")):
        counted = (
            sum(r[side]["completion_tokens"] for r in report["rows"])
            + report["engine"][side]["warmup"]["completion_tokens"]
        )
        assert server.generated == counted  # every token the stand-in generated, counted once
        # the concurrency each level kept: a warm-up of 2 and the level's 4 one at a time, then a warm-up
        # of 3 and the level's 6, 3 in flight
        arrivals = server.arrivals
        assert arrivals[:6] == [1] * 6 and max(arrivals[6:9]) == 3 and max(arrivals[9:]) == 3 and len(arrivals) == 15
        assert all(b["temperature"] == 0 and b["max_tokens"] == 12 for b in server.bodies)
    # the files
    out = tmp_path / "out"
    assert json.loads((out / "results.json").read_text()) == report
    lines = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * (4 + 6) and {x["engine"] for x in lines} == {"baseline", "spec"}
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_projection_reproduces_a_simulated_engines_speedup(tiny, prompts, tmp_path):
    """The stand-ins answer as an engine of known step times would (each request as if alone, so
    in flight they overlap as in an ideal batch); the projection, fed those step times and the tau
    the bench read from the engine, must give the speed-up the bench measured. Replies of 13
    tokens: 1 from the prefill and 3 drafts of 4 (tau 4), so the short-reply form applies. Within
    8%: the requests' HTTP round trips (a few ms here, up to ~15 ms on a loaded CI core) are not
    in the model, against replies of >= 170 ms."""
    steps = SimulatedSteps(target_step_s=0.03, verify_s=0.036, draft_step_s=0.003)
    model, tokenizer = tiny
    spec_cfg = {"method": "eagle3", "model": "unused", "num_speculative_tokens": 4}
    fixed = lambda prompt, n: [100 + i % 20 for i in range(13)]  # noqa: E731
    with (
        StandinVllm(model, tokenizer=tokenizer, scripted=fixed, steps=steps) as baseline,
        StandinVllm(
            model, tokenizer=tokenizer, scripted=fixed, steps=steps, speculative=spec_cfg, accept_each=3
        ) as spec,
    ):
        report = bench(
            baseline,
            spec,
            prompts,
            tmp_path / "out",
            concurrency=[1, 4],
            requests_per_slot=1,
            max_new_tokens=16,
            warmup_requests=1,
            plot=False,
        )
    for row in report["rows"]:
        tau = row["spec"]["mean_acceptance_length"]
        assert tau == 4.0
        predicted = projection.speedup(tau, 4, steps.target_step_s, steps.verify_s, steps.draft_step_s, reply_tokens=13)
        assert predicted == pytest.approx(13 * 0.03 / (0.03 + 3 * 0.048))  # by hand: 2.241
        assert row["speedup"] == pytest.approx(predicted, rel=0.08), row
        # the long-reply limit overstates short replies: tau t_T / cycle = 2.5
        assert projection.speedup(tau, 4, 0.03, 0.036, 0.003) == pytest.approx(2.5)


def test_sglang_counts_per_reply_and_temperatures(tiny, prompts, tmp_path):
    """engine=sglang: the acceptance comes from each reply's meta_info (asked with return_meta_info);
    every temperature is measured at every concurrency and sent as asked."""
    baseline, spec = servers(tiny, reply_meta=True)
    with baseline, spec:
        report = bench(
            baseline,
            spec,
            prompts,
            tmp_path / "out",
            engine="sglang",
            temperatures=[0.0, 0.7],
            warmup_requests=0,
            plot=False,
        )
    assert [(r["temperature"], r["concurrency"]) for r in report["rows"]] == [(0.0, 1), (0.0, 3), (0.7, 1), (0.7, 3)]
    for row in report["rows"]:
        lengths = expected_replies(tiny[1], row["spec"]["requests"])
        drafts = sum(-(-(t - 1) // (ACCEPT + 1)) for t in lengths)
        assert row["spec"]["drafts"] == drafts
        assert row["spec"]["mean_acceptance_length"] == pytest.approx((sum(lengths) - len(lengths)) / drafts)
    assert all("return_meta_info" in b for b in spec.bodies)
    assert [b["temperature"] for b in spec.bodies] == [0.0] * 10 + [0.7] * 10


def test_clear_errors(tiny, prompts, tmp_path):
    baseline, spec = servers(tiny)
    with baseline, spec:
        with pytest.raises(
            EngineError,
            match=rf"{spec.url}/metrics counted \d+ drafts during the baseline's run: the "
            r"baseline engine serves the target with a draft",
        ):
            bench(spec, spec, prompts, tmp_path / "a", plot=False)
        with pytest.raises(EngineError, match=rf"{baseline.url}/metrics exposes no speculative-decoding counters"):
            bench(baseline, baseline, prompts, tmp_path / "b", plot=False)
    baseline, spec = servers(tiny, reply_meta=True)
    with baseline, spec, pytest.raises(EngineError, match=r"the baseline engine's reply carries spec_verify_ct"):
        bench(spec, spec, prompts, tmp_path / "c", engine="sglang", plot=False)
    assert not (tmp_path / "a").exists()  # nothing written when a measurement fails
    for kw, message in (
        ({"draft": "d"}, r"baseline_url and spec_url not given: the engine is started here on target="),
        ({"target": "t"}, r"spec_url not given: the speculating engine is started here with draft="),
        ({"target": "t", "draft": "d", "concurrency": [4, 4]}, r"concurrency must list distinct levels"),
        ({"target": "t", "draft": "d", "temperatures": [-1.0]}, r"temperatures must list values >= 0"),
        ({"baseline_url": "localhost:8000", "spec_url": "http://x:1"}, r"baseline_url must be a base URL"),
        ({"target": "t", "draft": "d", "engine": "trtllm"}, r"engine must be one of \['sglang', 'vllm'\]"),
        ({"target": "t", "spec_url": "http://x:1", "spec_args": "--a"}, r"spec_args are flags for the speculating"),
    ):
        with pytest.raises(ConfigError, match=message):
            BenchConfig(out="o", **kw)


def test_the_shipped_held_out_prompts_by_default(tmp_path):
    b = Bench(BenchConfig(out=str(tmp_path), target="t", draft="d", plot=False))
    assert b.prompts.endswith("data_prep/prompts/heldout.jsonl") and len(b.conversations) == 37


def test_percentile_is_linear_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and percentile([5.0], 90) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0], 90) == 10.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A ``vllm`` that starts in a second, unlike the stand-ins (torch): it notes its argv and relays its
# port to the in-process stand-in serving with a draft when given --speculative-config, else to the other.
FAKE_VLLM = """
import http.server, json, os, sys, urllib.error, urllib.request
argv = sys.argv[1:]
with open(os.environ["FAKE_VLLM_ARGV"], "a") as f:
    f.write(json.dumps(argv) + "\\n")
upstream = os.environ["SPEC_URL" if "--speculative-config" in argv else "BASE_URL"]

class Relay(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def relay(self, data=None):
        headers = {"Content-Type": "application/json"} if data else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(upstream + self.path, data, headers)) as resp:
                status, body = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, body = e.code, e.read()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.relay()

    def do_POST(self):
        self.relay(self.rfile.read(int(self.headers["Content-Length"])))

http.server.ThreadingHTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Relay).serve_forever()
"""


@pytest.mark.slow
def test_started_engines(tiny, prompts, tmp_path, monkeypatch):
    """Without URLs the bench starts ``vllm serve`` twice, without and with --speculative-config,
    one after the other on ``port``, waits for each to answer, measures it and stops it; an engine
    that exits at start is reported with its log's tail."""
    for name, body in (
        ("bin", f'exec "{sys.executable}" "{tmp_path / "fake_vllm.py"}" "$@"'),
        ("broken", 'echo "vllm: error: no GPU here"; exit 3'),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "vllm").write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name / "vllm").chmod(0o755)
    (tmp_path / "fake_vllm.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_VLLM_ARGV", str(tmp_path / "argv.jsonl"))
    port = free_port()
    cfg = dict(
        target="some/target",
        draft=str(tmp_path / "export"),
        out=str(tmp_path / "out"),
        prompts=str(prompts),
        port=port,
        concurrency=[1, 2],
        min_requests=2,
        requests_per_slot=1,
        max_new_tokens=8,
        warmup_requests=1,
        settle_s=0.01,
        plot=False,
        num_speculative_tokens=K,
        engine_args="--enforce-eager --max-model-len 512",
        spec_args="--speculative-disable-by-batch-size 64",
    )
    baseline, spec = servers(tiny)
    with baseline, spec:
        monkeypatch.setenv("BASE_URL", baseline.url)
        monkeypatch.setenv("SPEC_URL", spec.url)
        report = Bench(BenchConfig(**cfg)).run()
    base_argv = ["vllm", "serve", "some/target", "--port", str(port), "--enforce-eager", "--max-model-len", "512"]
    spec_argv = (
        base_argv[:5]
        + [
            "--speculative-config",
            json.dumps(
                {"method": "eagle3", "model": str(tmp_path / "export"), "num_speculative_tokens": K},
                separators=(",", ":"),
            ),
        ]
        + base_argv[5:]
        + ["--speculative-disable-by-batch-size", "64"]  # spec_args: the speculating engine's only
    )
    assert [report["engine"][s]["started_here"] for s in ("baseline", "spec")] == [base_argv, spec_argv]
    started = [json.loads(x) for x in (tmp_path / "argv.jsonl").read_text().splitlines()]
    assert started == [base_argv[1:], spec_argv[1:]]  # what ran, in this order
    assert [r["spec"]["requests"] for r in report["rows"]] == [2, 2] and report["rows"][0]["spec"]["drafts"] > 0
    assert (tmp_path / "out" / "engine-baseline.log").exists() and (tmp_path / "out" / "engine-spec.log").exists()
    with socket.socket() as s:  # both engines were stopped: nothing listens on the port any more
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    monkeypatch.setenv("PATH", f"{tmp_path / 'broken'}:{os.environ['PATH']}")
    with pytest.raises(
        EngineError,
        match=r"(?s)the engine exited with status 3 before answering /health \(vllm serve "
        r".*engine-baseline.log ends:\nvllm: error: no GPU here",
    ):
        Bench(BenchConfig(**cfg | {"out": str(tmp_path / "bad")})).run()


def test_stalled_requests_against_the_levels_medians():
    def req(tokens, latency):
        return Request("p.jsonl:1", 1, tokens, latency, "length")

    level = [req(128, 0.2), req(128, 0.21), req(120, 0.19), req(128, 0.2)]
    assert stalled(level) == []
    # a long reply at the level's time per token, and a one-token reply (its prefill), are not stalls
    assert stalled(level + [req(1024, 1.6), req(1, 0.05)]) == []
    slow = req(128, 10.5)  # 50x the median latency: a compile inside the engine
    found = stalled(level + [slow])
    assert [r for r, _ in found] == [slow] and found[0][1] == pytest.approx(0.2, rel=0.1)
    assert stalled([req(128, 0.2), slow]) == []  # too few requests to say what is usual
    assert stalled(level + [req(128, 0.9)]) == []  # 4.5x: under the factor
    fast = [req(8, 0.01), req(8, 0.011), req(8, 0.009), req(8, 0.01)]
    assert stalled(fast + [req(8, 0.2)]) == []  # 20x, but 0.19 s: a hiccup, not a compile
    assert [r.latency_s for r, _ in stalled(fast + [req(8, 0.2)], min_s=0.1)] == [0.2]


def test_a_stalled_request_is_named_and_the_median_speedup_set_beside(tiny, prompts, tmp_path):
    steps = SimulatedSteps(0.004, 0.005, 0.001)
    baseline, spec = servers(tiny, steps=steps)
    baseline.slow_posts = {3: 1.5}  # the c=1 level's first request (after the 2 warm-up ones) stalls 1.5 s
    with baseline, spec:
        report = bench(baseline, spec, prompts, tmp_path / "out", concurrency=[1])
    row = report["rows"][0]
    assert len(report["warnings"]) == 1, report["warnings"]
    warning = report["warnings"][0]
    assert warning.startswith("baseline, concurrency 1, temperature 0.0: ") and "prompts.jsonl:1 turn 1 took" in warning
    # the stall is counted in the throughput's speed-up, not in the medians'
    tpot = [row[side]["time_per_output_token_s"]["p50"] for side in ("baseline", "spec")]
    assert row["speedup_by_tpot"] == pytest.approx(tpot[0] / tpot[1])
    assert row["speedup"] > 2 * row["speedup_by_tpot"]
    assert f"{row['speedup']:.2f}x by throughput, {row['speedup_by_tpot']:.2f}x by median time per token" in warning


def test_speedup_results_sets_the_engines_tau_beside_evals_on_the_same_turns(tmp_path):
    """tests/benchmarks/speedup_results.py: eval's tau over exactly the turns the bench sent the
    speculating engine at a concurrency, from eval's per-turn accepted counts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "speedup_results", os.path.join(os.path.dirname(__file__), "benchmarks", "speedup_results.py")
    )
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
    """tests/benchmarks/study35_results.py: each variant's tau at every reply length beside base's, the
    change it made, and whose synthesis it trained on; a failed variant says so."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "study35_results", os.path.join(os.path.dirname(__file__), "benchmarks", "study35_results.py")
    )
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
    """tests/benchmarks/study35_gpu.sh PLAN=1: a variant trained on another's synthesis gets that synthesis's
    settings (through a chain of FROMs) ahead of its own change, and nothing of its training levers; bad
    lines (not VAR=value, a FROM naming no variant, a FROM loop) are refused naming the line, before anything runs."""
    script = os.path.join(os.path.dirname(__file__), "benchmarks", "study35_gpu.sh")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
    """tests/benchmarks/study35_table.py: the committed summary is what the results files give today,
    each measured row's Δ is the difference of the two runs' own τ, and the acceptance that τ 3.5 needs
    solves 1 + a + … + a^5 = 3.5."""
    from tests.benchmarks import study35_table as t

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
    """tests/benchmarks/target_repetition.py: per bucket, the share of reply tokens closing a repeated run
    of 8 (a reply that runs its first 8 tokens again repeats at its 16th token only), and the replies
    that ran out of tokens."""
    from tests.benchmarks.target_repetition import repetition

    loop, fresh = [1, 2, 3, 4, 5, 6, 7, 8] * 2, list(range(20, 30))
    got = repetition([loop, fresh], 1, 4)
    assert got["replies"] == 2 and got["reply_tokens"] == 26 and got["replies_cut_at_max_new_tokens"] == 1
    assert [(b["from"], b["to"], b["tokens"], b["repeated_share"]) for b in got["by_reply_position"]] == [
        (0, 4, 8, 0.0),
        (4, 8, 8, 0.0),
        (8, 16, 10, 0.1),
    ]


def test_requests_carry_the_drafts_training_flags(tiny, prompts, tmp_path):
    """With draft= (its config records the flags its data was rendered with) every request carries
    them as chat_template_kwargs; other flags are sent as given and warned about."""
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(
        json.dumps({"eagle3_train": {"target": {"chat_template_kwargs": {"enable_thinking": False}}}})
    )
    for flags, warned in ((None, False), ({"enable_thinking": True}, True)):
        baseline, spec = servers(tiny)
        with baseline, spec:
            report = bench(
                baseline, spec, prompts, tmp_path / f"out-{warned}", draft=str(draft), chat_template_kwargs=flags,
                concurrency=[2],
            )  # fmt: skip
        want = flags if flags is not None else {"enable_thinking": False}
        assert report["chat_template_kwargs"] == want
        for server in (baseline, spec):
            assert server.bodies and all(b["chat_template_kwargs"] == want for b in server.bodies)
        assert any("enable_thinking: trained false != true" in w for w in report["warnings"]) == warned
