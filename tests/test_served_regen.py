"""Regeneration through a served engine (data_prep/served_regen.py) against stand-in servers fed
by the tiny target: token for token what transformers' generate_batch writes (fp32), for both
engines; retries, refusals, limits and seeds driven through the servers' API surface."""

import pytest
import torch

from data_prep.regenerate import RegenConfig, generate_batch
from data_prep.served_regen import ServedRegenConfig, cut_reply, prompt_seed, served_generate_batch
from eagle3_train.core.errors import ConfigError
from eagle3_train.engines.http import EngineError
from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer
from standin_engines import StandinSglang, StandinVllm

MAX_NEW = 12
EOS = [257, 259, 262]  # <|end_of_text|>, <|im_end|>, <|eot_id|>: the tiny target's own end-of-turn ids
USER_TURNS = ["Hi", "Tell me a story.", "q" * 30, "What is 2+2?", "abc def ghi", "Z", "The quick brown fox", "Hi"]
BACKENDS = {"vllm": StandinVllm, "sglang": StandinSglang}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Rendered one-turn prompts of different lengths (the last repeats the first)."""
    tok = build_tiny_tokenizer()
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for t in USER_TURNS
    ]


def hf_replies(prompts: list[list[int]], eos: list[int], max_new: int = MAX_NEW) -> tuple[list[list[int]], int]:
    """What ``regen.backend=hf`` writes: one left-padded greedy batch in fp32."""
    model = build_tiny_model()
    with torch.no_grad():
        return generate_batch(
            model,
            prompts,
            RegenConfig(max_new_tokens=max_new, batch_size=len(prompts)),
            eos,
            model.config.pad_token_id,
            torch.device("cpu"),
        )


@pytest.fixture(scope="module")
def stops(prompts) -> list[int]:
    """End-of-turn ids that end some greedy replies early: the tiny target, untrained, never
    writes its own, so two tokens it does write are declared end-of-turn too."""
    free, _ = hf_replies(prompts, EOS)
    return EOS + [free[0][4], free[3][7]]


def greedy(max_new: int = MAX_NEW) -> dict:
    return {"max_new_tokens": max_new, "do_sample": False, "temperature": 0.7, "top_p": 0.95, "seed": 0}


def server_cfg(url: str, **kw) -> ServedRegenConfig:
    return ServedRegenConfig(url=url, **{"concurrency": 3, "backoff_s": 0.01, "wait_for_server_s": 5.0, **kw})


def sent_prompts(server) -> list[list[int]]:
    return [b.get("prompt", b.get("input_ids")) for b in server.bodies]


@pytest.mark.parametrize("backend", BACKENDS)
def test_served_regeneration_equals_transformers(backend, prompts, stops):
    want, want_hit = hf_replies(prompts, stops)
    assert 0 < want_hit < len(prompts)  # some replies end on an end-of-turn id, some hit the limit
    with BACKENDS[backend](build_tiny_model()) as server:
        got, hit = served_generate_batch(prompts, server_cfg(server.url), greedy(), stops, backend)
    assert got == want and hit == want_hit
    assert sorted(sent_prompts(server)) == sorted(prompts)  # token ids went over the wire, as rendered
    params = [b if backend == "vllm" else b["sampling_params"] for b in server.bodies]
    assert all(
        p["temperature"] == 0 and p["stop_token_ids"] == stops and p["skip_special_tokens"] is False for p in params
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_end_of_turn_in_the_last_place_is_not_a_hit(backend, prompts):
    """SGLang checks the length before the stop token and reports ``length``; the reply still
    ended on its end-of-turn id, as transformers sees it."""
    free, _ = hf_replies(prompts[:1], EOS)
    j = next(j for j, t in enumerate(free[0]) if j > 0 and t not in free[0][:j])
    eos, max_new = EOS + [free[0][j]], j + 1
    want, want_hit = hf_replies(prompts[:1], eos, max_new)
    assert want == [free[0][:j]] and want_hit == 0
    with BACKENDS[backend](build_tiny_model()) as server:
        got, hit = served_generate_batch(prompts[:1], server_cfg(server.url), greedy(max_new), eos, backend)
    assert (got, hit) == (want, want_hit)


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_new_tokens_hits_are_counted(backend, prompts):
    with BACKENDS[backend](build_tiny_model()) as server:
        got, hit = served_generate_batch(prompts, server_cfg(server.url), greedy(), EOS, backend)
    assert hit == len(prompts) and all(len(r) == MAX_NEW for r in got)
    assert (got, hit) == hf_replies(prompts, EOS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_replies_depend_on_the_seed_not_on_concurrency(backend, prompts, stops):
    sampling = {"max_new_tokens": MAX_NEW, "do_sample": True, "temperature": 1.0, "top_p": 0.9, "seed": 7}
    with BACKENDS[backend](build_tiny_model()) as server:
        one, _ = served_generate_batch(prompts, server_cfg(server.url, concurrency=1), sampling, stops, backend)
        seeds = [b.get("seed", (b.get("sampling_params") or {}).get("sampling_seed")) for b in server.bodies]
        four, _ = served_generate_batch(prompts, server_cfg(server.url, concurrency=4), sampling, stops, backend)
        other, _ = served_generate_batch(prompts, server_cfg(server.url), {**sampling, "seed": 8}, stops, backend)
    assert one == four and one != other
    assert seeds == [prompt_seed(7, i, p) for i, p in enumerate(prompts)]
    assert len(set(seeds)) == len(prompts)  # the repeated prompt (index 0 and 7) draws its own reply
    assert one != hf_replies(prompts, stops)[0]  # sampled, not greedy


@pytest.mark.parametrize("backend", BACKENDS)
def test_transient_503_is_retried(backend, prompts, stops):
    with BACKENDS[backend](build_tiny_model()) as server:
        server.fail_posts = {1, 2}  # the first two requests answer HTTP 503
        got, hit = served_generate_batch(prompts, server_cfg(server.url), greedy(), stops, backend)
    assert (got, hit) == hf_replies(prompts, stops)
    assert server.posts == len(prompts) + 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_refusal_stops_with_url_and_prompt_index(backend, prompts, stops):
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    path = "/v1/completions" if backend == "vllm" else "/generate"
    with BACKENDS[backend](build_tiny_model()) as server:
        server.max_model_len = len(prompts[longest]) + MAX_NEW - 1  # only the longest prompt does not fit
        with pytest.raises(EngineError, match=rf"prompt {longest}: {server.url}{path} refused the request: HTTP 400"):
            served_generate_batch(prompts, server_cfg(server.url), greedy(), stops, backend)


def test_retries_that_keep_failing_stop_with_url_and_prompt(prompts, stops):
    with StandinVllm(build_tiny_model()) as server:
        server.fail_from = 1
        with pytest.raises(
            EngineError,
            match=rf"{server.url}/v1/completions \(prompt 0\): 3 attempts failed; the last: "
            rf".*HTTP 503",
        ):
            served_generate_batch(prompts[:1], server_cfg(server.url, retries=2), greedy(), stops, "vllm")


def test_vllm_model_name(prompts, stops):
    """null: the first model /v1/models lists; a name the engine does not serve is refused."""
    with StandinVllm(build_tiny_model()) as server:
        served_generate_batch(prompts[:1], server_cfg(server.url, model="standin-model"), greedy(), stops, "vllm")
        with pytest.raises(EngineError, match=r"prompt 0: .* HTTP 404: .*The model `other` does not exist"):
            served_generate_batch(prompts[:1], server_cfg(server.url, model="other"), greedy(), stops, "vllm")
    assert [b["model"] for b in server.bodies] == ["standin-model", "other"]


def test_engine_stop_ids_outside_eos_ids(prompts, stops):
    """An engine that stops on an id of its own: vLLM is told to ignore its eos ids (the reply
    is transformers'); SGLang cannot be (its ignore_eos drops stop_token_ids too), so it is refused."""
    longest = max(hf_replies(prompts, stops)[0], key=len)
    own = longest[len(longest) // 2]  # a token the target writes before any end-of-turn id
    assert own not in stops
    with StandinVllm(build_tiny_model()) as server:
        server.engine_eos.add(own)
        assert served_generate_batch(prompts, server_cfg(server.url), greedy(), stops, "vllm") == hf_replies(
            prompts, stops
        )
    with StandinSglang(build_tiny_model()) as server:
        server.engine_eos.add(own)
        with pytest.raises(EngineError, match=rf"the engine stopped on {own}, which is not an end-of-turn id"):
            served_generate_batch(prompts, server_cfg(server.url), greedy(), stops, "sglang")


def test_cut_reply():
    eos = [9, 8]
    assert cut_reply([1, 2, 9, 3], "stop", 9, eos, 5, "w") == ([1, 2], False)
    assert cut_reply([1, 2, 8], "length", None, eos, 3, "w") == ([1, 2], False)  # stop id in the last place
    assert cut_reply([1, 2, 3], "length", None, eos, 3, "w") == ([1, 2, 3], True)
    assert cut_reply([1, 2], "stop", 8, eos, 3, "w") == ([1, 2], False)  # an engine that drops its stop id
    assert cut_reply([], "stop", 9, eos, 3, "w") == ([], False)
    with pytest.raises(EngineError, match="w: the engine stopped on 7, which is not an end-of-turn id"):
        cut_reply([1, 7], "stop", 7, eos, 3, "w")
    with pytest.raises(EngineError, match="stopped for length after 2 of 3 tokens: its context is full"):
        cut_reply([1, 2], "length", None, eos, 3, "w")
    with pytest.raises(EngineError, match="4 tokens came back for max_new_tokens=3"):
        cut_reply([1, 2, 3, 4], "length", None, eos, 3, "w")
    with pytest.raises(EngineError, match="finish_reason 'abort'"):
        cut_reply([1], "abort", None, eos, 3, "w")
    with pytest.raises(EngineError, match="not a list of integers"):
        cut_reply([1, "a"], "length", None, eos, 3, "w")


def test_prompt_seed():
    assert prompt_seed(7, 0, [1, 2]) == prompt_seed(7, 0, [1, 2])
    assert (
        len(
            {prompt_seed(7, 0, [1, 2]), prompt_seed(8, 0, [1, 2]), prompt_seed(7, 1, [1, 2]), prompt_seed(7, 0, [1, 3])}
        )
        == 4
    )
    assert all(0 <= prompt_seed(s, i, [i]) < 2**63 for s in (0, 2**40) for i in range(50))


def test_bad_options():
    with pytest.raises(ConfigError, match="regen.server.url must be an http"):
        ServedRegenConfig(url="gpu1:8000")
    with pytest.raises(ConfigError, match="regen.server.concurrency must be positive"):
        ServedRegenConfig(concurrency=0)
    with pytest.raises(ConfigError, match="regen.server.retries must be >= 0"):
        ServedRegenConfig(retries=-1)
    with pytest.raises(ConfigError, match="regen.backend for a served engine must be one of"):
        served_generate_batch([[1]], ServedRegenConfig(), greedy(), EOS, "tgi")


@pytest.mark.parametrize("backend", BACKENDS)
def test_prepare_through_a_served_engine_equals_transformers(backend, tmp_path, write_jsonl, prepare):
    """eagle3-prepare regenerate=true regen.backend=<engine>: the same dataset as regen.backend=hf."""
    rows = [{"messages": [{"role": "user", "content": t}]} for t in USER_TURNS[:5]]
    rows.append(
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "old"},
                {"role": "user", "content": "And now?"},
            ]
        }
    )  # two slots: the second sees the first
    data = write_jsonl(rows)
    regen = dict(max_new_tokens=MAX_NEW, batch_size=4)
    _, want = prepare(data, out="hf", regenerate=True, regen=RegenConfig(**regen))
    with BACKENDS[backend](build_tiny_model()) as server:
        _, got = prepare(
            data,
            out=backend,
            regenerate=True,
            regen=RegenConfig(**regen, backend=backend, server=server_cfg(server.url)),
        )
    assert got["input_ids"] == want["input_ids"] and got["loss_mask"] == want["loss_mask"]


def test_engine_address_is_not_an_output_option(tmp_path, write_jsonl, prepare):
    """Restarted against the engine on another port, a prepare keeps its finished chunks and output."""
    data = write_jsonl([{"messages": [{"role": "user", "content": t}]} for t in USER_TURNS[:3]])
    regen = dict(max_new_tokens=4, batch_size=4, backend="vllm")
    with StandinVllm(build_tiny_model()) as server:
        first, _ = prepare(data, out="p", regenerate=True, regen=RegenConfig(**regen, server=server_cfg(server.url)))
    with StandinVllm(build_tiny_model()) as other:  # another port, another concurrency: nothing to redo
        again, _ = prepare(
            data, out="p", regenerate=True, regen=RegenConfig(**regen, server=server_cfg(other.url, concurrency=7))
        )
        assert other.bodies == []
    assert again["fingerprint"] == first["fingerprint"]
