"""Export, check and eval on the tiny target: a head trained on the target's own generations,
served through the right config and through an off-by-one one."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_train.core.errors import BadInputError, ConfigError, ContractError
from eagle3_train.core.prompt_files import Conversation
from eagle3_train.evaluation.decoding import Counters, Decoded, Reference, SpecDecoder
from eagle3_train.evaluation.eval import EvalConfig, Evaluator, lossless_check, run_eval
from eagle3_train.evaluation.tree import TreeShape
from eagle3_train.model import DraftConfig
from eagle3_train.serving.check import CheckConfig, run_check
from eagle3_train.serving.export import ExportConfig, Exporter, draft_config_from_json, draft_config_json
from legacy_eval import LegacySpecDecoder
from test_tree_decoding import repeats_by_search

WORDS = ["apple", "river", "stone", "cloud", "seven", "tiger", "music", "paper", "green", "window", "quick", "silver"]


def evaluate(root, draft, engine="vllm"):
    return Evaluator(
        EvalConfig(
            draft=str(draft),
            target=str(root / "target"),
            engine=engine,
            prompts=str(root / "prompts.jsonl"),
            limit=10,
            max_new_tokens=48,
            progress=False,
            out=str(draft.parent / f"eval-{draft.name}-{engine}"),
        )
    ).run()


def off_by_one(root, name, edit):
    bad = root / name
    shutil.copytree(root / "export", bad, dirs_exist_ok=True)
    config = json.loads((bad / "config.json").read_text())
    edit(config)
    (bad / "config.json").write_text(json.dumps(config))
    return bad


@pytest.mark.slow
def test_export_layout(pipeline):
    config = json.loads((pipeline / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["eagle3_train"]["capture"]["aux_indices"] == [1, 2, 3]
    assert config["draft_vocab_size"] == 320 and config["target_hidden_size"] == 64
    names = set(load_file(str(pipeline / "export" / "model.safetensors")))
    assert "embed_tokens.weight" not in names and {"fc.weight", "d2t", "t2d", "lm_head.weight"} <= names


def test_eval_warns_when_the_chain_is_longer_than_training(pipeline):
    """The pipeline trains 3 TTT steps; export records it, and eval (k=5 by default) warns."""
    from eagle3_train.evaluation.eval import short_training_warning

    config = json.loads((pipeline / "export" / "config.json").read_text())
    assert config["eagle3_train"]["training"]["ttt_length"] == 3
    assert "trained with ttt_length=3 but drafts chains of k=5: draft positions 4..5" in short_training_warning(
        config, 5
    )
    assert short_training_warning(config, 3) is None
    assert "drafts trees of num_steps=4: draft positions 4..4" in short_training_warning(config, 4, tree=True)
    assert short_training_warning({"eagle3_train": {}}, 5) is None  # a config that does not say: no guess


def test_right_config_beats_off_by_one_and_both_are_lossless(pipeline):
    right = evaluate(pipeline, pipeline / "export")
    # vLLM's id 0 is the last layer's pre-norm output (the embedding tensor it keeps is updated in
    # place): eval feeds that, in id 0's slot, and says so
    wrong = evaluate(
        pipeline, off_by_one(pipeline, "wrong", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]))
    )
    assert right["captured_hf_indices"] == right["fed"] == [1, 2, 3] and right["warnings"] == []
    assert (wrong["captured_hf_indices"], wrong["fed"], wrong["pre_norm_final"]) == ([1, 2], [4, 1, 2], True)
    assert "vLLM's id 0 arrives overwritten" in wrong["warnings"][0]
    assert right["rule"] == "0.33.0 (V2 runner, the default)"  # vLLM's default runner decides what eval feeds
    assert right["lossless"] == wrong["lossless"] == "identical"  # fp32: token for token
    assert right["tau"] > wrong["tau"] + 0.2, (right["tau"], wrong["tau"])
    assert right["tau"] > 2.0
    assert (pipeline / "eval-export-vllm" / "acceptance.png").stat().st_size > 1000
    # SGLang reads the nested ids (+1): the same capture, the same result
    assert evaluate(pipeline, pipeline / "export", "sglang")["tau"] == pytest.approx(right["tau"])
    # run again unchanged: the report is reused, not recomputed
    again = evaluate(pipeline, pipeline / "export")
    assert again == json.loads((pipeline / "eval-export-vllm" / "report.json").read_text())
    assert again["target_seconds"] == right["target_seconds"]


def test_check_flags_what_engines_would_get_wrong(pipeline, said):
    run = lambda d, **kw: run_check(CheckConfig(draft=str(d), target=str(pipeline / "target"), **kw))  # noqa: E731
    assert run(pipeline / "export") == 0
    top_only = off_by_one(pipeline, "top_only", lambda c: c.pop("eagle_config"))
    assert run(top_only) == 1
    out = said()
    assert (
        "sglang 0.5.17, 0.5.23: no ids where it reads -> engine default" in out and "silently uses the default" in out
    )
    shifted = off_by_one(
        pipeline, "shifted", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    )
    assert run(shifted) == 1
    # SGLang's id 3 + 1 lands on N = 4: the pre-norm final state, which no HF index names
    assert "captures HF [2, 3] + the pre-norm final state (no HF index), the draft was trained on [1, 2, 3]" in said()
    zeros = off_by_one(pipeline, "zeros", lambda c: None)
    w = load_file(str(zeros / "model.safetensors"))
    w["d2t"] = torch.zeros(200, dtype=torch.int64)  # a 200-token draft vocab mapped to ids 0..199
    save_file(w, str(zeros / "model.safetensors"))
    assert run(zeros) == 1
    assert "d2t is all zeros" in said()
    # a third-party draft without our block: the user says what it was trained on
    foreign = off_by_one(pipeline, "foreign", lambda c: c.pop("eagle3_train"))
    assert run(foreign, trained=[1, 2, 3]) == 0 and run(foreign, trained=[2, 3]) == 1
    said()
    extra = off_by_one(
        pipeline, "extra", lambda c: None
    )  # a weight no engine's draft has (and embeddings, which they load)
    w = load_file(str(extra / "model.safetensors"))
    w["aux_norm.weight"], w["embed_tokens.weight"] = torch.ones(3), torch.zeros(2, 2)
    save_file(w, str(extra / "model.safetensors"))
    assert run(extra) == 1
    assert "weights ['aux_norm.weight'] are not part of the EAGLE-3 draft the engines build" in said()
    # against another target: the layers resolved OK there too, but the shapes say it is not the one
    assert run_check(CheckConfig(draft=str(pipeline / "export"), target="tiny:llama")) == 1
    out = said()
    assert "fc takes states of width 192, but 3 layers of this target (hidden 256) are 768 wide" in out
    assert "hidden_size 64 (trained) != 256 (this target)" in out and "vocab_size" not in out  # both have 320
    assert "the draft was trained against another target" in out and "num_hidden_layers 4 (trained) != 8" in out
    # the same shapes, another config (a quantized or re-saved copy looks like this): a warning only
    assert run_check(CheckConfig(draft=str(pipeline / "export"), target="tiny")) == 0
    assert "WARNING: the target's config differs from the one the draft was trained against" in said()


def test_bad_drafts(pipeline, tmp_path):
    with pytest.raises(BadInputError, match="lacks config.json or model.safetensors"):
        evaluate(pipeline, tmp_path)
    bad = off_by_one(pipeline, "outside", lambda c: None)
    w = load_file(str(bad / "model.safetensors"))
    w["d2t"][-1] = 1000
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(ContractError, match="d2t maps draft ids outside the target vocab"):
        evaluate(pipeline, bad)
    wide = off_by_one(pipeline, "wide", lambda c: c.update(hidden_size=128))
    with pytest.raises(ContractError, match="do not fit target"):
        evaluate(pipeline, wide)
    two = off_by_one(pipeline, "two_layers", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2]))
    with pytest.raises(ContractError, match="fc takes 192: the engine would fail"):
        evaluate(pipeline, two)
    pre_norm = evaluate(
        pipeline, off_by_one(pipeline, "pre_norm", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 4]))
    )
    assert (pre_norm["captured_hf_indices"], pre_norm["fed"]) == (
        [1, 2],
        [1, 2, 4],
    )  # vLLM's id N=4: not HF 4 (post-norm)
    assert "feeds the last layer's output before the final norm (an id lands on N=4)" in pre_norm["warnings"][0]
    with pytest.raises(ContractError, match="HF index 0 \\(the embeddings\\)"):
        state = json.loads(
            (pipeline / "train" / "checkpoints").glob("step*").__next__().joinpath("state.json").read_text()
        )
        state["capture"]["aux_indices"] = [0, 1, 2]
        ck = tmp_path / "ck"
        shutil.copytree(next((pipeline / "train" / "checkpoints").glob("step*")), ck)
        (ck / "state.json").write_text(json.dumps(state))
        Exporter(ExportConfig(run=str(ck), out=str(tmp_path / "x"), engines=["sglang"])).run()
    assert not (tmp_path / "x").exists()  # nothing written on refusal


# -- batched eval: the same tokens as the pre-batching decoder, multi-turn, lossless check --------


def evaluator(root, **options):
    cfg = (
        dict(
            draft=str(root / "export"),
            target=str(root / "target"),
            engine="vllm",
            limit=10,
            prompts=str(root / "prompts.jsonl"),
            max_new_tokens=48,
            progress=False,
        )
        | options
    )
    return Evaluator(EvalConfig(**cfg))


def first_turns(ev):
    return [ev.tokenize(c, 0, []) for c in ev.conversations()]


@pytest.mark.slow
def test_batched_decoding_equals_the_pre_batching_decoder(pipeline, tmp_path):
    """fp32: every batch size gives the old decoder's tokens and accepted counts, prompt by prompt;
    the batched greedy reference gives transformers' generate."""
    ev = evaluator(pipeline, limit=12)
    prompts = first_turns(ev)
    legacy = LegacySpecDecoder(ev.target, ev.draft, ev.layers, ev.cfg.k, ev.eos)
    want = [legacy.generate(p, 48) for p in prompts]
    assert len({a for _, acc in want for a in acc}) >= 4  # rows accept different counts
    for batch in (1, 5, 12):
        ev.decoder.counters = Counters()
        got = ev.decoder.speculative(prompts, 48, batch)
        assert [g.tokens for g in got] == [w[0] for w in want], batch
        assert [g.accepted for g in got] == [w[1] for w in want], batch
        assert (ev.decoder.counters.compactions > 0) == (batch > 1)  # batch 1 crops; batches compact
    refs = ev.decoder.greedy(prompts, 48, 5)
    assert [r.tokens for r in refs] == [legacy.greedy(p, 48) for p in prompts]
    # the report of a batched run: the old decoder's tau and tokens (its batch 1 is checked above),
    # identical to plain greedy
    seven = evaluator(pipeline, limit=12, batch_size=7, out=str(tmp_path / "b7")).run()
    steps = [a for _, acc in want for a in acc]
    assert seven["tau"] == (sum(steps) + len(steps)) / len(steps)
    assert seven["lossless"] == "identical"
    read = lambda d: [json.loads(x)["tokens"] for x in (tmp_path / d / "outputs.jsonl").read_text().splitlines()]  # noqa: E731
    assert read("b7") == [w[0] for w in want]


