"""eagle3-prepare synthesize=N: user turns from the template's own pre-query rendering, filters,
data-parallel ranks, kill and resume."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk

from data_prep.prepare import PrepareConfig, Preparer
from data_prep.regenerate import RegenConfig
from data_prep.synthesize import (
    SET_FILTERS,
    USER_FILTERS,
    DuplicateFilter,
    SynthConfig,
    repeated_ngram_share,
    user_turn_prefix,
)
from eagle3_train.core.errors import ConfigError, ContractError, Eagle3Error
from eagle3_train.targets.tiny import build_tiny_tokenizer
from tests.conftest import LLAMA2_TEMPLATE, LLAMA3_TEMPLATE, SMOLLM2_TEMPLATE

SMOL_USER = "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n<|im_start|>user\n"


def _ids(tok, name: str) -> int:
    return tok.convert_tokens_to_ids(name)


class Recording(torch.nn.Module):
    """A model whose ``generate`` records the unpadded prompts it is given and answers from a
    script (or from a real model). Script items: ``(text, ends)`` -- ``ends`` appends the stop id."""

    def __init__(self, tok, script=None, model=None):
        super().__init__()
        self.tok, self.script, self.model = tok, list(script or []), model
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # generate_sorted asks for the device
        self.prompts: list[list[int]] = []
        self.max_new_tokens: list[int] = []  # of each generate call
        self.generation_config = None

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kw):
        self.max_new_tokens.append(max_new_tokens)
        for row, mask in zip(input_ids, attention_mask):
            self.prompts.append(row[mask.bool()].tolist())
        if self.model is not None:
            return self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
                **kw,
            )
        rows = []
        for row in input_ids:
            is_user = (
                self.tok.decode(row.tolist()).split("<|im_start|>")[-1].startswith("user")
            )  # a turn opened by starter words too
            text, ends = self.script.pop(0) if is_user else ("Sure, here it is.", True)
            ids = self.tok(text, add_special_tokens=False)["input_ids"][: max_new_tokens - ends]
            if ends:
                ids.append(_ids(self.tok, "<|im_end|>"))
            ids += [pad_token_id] * (max_new_tokens - len(ids))
            rows.append(ids)
        return torch.cat([input_ids, torch.tensor(rows)], 1)


def _prepare(tmp_path, monkeypatch, model, out="synth", **options):
    opts = dict(target="tiny", out=str(tmp_path / out), progress=False, chat_template=SMOLLM2_TEMPLATE)
    opts.update(options)
    cfg = PrepareConfig(**opts)
    preparer = Preparer(cfg)
    if model is not None:
        tok = preparer.target.tokenizer
        monkeypatch.setattr(
            preparer, "_load_generator", lambda: (model, sorted({_ids(tok, "<|im_end|>"), tok.eos_token_id}))
        )
    return preparer.run()


def test_user_prefix_is_the_templates_pre_query_rendering():
    tok = build_tiny_tokenizer(SMOLLM2_TEMPLATE)
    end = {_ids(tok, "<|im_end|>")}
    name = "the test template"
    assert user_turn_prefix(tok, [], end, name).text == SMOL_USER  # the template's default system prompt
    with_system = user_turn_prefix(tok, [{"role": "system", "content": "Ask about code."}], end, name)
    assert with_system.text == "<|im_start|>system\nAsk about code.<|im_end|>\n<|im_start|>user\n"
    assert with_system.end_id == _ids(tok, "<|im_end|>")
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert user_turn_prefix(tok, history, end, name).text == (
        SMOL_USER + "Hi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n"
    )
    llama3 = build_tiny_tokenizer(LLAMA3_TEMPLATE)
    p = user_turn_prefix(llama3, [], {_ids(llama3, "<|eot_id|>")}, name)
    assert p.text == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
    assert p.end_id == _ids(llama3, "<|eot_id|>")
    llama2 = build_tiny_tokenizer(LLAMA2_TEMPLATE)  # the user turn ends in plain text " [/INST]"
    with pytest.raises(Eagle3Error, match="the test template puts no special end-of-turn token"):
        user_turn_prefix(llama2, [], {_ids(llama2, "<|end_of_text|>")}, name)


def test_a_known_ending_derives_the_prefix_from_one_rendering(tmp_path, monkeypatch):
    """Synthesizer._prefix: the full derivation (two renderings) once per ending the template puts
    after a user message, then one rendering; every prefix equals user_turn_prefix's."""
    import data_prep.synthesize as synthesize

    tok = build_tiny_tokenizer(SMOLLM2_TEMPLATE)
    end = {_ids(tok, "<|im_end|>")}
    s = synthesize.Synthesizer(
        n=1,
        synth=SynthConfig(),
        regen=RegenConfig(),
        seed=0,
        work_dir=tmp_path,
        request={},
        overwrite=False,
        load_model=None,
        tokenizer=tok,
        special=end,
        template_name="t",
    )
    renders = []
    real = synthesize.render_text
    monkeypatch.setattr(synthesize, "render_text", lambda *a, **k: renders.append(1) or real(*a, **k))
    convs = [
        {"system": None, "messages": []},
        {"system": "Ask about code.", "messages": []},
        {
            "system": "Ask about math.",
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        },
    ]
    for i, c in enumerate(convs):
        history = ([{"role": "system", "content": c["system"]}] if c["system"] else []) + c["messages"]
        want = user_turn_prefix(tok, history, end, "t")
        before = len(renders)
        got = s._prefix(c)
        assert (got.text, got.end_id) == (want.text, want.end_id)
        assert len(renders) - before == (1 + 2 if i == 0 else 1)  # a failed shortcut, then the derivation
    assert s.endings == {"<|im_end|>\n": _ids(tok, "<|im_end|>")}


