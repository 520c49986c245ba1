"""What a run cannot learn from is said, counted, with the option that helps: too few optimizer
steps, samples cut at max_length, replies cut at regen.max_new_tokens, and reasoning in replies
where the template renders with thinking off (one rule for inline reasoning and reasoning fields)."""

import json

import pytest

from chat_fixtures import FIXTURES, fixture_tokenizer
from data_prep.chat import reasoning_when_off, thinking_off
from data_prep.prepare import PrepareConfig, Preparer
from data_prep.regenerate import RegenConfig
from eagle3_train.core.errors import ConfigError
from eagle3_train.targets import set_template_kwargs  # as load_target sets the flags
from test_reasoning import target_dir
from test_trainer import std, train  # noqa: F401  (std: the module's standardized data)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

QUESTION = {"role": "user", "content": "What is 2+3?"}
INLINE = {"role": "assistant", "content": "<think>\nAdd two and three.\n</think>\n\nIt is 5."}
FIELD = {"role": "assistant", "content": "It is 5.", "reasoning_content": "Add two and three."}
PLAIN = {"role": "assistant", "content": "It is 5."}


def prepare(root, target, rows, **opts):
    path = root / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = PrepareConfig(target=target, input=str(path), out=str(root / "prep"), progress=False, **opts)
    return Preparer(config).run()


def test_thinking_off_is_found_by_rendering_the_request():
    qwen3 = fixture_tokenizer(FIXTURES["qwen3"])
    assert not thinking_off(qwen3, ("<think>", "</think>"))
    set_template_kwargs(qwen3, {"enable_thinking": False})
    assert thinking_off(qwen3, ("<think>", "</think>"))
    assert not thinking_off(qwen3, None)
    set_template_kwargs(qwen3, {"enable_thinking": True})
    assert not thinking_off(qwen3, ("<think>", "</think>"))


@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_inline_reasoning_and_a_reasoning_field_follow_one_rule(policy):
    markers = ("<think>", "</think>")
    out, n = reasoning_when_off([QUESTION, INLINE, QUESTION, FIELD, QUESTION, PLAIN], markers, policy)
    assert n == 2 and out[5] == PLAIN
    want = "It is 5." if policy == "drop" else "<think>\nAdd two and three.\n</think>\n\nIt is 5."
    assert out[1] == out[3] == {"role": "assistant", "content": want}


def test_reasoning_with_thinking_off_is_dropped_counted_and_warned(tmp_path, said):
    f = FIXTURES["qwen3"]
    target = target_dir(tmp_path, f)
    rows = [{"messages": [QUESTION, INLINE]}, {"messages": [QUESTION, FIELD]}, {"messages": [QUESTION, PLAIN]}]
    off = {"enable_thinking": False}
    manifest = prepare(tmp_path, target, rows, chat_template_kwargs=off)
    assert manifest["counts"]["reasoning_with_thinking_off"] == 2
    text = said()
    assert "warning: 2 replies carry reasoning" in text and "reasoning_off=keep would keep it" in text
    from datasets import load_from_disk

    tok = fixture_tokenizer(f)
    ds = load_from_disk(str(tmp_path / "prep" / "dataset"))
    trained = [tok.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]) for r in ds]
    assert trained == ["It is 5.<|im_end|>"] * 3  # as the engine with thinking off writes them
    kept = prepare(tmp_path, target, rows, chat_template_kwargs=off, reasoning_off="keep", overwrite=True)
    assert kept["counts"]["reasoning_with_thinking_off"] == 2
    ds = load_from_disk(str(tmp_path / "prep" / "dataset"))
    trained = [tok.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]) for r in ds]
    assert trained[0] == trained[1] == "<think>\nAdd two and three.\n</think>\n\nIt is 5.<|im_end|>"
    # thinking on: the rule does not apply, and nothing is counted
    on = prepare(tmp_path, target, rows, chat_template_kwargs={"enable_thinking": True}, overwrite=True)
    assert "reasoning_with_thinking_off" not in on["counts"]
    with pytest.raises(ConfigError, match="reasoning_off must be one of"):
        PrepareConfig(input="x", out="y", reasoning_off="maybe")


def test_most_samples_cut_at_max_length_and_replies_at_max_new_tokens_are_warned(tmp_path, said):
    said()
    long = {"role": "assistant", "content": "word " * 40}
    rows = [{"messages": [{"role": "user", "content": "hi"}, long]}] * 3 + [{"messages": [QUESTION, PLAIN]}]
    prepare(tmp_path, "tiny", rows, max_length=64)
    assert "warning: 3 of 4 samples (75%) were cut at max_length=64" in said()
    rows = [{"messages": [{"role": "user", "content": w}]} for w in ("alpha", "beta", "gamma")]
    manifest = prepare(
        tmp_path, "tiny", rows, regenerate=True, regen=RegenConfig(max_new_tokens=4), overwrite=True, max_length=64
    )
    hit = manifest["regeneration"]["turns_hit_max_new_tokens"]
    assert hit >= 2 and f"warning: {hit} of 3 regenerated replies" in said()


def test_a_run_of_few_optimizer_steps_is_warned_with_what_helps(std, tmp_path, said):  # noqa: F811
    said()
    train(std, tmp_path / "few", max_steps=None)
    text = said()
    assert "warning: this run makes only" in text and "loop.min_steps=200" in text
    train(std, tmp_path / "asked", max_steps=2)  # loop.max_steps asked for few: no warning
    assert "warning: this run makes only" not in said()
