"""eagle3-prepare end to end on the tiny target: input forms, regeneration, bad input, reuse."""

import json
import subprocess
import sys

import pytest

from conftest import LLAMA3_TEMPLATE
from eagle3_train.core.errors import ContractError, Eagle3Error

OPENAI = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ]
    },
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]},
]
ROLE_TO_FROM = {"system": "system", "user": "human", "assistant": "gpt"}
SHAREGPT = [
    {"conversations": [{"from": ROLE_TO_FROM[m["role"]], "value": m["content"]} for m in row["messages"]]}
    for row in OPENAI
]


def test_sharegpt_and_openai_give_identical_output(write_jsonl, prepare):
    _, a = prepare(write_jsonl(OPENAI, "openai.jsonl"), out="a", chat_template=LLAMA3_TEMPLATE)
    _, b = prepare(write_jsonl(SHAREGPT, "sharegpt.jsonl"), out="b", chat_template=LLAMA3_TEMPLATE)
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
    assert a["sample_id"] == [0, 1]
    assert a["num_tokens"] == [len(x) for x in a["input_ids"]]
    assert a["num_loss_tokens"] == [sum(m) for m in a["loss_mask"]]
    assert a["source"][1].endswith("openai.jsonl:2")


def test_json_array_and_directory_inputs(tmp_path, write_jsonl, prepare):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.json").write_text(json.dumps(OPENAI[:1]))
    (tmp_path / "in" / "b.jsonl").write_text(json.dumps(OPENAI[1]) + "\n")
    manifest, ds = prepare(tmp_path / "in")
    assert manifest["counts"]["rows_written"] == 2
    assert ds["source"][0].endswith("a.json[item 0]") and ds["source"][1].endswith("b.jsonl:1")
    import gzip

    with gzip.open(tmp_path / "in" / "c.jsonl.gz", "wt") as f:  # a compressed corpus reads the same
        f.write(json.dumps(OPENAI[1]) + "\n")
    _, both = prepare(tmp_path / "in", out="with_gz")
    assert both["source"][2].endswith("c.jsonl.gz:1") and both["input_ids"][2] == ds["input_ids"][1]


def test_saved_dataset_input(tmp_path, write_jsonl, prepare):
    from datasets import Dataset

    Dataset.from_list(OPENAI).save_to_disk(str(tmp_path / "saved"))
    _, from_disk = prepare(tmp_path / "saved", out="x")
    _, from_file = prepare(write_jsonl(OPENAI), out="y")
    assert from_disk["input_ids"] == from_file["input_ids"]


def test_parquet_arrow_and_dataset_dict_inputs(tmp_path, write_jsonl, prepare):
    """Local parquet and Arrow files read as the JSONL they hold; a saved DatasetDict reads the
    split= it names, and one it lacks is refused listing its splits (was a misleading .json error)."""
    from datasets import Dataset, DatasetDict

    from eagle3_train.core.errors import BadInputError

    _, reference = prepare(write_jsonl(OPENAI), out="ref")
    ds = Dataset.from_list(OPENAI)
    ds.to_parquet(str(tmp_path / "data.parquet"))
    _, parquet = prepare(tmp_path / "data.parquet", out="pq")
    assert parquet["input_ids"] == reference["input_ids"] and parquet["source"][1].endswith("data.parquet[row 1]")
    import pyarrow as pa

    with pa.ipc.new_stream(str(tmp_path / "data.arrow"), ds.data.table.schema) as w:  # as datasets writes its cache
        w.write_table(ds.data.table)
    _, arrow = prepare(tmp_path / "data.arrow", out="arrow")
    assert arrow["input_ids"] == reference["input_ids"]
    DatasetDict({"train": ds, "test": Dataset.from_list(OPENAI[:1])}).save_to_disk(str(tmp_path / "dd"))
    _, train = prepare(tmp_path / "dd", out="dd_train")
    _, test = prepare(tmp_path / "dd", out="dd_test", split="test")
    assert train["input_ids"] == reference["input_ids"] and test["input_ids"] == reference["input_ids"][:1]
    with pytest.raises(
        BadInputError,
        match=r"dd is a DatasetDict without a split 'validation'; its splits: "
        r"\['train', 'test'\]",
    ):
        prepare(tmp_path / "dd", out="dd_x", split="validation")


