"""Reasoning targets: chat-template flags, conversations rendered as the engine serves each turn,
reasoning kept, dropped or cut, tau inside reasoning and inside the answer.

The six template families of tests/chat_fixtures.py (Qwen3, DeepSeek-R1, DeepSeek-V3.1, gpt-oss,
Llama-3.1, Kimi-K2-Thinking) are checked against an independent reference: the request rendered
afresh for each turn by the template itself, followed by the reply written out by hand from the
family's documentation.
"""

import json

import numpy as np
import pytest

from chat_fixtures import FIXTURES, conversation, fixture_tokenizer
from data_prep.chat import render_conversation, special_ids
from data_prep.conversations import normalize
from data_prep.prepare import PrepareConfig, Preparer
from eagle3_train.core.errors import ConfigError, Eagle3Error
from eagle3_train.core.reasoning import kwargs_warning, markers_for, reasoning_tokens
from eagle3_train.core.split import TURN_SHIFT, split_eval
from eagle3_train.targets import set_template_kwargs
from eagle3_train.targets.tiny import save_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

CASES = [(name, i) for name, f in FIXTURES.items() for i in range(len(f.kwargs_variants))]
THINK = ["Add two and three.", "Five times four."]
ANSWER = ["It is 5.", "It is 20."]


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def fresh_request(tok, messages, kwargs):
    """The request for the turn after ``messages``, rendered afresh by the template."""
    return ids(tok, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs))


def end_ids(tok, f):
    return special_ids(tok, {tok.convert_tokens_to_ids(e) for e in f.eos})


@pytest.mark.parametrize("name,variant", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_every_trained_token_is_a_fresh_render_of_the_served_request(name, variant):
    """Each family, each flag setting: the samples' ids are the request the engine renders for
    that turn followed by the reply the model writes; the loss covers exactly that reply."""
    f = FIXTURES[name]
    kwargs = f.kwargs_variants[variant]
    tok = fixture_tokenizer(f)
    set_template_kwargs(tok, kwargs)
    messages = normalize(conversation(f, reasoning=f.markers is not None), "c.jsonl:1").messages
    samples, cost = render_conversation(
        tok, messages, "c.jsonl:1", max_length=4096, truncate=False, end_ids=end_ids(tok, f)
    )
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    expected = [
        (
            fresh_request(tok, messages[:i], kwargs),
            ids(tok, f.reply(THINK[n] if f.markers else None, ANSWER[n], kwargs)),
        )
        for n, i in enumerate(turns)
    ]
    if f.rewrites_history:
        assert [s.turn for s in samples] == [0, 1]
        for s, (request, reply) in zip(samples, expected):
            assert s.rendered.input_ids.tolist() == request + reply
            assert s.rendered.loss_mask.tolist() == [0] * len(request) + [1] * len(reply)
        assert cost["tokens"] == sum(len(a) + len(b) for a, b in expected)
        assert 0 < cost["shared_prefix_tokens"] < len(expected[1][0])
        second = tok.decode(samples[1].rendered.input_ids)
        assert THINK[0] not in second  # turn 1's reasoning is not in turn 2's context
        if THINK[1] in f.reply(THINK[1], ANSWER[1], kwargs):
            assert THINK[1] in second
    else:  # one sample, each turn's request and reply a prefix of it, the loss on the replies alone
        (s,) = samples
        got, mask = s.rendered.input_ids.tolist(), s.rendered.loss_mask.tolist()
        for request, reply in expected:
            assert got[: len(request) + len(reply)] == request + reply
            assert all(mask[len(request) : len(request) + len(reply)])
        assert sum(mask) == sum(len(reply) for _, reply in expected)


def test_a_template_that_never_renders_a_separate_reasoning_field_is_refused_by_row():
    """DeepSeek-V3.1's template renders no reasoning_content: with thinking on, the reply cannot
    be derived from it, and the row says to give the reasoning inline."""
    f = FIXTURES["deepseek_v3_1"]
    tok = fixture_tokenizer(f)
    set_template_kwargs(tok, {"thinking": True})
    messages = normalize(
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
            ]
        },
        "c.jsonl:3",
    ).messages
    with pytest.raises(Eagle3Error, match=r"c.jsonl:3.*reasoning_content.*inline.*template_drops_reasoning"):
        render_conversation(tok, messages, "c.jsonl:3", max_length=512, truncate=False, end_ids=end_ids(tok, f))


