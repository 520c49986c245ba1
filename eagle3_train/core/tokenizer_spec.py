"""What a tokenizer is, by part: the spec its hash is taken over (:func:`eagle3_train.targets.identity.tokenizer_hash`),
and the facts a prepared manifest records beside the hash so that a tokenizer that differs later can be
explained in words (which special tokens, which parts, which libraries loaded it)."""

from __future__ import annotations

import json
from typing import Any

from eagle3_train.core.fileio import sha256_json


def tokenizer_spec(tokenizer: Any) -> dict[str, Any]:
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


def tokenizer_facts(tokenizer: Any) -> dict[str, Any]:
    """What a manifest records beside the tokenizer hash so that a mismatch can be explained: the
    hash of each part of the tokenizer, its special tokens, and the libraries that loaded it (one
    checkpoint, a GGUF above all, can load as another tokenizer under another transformers)."""
    import tokenizers
    import transformers

    spec = tokenizer_spec(tokenizer)
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
