"""Tiny random-init targets, built in process from the transformers classes: ``target=tiny`` and
``target=tiny:<family>``.

``tiny`` is the 4-layer Llama (hidden 64) the unit tests run on in well under a second.
``tiny:<family>`` is one target of each family an engine serves with EAGLE-3, small but with the
family's own machinery: 8 layers (so the default aux indices ``[2, 4, 5]`` are distinct), hidden 256,
GQA, mixture-of-experts with 4 experts and top-2 routing, DeepSeek's multi-head latent attention,
gpt-oss's attention sinks and alternating sliding-window layers, tied and untied embeddings. They
share a byte-level tokenizer (one token per UTF-8 byte) with a ChatML template, and can be saved as a
Hugging Face directory (:func:`save_tiny`) that an engine loads like a user's model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle3_train.core import families
from eagle3_train.core.errors import ConfigError

# ChatML, as SmolLM2 and Qwen use it: the default template of the tiny targets.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<pad>",
)
TINY_VOCAB_SIZE = 320  # 256 bytes + 8 special tokens, padded as real vocabularies are
_TOKEN_IDS = {t: 256 + i for i, t in enumerate(TINY_SPECIAL_TOKENS)}

TINY = "tiny"
PREFIX = "tiny:"

# Shared by every family: the vocabulary, the special token ids and an honest small shape.
_COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "bos_token_id": _TOKEN_IDS["<|begin_of_text|>"],
    "eos_token_id": [_TOKEN_IDS["<|im_end|>"], _TOKEN_IDS["<|eot_id|>"], _TOKEN_IDS["<|end_of_text|>"]],
    "pad_token_id": _TOKEN_IDS["<pad>"],
}

# family -> the model_type and what its config says beyond _COMMON: the family table's tiny column
# (eagle3_train/core/families.py).
FAMILIES: dict[str, dict[str, Any]] = {
    f.model_type: {"model_type": f.model_type, **f.tiny} for f in families.FAMILIES if f.tiny is not None
}


def is_tiny(target: str) -> bool:
    """Whether ``target`` names a tiny in-process target (``tiny`` or ``tiny:<family>``)."""
    return target == TINY or target.startswith(PREFIX)


def tiny_family(target: str) -> str | None:
    """The family of ``tiny:<family>`` (None for the plain ``tiny``), refusing an unknown one."""
    if target == TINY:
        return None
    family = target[len(PREFIX) :]
    if family not in FAMILIES:
        raise ConfigError(
            f"target={target}: no tiny target of family {family!r}; choose one of "
            f"{', '.join(PREFIX + f for f in FAMILIES)} (or plain {TINY})"
        )
    return family


def tiny_config(target: str = TINY) -> Any:
    """Config of ``target``: ``tiny`` is 4 layers, hidden 64, GQA 4/2 heads; ``tiny:<family>`` is
    :data:`FAMILIES`' row over the shared shape. Vocabulary 320 for all."""
    from transformers import AutoConfig, LlamaConfig

    family = tiny_family(target)
    if family is None:
        return LlamaConfig(
            **{**_COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4},
            tie_word_embeddings=False,
        )
    row = dict(FAMILIES[family])
    return AutoConfig.for_model(row.pop("model_type"), **{**_COMMON, **row})


def build_tiny_model(config: Any | None = None, seed: int = 0) -> Any:
    """The tiny target of ``config`` (default: ``tiny``'s) with weights fixed by ``seed``, in fp32
    (the global RNG is left untouched). A family target (8 layers) replies in text: see
    :func:`_speak_text`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = config or tiny_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    if config.num_hidden_layers != 4:
        _speak_text(model)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    return model.eval()


def _speak_text(model: Any) -> None:
    """Keep greedy replies to bytes and the end of turn, so a regenerated reply is never empty or
    cut at a token the tokenizer lacks: the output rows of the padding ids (no token of the
    tokenizer) are zeroed, those of the special tokens other than ``<|im_end|>`` scaled by 1/100
    (with tied embeddings they are also the input rows, which prompts use)."""
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head[256 + len(TINY_SPECIAL_TOKENS) :] = 0
        quiet = [i for i in range(256, 256 + len(TINY_SPECIAL_TOKENS)) if i != _TOKEN_IDS["<|im_end|>"]]
        head[quiet] *= 0.01


def build_tiny_tokenizer(chat_template: str = CHATML_TEMPLATE) -> Any:
    """A byte-level tokenizer (one token per UTF-8 byte, no merges) plus special tokens.

    Every string round-trips, and tokenisation is plain concatenation, which lets tests build the
    expected ids of a conversation piece by piece.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        additional_special_tokens=[
            t for t in TINY_SPECIAL_TOKENS if t not in {"<|begin_of_text|>", "<|im_end|>", "<pad>"}
        ],
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def save_tiny(target: str, directory: str | Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Save ``target`` (``tiny`` or ``tiny:<family>``) as a Hugging Face directory (config,
    safetensors weights in ``dtype``, tokenizer with its chat template, generation config), the way a
    user's model arrives: engines and ``target=<dir>`` load it. Returns the directory."""
    out = Path(directory)
    model = build_tiny_model(tiny_config(target), seed=seed).to(getattr(torch, dtype))
    model.save_pretrained(out)
    # every field written, as released checkpoints write them: transformers saves only the fields
    # that differ from its class defaults, and an engine pinned to an older transformers reads the
    # file with older defaults (SGLang 0.5.17 on transformers 5.12.1 has no gpt-oss swiglu_limit)
    (out / "config.json").write_text(model.config.to_json_string(use_diff=False))
    build_tiny_tokenizer().save_pretrained(out)
    return out