def target_dir(root, f):
    """A tiny target of ``f``'s family saved with ``f``'s tokenizer and template, as a user's model."""
    out = save_tiny(f"tiny:{f.family}", root / f"target-{f.name}", dtype="float32")
    fixture_tokenizer(f).save_pretrained(out)
    return str(out)


def prepare(root, target, rows, **opts):
    path = root / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Preparer(PrepareConfig(target=target, input=str(path), out=str(root / "prep"), progress=False, **opts)).run()


def test_two_turn_reasoning_prepares_per_turn_with_the_flags_recorded(tmp_path):
    """The issue's case: a Qwen3-style template that drops earlier reasoning, two turns with
    reasoning in both replies. Each turn is its own sample (ids: the conversation's, turn above bit
    56), turn 2 holds turn 2's reasoning and not turn 1's, the flags are in the target identity."""
    f = FIXTURES["qwen3"]
    target = target_dir(tmp_path, f)
    manifest = prepare(tmp_path, target, [conversation(f)] * 3, chat_template_kwargs={"enable_thinking": True})
    from datasets import load_from_disk

    ds = load_from_disk(str(tmp_path / "prep" / "dataset"))
    assert ds["sample_id"] == [0, 1 << TURN_SHIFT, 1, 1 + (1 << TURN_SHIFT), 2, 2 + (1 << TURN_SHIFT)]
    assert ds["source"][:2] == [f"{tmp_path}/chats.jsonl:1 turn 1", f"{tmp_path}/chats.jsonl:1 turn 2"]
    tok = fixture_tokenizer(f)
    second = tok.decode(ds[1]["input_ids"])
    assert THINK[1] in second and THINK[0] not in second
    assert tok.decode([t for t, m in zip(ds[1]["input_ids"], ds[1]["loss_mask"]) if m]) == (
        f"<think>\n{THINK[1]}\n</think>\n\n{ANSWER[1]}<|im_end|>"
    )
    assert manifest["target"]["chat_template_kwargs"] == {"enable_thinking": True}
    per_turn = manifest["counts"]["per_turn"]
    assert per_turn["conversations"] == 3 and per_turn["samples"] == 6
    assert per_turn["tokens"] == sum(len(x) for x in ds["input_ids"]) > per_turn["tokens_whole"] * 1.3
    # the flags decide the output: other flags are another preparation
    with pytest.raises(Eagle3Error, match="overwrite"):
        prepare(tmp_path, target, [conversation(f)] * 3, chat_template_kwargs={"enable_thinking": False})
    # render=whole refuses the conversation, saying why and what to do
    with pytest.raises(Eagle3Error, match=r"chats.jsonl:1.*render=auto.*template_rewrites_history"):
        prepare(tmp_path, target, [conversation(f)], render="whole", overwrite=True)


def test_turn_samples_share_their_conversations_split():
    base = np.arange(400, dtype=np.int64)
    ids_ = np.concatenate([base + (t << TURN_SHIFT) for t in range(3)])
    held = split_eval(ids_, 0.1, 0)
    conv = held & ((1 << 48) - 1)
    assert len(held) == 3 * len(np.unique(conv))  # every turn of a held-out conversation, none of the others


def test_flags_must_be_a_mapping():
    with pytest.raises(ConfigError, match=r"chat_template_kwargs must be a mapping"):
        PrepareConfig(input="x.jsonl", out="o", chat_template_kwargs="enable_thinking")


@pytest.mark.parametrize(
    "name,prompt_tail,reply,reasoning",
    [
        ("qwen3", "<|im_start|>assistant\n", "<think>\nab\n</think>\n\nxy<|im_end|>", "<think>\nab\n</think>"),
        ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "xy<|im_end|>", ""),  # thinking off
        ("qwen3", "<|im_start|>assistant\n", "xy<|im_end|>", ""),  # no reasoning written
        ("deepseek_r1", "<｜Assistant｜><think>\n", "ab\n</think>\n\nxy<｜end▁of▁sentence｜>", "ab\n</think>"),
        ("deepseek_r1", "<｜Assistant｜><think>\n", "abcdef", "abcdef"),  # cut off inside its reasoning
        (
            "gpt_oss",
            "<|start|>assistant",
            "<|channel|>analysis<|message|>ab<|end|><|start|>assistant<|channel|>final<|message|>x<|return|>",
            "<|channel|>analysis<|message|>ab<|end|>",
        ),
    ],
)
def test_reasoning_tokens_end_at_the_end_marker(name, prompt_tail, reply, reasoning):
    f = FIXTURES[name]
    tok = fixture_tokenizer(f)
    markers = markers_for(f.template, None)
    assert markers == f.markers
    reply_ids = ids(tok, reply)
    got = reasoning_tokens(tok, ids(tok, prompt_tail), reply_ids, markers)
    assert tok.decode(reply_ids[:got]) == reasoning


