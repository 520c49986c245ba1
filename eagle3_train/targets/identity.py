"""What identifies a target across machines and stages: its config's math, its tokenizer and its
chat template, hashed into a :class:`~eagle3_train.core.contract.TargetIdentity`."""

from __future__ import annotations

from typing import Any

from eagle3_train.core.contract import TargetIdentity
from eagle3_train.core.fileio import sha256_json, sha256_text
from eagle3_train.core.tokenizer_spec import tokenizer_spec
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


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of what makes the tokenizer map text to ids (not its padding/truncation state)."""
    return sha256_json(tokenizer_spec(tokenizer))