def test_draft_cost_per_step_is_flat_in_the_context(pipeline):
    """A verify step costs the draft the new columns (1 + accepted) and k-1 chain steps, whether the
    context is 30 or 900 tokens (the old decoder re-ran the whole context every step)."""
    ev = evaluator(pipeline)
    k = ev.cfg.k
    short = ev.tokenize(Conversation("short", "c", ["apple"]), 0, [])
    long = ev.tokenize(Conversation("long", "c", [" ".join(WORDS * 15)]), 0, [])
    assert len(long) > 25 * len(short) / 2
    for prompt in (short, long):
        ev.decoder.counters = Counters()
        out = ev.decoder.speculative([prompt], 48, 1)[0]
        c = ev.decoder.counters
        assert c.row_rounds == len(out.accepted) > 5
        assert c.draft_positions == sum(a + 1 + (k - 1) for a in out.accepted) <= 2 * k * c.row_rounds


def test_multi_turn_follows_the_targets_own_replies(pipeline, tmp_path):
    """MT-bench shape: turn 2 is asked after the target's greedy reply to turn 1 (rebuilt here with
    transformers' generate), and the report groups tau by category."""
    rows = [
        {"question_id": i, "category": cat, "turns": [u1, u2]}
        for i, (cat, u1, u2) in enumerate(
            [
                ("writing", "apple river stone", "seven tiger"),
                ("math", "cloud seven", "paper green window"),
                ("writing", "quick silver music", "apple"),
            ]
        )
    ]
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ev = evaluator(pipeline, prompts=str(path), out=str(tmp_path / "mt"), batch_size=2)
    report = ev.run()
    outputs = [json.loads(x) for x in (tmp_path / "mt" / "outputs.jsonl").read_text().splitlines()]
    legacy = LegacySpecDecoder(ev.target, ev.draft, ev.layers, ev.cfg.k, ev.eos)
    tok = ev.target.tokenizer

    def template(m: list[dict]) -> list[int]:
        return tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]

    for i, r in enumerate(rows):
        u1 = {"role": "user", "content": r["turns"][0]}
        first = legacy.greedy(template([u1]), 48)
        reply = tok.decode(first[:-1] if first[-1] in ev.eos else first)
        second = legacy.greedy(
            template([u1, {"role": "assistant", "content": reply}, {"role": "user", "content": r["turns"][1]}]), 48
        )
        got = {o["turn"]: o for o in outputs if o["source"] == f"{path}:{i + 1}"}
        assert got[1]["tokens"] == first and got[2]["tokens"] == second and got[1]["reply"] == reply
    assert report["conversations"] == 3 and report["prompts"] == 6 and set(report["turns"]) == {"1", "2"}
    assert report["lossless"] == "identical"
    for cat in ("writing", "math"):
        steps = [a for o in outputs if o["category"] == cat for a in o["accepted"]]
        assert report["categories"][cat]["tau"] == pytest.approx((sum(steps) + len(steps)) / len(steps))
    # τ by prompt length: every turn in the bucket its own prompt's length names, each bucket's τ over its turns
    from eagle3_train.evaluation.eval import length_bucket

    assert sum(v["prompts"] for v in report["prompt_lengths"].values()) == report["prompts"]
    for span, figures in report["prompt_lengths"].items():
        steps = [a for o in outputs if length_bucket(o["prompt_tokens"]) == span for a in o["accepted"]]
        assert figures["tau"] == pytest.approx((sum(steps) + len(steps)) / len(steps))
    assert (tmp_path / "mt" / "acceptance.png").stat().st_size > 1000