def test_flag_differences_are_named():
    assert kwargs_warning({"enable_thinking": True}, {"enable_thinking": True}, "eval") is None
    text = kwargs_warning({"enable_thinking": True}, {"enable_thinking": False}, "eagle3-eval")
    assert "enable_thinking: trained true != false" in text
    assert "thinking: trained null != true" in kwargs_warning({}, {"thinking": True}, "serving")


def drafted(root, f, kwargs):
    """A tiny target of ``f``'s family and template, its two-turn conversations prepared with
    ``kwargs`` (per turn where the template rewrites history), a draft trained online and exported."""
    from eagle3_train.serving.export import ExportConfig, Exporter
    from eagle3_train.training.online import PreparedConfig
    from test_trainer import train

    target = target_dir(root, f)
    rows = [conversation(f, reasoning=f.markers is not None) for _ in range(8)]
    prepare(root, target, rows, chat_template_kwargs=kwargs)
    online = PreparedConfig(aux_indices=[2, 4, 5], draft_vocab_size=320, eval_fraction=0.0)
    train(root / "prep", root / "train", target=target, source="online", prepared=online, epochs=1)
    Exporter(ExportConfig(run=str(root / "train"), out=str(root / "export"))).run()
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": ["What is 2+3?", f"And times {n}?"]}) + "\n" for n in range(4)))
    return target, prompts


def evaluate(root, target, prompts, name, **opts):
    from eagle3_train.evaluation.eval import EvalConfig, Evaluator

    return Evaluator(
        EvalConfig(
            draft=str(root / "export"),
            target=target,
            engine="vllm",
            prompts=str(prompts),
            max_new_tokens=12,
            batch_size=4,
            k=3,
            progress=False,
            plot=False,
            out=str(root / name),
            **opts,
        )  # fmt: skip
    ).run()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FIXTURES))
def test_eval_is_lossless_with_the_trained_flags_and_warns_on_others(name, tmp_path):
    """Every family through prepare (its flags) -> online training -> export -> eval: eval renders
    with the flags the draft was trained on unless told otherwise, stays lossless, splits tau into
    reasoning and answer where the template has reasoning markers, and warns on other flags."""
    f = FIXTURES[name]
    kwargs = f.kwargs_variants[-1]
    target, prompts = drafted(tmp_path, f, kwargs)
    report = evaluate(tmp_path, target, prompts, "eval")
    assert report["lossless"] == "identical" and report["prompts"] == 8
    assert report["chat_template_kwargs"] == kwargs and report["warnings"] == []
    region = report["by_region"]
    if f.markers is None:
        assert region is None
    else:
        assert region["markers"] == list(f.markers)
        assert region["reasoning"]["tokens"] + region["answer"]["tokens"] == report["tokens"]
        steps = region["reasoning"]["verify_steps"] + region["answer"]["verify_steps"]
        assert steps == report["verify_steps"]
        if name == "deepseek_r1":  # its prompt opens <think>: the tiny target never closes it
            assert region["answer"]["tokens"] == 0 and region["reasoning"]["tau"] == pytest.approx(report["tau"])
    if name in ("qwen3", "gpt_oss"):  # other flags (the warning does not depend on the family)
        other = {"enable_thinking": True} if name == "qwen3" else {"reasoning_effort": "low"}
        flipped = evaluate(tmp_path, target, prompts, "eval-flipped", chat_template_kwargs=other)
        assert flipped["lossless"] == "identical" and flipped["chat_template_kwargs"] == other
        assert any("chat_template_kwargs" in w and "trained" in w for w in flipped["warnings"])


