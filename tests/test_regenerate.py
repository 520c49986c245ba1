"""Regeneration writes every assistant turn with the target's own greedy output."""

import pytest
import torch

from conftest import LLAMA3_TEMPLATE
from data_prep.regenerate import RegenConfig, assistant_slots
from eagle3_train.core.errors import ConfigError
from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer

ROWS = [
    {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "old reply"},
            {"role": "user", "content": "And then?"},
            {"role": "assistant", "content": "old"},
        ]
    },
    {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Tell me a story."}]},
    {"messages": [{"role": "user", "content": "one"}, {"role": "user", "content": "two, longer prompt"}]},
]
MAX_NEW = 10
EOS = [259, 262, 257]  # <|im_end|>, <|eot_id|>, <|end_of_text|> of the tiny tokenizer


def direct_generate(model, tok, messages):
    """Plain batch-of-one greedy generate, decoded the way any user would."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=EOS, pad_token_id=263)
    reply = out[0, ids["input_ids"].shape[1] :].tolist()
    reply = reply[: next((i for i, t in enumerate(reply) if t in EOS), len(reply))]  # up to the end of turn
    return tok.decode(reply, skip_special_tokens=False).strip()


def test_assistant_slots():
    msgs, slots = assistant_slots(ROWS[2]["messages"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"] and slots == [1, 3]
    msgs, slots = assistant_slots(ROWS[0]["messages"])
    assert len(msgs) == 4 and slots == [1, 3]


def test_regeneration_matches_direct_generate(write_jsonl, prepare):
    manifest, ds = prepare(
        write_jsonl(ROWS),
        chat_template=LLAMA3_TEMPLATE,
        regenerate=True,
        regen=RegenConfig(max_new_tokens=MAX_NEW, batch_size=2),
    )
    assert manifest["regeneration"]["turns_hit_max_new_tokens"] >= 0
    tok = build_tiny_tokenizer(LLAMA3_TEMPLATE)
    model = build_tiny_model()
    with torch.no_grad():
        for row, ids in zip(ROWS, ds["input_ids"]):
            # replay the conversation turn by turn with direct generate calls
            msgs, slots = assistant_slots(row["messages"])
            for s in slots:
                msgs[s]["content"] = direct_generate(model, tok, msgs[:s])
            assert all(msgs[s]["content"] != "old reply" for s in slots)
            want = tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
            assert ids == want


def test_regeneration_chunks_resume(tmp_path, write_jsonl, prepare):
    path = write_jsonl(ROWS)
    opts = dict(regenerate=True, regen=RegenConfig(max_new_tokens=MAX_NEW, chunk_size=2), chat_template=LLAMA3_TEMPLATE)
    _, first = prepare(path, **opts)
    chunks = sorted(p.name for p in (tmp_path / "prepared" / "regen").glob("chunk-*.json"))
    assert chunks == ["chunk-00000.json", "chunk-00001.json"]
    # a crash after the chunks but before the manifest: the rerun takes the chunks from disk
    (tmp_path / "prepared" / "manifest.json").unlink()
    (tmp_path / "prepared" / "regen" / "chunk-00000.json").write_text(
        (tmp_path / "prepared" / "regen" / "chunk-00000.json").read_text().replace('"Hi"', '"Hi!"')
    )
    _, second = prepare(path, **opts)
    assert second["input_ids"][1:] == first["input_ids"][1:]
    assert second["input_ids"][0] != first["input_ids"][0]  # the edited chunk was read, not regenerated


def test_continuous_and_static_batching_equal_padded_batches():
    """regen.batching=continuous (transformers' generate_batch) and static (a static KV cache, full
    batches, widths rounded up) give the greedy replies of padded,
    length-sorted model.generate batches, in the prompts' order, cut at the first end-of-turn token,
    with the same count of replies that hit max_new_tokens."""
    from data_prep.regenerate import generate_sorted

    model = build_tiny_model().eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (5, 19, 9, 13, 7, 3)]
    eos = [101, 277]  # tokens the tiny model emits early in some replies
    padded = generate_sorted(model, prompts, RegenConfig(max_new_tokens=10, batch_size=4), eos, 0)
    continuous = generate_sorted(
        model, prompts, RegenConfig(max_new_tokens=10, batch_size=4, batching="continuous"), eos, 0
    )
    assert continuous == padded
    static = generate_sorted(model, prompts, RegenConfig(max_new_tokens=10, batch_size=4, batching="static"), eos, 0)
    assert static == padded  # a filled-up last batch and wider left padding change nothing
    assert 0 < padded[1] < len(prompts) and any(len(r) < 10 for r in padded[0])  # some cut, some at the limit
    with pytest.raises(ConfigError, match="regen.batching must be one of"):
        RegenConfig(batching="paged")


def test_generated_lengths_are_checked_before_any_work(tmp_path):
    """regen.max_new_tokens (and synth.max_new_tokens) longer than the target's context, or than
    max_length where every conversation is cut, is refused at start (10,000,000 once ran 11 minutes)."""
    from data_prep.prepare import PrepareConfig, Preparer
    from data_prep.synthesize import SynthConfig

    rows = tmp_path / "in.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    base = dict(target="tiny", input=str(rows), out=str(tmp_path / "o"), regenerate=True, progress=False)
    with pytest.raises(ConfigError, match=r"regen.max_new_tokens=10000000 does not fit the target's context of 4096"):
        Preparer(PrepareConfig(**base, regen=RegenConfig(max_new_tokens=10_000_000)))
    with pytest.raises(ConfigError, match=r"regen.max_new_tokens=600 is longer than max_length=512"):
        Preparer(PrepareConfig(**base, max_length=512, regen=RegenConfig(max_new_tokens=600)))
    synth = dict(base, input=None, regenerate=False, synthesize=4)
    with pytest.raises(ConfigError, match=r"synth.max_new_tokens=5000 does not fit"):
        Preparer(PrepareConfig(**synth, synth=SynthConfig(max_new_tokens=5000)))
    assert not (tmp_path / "o").exists()
    Preparer(PrepareConfig(**base, max_length=512, regen=RegenConfig(max_new_tokens=512)))  # at the limit: taken