def test_prompt_length_buckets_name_their_edges_and_come_shortest_first():
    from types import SimpleNamespace

    from eagle3_train.evaluation.eval import by_prompt_length, length_bucket

    assert [length_bucket(n) for n in (0, 255, 256, 1023, 1024, 4095, 4096, 8192, 40000)] == [
        "<256",
        "<256",
        "256-1k",
        "256-1k",
        "1k-2k",
        "2k-4k",
        "4k-8k",
        "8k-16k",
        ">=32k",
    ]
    turns = [
        SimpleNamespace(prompt_tokens=n, tokens=[0] * 3, accepted=a) for n, a in ((5000, [0, 1]), (10, [4]), (300, [2]))
    ]
    report = by_prompt_length(turns, 5)  # type: ignore[arg-type]
    assert list(report) == ["<256", "256-1k", "4k-8k"]
    assert [report[s]["tau"] for s in report] == [5.0, 3.0, 1.5]


def test_tree_drafts_are_lossless_batch_invariant_and_accept_more(pipeline, tmp_path):
    """Trees verified in one target forward under the tree mask: topk=1 is the chain of the same
    depth, token for token and step for step; topk=4 gives plain greedy's tokens, the same tokens and
    accepted counts at batch 1 and 6, and accepts more per step than the chain (the trained draft
    agrees with the target often, and a tree holds its runner-up guesses too)."""
    ev = evaluator(pipeline, limit=6, k=4)
    prompts = first_turns(ev)
    refs = [r.tokens for r in ev.decoder.greedy(prompts, 48, 6)]
    chain = ev.decoder.speculative(prompts, 48, 6)
    tau = lambda out: sum(a + 1 for o in out for a in o.accepted) / sum(len(o.accepted) for o in out)  # noqa: E731
    for shape in (TreeShape(1, 5), TreeShape(4, 24)):
        dec = SpecDecoder(ev.target.model, ev.draft, ev.layers, 4, ev.eos, shape)
        got = {}
        for batch in (6, 1):
            dec.counters = Counters()
            got[batch] = dec.speculative(prompts, 48, batch)
        assert [o.tokens for o in got[1]] == [o.tokens for o in got[6]] == refs, shape
        assert [o.accepted for o in got[1]] == [o.accepted for o in got[6]], shape
        if shape.topk == 1:
            assert [o.accepted for o in got[1]] == [o.accepted for o in chain]
        else:
            assert tau(got[6]) > tau(chain) + 0.2, (tau(got[6]), tau(chain))
            # one row at a time: a round costs the draft its new columns and 3 frontier steps of 4 nodes
            assert dec.counters.draft_positions == sum(a + 1 + 3 * 4 for o in got[1] for a in o.accepted)
    # the report: the tree's settings, per-depth acceptance, lossless; tau by reply position is the
    # same verify steps regrouped, for trees and chains
    for options in (dict(topk=4, num_steps=4, num_draft_tokens=24), dict(k=4)):
        report = evaluator(pipeline, limit=6, position_bucket=8, out=str(tmp_path / str(len(options))), **options).run()
        assert report["lossless"] == "identical" and report["k"] == 4
        assert report["tree"] == (None if len(options) == 1 else {"topk": 4, "num_steps": 4, "num_draft_tokens": 24})
        steps = [
            json.loads(x)["accepted"] for x in (tmp_path / str(len(options)) / "outputs.jsonl").read_text().splitlines()
        ]
        assert report["tau"] == pytest.approx(tau([Decoded([], s) for s in steps]))
        buckets = report["by_reply_position"]
        assert [(b["from"], b["to"]) for b in buckets] == [(0, 8), (8, 16), (16, 32), (32, 64)]
        assert sum(b["verify_steps"] for b in buckets) == report["verify_steps"]
        assert sum(b["tokens"] for b in buckets) == sum(a + 1 for s in steps for a in s)
        assert sum(b["tau"] * b["verify_steps"] for b in buckets) == pytest.approx(
            report["tau"] * report["verify_steps"]
        )
        # the share of each stretch's tokens that repeat, from the replies the outputs file holds
        replies = [
            json.loads(x)["tokens"] for x in (tmp_path / str(len(options)) / "outputs.jsonl").read_text().splitlines()
        ]
        for b in buckets:
            flags = [r for t in replies for i, r in enumerate(repeats_by_search(t, 8)) if b["from"] <= i < b["to"]]
            assert b["repeated_share"] == pytest.approx(sum(flags) / len(flags)) and b["tokens_at_positions"] == len(
                flags
            )
        assert len(report["looping"]) == sum(b["repeated_share"] >= 0.5 for b in buckets)