def test_tool_messages_stay_in_the_context_and_out_of_the_loss(write_jsonl, prepare):
    """A tool's result (role tool) is rendered where it stands and never trained on: the loss covers
    the assistant turns only, exactly as without the tool message's tokens being masked."""
    row = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look."},
            {"role": "tool", "content": "sunny, 21C"},
            {"role": "assistant", "content": "It is sunny."},
        ]
    }
    _, ds = prepare(write_jsonl([row], "tool.jsonl"), chat_template=LLAMA3_TEMPLATE)
    from eagle3_train.targets.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer(LLAMA3_TEMPLATE)
    ids, mask = ds["input_ids"][0], ds["loss_mask"][0]
    text = tok.decode(ids)
    assert "sunny, 21C" in text
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert "Let me look." in trained and "It is sunny." in trained and "sunny, 21C" not in trained


def test_manifest_records_target_and_counts(write_jsonl, prepare):
    manifest, ds = prepare(write_jsonl(OPENAI))
    assert manifest["stage"] == "prepare"
    assert manifest["target"]["path"] == "tiny" and len(manifest["target"]["chat_template_hash"]) == 64
    c = manifest["counts"]
    assert c["rows_read"] == c["rows_written"] == 2
    assert c["tokens"] == sum(ds["num_tokens"]) and c["loss_tokens"] == sum(ds["num_loss_tokens"])


def test_rerun_reuses_and_other_options_are_refused(write_jsonl, prepare):
    path = write_jsonl(OPENAI)
    first, _ = prepare(path)
    again, _ = prepare(path)
    assert again["created_at"] == first["created_at"]  # not rewritten
    with pytest.raises(ContractError, match="overwrite=true"):
        prepare(path, max_length=64)
    replaced, ds = prepare(path, max_length=50, overwrite=True)
    assert replaced["counts"]["truncated"] == 1 and max(ds["num_tokens"]) == 50


# --- bad input: each case names file, line and field ---------------------------------------------

BAD_CASES = [
    ('{"messages": [', "data.jsonl:2: malformed JSON", "malformed_json"),
    (
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}]},
        "data.jsonl:2: field 'conversations[1].from': unknown role 'robot'",
        "unknown_role",
    ),
    ({"messages": []}, "data.jsonl:2: field 'messages': conversation has no messages", "empty_conversation"),
    (
        {"messages": [{"role": "user", "content": "hi"}]},
        "data.jsonl:2: field 'messages': conversation has no assistant turn",
        "no_assistant_turn",
    ),
    ({"text": "hello"}, "data.jsonl:2: row has neither 'messages' (OpenAI) nor 'conversations'", "missing_field"),
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]},
        "data.jsonl:2: field 'messages[1].content': content must be text",
        "bad_content",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "system", "content": "x"},
                {"role": "assistant", "content": "y"},
            ]
        },
        "data.jsonl:2: field 'messages[1]': a system message may only be the first",
        "misplaced_system",
    ),
]


@pytest.mark.parametrize("bad, message, reason", BAD_CASES, ids=[c[2] for c in BAD_CASES])
def test_bad_row_error_names_file_line_field(write_jsonl, prepare, bad, message, reason):
    path = write_jsonl([OPENAI[0], bad, OPENAI[1]])
    with pytest.raises(Eagle3Error) as e:
        prepare(path)
    assert message in str(e.value) and f"[{reason}]" in str(e.value)
    manifest, ds = prepare(path, on_bad_row="skip", out="skipped")
    assert manifest["counts"]["skipped"] == {reason: 1}
    assert manifest["skipped_examples"][reason][0].startswith(str(path) + ":2")
    assert manifest["counts"]["rows_read"] == 3 and len(ds) == 2


@pytest.mark.parametrize("name", ["data.jsonl", "data.jsonl.gz"])
def test_non_utf8_line_is_a_bad_row(tmp_path, prepare, name):
    import gzip

    latin1 = json.dumps(
        {"messages": [{"role": "user", "content": "caf\u00e9"}, {"role": "assistant", "content": "x"}]},
        ensure_ascii=False,
    ).encode("latin-1")
    raw = b"\n".join([json.dumps(OPENAI[0]).encode(), latin1, json.dumps(OPENAI[1]).encode()]) + b"\n"
    path = tmp_path / name
    path.write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    with pytest.raises(Eagle3Error) as e:
        prepare(path)
    assert f"{path}:2: not valid UTF-8 (byte 0xe9 at column 47): re-encode the file as UTF-8 [bad_encoding]" in str(
        e.value
    )
    manifest, ds = prepare(path, on_bad_row="skip", out="skipped")
    assert manifest["counts"]["skipped"] == {"bad_encoding": 1}
    assert manifest["counts"]["rows_read"] == 3 and len(ds) == 2
    assert ds["source"][1].endswith(f"{name}:3")