@pytest.mark.parametrize("keep_system", [True, False])
def test_synthesized_turns_are_generated_from_exactly_the_prefix(tmp_path, monkeypatch, keep_system):
    tok = build_tiny_tokenizer(SMOLLM2_TEMPLATE)
    model = Recording(tok, [("How do I sort a list?", True), ("What is a closure?", True)])
    manifest = _prepare(
        tmp_path,
        monkeypatch,
        model,
        synthesize=2,
        synth=SynthConfig(chunk_size=2, system_prompts=["Ask about code."], keep_system_prompt=keep_system),
        save_conversations=str(tmp_path / "corpus.jsonl.gz"),
    )
    steer = "<|im_start|>system\nAsk about code.<|im_end|>\n<|im_start|>user\n"
    user_prompts, reply_prompts = model.prompts[:2], model.prompts[2:]
    assert user_prompts == [tok(steer, add_special_tokens=False)["input_ids"]] * 2
    system = steer[: -len("<|im_start|>user\n")] if keep_system else SMOL_USER[: -len("<|im_start|>user\n")]
    asked = ["How do I sort a list?", "What is a closure?"]
    assert sorted(tok.decode(p) for p in reply_prompts) == sorted(  # the replies are batched by length
        system + f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in asked
    )
    ds = load_from_disk(str(tmp_path / "synth" / "dataset"))
    assert manifest["counts"]["rows_written"] == 2
    again = _prepare(tmp_path, monkeypatch, None, out="again", input=str(tmp_path / "corpus.jsonl.gz"))
    assert again["counts"]["rows_written"] == 2  # the saved corpus prepares to the same tokens
    assert load_from_disk(str(tmp_path / "again" / "dataset"))["input_ids"] == ds["input_ids"]
    assert tok.decode(ds[1]["input_ids"]) == system + (
        "<|im_start|>user\nWhat is a closure?<|im_end|>\n<|im_start|>assistant\nSure, here it is.<|im_end|>\n"
    )


