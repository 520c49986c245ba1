"""eagle3-served-acceptance against a stand-in vLLM whose /metrics counters advance by known
amounts per request (tests/standin_engines.py), and, once, by a real draft run as eagle3-eval runs it."""

import json
import socket
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

from eagle3_train.core.errors import ConfigError, Eagle3Error
from eagle3_train.core.reports import SERVED_SCHEMA_VERSION, read_served_report
from eagle3_train.engines.http import EngineError
from eagle3_train.engines.registry import ENGINES
from eagle3_train.evaluation.eval import EvalConfig, Evaluator
from eagle3_train.evaluation.served_acceptance import (
    ServedAcceptance,
    ServedAcceptanceConfig,
    SpecCounts,
    figures,
    parse_prometheus,
    read_counts,
)
from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer
from standin_engines import StandinVllm
from test_export_eval import off_by_one

K = 5
SPEC = {"method": "eagle3", "model": "unused-with-a-plan", "num_speculative_tokens": K}
ROWS = [
    {"category": "math", "messages": [{"role": "user", "content": "two plus two"}]},
    {"category": "math", "turns": ["seven", "eight"]},  # MT-bench shape, two turns
    {
        "category": "chat",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "dropped"},
            {"role": "user", "content": "again"},
        ],
    },
]


FIGURES = ("drafts", "accepted_tokens", "completion_tokens", "prompt_tokens", "acceptance_per_position", "requests")


def plan(messages):
    """Accepted counts of each draft of one request: chat (the one with a system prompt) [1], math [5, 2, 0]."""
    return [1] if messages[0]["role"] == "system" else [5, 2, 0]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def standin(**kw):
    kw = {"tokenizer": build_tiny_tokenizer(), "speculative": SPEC, "accepted_plan": plan, "engines": 2} | kw
    return StandinVllm(build_tiny_model(), **kw)


def measure(server_url, prompts, out, **kw):
    cfg = ServedAcceptanceConfig(
        server=server_url,
        prompts=str(prompts),
        out=str(out),
        **{"max_new_tokens": 6, "settle_s": 0.01, "concurrency": 3} | kw,
    )
    return ServedAcceptance(cfg).run()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_text_as_prometheus_client_writes_it():
    text = "\n".join(
        [
            "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="a \\"b\\", c"} 7.0',
            'vllm:spec_decode_num_drafts_created{engine="0",model_name="a \\"b\\", c"} 1.76e+09',
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="x"} 5.0 1700000000000',
            'vllm:spec_decode_num_draft_tokens_total{engine="0"} 60',
            "vllm:spec_decode_num_accepted_tokens 9",  # a counter written without _total
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1",engine="0"} 3.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0",engine="0"} 6.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0",engine="1"} 1.0',
            'vllm:request_success_total{finished_reason="stop"} 2.0',
            'vllm:request_success_total{finished_reason="length"} 1.0',
            "vllm:kv_cache_usage_perc NaN",
            'vllm:request_prompt_tokens_bucket{le="+Inf"} 3.0',
        ]
    )
    samples = parse_prometheus(text)
    assert samples["vllm:spec_decode_num_drafts_total"][0] == ({"engine": "0", "model_name": 'a "b", c'}, 7.0)
    assert samples["vllm:request_prompt_tokens_bucket"] == [({"le": "+Inf"}, 3.0)]
    counts = read_counts(text, ENGINES["vllm"].metrics, "here")
    assert counts == SpecCounts(
        drafts=12, draft_tokens=60, accepted=9, accepted_per_position=(7, 3), requests=3, generation_tokens=0
    )


def test_figures_are_the_difference_of_the_counters():
    before = SpecCounts(100, 500, 120, (60, 40, 20, 0, 0), 10, 900)
    after = SpecCounts(112, 560, 148, (68, 48, 24, 4, 4), 14, 1000)
    f = figures(after.minus(before, "here"))
    assert (f.drafts, f.draft_tokens, f.accepted_tokens) == (12, 60, 28)
    assert f.mean_acceptance_length == pytest.approx(1 + 28 / 12)
    assert f.mean_draft_length == 5 and f.draft_acceptance_rate == pytest.approx(28 / 60)
    assert f.acceptance_per_position == pytest.approx([8 / 12, 8 / 12, 4 / 12, 4 / 12, 4 / 12])
    assert f.conditional_acceptance_per_position == pytest.approx([8 / 12, 8 / 8, 4 / 8, 4 / 4, 4 / 4])
    assert figures(before.minus(before, "here")) is None  # nothing drafted
    with pytest.raises(EngineError, match=r"here: the counters \['drafts', 'accepted'\] went down .* restarted"):
        SpecCounts(90, 600, 100, (60, 40, 20, 0, 0), 10, 900).minus(before, "here")


