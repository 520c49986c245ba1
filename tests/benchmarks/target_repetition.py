"""How much of a target's own greedy replies repeat themselves, by position in the reply: the share of
the reply tokens that close a run of 8 tokens already seen earlier in the same reply (eagle3-eval's
``repeated_share``, the same function and buckets), with the replies' lengths. A draft copies a loop
easily, so where the share is high τ says little about new text. Every turn of every conversation is
answered in order (a later turn after the target's own earlier replies, as eagle3-eval sends them);
plain greedy decoding with transformers' ``generate``, no draft. Not part of the test suite.

    python3 -m tests.benchmarks.target_repetition --max-new-tokens 512 --out F.json   # EAGLE3_CACHE set
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
from eagle3_train.core.prompt_files import read_conversations
from eagle3_train.evaluation.eval import REPEAT_NGRAM, bucket_edges, repeated_tokens
from eagle3_train.targets import load_target


def greedy_replies(target, conversations, max_new_tokens: int, batch: int) -> list[tuple[str, int, list[int]]]:
    """(source, turn, reply tokens without the end of turn) for every turn, turn by turn, batched."""
    tok = target.tokenizer
    tok.padding_side = "left"
    eos = {t for t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int) and t >= 0}
    replies: dict[str, list[str]] = {c.source: [] for c in conversations}
    out = []
    for turn in range(max(len(c.turns) for c in conversations)):
        todo = [c for c in conversations if turn < len(c.turns)]
        for i in range(0, len(todo), batch):
            part = todo[i : i + batch]
            texts = [
                tok.apply_chat_template(c.messages(turn, replies[c.source]), add_generation_prompt=True, tokenize=False)
                for c in part
            ]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                ids = target.model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=min(eos) if tok.pad_token_id is None else tok.pad_token_id,
                )
            for c, row in zip(part, ids[:, enc["input_ids"].shape[1] :].tolist()):
                end = next((j for j, t in enumerate(row) if t in eos), None)
                reply = row if end is None else row[:end]
                replies[c.source].append(tok.decode(reply))
                out.append((c.source, turn + 1, reply, end is None))
    return out


def repetition(replies, bucket: int) -> dict:
    shares: dict[tuple[int, int], list[bool]] = {}
    for _, _, tokens, _ in replies:
        for position, repeated in enumerate(repeated_tokens(tokens)):
            shares.setdefault(bucket_edges(position, bucket), []).append(repeated)
    lengths = sorted(len(t) for _, _, t, _ in replies)
    return {
        "replies": len(replies),
        "reply_tokens": sum(lengths),
        "median_reply_tokens": lengths[len(lengths) // 2],
        "replies_cut_at_max_new_tokens": sum(cut for *_, cut in replies),
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
    replies = greedy_replies(target, conversations, a.max_new_tokens, a.batch)
    result = {
        "what": f"the target's own greedy replies (fp32, transformers generate, no draft) to {os.path.relpath(a.prompts)}, "
        "every turn: "
        f"the share of reply tokens that close a run of {REPEAT_NGRAM} tokens seen earlier in the same reply "
        "(eagle3-eval's repeated_share), by position in the reply",
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}",
        "command": "python3 -m tests.benchmarks.target_repetition "
        f"--target {a.target} --max-new-tokens {a.max_new_tokens} --bucket {a.bucket} --out {a.out}",
        "date": date.today().isoformat(),
        "runs": "single run (greedy: deterministic)",
        "target": a.target,
        "max_new_tokens": a.max_new_tokens,
        "wall_s": round(time.time() - start, 1),
    } | repetition(replies, a.bucket)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["by_reply_position"]))


if __name__ == "__main__":
    main()