def test_example_prompts_steer_the_questions_only(tmp_path, monkeypatch):
    """synth.example_prompts_file: each conversation's question is written under its steering prompt
    plus examples_per_prompt first user turns of the file, drawn by (seed, conversation) whatever
    the chunking; with keep_system_prompt=false the answers and the stored data never see them."""
    import gzip
    import json

    from data_prep.synthesize import EXAMPLES_HEADER

    examples = [f"Example request number {i}, about topic {i}." for i in range(6)]
    (tmp_path / "mine.jsonl").write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": e}, {"role": "assistant", "content": "ok"}]}) + "\n"
            for e in examples
        )
    )
    tok = build_tiny_tokenizer(SMOLLM2_TEMPLATE)
    asked = [(f"Question {i}?", True) for i in range(4)]
    steerings = []
    for chunk, out in ((4, "a"), (1, "b")):
        model = Recording(tok, list(asked))
        _prepare(
            tmp_path,
            monkeypatch,
            model,
            out=out,
            synthesize=4,
            synth=SynthConfig(
                chunk_size=chunk,
                system_prompts=["Ask about code."],
                keep_system_prompt=False,
                example_prompts_file=str(tmp_path / "mine.jsonl"),
                examples_per_prompt=2,
            ),
            save_conversations=str(tmp_path / f"{out}.jsonl.gz"),
        )
        questions = [tok.decode(p) for p in model.prompts if tok.decode(p).endswith("user\n")]
        replies = [tok.decode(p) for p in model.prompts if not tok.decode(p).endswith("user\n")]
        steerings.append(sorted(questions))
        for q in questions:
            listed = q.split(f"Ask about code.\n\n{EXAMPLES_HEADER}\n")[1].split("<|im_end|>")[0].split("\n")
            assert len(listed) == 2 and len(set(listed)) == 2
            assert all(line.removeprefix("- ") in examples for line in listed)
        assert len(set(questions)) > 1  # conversations draw their own examples
        assert not any("Example request" in r for r in replies)
        with gzip.open(tmp_path / f"{out}.jsonl.gz", "rt") as f:  # the steering is kept as metadata only
            rows = [json.loads(line) for line in f]
        assert all(EXAMPLES_HEADER in r["system_prompt"] for r in rows)
        assert not any("Example request" in m["content"] for r in rows for m in r["messages"])
        data = load_from_disk(str(tmp_path / out / "dataset"))
        assert not any("Example request" in tok.decode(ids) for ids in data["input_ids"])
    assert steerings[0] == steerings[1]  # one chunk of 4 or four of 1: the same draws
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises((ConfigError, Eagle3Error), match="empty.jsonl"):
        SynthConfig(example_prompts_file=str(tmp_path / "empty.jsonl")).examples()
    with pytest.raises(ConfigError, match="does not exist"):
        SynthConfig(example_prompts_file=str(tmp_path / "none.jsonl")).examples()


def test_starter_words_open_the_first_question(tmp_path, monkeypatch):
    """synth.starter_words=2: the first user turn's prompt ends with the first two words of the first
    example its steering lists (the same in any chunking), and the stored question is those words
    followed by what the target wrote; a later turn has none. Without the file it is refused."""
    import gzip
    import json

    from data_prep.synthesize import EXAMPLES_HEADER

    examples = ["Write a haiku about rain.", "What is a closure?", "Explain   recursion simply."]
    (tmp_path / "mine.jsonl").write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": e}]}) + "\n" for e in examples)
    )
    openings = {"Write a", "What is", "Explain recursion"}
    tok = build_tiny_tokenizer(SMOLLM2_TEMPLATE)
    firsts = []
    for chunk, out in ((6, "a"), (3, "b")):
        model = Recording(tok, [(f" thing number {i}?", True) for i in range(12)])
        _prepare(
            tmp_path,
            monkeypatch,
            model,
            out=out,
            synthesize=6,
            synth=SynthConfig(
                chunk_size=chunk,
                turns=2,
                keep_system_prompt=False,
                starter_words=2,
                example_prompts_file=str(tmp_path / "mine.jsonl"),
            ),
            save_conversations=str(tmp_path / f"{out}.jsonl.gz"),
        )
        asked = [
            tok.decode(p) for p in model.prompts if not tok.decode(p).split("<|im_start|>")[-1].startswith("assistant")
        ]
        first = [a for a in asked if a.count("<|im_start|>user") == 1]
        openings_asked = [a.split("<|im_start|>user\n")[-1] for a in first]
        for a, opening in zip(first, openings_asked):
            shown = a.split(f"{EXAMPLES_HEADER}\n- ")[1].split("\n")[0]  # the first example listed
            assert " ".join(shown.split()[:2]) == opening
        later = [a for a in asked if a.count("<|im_start|>user") == 2]
        assert len(first) == 6 and set(openings_asked) <= openings and len(later) == 6
        assert all(a.endswith("<|im_start|>user\n") for a in later)
        with gzip.open(tmp_path / f"{out}.jsonl.gz", "rt") as f:
            stored = [json.loads(line)["messages"] for line in f]
        starts = [c[0]["content"].split(" thing number ")[0] for c in stored]
        assert sorted(starts) == sorted(openings_asked)
        assert all(c[2]["content"].startswith("thing number ") for c in stored)
        firsts.append(sorted(openings_asked))
    assert firsts[0] == firsts[1] and len(set(firsts[0])) > 1
    with pytest.raises(ConfigError, match="example_prompts_file"):
        SynthConfig(starter_words=1)