def test_non_utf8_json_array_names_file_and_line(tmp_path, prepare):
    path = tmp_path / "data.json"
    path.write_bytes(b'[\n{"messages": [{"role": "user", "content": "caf\xe9"}]}\n]\n')
    with pytest.raises(Eagle3Error, match=rf"^{path}:2: not valid UTF-8 \(byte 0xe9 at column 47\)"):
        prepare(path, on_bad_row="skip")  # the whole file is undecodable: not a row to skip


def test_too_long_conversation(write_jsonl, prepare):
    long = {"messages": [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl([OPENAI[1], long])
    with pytest.raises(Eagle3Error, match=r"data.jsonl:2: \d+ tokens exceed max_length=128 \(truncate=false\)"):
        prepare(path, max_length=128, truncate=False)
    # truncating would leave no assistant token: a bad row even with truncate=true
    with pytest.raises(Eagle3Error, match="data.jsonl:2: no assistant token within the first max_length=128"):
        prepare(path, max_length=128, out="t")
    manifest, _ = prepare(path, max_length=128, on_bad_row="skip", out="s")
    assert manifest["counts"]["skipped"] == {"no_assistant_tokens": 1}


def test_template_error_is_a_bad_row(write_jsonl, prepare):
    from conftest import LLAMA2_TEMPLATE

    two_users = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "c"},
        ]
    }
    with pytest.raises(Eagle3Error, match="data.jsonl:1: the chat template refused .*roles must alternate"):
        prepare(write_jsonl([two_users]), chat_template=LLAMA2_TEMPLATE)


def test_tokenizer_without_chat_template(tmp_path, write_jsonl, prepare):
    from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.chat_template = None
    build_tiny_model().save_pretrained(tmp_path / "plain")
    tok.save_pretrained(tmp_path / "plain")
    with pytest.raises(Eagle3Error, match="has no chat template; pass chat_template="):
        prepare(write_jsonl(OPENAI), target=str(tmp_path / "plain"))
    # the override makes the same directory usable
    manifest, _ = prepare(write_jsonl(OPENAI), target=str(tmp_path / "plain"), chat_template=LLAMA3_TEMPLATE)
    assert manifest["counts"]["rows_written"] == 2


def test_missing_input(tmp_path, prepare):
    with pytest.raises(Eagle3Error, match="does not exist"):
        prepare(tmp_path / "nope.jsonl")


@pytest.mark.slow
def test_cli_prints_error_without_traceback(tmp_path, write_jsonl):
    path = write_jsonl([OPENAI[0], '{"messages": ['])
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep.prepare", "target=tiny", f"input={path}", f"out={tmp_path / 'o'}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert f"eagle3-prepare: error: {path}:2: malformed JSON" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]  # nothing written to cwd
    # (a file that is not UTF-8 is the same kind of error: test_non_utf8_line_is_a_bad_row, in process)