def test_served_figures_are_the_servers_counts_over_the_run(prompts, tmp_path):
    with standin() as server:
        server.count_request([5, 5], 4, "stop")  # traffic before the run: subtracted
        server.count_request([5, 5], 4, "length")
        report = measure(server.url, prompts, tmp_path / "out")
        bodies = [b for b in server.bodies if "messages" in b]
    # math: 3 requests x drafts [5, 2, 0]; chat: 2 requests x [1] (counted on two engine label sets)
    assert (report.requests, report.conversations, report.drafts, report.accepted_tokens) == (5, 3, 11, 23)
    assert report.draft_tokens == 55 and report.num_speculative_tokens == K
    assert report.mean_acceptance_length == pytest.approx(1 + 23 / 11)
    assert report.acceptance_per_position == pytest.approx([8 / 11, 6 / 11, 3 / 11, 3 / 11, 3 / 11])
    assert report.conditional_acceptance_per_position == pytest.approx([8 / 11, 6 / 8, 3 / 6, 3 / 3, 3 / 3])
    assert report.categories["math"]["mean_acceptance_length"] == pytest.approx(1 + 21 / 9)
    assert report.categories["chat"]["mean_acceptance_length"] == pytest.approx(2.0)
    assert report.categories["chat"]["acceptance_per_position"] == pytest.approx([1, 0, 0, 0, 0])
    assert report.counters_before == {"drafts": 4, "draft_tokens": 20, "accepted_tokens": 20}
    assert report.server_counted == {"requests": 5, "generation_tokens": report.completion_tokens}
    assert report.warnings == [] and report.models == ["standin-model"] and report.model == "standin-model"
    assert all(b["temperature"] == 0 and b["max_tokens"] == 6 and b["model"] == "standin-model" for b in bodies)
    assert read_served_report(tmp_path / "out" / "report.json") == report  # what it wrote reads back as it was
    written = json.loads((tmp_path / "out" / "report.json").read_text())  # the keys its reports have always had
    assert set(written) == {"chat_template_kwargs", "schema_version"} | {
        "server", "engine", "metrics_read_from", "models", "model", "prompts", "conversations", "requests",
        "prompt_tokens", "completion_tokens", "finish_reasons", "max_new_tokens", "num_speculative_tokens", "drafts",
        "draft_tokens", "accepted_tokens", "mean_acceptance_length", "mean_draft_length", "draft_acceptance_rate",
        "acceptance_per_position", "conditional_acceptance_per_position", "categories", "server_counted",
        "counters_before", "definitions", "warnings", "seconds", "completion_tokens_per_s", "config",
    }  # fmt: skip
    assert report.schema_version == SERVED_SCHEMA_VERSION
    # multi-turn: each later turn carries the engine's own replies (system prompt kept, given assistant text dropped)
    outputs = [json.loads(x) for x in (tmp_path / "out" / "outputs.jsonl").read_text().splitlines()]
    reply = {(o["source"].rsplit(":", 1)[1], o["turn"]): o["reply"] for o in outputs}
    assert len(outputs) == 5 and sum(o["completion_tokens"] for o in outputs) == report.completion_tokens
    assert [m for b in bodies for m in [b["messages"]] if len(m) == 3] == [
        [
            {"role": "user", "content": "seven"},
            {"role": "assistant", "content": reply[("2", 1)]},
            {"role": "user", "content": "eight"},
        ]
    ]
    assert [m for b in bodies for m in [b["messages"]] if m[0]["role"] == "system" and len(m) == 4] == [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": reply[("3", 1)]},
            {"role": "user", "content": "again"},
        ]
    ]


def test_other_clients_requests_are_flagged(prompts, tmp_path, caplog):
    with standin() as server:
        server.other_traffic = True  # every request is counted twice, as if another client sent its twin
        report = measure(server.url, prompts, tmp_path / "out")
    assert report.server_counted["requests"] == 10 and report.drafts == 22
    assert "the server counted 10 finished requests" in report.warnings[0]
    assert [
        r
        for r in caplog.records
        if r.levelname == "WARNING" and "other requests (another client, a retry) are in the figures" in r.getMessage()
    ]


