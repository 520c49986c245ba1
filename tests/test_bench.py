"""eagle3-bench against stand-in engines (tests/standin_engines.py) whose replies are scripted (no
model runs), whose drafts accept a known count, and which, when asked, answer as late as a simulated
engine of given step times would: the report's fields, the requests and tokens of each level, the
concurrency the engine saw, the speed-up from the two measured rates, and the projection."""

import json
import os
import socket
import sys

import pytest

from eagle3_train.core.errors import ConfigError
from eagle3_train.core.reports import BENCH_SCHEMA_VERSION, read_bench_report
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
    assert report.schema_version == BENCH_SCHEMA_VERSION and report.what.startswith("eagle3-bench: ")
    assert report.engine["name"] == "vllm" and report.engine["spec"]["version"] == "0.0.0+standin"
    assert report.engine["baseline"]["model"] == "standin-model" and report.engine["spec"]["started_here"] is None
    assert report.settings["conversations"] == 3 and report.settings["conversations_per_level"] == {
        "1": 4,
        "3": 6,
    }
    assert [r.concurrency for r in report.rows] == [1, 3] and report.warnings == []
    # requests and tokens per level: the script's replies, counted as the stand-ins generated them
    # the warm-up: before each level, max(2, its concurrency) requests at its concurrency
    warm = report.engine["baseline"]["warmup"]
    assert warm == {
        "requests": 2 + 3,
        "completion_tokens": sum(expected_replies(tokenizer, 2)) + sum(expected_replies(tokenizer, 3)),
    }
    for row, n in zip(report.rows, (4, 6)):
        lengths = expected_replies(tokenizer, n)
        for figs in (row.baseline, row.spec):
            assert figs["requests"] == n and figs["completion_tokens"] == sum(lengths)
            assert figs["output_tokens_per_s"] == pytest.approx(figs["completion_tokens"] / figs["seconds"])
            # per request: its latency over its tokens; the slowest per token is the shortest reply
            assert figs["time_per_output_token_s"]["p90"] <= figs["latency_s"]["p90"] / min(lengths)
        assert row.speedup == pytest.approx(row.spec["output_tokens_per_s"] / row.baseline["output_tokens_per_s"])
        # each reply: its first token from the prefill, then drafts of ACCEPT + 1 tokens, the last cut
        drafts = sum(-(-(t - 1) // (ACCEPT + 1)) for t in lengths)
        assert row.spec["drafts"] == drafts and row.spec["accepted_tokens"] == sum(lengths) - n - drafts
        assert row.spec["mean_acceptance_length"] == pytest.approx((sum(lengths) - n) / drafts)
    for server, side, levels in (
        (baseline, "baseline", [r.baseline for r in report.rows]),
        (spec, "spec", [r.spec for r in report.rows]),
    ):
        counted = sum(f["completion_tokens"] for f in levels) + report.engine[side]["warmup"]["completion_tokens"]
        assert server.generated == counted  # every token the stand-in generated, counted once
        # the concurrency each level kept: a warm-up of 2 and the level's 4 one at a time, then a warm-up
        # of 3 and the level's 6, 3 in flight
        arrivals = server.arrivals
        assert arrivals[:6] == [1] * 6 and max(arrivals[6:9]) == 3 and max(arrivals[9:]) == 3 and len(arrivals) == 15
        assert all(b["temperature"] == 0 and b["max_tokens"] == 12 for b in server.bodies)
    # the files
    out = tmp_path / "out"
    assert read_bench_report(out / "results.json") == report  # what it wrote reads back as it was
    written = json.loads((out / "results.json").read_text())  # the keys results files have always had
    assert set(written) == {"schema_version", "chat_template_kwargs"} | {
        "what", "machine", "command", "date", "engine", "settings", "rows", "warnings", "config"
    }  # fmt: skip
    assert set(written["rows"][0]) == {"temperature", "concurrency", "baseline", "spec", "speedup", "speedup_by_tpot"}
    lines = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * (4 + 6) and {x["engine"] for x in lines} == {"baseline", "spec"}
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_projection_reproduces_a_simulated_engines_speedup(tiny, prompts, tmp_path):
    """The stand-ins answer as an engine of known step times would (each request as if alone, so
    in flight they overlap as in an ideal batch); the projection, fed those step times and the tau
    the bench read from the engine, must give the speed-up the bench measured. Replies of 13
    tokens: 1 from the prefill and 3 drafts of 4 (tau 4), so the short-reply form applies. Within
    8%: the requests' HTTP round trips and the stand-in's own work before it sleeps (a few ms here,
    20 ms once on a loaded CI core, which put a 170 ms reply 9% late) are not in the model, against
    replies of >= 520 ms."""
    steps = SimulatedSteps(target_step_s=0.09, verify_s=0.108, draft_step_s=0.009)
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
    for row in report.rows:
        tau = row.spec["mean_acceptance_length"]
        assert tau == 4.0
        predicted = projection.speedup(tau, 4, steps.target_step_s, steps.verify_s, steps.draft_step_s, reply_tokens=13)
        assert predicted == pytest.approx(13 * 0.09 / (0.09 + 3 * 0.144))  # by hand: 2.241
        assert row.speedup == pytest.approx(predicted, rel=0.08), row
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
    assert [(r.temperature, r.concurrency) for r in report.rows] == [(0.0, 1), (0.0, 3), (0.7, 1), (0.7, 3)]
    for row in report.rows:
        lengths = expected_replies(tiny[1], row.spec["requests"])
        drafts = sum(-(-(t - 1) // (ACCEPT + 1)) for t in lengths)
        assert row.spec["drafts"] == drafts
        assert row.spec["mean_acceptance_length"] == pytest.approx((sum(lengths) - len(lengths)) / drafts)
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
    assert [report.engine[s]["started_here"] for s in ("baseline", "spec")] == [base_argv, spec_argv]
    started = [json.loads(x) for x in (tmp_path / "argv.jsonl").read_text().splitlines()]
    assert started == [base_argv[1:], spec_argv[1:]]  # what ran, in this order
    assert [r.spec["requests"] for r in report.rows] == [2, 2] and report.rows[0].spec["drafts"] > 0
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
    row = report.rows[0]
    assert len(report.warnings) == 1, report.warnings
    warning = report.warnings[0]
    assert warning.startswith("baseline, concurrency 1, temperature 0.0: ") and "prompts.jsonl:1 turn 1 took" in warning
    # the stall is counted in the throughput's speed-up, not in the medians'
    tpot = [figs["time_per_output_token_s"]["p50"] for figs in (row.baseline, row.spec)]
    assert row.speedup_by_tpot == pytest.approx(tpot[0] / tpot[1])
    assert row.speedup > 2 * row.speedup_by_tpot
    assert f"{row.speedup:.2f}x by throughput, {row.speedup_by_tpot:.2f}x by median time per token" in warning


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
        assert report.chat_template_kwargs == want
        for server in (baseline, spec):
            assert server.bodies and all(b["chat_template_kwargs"] == want for b in server.bodies)
        assert any("enable_thinking: trained false != true" in w for w in report.warnings) == warned