def test_lossless_check_classifies_the_first_difference():
    ref = Reference([5, 6, 7, 8], [2.0, 1e-5, 3.0, 0.5])
    assert lossless_check([5, 6, 7, 8], ref, 1e-3) == {"status": "identical"}
    tie = lossless_check([5, 9, 7, 8], ref, 1e-3)
    assert (tie["status"], tie["position"], tie["margin"], tie["speculative_token"], tie["reference_token"]) == (
        "numerical",
        1,
        1e-5,
        9,
        6,
    )
    assert lossless_check([5, 6, 1], ref, 1e-3)["status"] == "diverged"
    # a margin on the threshold is a near-tie (bf16 margins come on a grid: 0.5 is a few units in the
    # last place); just past it is not
    assert lossless_check([5, 6, 7, 1], ref, 0.5)["status"] == "numerical"
    assert lossless_check([5, 6, 7, 1], ref, 0.4999)["status"] == "diverged"
    assert lossless_check([5, 6, 7, 8], Reference([5, 6, 7, 8, 2], [1.0] * 5), 1e-3)["position"] == 4


def perturbed(monkeypatch, edit):
    """Let ``edit(logits, speculative)`` change the target's logits as the decoders see them."""
    real = SpecDecoder.target_forward

    def target(self, ids, positions, valid, cache, aux, last_only=False):
        logits, states = real(self, ids, positions, valid, cache, aux, last_only)
        return edit(logits.clone(), aux), states  # aux: the speculative path (greedy never asks)

    monkeypatch.setattr(SpecDecoder, "target_forward", target)


