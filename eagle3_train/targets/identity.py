"""What identifies a target across machines and stages: its config's math, its tokenizer and its
chat template, hashed into a :class:`~eagle3_train.core.contract.TargetIdentity`."""

from __future__ import annotations

import json
from typing import Any

from eagle3_train.core.contract import TargetIdentity
from eagle3_train.core.fileio import sha256_json, sha256_text
from eagle3_train.targets.template import chat_template_of, template_kwargs

# Config keys that describe how a model was saved or run, not what it computes.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "quantization_config",
        "architectures",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_commit_hash",
    }
)


def text_config(config: Any) -> Any:
    """The language-model part of a config (multimodal configs nest it as ``text_config``)."""
    return getattr(config, "text_config", None) or config


def config_hash(config: Any) -> str:
    """sha256 of what a config says about the model's math (not how it was saved or run)."""
    return sha256_json({k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS})


def target_identity(name: str, config: Any, tokenizer: Any) -> TargetIdentity:
    """Path and hashes that identify a target across machines and stages."""
    return TargetIdentity(
        path=name,
        model_type=str(text_config(config).model_type),
        config_hash=config_hash(config),
        tokenizer_hash=tokenizer_hash(tokenizer),
        chat_template_hash=sha256_text(chat_template_of(tokenizer) or ""),
        chat_template_kwargs=template_kwargs(tokenizer),
    )


def _tokenizer_spec(tokenizer: Any) -> dict[str, Any]:
    """What makes the tokenizer map text to ids (not its padding/truncation state), by part."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
    else:  # a slow (Python) tokenizer: its vocabulary defines it
        spec = {"vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])}
    spec["special_tokens"] = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    return spec


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of what makes the tokenizer map text to ids (not its padding/truncation state)."""
    return sha256_json(_tokenizer_spec(tokenizer))


def tokenizer_facts(tokenizer: Any) -> dict[str, Any]:
    """What a manifest records beside :func:`tokenizer_hash` so that a mismatch can be explained: the
    hash of each part of the tokenizer, its special tokens, and the libraries that loaded it (one
    checkpoint, a GGUF above all, can load as another tokenizer under another transformers)."""
    import tokenizers
    import transformers

    spec = _tokenizer_spec(tokenizer)
    return {
        "parts": {k: sha256_json(v) for k, v in sorted(spec.items()) if k != "special_tokens"},
        "special_tokens": spec["special_tokens"],
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def tokenizer_differences(there: dict[str, Any], here: dict[str, Any]) -> str:
    """How the tokenizer ``there`` (facts a manifest recorded) differs from ``here``, in words: its
    special tokens that differ, the other parts that differ, and the libraries where they differ."""
    said = []
    t, h = there.get("special_tokens", {}), here.get("special_tokens", {})
    tokens = [f"{k} {t.get(k)!r} there, {h.get(k)!r} here" for k in sorted(set(t) | set(h)) if t.get(k) != h.get(k)]
    if tokens:
        said.append(f"special tokens: {'; '.join(tokens)}")
    tp, hp = there.get("parts", {}), here.get("parts", {})
    parts = [k for k in sorted(set(tp) | set(hp)) if tp.get(k) != hp.get(k)]
    if parts:
        said.append(f"other parts: {', '.join(parts)}")
    libs = [
        f"{k} {there.get(k)} there, {here.get(k)} here"
        for k in ("transformers", "tokenizers")
        if there.get(k) != here.get(k)
    ]
    if libs:
        said.append(f"loaded by {'; '.join(libs)}")
    return ". ".join(said)
