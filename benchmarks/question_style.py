"""How human the synthesized questions read (issue #13): first user turns of saved conversations
(eagle3-prepare ... save_conversations=F) against the shipped human prompts (held-out + training):
length in the target's tokens (median, 90th percentile), the share that opens in the first person
("I'm planning ..."), the most common first words, and the synthesis' drops per 100 questions
asked. Not part of the test suite.

    python3 benchmarks/question_style.py name=/tmp/qp/a.jsonl.gz[:/tmp/qp/a] ... --out F.json
(``:dir``: the eagle3-prepare out= directory whose synth/ chunks give the drops; EAGLE3_CACHE set)
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import Counter
from pathlib import Path

import data_prep.prompts as shipped
from eagle3_train.targets import load_target

FIRST_PERSON = ("i'm", "i am", "i have", "i want", "i need", "i'd", "i ", "my ")


def style(questions: list[str], tok) -> dict:
    lengths = sorted(len(tok(q, add_special_tokens=False)["input_ids"]) for q in questions)
    first = Counter(q.split()[0].lower().strip(",.'!?") for q in questions if q.split())
    return {
        "questions": len(questions),
        "median_tokens": statistics.median(lengths),
        "p90_tokens": lengths[int(0.9 * (len(lengths) - 1))],
        "first_person": round(sum(q.lower().startswith(FIRST_PERSON) for q in questions) / len(questions), 3),
        "first_words": first.most_common(6),
    }


def drops(out_dir: Path) -> dict:
    asked, dropped = 0, Counter()
    for chunk in sorted((out_dir / "synth").glob("chunk-*.json")):
        c = json.loads(chunk.read_text())
        dropped.update(c["dropped"])
        asked += len(c["conversations"]) + sum(c["dropped"].values())
    return {"asked": asked, "dropped": dict(dropped), "kept_share": round(1 - sum(dropped.values()) / asked, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="name=conversations.jsonl.gz[:prepare out dir]")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import os

    tok = load_target("embedded", cache_dir=os.environ.get("EAGLE3_CACHE"), load_model=False).tokenizer
    base = Path(shipped.__file__).parent
    human = [
        json.loads(line)["messages"][0]["content"]
        for f in ("heldout.jsonl", "train.jsonl")
        for line in (base / f).read_text().splitlines()
    ]
    result = {"human (heldout + train prompts)": style(human, tok)}
    for run in a.runs:
        name, _, spec = run.partition("=")
        path, _, out_dir = spec.partition(":")
        with gzip.open(path, "rt") as f:
            result[name] = style([json.loads(line)["messages"][0]["content"] for line in f], tok)
        if out_dir:
            result[name] |= drops(Path(out_dir))
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