def test_near_tie_is_numerical_and_a_corrupted_decoder_diverges(pipeline, tmp_path, monkeypatch):
    ev = evaluator(pipeline, limit=6)
    a = ev.decoder.greedy(first_turns(ev)[:1], 48, 1)[0].tokens[0]  # a token the target emits
    b = 300  # a token it never emits, made a's exact twin: plain greedy keeps a (the lower id) ...

    def tie(logits, speculative):  # ... while speculative decoding sees b ahead by 1e-5
        logits[..., b] = logits[..., a] + (1e-5 if speculative else 0.0)
        return logits

    perturbed(monkeypatch, tie)
    report = evaluator(pipeline, limit=6, out=str(tmp_path / "tie")).run()
    assert report["lossless"] == "numerical" and report["lossless_counts"]["numerical"] >= 1
    case = report["lossless_cases"][0]
    assert (case["margin"], case["reference_token"], case["speculative_token"]) == (0.0, a, b)
    assert report["lossless_counts"]["diverged"] == 0

    monkeypatch.undo()  # now a real bug: b pushed far ahead on the speculative path
    perturbed(
        monkeypatch, lambda logits, speculative: logits + 50.0 * speculative * (torch.arange(logits.shape[-1]) == b)
    )
    cfg = EvalConfig(
        draft=str(pipeline / "export"),
        target=str(pipeline / "target"),
        engine="vllm",
        limit=6,
        prompts=str(pipeline / "prompts.jsonl"),
        max_new_tokens=48,
        progress=False,
        out=str(tmp_path / "bad"),
    )
    assert run_eval(cfg) == 1
    report = json.loads((tmp_path / "bad" / "report.json").read_text())
    assert report["lossless"] == "diverged" and report["lossless_counts"]["diverged"] == 6
    assert all(
        c["position"] == 0 and c["speculative_token"] == b and c["margin"] > 1e-3 for c in report["lossless_cases"]
    )