def test_tokenizing_processes_started_before_synthesis_write_what_one_process_writes(tmp_path, monkeypatch):
    """With tokenising processes (started before the target writes, so that their start-up overlaps
    the generation) the synthesized dataset is the one tokenised in this process."""
    from datasets import load_from_disk

    tok = build_tiny_tokenizer(SMOLLM2_TEMPLATE)
    got = {}
    for workers in (0, 2):
        model = Recording(tok, [(f"Question {i} about {'x ' * i}?", True) for i in range(5)])
        m = _prepare(
            tmp_path,
            monkeypatch,
            model,
            out=f"w{workers}",
            synthesize=5,
            tokenize_workers=workers,
            synth=SynthConfig(chunk_size=5),
        )
        assert m["tokenize"]["processes"] == max(workers, 1) and m["tokenize"]["started_before"] == (workers == 2)
        got[workers] = load_from_disk(str(tmp_path / f"w{workers}" / "dataset")).to_dict()
    assert len(got[0]["input_ids"]) == 5 and got[2] == got[0]


def test_every_filter_drops_and_counts(tmp_path, monkeypatch):
    tok = build_tiny_tokenizer(SMOLLM2_TEMPLATE)
    photosynthesis = (
        "Could you explain in simple terms how photosynthesis turns sunlight water and carbon dioxide "
        "into sugar for the plants"
    )
    script = [
        ("How do I bake bread at home?", True),  # kept
        ("", True),  # empty
        ("hi", True),  # too_short (2 byte tokens < 3)
        ("a very long question " * 8, False),  # too_long: sampling stops at 141 tokens, past max_tokens=140
        (
            "it goes on and on ",
            False,
        ),  # too_long as well: never ends (no_end_of_turn needs max_new_tokens <= max_tokens)
        ("What does <|im_start|> mean?", True),  # special_tokens
        ("the cat sat on the mat " * 3, True),  # repetition (9 of 15 word 4-grams repeat)
        ("how do I BAKE  bread at home?", True),  # exact_duplicate of the first
        (photosynthesis + "?", True),  # kept
        (photosynthesis + " and trees?", True),  # near_duplicate (Jaccard 15/17)
        ("Write a short poem about the sea.", True),  # kept
    ]
    model = Recording(tok, script)
    synth = SynthConfig(chunk_size=len(script), min_tokens=3, max_tokens=140, max_new_tokens=200)
    manifest = _prepare(tmp_path, monkeypatch, model, synthesize=3, synth=synth)
    stats = manifest["regeneration"]["synthesis"]
    every_once = {r: 1 for r in USER_FILTERS + SET_FILTERS if r != "no_end_of_turn"}  # tested below: never_ends
    assert stats["dropped"] == every_once | {"too_long": 2}
    assert model.max_new_tokens[0] == 141  # the user turns: no token sampled beyond what max_tokens can keep
    assert stats["chunks"] == 1 and stats["conversations_kept"] == 3
    ds = load_from_disk(str(tmp_path / "synth" / "dataset"))
    firsts = [tok.decode(r["input_ids"]).split("<|im_start|>user\n")[1].split("<|im_end|>")[0] for r in ds]
    assert firsts == [script[0][0], photosynthesis + "?", script[10][0]]


