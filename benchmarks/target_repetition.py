"""How much of a target's own greedy replies repeat themselves, by position in the reply: the share of
the reply tokens that close a run of 8 tokens already seen earlier in the same reply (eagle3-eval's
``repeated_share``, the same function and buckets), with the replies' lengths. A draft copies a loop
easily, so where the share is high τ says little about new text. Every turn of every conversation is
answered in order (a later turn after the target's own earlier replies, as eagle3-eval sends them),
greedily, generated as eagle3-prepare regenerates (no draft). Not part of the test suite.

    python3 -m benchmarks.target_repetition --max-new-tokens 512 --out F.json   # EAGLE3_CACHE set
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import date
from pathlib import Path

import torch

import data_prep.prompts as shipped
from data_prep.regenerate import RegenConfig, generate_sorted
from eagle3_train.core.prompt_files import read_conversations
from eagle3_train.evaluation.eval import REPEAT_NGRAM, bucket_edges, repeated_tokens
from eagle3_train.targets import eos_ids, load_target


def greedy_replies(target, conversations, max_new_tokens: int, batch: int) -> tuple[list[list[int]], int]:
    """The reply tokens (without the end of turn) of every turn, turn by turn as eagle3-eval sends them,
    generated the way eagle3-prepare regenerates (greedy, left-padded, length-sorted batches); and how
    many replies ran to ``max_new_tokens``."""
    tok = target.tokenizer
    eos = sorted(eos_ids(target.model, tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    cfg = RegenConfig(max_new_tokens=max_new_tokens, batch_size=batch)
    texts: dict[str, list[str]] = {c.source: [] for c in conversations}
    replies, unfinished = [], 0
    for turn in range(max(len(c.turns) for c in conversations)):
        todo = [c for c in conversations if turn < len(c.turns)]
        prompts = [
            tok.apply_chat_template(
                c.messages(turn, texts[c.source]), add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            for c in todo
        ]
        with torch.no_grad():
            out, cut = generate_sorted(target.model, prompts, cfg, eos, pad)
        unfinished += cut
        for c, reply in zip(todo, out):
            texts[c.source].append(tok.decode(reply))
            replies.append(reply)
    return replies, unfinished


def repetition(replies: list[list[int]], unfinished: int, bucket: int) -> dict:
    shares: dict[tuple[int, int], list[bool]] = {}
    for tokens in replies:
        for position, repeated in enumerate(repeated_tokens(tokens)):
            shares.setdefault(bucket_edges(position, bucket), []).append(repeated)
    lengths = sorted(len(t) for t in replies)
    return {
        "replies": len(replies),
        "reply_tokens": sum(lengths),
        "median_reply_tokens": lengths[len(lengths) // 2],
        "replies_cut_at_max_new_tokens": unfinished,
        "by_reply_position": [
            {"from": a, "to": b, "tokens": len(f), "repeated_share": round(sum(f) / len(f), 4)}
            for (a, b), f in sorted(shares.items())
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="embedded")
    ap.add_argument("--prompts", default=str(Path(shipped.__file__).parent / "heldout.jsonl"))
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--bucket", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    start = time.time()
    target = load_target(a.target, cache_dir=os.environ.get("EAGLE3_CACHE"), dtype="float32")
    conversations = read_conversations(a.prompts)
    replies, unfinished = greedy_replies(target, conversations, a.max_new_tokens, a.batch)
    result = {
        "what": f"the target's own greedy replies (fp32, transformers generate, no draft) to {os.path.relpath(a.prompts)}, "
        "every turn: "
        f"the share of reply tokens that close a run of {REPEAT_NGRAM} tokens seen earlier in the same reply "
        "(eagle3-eval's repeated_share), by position in the reply",
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}",
        "command": "python3 -m benchmarks.target_repetition "
        f"--target {a.target} --max-new-tokens {a.max_new_tokens} --bucket {a.bucket} --out {a.out}",
        "date": date.today().isoformat(),
        "runs": "single run (greedy: deterministic)",
        "target": a.target,
        "max_new_tokens": a.max_new_tokens,
        "wall_s": round(time.time() - start, 1),
    } | repetition(replies, unfinished, a.bucket)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["by_reply_position"]))


if __name__ == "__main__":
    main()