def test_eval_writes_beside_the_export_by_default(pipeline):
    """Without out=, the report goes next to the draft, not into the directory engines load and
    users upload."""
    ev = Evaluator(
        EvalConfig(
            draft=str(pipeline / "export"),
            target=str(pipeline / "target"),
            engine="sglang",
            prompts=str(pipeline / "prompts.jsonl"),
            progress=False,
        )
    )
    assert ev.out == pipeline / "export-eval-sglang"


def test_bad_eval_input(pipeline, tmp_path):
    with pytest.raises(ConfigError, match="batch_size must be positive, got 0"):
        EvalConfig(draft="x", prompts="y", batch_size=0)
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "apple " * 700}) + "\n")
    with pytest.raises(
        BadInputError,
        match=r"long.jsonl:1: turn 1 is \d+ tokens; with max_new_tokens=48 and k=5 it "
        r"does not fit the target's context of 4096",
    ):
        evaluator(pipeline, prompts=str(path), out=str(tmp_path / "o")).run()


def test_config_json_maps_back_to_the_draft_config():
    """export writes config.json from a DraftConfig and eval reads it back through one pair of functions."""
    from transformers import LlamaConfig

    from eagle3_train.targets.tiny import tiny_config

    llama31 = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    for dc in (DraftConfig.from_target(tiny_config(), 3, 200), DraftConfig.from_target(llama31, 3, 32000)):
        assert draft_config_from_json(draft_config_json(dc), 3 * dc.target_hidden_size) == dc
    # a third-party config without rope_parameters, head_dim or draft_vocab_size
    old = {
        k: v
        for k, v in draft_config_json(DraftConfig.from_target(tiny_config(), 3, 320)).items()
        if k not in ("rope_parameters", "head_dim", "draft_vocab_size")
    }
    got = draft_config_from_json(old, 3 * 64)
    assert (got.head_dim, got.draft_vocab_size, got.rope_parameters) == (
        16,
        320,
        {"rope_theta": 10000.0, "rope_type": "default"},
    )


def card_commands(text):
    """The shell commands of a card's ```bash blocks, each split into words."""
    import re
    import shlex

    return [shlex.split(block) for block in re.findall(r"```bash\n(.*?)\n```", text, re.S)]


def parse_command(argv):
    """(engine name, {argument: value}) of a command line, parsed by the flags its engine module
    knows; ValueError for a program no engine has or a flag the engine does not take."""
    from eagle3_train.engines.registry import ENGINES

    for name, engine in ENGINES.items():
        if engine.command is not None and tuple(argv[: len(engine.command.program)]) == engine.command.program:
            return name, engine.command.parse(argv)
    raise ValueError(f"no engine starts with {argv[:3]}")