def test_a_later_round_is_filtered_against_the_earlier_ones(tmp_path, monkeypatch):
    """Filters that leave too few conversations make a second round of chunks; its set filters read
    only the new chunks but continue the first round's state, so a repeat across rounds is
    dropped and no count is taken twice."""
    tok = build_tiny_tokenizer(SMOLLM2_TEMPLATE)
    script = [
        ("How do I bake bread at home?", True),
        ("", True),  # chunk 0: kept, empty
        ("What is a closure?", True),
        ("hi", True),  # chunk 1: kept, too_short
        ("how do i bake bread at HOME?", True),
        ("Write a poem about the sea.", True),
    ]  # round 2: repeat, kept
    model = Recording(tok, script)
    manifest = _prepare(tmp_path, monkeypatch, model, synthesize=3, synth=SynthConfig(chunk_size=2, min_tokens=3))
    stats = manifest["regeneration"]["synthesis"]
    assert stats["chunks"] == 3 and stats["conversations_kept"] == 3
    assert stats["dropped"] == {"empty": 1, "too_short": 1, "exact_duplicate": 1}
    ds = load_from_disk(str(tmp_path / "synth" / "dataset"))
    firsts = [tok.decode(r["input_ids"]).split("<|im_start|>user\n")[1].split("<|im_end|>")[0] for r in ds]
    assert firsts == [script[0][0], script[2][0], script[5][0]]


def test_duplicates_exact_and_near():
    base = "Please list five practical tips for staying focused while studying for long exams at home"
    # 13 word 3-grams; "today" adds one (Jaccard 13/14), "school" for "home" swaps one (12/14), "ten" for
    # "five" swaps three (10/16): below 0.8, kept
    texts = [
        base,
        base.upper(),
        base + " today",
        "Tell me a joke about cats.",
        base.replace("home", "school"),
        base.replace("five", "ten"),
        "Tell me a joke about dogs.",
    ]
    assert DuplicateFilter(0.8).add(texts) == {1: "exact_duplicate", 2: "near_duplicate", 4: "near_duplicate"}
    assert DuplicateFilter(1.0).add(texts) == {1: "exact_duplicate"}
    pieces = DuplicateFilter(0.8)  # synthesis rounds: the same texts in pieces, duplicates across them
    assert pieces.add(texts[:2]) | pieces.add(texts[2:5]) | pieces.add([]) | pieces.add(texts[5:]) == DuplicateFilter(
        0.8
    ).add(texts)
    assert repeated_ngram_share("one two three four " * 4) == pytest.approx(1 - 4 / 13)
    assert repeated_ngram_share("a b c") == 0.0


def test_bad_input(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="synthesize must be positive, got 0"):
        PrepareConfig(target="tiny", out=str(tmp_path / "x"), synthesize=0)
    with pytest.raises(ConfigError, match="exactly one"):
        PrepareConfig(target="tiny", out=str(tmp_path / "x"))
    with pytest.raises(Eagle3Error, match="puts no special end-of-turn token"):
        _prepare(
            tmp_path, monkeypatch, None, synthesize=2, chat_template=LLAMA2_TEMPLATE, synth=SynthConfig(chunk_size=2)
        )
    tok = build_tiny_tokenizer(SMOLLM2_TEMPLATE)
    _prepare(
        tmp_path,
        monkeypatch,
        Recording(tok, [("Why is the sky blue?", True)]),
        synthesize=1,
        synth=SynthConfig(chunk_size=1),
    )
    with pytest.raises(ContractError, match=r"synth\.temperature: 1\.0 != 0\.5"):  # a finished output
        _prepare(tmp_path, monkeypatch, None, synthesize=1, synth=SynthConfig(chunk_size=1, temperature=0.5))
    (tmp_path / "synth" / "manifest.json").unlink()  # as if killed before the end: only chunks remain
    with pytest.raises(
        ContractError,
        match=r"holds an unfinished set of synthesized conversations made otherwise .*:\n  synth\.temperature: 1\.0 != 0\.5",
    ):
        _prepare(tmp_path, monkeypatch, None, synthesize=1, synth=SynthConfig(chunk_size=1, temperature=0.5))