def test_check_and_served_acceptance_compare_the_flags_with_the_drafts(tmp_path, said):
    """eagle3-check names flags that differ from training's; served acceptance sends the draft's
    training flags by default (the engine renders the same request prepare did) and warns on others."""
    from eagle3_train.evaluation.served_acceptance import ServedAcceptance, ServedAcceptanceConfig
    from eagle3_train.serving.check import CheckConfig, ServingConfig, run_check
    from eagle3_train.targets import load_target
    from eagle3_train.targets.tiny import build_tiny_model
    from standin_engines import StandinVllm

    f = FIXTURES["qwen3"]
    trained = {"enable_thinking": False}
    target, prompts = drafted(tmp_path, f, trained)
    draft = str(tmp_path / "export")
    said()
    assert run_check(CheckConfig(draft=draft, target=target, serving=ServingConfig(chat_template_kwargs=trained))) == 0
    text = said()
    assert 'chat_template_kwargs {"enable_thinking": false}' in text and "trained false" not in text
    assert run_check(CheckConfig(draft=draft, target=target, serving=ServingConfig(chat_template_kwargs={}))) == 0
    assert "enable_thinking: trained false != null" in said()
    readme = (tmp_path / "export" / "README.md").read_text()
    assert '`chat_template_kwargs` `{"enable_thinking": false}`' in readme

    tok = load_target(target, cache_dir=None, load_model=False).tokenizer
    spec = {"method": "eagle3", "model": "unused-with-a-plan", "num_speculative_tokens": 3}
    for flags, warned in ((None, False), ({"enable_thinking": True}, True)):
        with StandinVllm(build_tiny_model(), tokenizer=tok, speculative=spec, accepted_plan=lambda m: [1]) as server:
            cfg = ServedAcceptanceConfig(
                server=server.url, prompts=str(prompts), out=str(tmp_path / f"acc-{warned}"), max_new_tokens=4,
                settle_s=0.01, draft=draft, chat_template_kwargs=flags,
            )  # fmt: skip
            report = ServedAcceptance(cfg).run()
            sent = [b.get("chat_template_kwargs") for b in server.bodies if "messages" in b]
            first = [
                p
                for p, b in zip(server.prompts, [b for b in server.bodies if "messages" in b])
                if len(b["messages"]) == 1
            ]
        want = flags if flags is not None else trained
        assert sent == [want] * 8 and report.chat_template_kwargs == want
        request = tok.apply_chat_template(
            [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True, **want
        )
        assert first and all(p == ids(tok, request) for p in first)
        assert request.endswith("<think>\n\n</think>\n\n") == (want == trained)
        assert any("enable_thinking: trained false != true" in w for w in report.warnings) == warned


def test_replies_cut_inside_their_reasoning_are_counted_and_dropped_or_kept(tmp_path):
    """DeepSeek-R1's generation prompt opens <think>; the tiny target never closes it, so every
    regenerated reply that hits regen.max_new_tokens is cut inside its reasoning: counted, and its
    conversation dropped (a bad row) unless regen.cut_in_reasoning=keep."""
    from data_prep.regenerate import RegenConfig

    f = FIXTURES["deepseek_r1"]
    target = target_dir(tmp_path, f)
    rows = [{"messages": [{"role": "user", "content": w}]} for w in ("alpha", "beta", "gamma")]
    kept = prepare(
        tmp_path, target, rows, regenerate=True, regen=RegenConfig(max_new_tokens=6, cut_in_reasoning="keep")
    )
    assert kept["regeneration"]["conversations_cut_in_reasoning"] == 3 and kept["counts"]["rows_written"] == 3
    with pytest.raises(Eagle3Error, match=r"(?s)no usable conversation.*cut_in_reasoning: 3"):
        prepare(
            tmp_path,
            target,
            rows,
            regenerate=True,
            regen=RegenConfig(max_new_tokens=6),
            on_bad_row="skip",
            overwrite=True,
        )
    # the same target under a template whose prompt opens no reasoning: nothing is cut inside it
    g = FIXTURES["qwen3"]
    other = target_dir(tmp_path, g)
    clean = prepare(
        tmp_path, other, rows, regenerate=True, regen=RegenConfig(max_new_tokens=6), overwrite=True,
        chat_template_kwargs={"enable_thinking": False},
    )  # fmt: skip
    assert clean["regeneration"]["conversations_cut_in_reasoning"] == 0 and clean["counts"]["rows_written"] == 3