def test_the_export_is_ready_to_publish(pipeline, tmp_path):
    """An export holds its model card: the hub's front matter, the target and capture it was
    trained for, each engine's serve command (parsed back by the flags its engine module knows),
    and, once eval has run on these very files, their tau. No file names a local path; the
    weights say format pt."""
    import yaml
    from safetensors import safe_open

    from eagle3_train.serving.export import CardConfig

    out = tmp_path / "published"

    def export(**card):
        return Exporter(ExportConfig(run=str(pipeline / "train"), out=str(out), card=CardConfig(**card))).run()

    config = export(base_model="org/tiny-target")
    local = str(pipeline.parent)  # pytest's base directory: the run, the target and this export are under it
    for f in out.rglob("*"):
        assert local.encode() not in f.read_bytes(), f"{f.name} names a local path"
    assert config["eagle3_train"]["target"]["path"] == config["eagle3_train"]["capture"]["target"]["path"] == "target"
    with safe_open(str(out / "model.safetensors"), framework="pt") as st:
        assert st.metadata() == {"format": "pt"}
    text = (out / "README.md").read_text()
    meta = yaml.safe_load(text.split("---\n")[1])
    assert meta["base_model"] == "org/tiny-target" and meta["library_name"] == "eagle3_train"
    assert meta["license"] == "other" and {"eagle3", "speculative-decoding", "sglang", "vllm"} <= set(meta["tags"])
    identity = config["eagle3_train"]["target"]
    assert f"| `target` | `{identity['model_type']}` | 4 |" in text and identity["config_hash"] in text
    assert "HF indices `[1, 2, 3]`" in text
    assert "| `eagle_config.eagle_aux_hidden_state_layer_ids` | `[0, 1, 2]` | HF [1, 2, 3] |" in text  # SGLang's ids
    assert "| `eagle_aux_hidden_state_layer_ids` | `[1, 2, 3]` | HF [1, 2, 3] |" in text  # vLLM's
    commands = dict(parse_command(argv) for argv in card_commands(text))
    assert commands == {  # the trained 3 TTT steps drafted per step; the draft by its directory's name
        "vllm": {
            "model": "org/tiny-target",
            "--speculative-config": {"method": "eagle3", "model": "published", "num_speculative_tokens": 3},
        },
        "sglang": {
            "--model-path": "org/tiny-target",
            "--speculative-algorithm": "EAGLE3",
            "--speculative-draft-model-path": "published",
            "--speculative-num-steps": 3,
            "--speculative-eagle-topk": 1,
            "--speculative-num-draft-tokens": 4,
            # SGLang runs a draft in its own config's dtype: the export's, for both models, so a target
            # whose config names another dtype serves too (vLLM runs the draft in the target's)
            "--dtype": "bfloat16",
        },
    }
    with pytest.raises(ValueError, match="'--speculative-topk' is not a flag of python -m sglang.launch_server"):
        parse_command(card_commands(text)[0] + ["--speculative-topk", "1"])
    assert "No `eagle3-eval` report of these files" in text
    # eval beside the export (its default out), then the same export again: the card shows its tau
    report = Evaluator(
        EvalConfig(
            draft=str(out),
            target=str(pipeline / "target"),
            engine="sglang",
            limit=4,
            prompts=str(pipeline / "prompts.jsonl"),
            max_new_tokens=16,
            progress=False,
        )
    ).run()
    stale = tmp_path / "published-eval-vllm"  # a report of other files is not this draft's
    shutil.copytree(tmp_path / "published-eval-sglang", stale)
    (stale / "report.json").write_text(
        json.dumps(
            report
            | {
                "engine": "vllm",
                "request": report["request"] | {"draft": {"config.json": "0" * 64, "model.safetensors": "0" * 64}},
            }
        )
    )
    weights = (out / "model.safetensors").read_bytes()
    export(repo_id="org/tiny-draft", license="llama3.1")
    assert (out / "model.safetensors").read_bytes() == weights  # the same files eval measured
    text = (out / "README.md").read_text()
    accept = ", ".join(f"{a:.2f}" for a in report["acceptance_per_position"])
    assert f"| sglang | `prompts.jsonl` | 4 | 5 | {report['tau']:.2f} | {accept} | {report['lossless']} |" in text
    assert "| vllm |" not in text and "No `eagle3-eval` report" not in text
    assert yaml.safe_load(text.split("---\n")[1])["license"] == "llama3.1"
    commands = dict(parse_command(argv) for argv in card_commands(text))
    assert commands["sglang"]["--speculative-draft-model-path"] == "org/tiny-draft"
    assert commands["vllm"]["--speculative-config"]["model"] == "org/tiny-draft"
    for f in out.rglob("*"):
        assert local.encode() not in f.read_bytes(), f"{f.name} names a local path"