def _torchrun(out: Path, nproc: int, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "data_prep.prepare",
        "target=tiny",
        f"out={out}",
        "synthesize=10",
        "progress=false",
        "device=cpu",
        "synth.chunk_size=4",
        "synth.max_new_tokens=48",
        "synth.min_tokens=1",
        "synth.max_tokens=48",
        "synth.max_repeated_ngrams=1",
        "regen.max_new_tokens=8",
        "regen.batch_size=4",
        "synth.turns=2",
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)


@pytest.mark.slow
def test_two_ranks_killed_and_resumed_equal_one_rank(tmp_path, monkeypatch):
    one = tmp_path / "one"
    cfg = PrepareConfig(
        target="tiny",
        out=str(one),
        synthesize=10,
        progress=False,
        device="cpu",
        synth=SynthConfig(chunk_size=4, max_new_tokens=48, min_tokens=1, max_tokens=48, max_repeated_ngrams=1, turns=2),
        regen=RegenConfig(max_new_tokens=8, batch_size=4),
    )
    Preparer(cfg).run()
    crashed = _torchrun(tmp_path / "two", 2, {"EAGLE3_FAULT_AT": "synth.chunk:1"})
    assert crashed.returncode != 0
    assert not (tmp_path / "two" / "manifest.json").exists()
    survived = sorted(p.name for p in (tmp_path / "two" / "synth").glob("chunk-*.json"))
    assert survived, crashed.stderr[-2000:]
    mtimes = {n: (tmp_path / "two" / "synth" / n).stat().st_mtime_ns for n in survived}
    resumed = _torchrun(tmp_path / "two", 2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert all((tmp_path / "two" / "synth" / n).stat().st_mtime_ns == t for n, t in mtimes.items())  # not redone
    a, b = load_from_disk(str(one / "dataset")), load_from_disk(str(tmp_path / "two" / "dataset"))
    assert len(a) == len(b) == 10
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
    assert any(r.count(1) > 1 for r in a["loss_mask"]) and len(set(map(tuple, a["input_ids"]))) == 10
    two_turns = [build_tiny_tokenizer().decode(r).count("<|im_start|>assistant") for r in a["input_ids"]]
    assert max(two_turns) == 2  # later user turns were written after the first reply


def test_nothing_kept_stops_with_the_counts_and_reuse_refuses_a_late_save(tmp_path, monkeypatch):
    tok = build_tiny_tokenizer(SMOLLM2_TEMPLATE)
    never_ends = Recording(tok, [("and so on ", False)] * 4)  # a target that never ends its question
    with pytest.raises(
        Eagle3Error, match=r"every synthesized conversation of 1 chunk\(s\) was dropped \(\{'no_end_of_turn': 2\}\)"
    ):
        _prepare(
            tmp_path,
            monkeypatch,
            never_ends,
            out="none",
            synthesize=2,
            synth=SynthConfig(chunk_size=2, max_new_tokens=8),
        )
    _prepare(
        tmp_path,
        monkeypatch,
        Recording(tok, [("Why is the sky blue?", True)]),
        synthesize=1,
        synth=SynthConfig(chunk_size=1),
    )
    with pytest.raises(ConfigError, match="save_conversations= writes only while preparing"):
        _prepare(
            tmp_path,
            monkeypatch,
            None,
            synthesize=1,
            synth=SynthConfig(chunk_size=1),
            save_conversations=str(tmp_path / "late.jsonl"),
        )
    with pytest.raises(ConfigError, match="must name a .jsonl or .jsonl.gz file"):
        PrepareConfig(target="tiny", out=str(tmp_path / "x"), synthesize=1, save_conversations="c.json")


def test_a_small_request_writes_about_what_it_asks(tmp_path, monkeypatch):
    """synthesize=6 wrote a whole chunk of 512 (over 20 minutes on a CPU); now its chunk holds 16
    (6 at the expected keep rate, as a power of two), the first 6 kept conversations are the
    dataset, and a request of at least 0.8 chunks keeps the configured size."""
    from data_prep.synthesize import chunk_size_for

    tok = build_tiny_tokenizer(SMOLLM2_TEMPLATE)
    model = Recording(tok, [(f"Question number {i}?", True) for i in range(16)])
    manifest = _prepare(tmp_path, monkeypatch, model, synthesize=6, synth=SynthConfig(turns=1))
    questions = [p for p in model.prompts if tok.decode(p).endswith("user\n")]
    assert len(questions) == 16 and manifest["regeneration"]["synthesis"]["chunks"] == 1
    assert manifest["counts"]["rows_written"] == 6 and manifest["regeneration"]["synthesis"]["conversations_kept"] == 6
    assert [chunk_size_for(n, 512) for n in (1, 6, 13, 100, 409, 410, 5000)] == [16, 16, 32, 128, 512, 512, 512]


# -- long-context conversations --------------------------------------------------------------------


class ByPrompt(torch.nn.Module):
    """Answers by the prompt alone, so any chunking or a resume gives the same text: a question
    names the topic of its steering prompt, a reply quotes its question, and the answer to a
    document-and-task prompt names the task. Records every prompt."""

    def __init__(self, tok):
        super().__init__()
        self.tok = tok
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # generate_sorted asks for the device
        self.prompts: list[str] = []
        self.generation_config = None

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kw):
        rows = []
        for row, mask in zip(input_ids, attention_mask):
            text = self.tok.decode(row[mask.bool()].tolist())
            self.prompts.append(text)
            if text.split("<|im_start|>")[-1].startswith("user"):
                out = f"Tell me about topic {text.split('Topic ')[1].split('<|im_end|>')[0]}?"
            else:
                asked = text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
                out = f"Done: {asked.split(chr(10))[-1]}" if "\n\n" in asked else f"Reply to '{asked}', all of it."
            ids = self.tok(out, add_special_tokens=False)["input_ids"][: max_new_tokens - 1]
            ids += [_ids(self.tok, "<|im_end|>")] + [pad_token_id] * (max_new_tokens - len(ids) - 1)
            rows.append(ids)
        return torch.cat([input_ids, torch.tensor(rows)], 1)


