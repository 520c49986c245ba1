"""Evaluation prompt files as users have them, and the errors for anything else."""

import gzip
import json

import pytest

from eagle3_train.core.errors import BadInputError
from eagle3_train.core.prompt_files import Conversation, read_conversations


def test_each_benchmark_shape_parses(write_jsonl, tmp_path):
    ours = write_jsonl(
        [
            {
                "category": "coding",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "dropped: the target answers"},
                    {"role": "user", "content": "More"},
                ],
            }
        ],
        "ours.jsonl",
    )
    assert read_conversations(ours) == [Conversation(f"{ours}:1", "coding", ["Hi", "More"], "Be brief.")]
    mt = write_jsonl([{"question_id": 81, "category": "writing", "turns": ["Write.", "Rewrite."]}], "question.jsonl")
    assert read_conversations(mt) == [Conversation(f"{mt}:1", "writing", ["Write.", "Rewrite."])]
    gsm = write_jsonl([{"question": "2+2?", "answer": "4"}, "", {"question": "3+3?", "answer": "6"}], "test.jsonl")
    assert [c.turns for c in read_conversations(gsm)] == [["2+2?"], ["3+3?"]]
    assert [c.source for c in read_conversations(gsm)] == [f"{gsm}:1", f"{gsm}:3"]  # line numbers of the file
    assert read_conversations(gsm)[0].category == "test"  # no category: the file's name
    humaneval = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(humaneval, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n", "canonical_solution": "..."}) + "\n")
    assert read_conversations(humaneval) == [Conversation(f"{humaneval}:1", "HumanEval", ["def f(x):\n"])]
    other = write_jsonl([{"text": "a"}, {"text": ["b", "c"]}], "other.jsonl")
    assert [c.turns for c in read_conversations(other, column="text")] == [["a"], ["b", "c"]]
    assert len(read_conversations(mt, limit=1)) == 1


def test_a_saved_dataset_with_a_column(tmp_path):
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_dict({"problem": ["one", "two"], "category": ["x", "y"]})
    ds.save_to_disk(str(tmp_path / "ds"))
    got = read_conversations(tmp_path / "ds", column="problem")
    assert [(c.source, c.category, c.turns) for c in got] == [
        (f"{tmp_path / 'ds'}[row 0]", "x", ["one"]),
        (f"{tmp_path / 'ds'}[row 1]", "y", ["two"]),
    ]
    with pytest.raises(
        BadInputError, match=r"ds\[row 0\]: no field 'prompt' \(column=prompt\); fields: \['category', 'problem'\]"
    ):
        read_conversations(tmp_path / "ds", column="prompt")
    DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(
        BadInputError, match=r"holds the splits \['test'\]: point prompts at one of them \(e.g. .*dd/test\)"
    ):
        read_conversations(tmp_path / "dd")
    assert [c.turns for c in read_conversations(tmp_path / "dd" / "test", column="problem")] == [["one"], ["two"]]


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"text": "hi"},
            r":1: unknown prompt shape \(fields \['text'\]\): expected one of \['messages', 'conversations', 'turns', 'prompt', 'question'\]",
        ),
        (
            {"turns": ["a", 3]},
            r":1: field 'turns' must be a string, a non-empty list of strings or a list of messages, got \['a', 3\]",
        ),
        ({"turns": []}, r":1: field 'turns' must be a string, a non-empty list"),
        ({"prompt": "  "}, r":1: field 'prompt' is empty"),
        ({"question": "q", "category": 3}, r":1: field 'category' must be a string, got 3"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, r":1: field 'messages': no user turn"),
        ({"messages": [{"role": "critic", "content": "x"}]}, r":1: field 'messages\[0\].role' is 'critic'"),
        ({"messages": [{"role": "user", "content": None}]}, r":1: field 'messages\[0\].content' must be a string"),
        ('{"prompt": ', r":1: malformed JSON"),
        ('["a"]', r":1: expected an object, got list"),
    ],
)
def test_bad_rows_name_file_line_and_field(write_jsonl, row, message):
    path = write_jsonl([row], "bad.jsonl")
    with pytest.raises(BadInputError, match="bad.jsonl" + message):
        read_conversations(path)


def test_empty_and_missing_files(write_jsonl, tmp_path):
    with pytest.raises(BadInputError, match="no prompts in it"):
        read_conversations(write_jsonl(["", "  "], "empty.jsonl"))
    with pytest.raises(BadInputError, match="does not exist"):
        read_conversations(tmp_path / "nope.jsonl")
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(BadInputError, match="prompts directory .*plain_dir holds no .jsonl.* and is no dataset saved"):
        read_conversations(tmp_path / "plain_dir")
    # a directory of prompt files is read as prepare reads one: every file in name order
    (tmp_path / "files").mkdir()
    write_jsonl([{"prompt": "a"}], "files/1.jsonl")
    write_jsonl([{"prompt": "b"}], "files/2.jsonl")
    assert [c.turns for c in read_conversations(tmp_path / "files")] == [["a"], ["b"]]


def test_messages_of_a_later_turn_carry_the_replies():
    c = Conversation("x:1", "c", ["u1", "u2", "u3"], "sys")
    assert c.messages(2, ["r1", "r2"]) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "r1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "r2"},
        {"role": "user", "content": "u3"},
    ]


def test_prepares_formats_read_in_eval_too(write_jsonl, tmp_path):
    """ShareGPT rows (refused by eval while prepare took them) and parquet files read as the same
    conversations; a tool message is refused by name (eval has the target answer every turn)."""
    from datasets import Dataset

    openai = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Again"},
        ]
    }
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "Again"},
        ]
    }
    (a,) = read_conversations(write_jsonl([openai], "a.jsonl"))
    (b,) = read_conversations(write_jsonl([sharegpt], "b.jsonl"))
    assert (a.turns, a.system) == (b.turns, b.system) == (["Hi", "Again"], "Be brief.")
    Dataset.from_list([sharegpt]).to_parquet(str(tmp_path / "p.parquet"))
    (c,) = read_conversations(tmp_path / "p.parquet")
    assert (c.turns, c.system, c.category) == (["Hi", "Again"], "Be brief.", "p")
    tool = {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]}
    with pytest.raises(BadInputError, match=r"t.jsonl:1: field 'messages\[1\]' is a tool message"):
        read_conversations(write_jsonl([tool], "t.jsonl"))


def test_the_shipped_prompts_are_found_by_path():
    from pathlib import Path

    from eagle3_train.core.prompt_files import shipped_prompts

    assert (
        shipped_prompts("heldout.jsonl")
        == Path(__file__).resolve().parents[1] / "data_prep" / "prompts" / "heldout.jsonl"
    )
    with pytest.raises(BadInputError, match=r"the shipped prompt file .*nothing.jsonl is missing .* give prompts="):
        shipped_prompts("nothing.jsonl")
