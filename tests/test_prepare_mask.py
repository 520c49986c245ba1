"""The loss mask is exactly the assistant spans (content + end-of-turn), for several templates.

The tiny tokenizer is byte-level without merges, so the expected ids of a rendered conversation are
the concatenation of its pieces' ids: the test builds them piece by piece, independently of how
prepare finds the spans.
"""

import numpy as np
import pytest

from conftest import LLAMA2_TEMPLATE, LLAMA3_TEMPLATE, SMOLLM2_TEMPLATE
from data_prep.chat import render_with_mask, special_ids
from eagle3_train.targets.tiny import build_tiny_tokenizer

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Say 'Hello!' twice."},  # user text repeating assistant text
    {"role": "assistant", "content": "Hello! Hello!"},
]
NO_SYSTEM = CONV[1:]

# (template, conversation, pieces): each piece is (text, is_assistant).
CASES = {
    "llama3": (
        LLAMA3_TEMPLATE,
        CONV,
        [
            (
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
                0,
            ),
            ("Hello! How can I help?<|eot_id|>", 1),
            (
                "<|start_header_id|>user<|end_header_id|>\n\nSay 'Hello!' twice.<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
                0,
            ),
            ("Hello! Hello!<|eot_id|>", 1),
        ],
    ),
    "chatml-default-system": (
        SMOLLM2_TEMPLATE,
        NO_SYSTEM,
        [
            (
                "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
                "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
                0,
            ),
            ("Hello! How can I help?<|im_end|>", 1),
            ("\n<|im_start|>user\nSay 'Hello!' twice.<|im_end|>\n<|im_start|>assistant\n", 0),
            ("Hello! Hello!<|im_end|>", 1),
            ("\n", 0),
        ],
    ),
    "chatml-system": (
        SMOLLM2_TEMPLATE,
        CONV,
        [
            (
                "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
                0,
            ),
            ("Hello! How can I help?<|im_end|>", 1),
            ("\n<|im_start|>user\nSay 'Hello!' twice.<|im_end|>\n<|im_start|>assistant\n", 0),
            ("Hello! Hello!<|im_end|>", 1),
            ("\n", 0),
        ],
    ),
    "llama2-system-in-user": (
        LLAMA2_TEMPLATE,
        CONV,
        [
            ("<|begin_of_text|>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi there [/INST] ", 0),
            ("Hello! How can I help? <|end_of_text|>", 1),
            ("<|begin_of_text|>[INST] Say 'Hello!' twice. [/INST] ", 0),
            ("Hello! Hello! <|end_of_text|>", 1),
        ],
    ),
}


def expected(tokenizer, pieces):
    ids, mask = [], []
    for text, is_assistant in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [is_assistant] * len(piece)
    return np.array(ids), np.array(mask)


@pytest.mark.parametrize("case", sorted(CASES))
def test_mask_equals_assistant_spans(case):
    template, conv, pieces = CASES[case]
    tok = build_tiny_tokenizer(template)
    r = render_with_mask(tok, conv, "test", max_length=4096, truncate=True, end_ids=special_ids(tok))
    want_ids, want_mask = expected(tok, pieces)
    np.testing.assert_array_equal(r.input_ids, want_ids)
    np.testing.assert_array_equal(r.loss_mask, want_mask)
    # and the ids are exactly what the template's own tokenisation gives
    assert r.input_ids.tolist() == tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]


def test_truncation_keeps_prefix():
    tok = build_tiny_tokenizer(LLAMA3_TEMPLATE)
    full = render_with_mask(tok, CONV, "t", max_length=4096, truncate=True, end_ids=special_ids(tok))
    cut = render_with_mask(tok, CONV, "t", max_length=100, truncate=True, end_ids=special_ids(tok))
    assert cut.truncated and not full.truncated
    np.testing.assert_array_equal(cut.input_ids, full.input_ids[:100])
    np.testing.assert_array_equal(cut.loss_mask, full.loss_mask[:100])


@pytest.mark.slow
def test_mask_on_smollm2_tokenizer():
    """The real SmolLM2 tokenizer (BPE with merges): masked tokens decode to content + <|im_end|>."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoTokenizer

    from eagle3_train.targets import EMBEDDED_GGUF, EMBEDDED_PACKAGE

    folder = Path(importlib.util.find_spec(EMBEDDED_PACKAGE).submodule_search_locations[0])
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=EMBEDDED_GGUF)
    r = render_with_mask(tok, NO_SYSTEM, "t", max_length=4096, truncate=True, end_ids=special_ids(tok))
    runs, current = [], []
    for i, m in zip(r.input_ids.tolist(), r.loss_mask.tolist()):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    assert [tok.decode(run) for run in runs] == ["Hello! How can I help?<|im_end|>", "Hello! Hello!<|im_end|>"]