LONG = dict(
    long_fraction=0.25, long_tokens=[40, 90], system_prompts=[f"Topic {i}" for i in range(64)], keep_system_prompt=False
)


def _long_run(tmp_path, monkeypatch, out, n=16, **synth):
    tok = build_tiny_tokenizer(SMOLLM2_TEMPLATE)
    model = ByPrompt(tok)
    options = {**LONG, "chunk_size": 16, **synth}
    manifest = _prepare(
        tmp_path,
        monkeypatch,
        model,
        out=out,
        synthesize=n,
        synth=SynthConfig(**options),
        save_conversations=str(tmp_path / f"{out}.jsonl"),
    )
    import json

    convs = [json.loads(line) for line in (tmp_path / f"{out}.jsonl").read_text().splitlines()]
    return manifest, convs, model


def test_long_context_conversations_are_documents_of_the_runs_own_replies(tmp_path, monkeypatch):
    from data_prep.synthesize import LONG_SEPARATOR

    manifest, convs, model = _long_run(tmp_path, monkeypatch, "a")
    tasks = (Path(__file__).resolve().parents[1] / "data_prep/prompts/long_tasks.txt").read_text().splitlines()
    longs = [c for c in convs if "document_tokens" in c]
    assert len(convs) == 16 and len(longs) == 4  # round(16 * 0.25), the rest short
    assert [c["id"] for c in longs] == [3, 7, 11, 15]  # evenly spread slots
    replies = [c["messages"][-1]["content"] for c in convs if c not in longs]
    assert all(r.startswith("Reply to 'Tell me about topic") for r in replies)
    for c in longs:
        (user, answer) = c["messages"]
        doc, task = user["content"].rsplit(LONG_SEPARATOR, 1)
        assert task in tasks and answer == {"role": "assistant", "content": f"Done: {task}"}
        length = c["document_tokens"]
        assert length in (40, 90)
        assert length - len(LONG_SEPARATOR) <= len(doc.encode()) <= length  # byte-level: a token a byte
        pieces = doc.split(LONG_SEPARATOR)  # whole replies, the last one cut
        assert all(p in replies for p in pieces[:-1]) and any(r.startswith(pieces[-1]) for r in replies)
    asked = [p for p in model.prompts if "\n\n" in p.split("<|im_start|>user\n")[-1]]
    assert len(asked) == 4  # every long one answered once, as a regenerated reply
    stats = manifest["regeneration"]["synthesis"]["long_context"]
    histogram = Counter(str(c["document_tokens"]) for c in longs)
    assert stats == {"asked": 4, "kept": 4, "document_tokens": dict(sorted(histogram.items()))}


