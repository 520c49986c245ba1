"""The CPU side of one synthesis chunk (issue #13): eagle3-prepare synthesize= on the embedded
target's tokenizer and template, with the generation replaced by a stand-in that returns at once
(questions of 25 random words, answers of 120 tokens), so only rendering, tokenising, decoding,
filtering and writing are timed. Not part of the test suite.

    python3 benchmarks/bench_synth_cpu.py --n 2048 --out /tmp/synth_cpu.json   # EAGLE3_CACHE set
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from common import FILLER_WORDS

import data_prep.synthesize as synthesize
from data_prep.prepare import PrepareConfig, Preparer
from data_prep.regenerate import RegenConfig
from data_prep.synthesize import SynthConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2048, help="conversations, one chunk")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import os

    prompts = Path(synthesize.__file__).parent / "prompts"
    cache = os.environ.get("EAGLE3_CACHE")
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = PrepareConfig(
            target="embedded",
            cache_dir=cache,
            out=f"{tmp}/synth",
            synthesize=a.n,
            progress=False,
            device="cpu",
            tokenize_workers=1,
            synth=SynthConfig(
                chunk_size=a.n,
                system_prompts_file=str(prompts / "synth_systems.txt"),
                keep_system_prompt=False,
                example_prompts_file=str(prompts / "train.jsonl"),
            ),
            regen=RegenConfig(max_new_tokens=128, batch_size=a.n),
        )
        preparer = Preparer(cfg)
        tok = preparer.target.tokenizer
        answer = tok("Learning Python is easy. " * 25, add_special_tokens=False)["input_ids"][:120]

        def stand_in(model, prompts, cfg, stops, pad, bar=None, seed=0):
            if cfg.do_sample:  # the questions
                return [
                    tok(" ".join(rng.choices(FILLER_WORDS, k=25)) + "?", add_special_tokens=False)["input_ids"]
                    for _ in prompts
                ], {}
            return [list(answer) for _ in prompts], {}

        synthesize.generate_sorted = stand_in
        chunk = {}
        real = synthesize.Synthesizer._generate_chunk

        def timed(self, c):
            t0 = time.perf_counter()
            real(self, c)
            chunk[c] = time.perf_counter() - t0

        synthesize.Synthesizer._generate_chunk = timed
        preparer._load_generator = lambda: (None, [tok.eos_token_id])
        preparer.run()
    result = {
        "what": "CPU seconds of one synthesis chunk with a stand-in generator (benchmarks/bench_synth_cpu.py)",
        "conversations": a.n,
        "chunk_seconds": {str(k): round(v, 3) for k, v in chunk.items()},
    }
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