def test_clear_errors(prompts, tmp_path):
    port = free_port()  # nothing listens there
    with pytest.raises(
        Eagle3Error,
        match=rf"(?s)http://127.0.0.1:{port} did not become ready within 0 s.*"
        r"start it with speculative decoding first: vllm serve",
    ):
        measure(f"http://127.0.0.1:{port}", prompts, tmp_path / "a")
    with (
        standin(speculative=None) as server,
        pytest.raises(
            EngineError,
            match=rf"{server.url}/metrics exposes no speculative-decoding counters "
            r"\(vllm:spec_decode_num_drafts, .*the engine does not speculate",
        ),
    ):
        measure(server.url, prompts, tmp_path / "b")
    with (
        standin(accepted_plan=[]) as server,
        pytest.raises(EngineError, match=rf"{server.url}/metrics counted no speculative drafts over 5 requests"),
    ):
        measure(server.url, prompts, tmp_path / "c")
    with standin() as server:
        server.fail_posts = {2}
        with pytest.raises(
            EngineError,
            match=rf"{server.url}/v1/chat/completions \(.*\): 1 attempts failed; the last: "
            r".*HTTP 503",
        ):
            measure(server.url, prompts, tmp_path / "d")
        with pytest.raises(
            ConfigError, match=r"model=other is not served by .* \(/v1/models lists \['standin-model'\]\)"
        ):
            measure(server.url, prompts, tmp_path / "e", model="other")
    with standin() as server:  # a fresh one: the requests of the stopped run above may still be counted there
        server.fail_posts = {2}  # one transient failure, retried
        report = measure(server.url, prompts, tmp_path / "f", retries=1, backoff_s=0.01)
        assert report.requests == 5 and report.server_counted["requests"] == 5  # the 503 was never served
        assert report.warnings == [] and server.posts == 6
    with pytest.raises(ConfigError, match=r"engine must be one of \['sglang', 'vllm'\]"):
        ServedAcceptanceConfig(server="http://x:1", prompts="p", out="o", engine="trtllm")
    with pytest.raises(ConfigError, match=r"server must be a base URL"):
        ServedAcceptanceConfig(server="127.0.0.1:8000", prompts="p", out="o")
    with pytest.raises(ConfigError, match=r"template=client renders the prompts with tokenizer="):
        ServedAcceptanceConfig(server="http://x:1", prompts="p", out="o", template="client")
    with pytest.raises(ConfigError, match=r"template must be server .* or client"):
        ServedAcceptanceConfig(server="http://x:1", prompts="p", out="o", template="harmony")
    assert not (tmp_path / "a").exists()  # nothing written when the run fails


@pytest.mark.slow
def test_command_line(prompts, tmp_path):
    with standin() as server:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "eagle3_train.evaluation.served_acceptance",
                f"server={server.url}",
                f"prompts={prompts}",
                f"out={tmp_path / 'out'}",
                "max_new_tokens=4",
                "settle_s=0.01",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 0, run.stderr
    assert (
        f"eagle3-served-acceptance (vllm at {server.url}, model standin-model): mean acceptance length 3.09 over "
        f"11 drafts of 5.00 tokens" in run.stdout
    )
    port = free_port()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3_train.evaluation.served_acceptance",
            f"server=http://127.0.0.1:{port}",
            f"prompts={prompts}",
            f"out={tmp_path / 'x'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and run.stderr.startswith(f"eagle3-served-acceptance: error: http://127.0.0.1:{port} ")


@pytest.mark.slow
def test_a_drafting_standin_gives_eagle3_evals_figures(pipeline, tmp_path):
    """The stand-in speculates with the exported draft as eagle3-eval does (fp32, same layers by
    vLLM's rule): the served figures must be eval's tau and per-position rates, and the off-by-one
    config must collapse in both."""
    model = AutoModelForCausalLM.from_pretrained(pipeline / "target")
    tokenizer = build_tiny_tokenizer()
    wrong = off_by_one(pipeline, "served_wrong", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]))
    results = {}
    for name, draft in (("right", pipeline / "export"), ("wrong", wrong)):
        spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
        with StandinVllm(model, tokenizer=tokenizer, speculative=spec) as server:
            served = measure(server.url, pipeline / "prompts.jsonl", tmp_path / name, limit=10, max_new_tokens=48)
            if name == "right":  # the prompts rendered here and sent as token ids to /v1/completions: the same
                ids = measure(
                    server.url,
                    pipeline / "prompts.jsonl",
                    tmp_path / "ids",
                    limit=10,
                    max_new_tokens=48,
                    template="client",
                    tokenizer=str(pipeline / "target"),
                )
                assert [getattr(ids, k) for k in FIGURES] == [getattr(served, k) for k in FIGURES]
        ev = Evaluator(
            EvalConfig(
                draft=str(draft),
                target=str(pipeline / "target"),
                engine="vllm",
                k=3,
                limit=10,
                prompts=str(pipeline / "prompts.jsonl"),
                max_new_tokens=48,
                progress=False,
                out=str(tmp_path / f"eval-{name}"),
            )
        ).run()
        assert served.mean_acceptance_length == pytest.approx(ev["tau"], abs=1e-9)
        assert served.conditional_acceptance_per_position == pytest.approx(ev["acceptance_per_position"], abs=1e-9)
        assert served.drafts == ev["verify_steps"] and served.completion_tokens == ev["tokens"]
        results[name] = served.mean_acceptance_length
    assert results["right"] > 2.0 and results["right"] > results["wrong"] + 0.2, results