def test_long_context_conversations_are_deterministic_and_resume(tmp_path, monkeypatch):
    import shutil

    _, first, _ = _long_run(tmp_path, monkeypatch, "a", n=24)
    _, again, _ = _long_run(tmp_path, monkeypatch, "b", n=24)
    assert again == first
    shutil.copytree(tmp_path / "a" / "synth", tmp_path / "c" / "synth")  # a run killed after its first chunk
    (tmp_path / "c" / "synth" / "chunk-000001.json").unlink()
    _, resumed, model = _long_run(tmp_path, monkeypatch, "c", n=24)
    assert resumed == first
    assert model.prompts and all(int(t) >= 16 for p in model.prompts for t in re.findall(r"Topic (\d+)", p))
    with pytest.raises(ContractError, match="synth.long_fraction: 0.25 != 0.5"):
        _long_run(tmp_path, monkeypatch, "a", n=24, long_fraction=0.5)


def test_without_long_context_nothing_changes(tmp_path, monkeypatch):
    """long_fraction=0 (the default) writes what a run before the option wrote, and records no
    long-context option, so such outputs are reused."""
    import json

    _, convs, _ = _long_run(tmp_path, monkeypatch, "a", long_fraction=0.0)
    assert len(convs) == 16 and not any("document_tokens" in c for c in convs)
    request = json.loads((tmp_path / "a" / "synth" / "request.json").read_text())
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert not any(k.startswith("long") for k in request["synth"])
    assert not any(k.startswith("long") for k in manifest["request"]["config"]["synth"])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"long_fraction": 1.0}, r"^synth\.long_fraction must be in \[0, 1\) .*got 1\.0$"),
        ({"long_fraction": float("nan")}, r"^synth\.long_fraction must be in \[0, 1\) .*got nan$"),
        ({"long_tokens": []}, r"^synth\.long_tokens must be a non-empty list of positive token counts, got \[\]$"),
        ({"long_tokens": [100, 0]}, r"^synth\.long_tokens must be .* got \[100, 0\]$"),
    ],
)
def test_bad_long_context_options_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        SynthConfig(**options)


def test_long_documents_must_fit_max_length_and_the_context(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"more than max_length=2048, .* raise max_length \(to at least \d+\)"):
        _prepare(tmp_path, monkeypatch, None, synthesize=4, synth=SynthConfig(long_fraction=0.1, long_tokens=[3000]))
    with pytest.raises(ConfigError, match=r"more than the target's context of 4096: lower synth.long_tokens"):
        _prepare(tmp_path, monkeypatch, None, synthesize=4, max_length=8192, synth=SynthConfig(long_fraction=0.1))
    (tmp_path / "tasks.txt").write_text("\n\n")
    with pytest.raises(ConfigError, match=r"synth\.long_tasks_file .*tasks\.txt holds no task"):
        _prepare(
            tmp_path,
            monkeypatch,
            None,
            synthesize=4,
            synth=SynthConfig(long_fraction=0.1, long_tokens=[50], long_tasks_file=str(tmp_path / "tasks.txt")),
        )