@pytest.mark.slow
def test_graph_decoder_equals_the_eager_decoder(pipeline, tmp_path):
    """decoder=graph (static caches; on the CPU its rounds run eagerly): the eager decoder's tokens and
    accepted counts at every batch size, fp32; its plain greedy gives the model's own greedy."""
    from eagle3_train.evaluation.graph_spec import GraphSpecDecoder

    ev = evaluator(pipeline, limit=12)
    prompts = first_turns(ev)
    want = ev.decoder.speculative(prompts, 48, 12)
    assert len({a for w in want for a in w.accepted}) >= 4  # rows accept different counts
    fast = GraphSpecDecoder(ev.target.model, ev.draft, ev.layers, ev.cfg.k, ev.eos)
    for batch, n in ((1, 4), (5, 12), (12, 12)):  # one row alone (the first 4 prompts), mixed batches
        got = fast.speculative(prompts[:n], 48, batch)
        assert [g.tokens for g in got] == [w.tokens for w in want[:n]], batch
        assert [g.accepted for g in got] == [w.accepted for w in want[:n]], batch
    # a later batch of a kept shape reuses its buffers (and on a GPU its captured round), reset in place
    made = fast.states_made
    assert made < 4 + 3 + 1 and len(fast.rounds) == made  # 8 batches so far, fewer shapes
    assert fast.speculative(prompts, 48, 5) == want and fast.states_made == made
    lean = GraphSpecDecoder(ev.target.model, ev.draft, ev.layers, ev.cfg.k, ev.eos, graph_bytes=0)
    assert lean.speculative(prompts, 48, 5) == want and len(lean.rounds) == 1  # only the last shape kept
    assert [g.tokens for g in fast.greedy(prompts, 48, 5)] == [r.tokens for r in ev.decoder.greedy(prompts, 48, 12)]
    for m in (1, 2):  # replies shorter than a round
        assert fast.speculative(prompts, m, 5) == ev.decoder.speculative(prompts, m, 5), m
    # an end token as some rows' first token, and as a token others reach mid-reply
    eos = ev.eos | {want[0].tokens[0], want[1].tokens[5]}
    ends = SpecDecoder(ev.target.model, ev.draft, ev.layers, ev.cfg.k, eos).speculative(prompts, 48, 12)
    assert GraphSpecDecoder(ev.target.model, ev.draft, ev.layers, ev.cfg.k, eos).speculative(prompts, 48, 5) == ends
    assert len(ends[0].tokens) == 1 and len(ends[1].tokens) <= 6
    report = evaluator(pipeline, limit=12, batch_size=5, decoder="graph", out=str(tmp_path / "g")).run()
    steps = [a for w in want for a in w.accepted]
    assert report["decoder"] == "graph" and report["lossless"] == "identical"
    assert report["timed_greedy_equals_reference"] == 12 and report["draft_seconds"] is None
    assert report["tau"] == (sum(steps) + len(steps)) / len(steps)


def test_graph_decoder_refusals():
    """decoder=graph decodes chains of dense targets; anything else is refused up front, naming the way out."""
    from types import SimpleNamespace

    from eagle3_train.evaluation.eval import EvalConfig
    from eagle3_train.evaluation.graph_spec import GraphSpecDecoder

    with pytest.raises(ConfigError, match="decoder must be eager or graph"):
        EvalConfig(draft="d", prompts="p", decoder="fast")
    with pytest.raises(ConfigError, match="tree drafts run with decoder=eager"):
        EvalConfig(draft="d", prompts="p", decoder="graph", topk=4, num_draft_tokens=16)
    moe = SimpleNamespace(config=SimpleNamespace(model_type="qwen3_moe"))
    with pytest.raises(ConfigError, match="not model_type 'qwen3_moe'; use decoder=eager"):
        GraphSpecDecoder(moe, None, [1], 5, {0})  # type: ignore[arg-type]


def test_graph_round_never_reads_a_value_on_the_host():
    """What a CUDA graph captures must not wait for a value on the host (a sync breaks capture). On
    meta tensors every op runs but any read of a value fails: one speculative round and one greedy
    round run there."""
    from eagle3_train.evaluation.graph_spec import GraphSpecDecoder
    from eagle3_train.model import Eagle3Draft
    from eagle3_train.targets.tiny import build_tiny_model, tiny_config

    model = build_tiny_model().eval()
    draft = Eagle3Draft(DraftConfig.from_target(tiny_config(), num_aux=3, draft_vocab_size=48)).eval()
    dec = GraphSpecDecoder(model, draft, [1, 2, 4], 3, {5})
    states = {k: dec._kept(2, 128, 64, k, 16, torch.tensor([10, 20]))[0] for k in (3, 0)}
    model.to("meta"), draft.to("meta")
    dec.eos_ids = dec.eos_ids.to("meta")
    for k, state in states.items():
        s = {name: t.to("meta") for name, t in state.items()}
        dec._round(s, k, 16)
        with pytest.raises(RuntimeError, match="meta"):  # the check bites: a host read fails here
            bool(s["done"].all())