@pytest.mark.slow
def test_sglang_figures_are_summed_from_each_replys_meta_info(pipeline, tmp_path):
    """SGLang returns its counts per reply (meta_info, asked with return_meta_info) and none in
    /metrics: the served figures are the sums over this client's replies, equal to eagle3-eval's
    with engine=sglang on the same draft and prompts; a server whose replies lack them is refused."""
    model = AutoModelForCausalLM.from_pretrained(pipeline / "target")
    spec = {"method": "eagle3", "model": str(pipeline / "export"), "num_speculative_tokens": 3}
    with StandinVllm(model, tokenizer=build_tiny_tokenizer(), speculative=spec, reply_meta=True) as server:
        served = measure(
            server.url, pipeline / "prompts.jsonl", tmp_path / "sg", limit=10, max_new_tokens=48, engine="sglang"
        )
        # token ids rendered here, to SGLang's native /generate: the same replies and figures
        ids = measure(
            server.url,
            pipeline / "prompts.jsonl",
            tmp_path / "sg-ids",
            limit=10,
            max_new_tokens=48,
            engine="sglang",
            template="client",
            tokenizer=str(pipeline / "target"),
        )
        assert [getattr(ids, k) for k in FIGURES] == [getattr(served, k) for k in FIGURES]
        with pytest.raises(EngineError, match="carries no spec_verify_ct in its meta_info"):
            server.hide_spec = True  # replies without the figures: a server that does not speculate
            measure(
                server.url, pipeline / "prompts.jsonl", tmp_path / "sg2", limit=2, max_new_tokens=48, engine="sglang"
            )
    ev = Evaluator(
        EvalConfig(
            draft=str(pipeline / "export"),
            target=str(pipeline / "target"),
            engine="sglang",
            k=3,
            limit=10,
            prompts=str(pipeline / "prompts.jsonl"),
            max_new_tokens=48,
            progress=False,
            out=str(tmp_path / "eval-sg"),
        )
    ).run()
    assert served.mean_acceptance_length == pytest.approx(ev["tau"], abs=1e-9) and served.drafts == ev["verify_steps"]
    assert served.conditional_acceptance_per_position == pytest.approx(ev["acceptance_per_position"], abs=1e-9)
    assert served.metrics_read_from.startswith("SGLang 0.5.17") and served.warnings == []


def test_sglang_meta_info_as_sglang_0_5_17_returned_it():
    """A reply's meta_info as SGLang 0.5.17 returned it on an H200 (a draft that accepted nothing):
    the histogram stops after the largest count seen, and the positions up to the draft length
    (proposed / verify steps) count as accepting nothing, not as absent."""
    from eagle3_train.evaluation.served_acceptance import reply_counts

    names = ENGINES["sglang"].metrics
    seen = {
        "finish_reason": {"type": "length", "length": 16},
        "prompt_tokens": 27,
        "completion_tokens": 16,
        "spec_accept_rate": 0.0,
        "spec_accept_length": 1.0666666666666667,
        "spec_num_correct_drafts": 0,
        "spec_num_proposed_drafts": 60,
        "spec_verify_ct": 15,
        "spec_correct_drafts_histogram": [15],
    }
    c = reply_counts(seen, names, 16, "x")
    assert c.accepted_per_position == (0, 0, 0, 0) and figures(c).acceptance_per_position == [0, 0, 0, 0]
    partial = {
        **seen,
        "spec_num_correct_drafts": 5,
        "spec_num_proposed_drafts": 24,
        "spec_verify_ct": 6,
        "spec_correct_drafts_histogram": [3, 1, 2],
    }  # 3 steps accepted 0, one 1, two 2
    c = reply_counts(partial, names, 16, "x")
    assert c.accepted_per_position == (3, 2, 0, 0) and sum(c.accepted_per_position) == c.accepted