@pytest.mark.slow
def test_tokenizing_processes_write_what_one_process_writes(write_jsonl, prepare):
    """tokenize_workers=2 (spawned processes, slices in order) gives the same rows, masks, skipped
    rows and error as tokenising in this process; a row too long under truncate=false is a bad row
    from either."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"q{i} " * (1 + i % 7)},
                {"role": "assistant", "content": f"answer {i} " * (1 + i % 40)},
            ]
        }
        for i in range(24)
    ]
    path = write_jsonl(rows)
    opts = dict(max_length=160, truncate=False, on_bad_row="skip")
    one, ds1 = prepare(path, out="one", **opts)
    two, ds2 = prepare(path, out="two", tokenize_workers=2, **opts)
    assert 0 < one["counts"]["skipped"]["too_long"] < 24
    assert two["counts"] == one["counts"] and two["skipped_examples"] == one["skipped_examples"]
    assert ds2["input_ids"] == ds1["input_ids"] and ds2["loss_mask"] == ds1["loss_mask"]
    assert ds2["source"] == ds1["source"]
    # the manifest says how the tokenising went: one process, or when the two began their slices
    assert one["tokenize"]["processes"] == 1 and "first_slice_began_s" not in one["tokenize"]
    t = two["tokenize"]
    assert t["processes"] == 2 and 0 < t["first_slice_began_s"] <= t["last_slice_began_s"] <= t["seconds"]
    with pytest.raises(Eagle3Error, match=r"data.jsonl:\d+: .*exceed max_length=160 \(truncate=false\) \[too_long\]"):
        prepare(path, out="err", max_length=160, truncate=False, tokenize_workers=2)


def test_repeat_writes_copies_with_consecutive_ids_and_old_outputs_stay_valid(tmp_path, write_jsonl, prepare):
    from data_prep.prepare import PrepareConfig, Preparer

    path = write_jsonl(OPENAI)
    once, one = prepare(path, out="once", sample_id_offset=100)
    thrice, three = prepare(path, out="thrice", sample_id_offset=100, repeat=3)
    # copy r of row i: 100 + i + r * 2**48 (copies share their original's train/eval split)
    assert list(three["sample_id"]) == [100 + i + (r << 48) for r in range(3) for i in range(2)]
    assert list(three["input_ids"]) == list(one["input_ids"]) * 3
    assert list(three["loss_mask"]) == list(one["loss_mask"]) * 3
    assert thrice["counts"]["rows_read"] == 2 and thrice["counts"]["rows_written"] == 6
    assert thrice["counts"]["tokens"] == 3 * once["counts"]["tokens"]
    # repeat=1 is not among the options that decide an output: a manifest written before the option
    # existed (its config without it) names the same output
    preparer = Preparer(PrepareConfig(target="tiny", input=str(path), out=str(tmp_path / "once"), sample_id_offset=100))
    old = {k: v for k, v in once["config"].items() if k != "repeat"}
    assert preparer._output_options(old) == preparer._output_options()
    with pytest.raises(ContractError, match="overwrite=true"):  # another repeat is another output
        prepare(path, out="once", sample_id_offset=100, repeat=2)
    with pytest.raises(Exception, match="repeat"):
        prepare(path, out="never", repeat=0)


def test_data_of_another_tokenizer_is_refused_with_what_differs(tmp_path, write_jsonl, prepare):
    """Prepared for one tokenizer, read for a target whose tokenizer differs (here a saved copy of the
    tiny target with another eos token, as a GGUF can load under another transformers): refused, and
    the message says which special tokens and parts differ, from the facts the manifest recorded. A
    manifest from before those facts is still refused, without them."""
    from eagle3_train.core.prepared import PreparedData
    from eagle3_train.core.tokenizer_spec import tokenizer_differences, tokenizer_facts
    from eagle3_train.targets import load_target

    data = write_jsonl([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    manifest, _ = prepare(data)
    tiny = load_target("tiny", cache_dir=None, load_model=False)
    assert manifest["tokenizer"] == tokenizer_facts(tiny.tokenizer)
    tok = tiny.tokenizer
    tok.add_special_tokens({"eos_token": "<|other_end|>"})
    tok.save_pretrained(tmp_path / "m")
    tiny.config.save_pretrained(tmp_path / "m")
    other = load_target(str(tmp_path / "m"), cache_dir=None, load_model=False)
    assert other.identity.tokenizer_hash != tiny.identity.tokenizer_hash
    with pytest.raises(ContractError) as e:
        PreparedData(tmp_path / "prepared").identity_for(other, "mine")
    said = str(e.value)
    there = manifest["tokenizer"]["special_tokens"]["eos_token"]
    assert f"eos_token {there!r} there, '<|other_end|>' here" in said and "other parts: added_tokens" in said
    assert "loaded by" not in said and said.endswith("prepare the data with this target, where it trains")
    # a manifest written before the facts: the same refusal, without them
    path = tmp_path / "prepared/manifest.json"
    old = json.loads(path.read_text())
    del old["tokenizer"]
    path.write_text(json.dumps(old))
    with pytest.raises(ContractError, match=r"tokenises differently \([0-9a-f]{12}\): prepare the data"):
        PreparedData(tmp_path / "prepared").identity_for(other, "mine")
    # the libraries, where they differ (the GGUF's tokenizer under transformers 5.25 and 5.17)
    facts = tokenizer_facts(tiny.tokenizer)
    moved = {**facts, "transformers": "5.17.0"}
    assert tokenizer_differences(facts, moved) == f"loaded by transformers {facts['transformers']} there, 5.17.0 here"
    assert tokenizer_differences(facts, facts) == ""
