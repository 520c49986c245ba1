"""A target's chat template: its text, one given in its place, and the flags every render passes
(``chat_template_kwargs``), kept on the tokenizer so they travel with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_train.core.errors import BadInputError, ConfigError

TEMPLATE_KWARGS_ATTR = "eagle3_chat_template_kwargs"


def set_template_kwargs(tokenizer: Any, kwargs: dict[str, Any] | None) -> None:
    """Every render of ``tokenizer``'s chat template here passes ``kwargs`` (a plain dict of
    JSON values: it travels with the tokenizer into tokenising processes)."""
    if kwargs is not None and not isinstance(kwargs, dict) and hasattr(kwargs, "items"):  # an OmegaConf node
        from omegaconf import OmegaConf

        kwargs = OmegaConf.to_container(kwargs, resolve=True)
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(f"chat_template_kwargs must be a mapping (e.g. {{enable_thinking: false}}), got {kwargs!r}")
    setattr(tokenizer, TEMPLATE_KWARGS_ATTR, json.loads(json.dumps(dict(kwargs or {}))))


def template_kwargs(tokenizer: Any) -> dict[str, Any]:
    """The flags :func:`set_template_kwargs` gave ``tokenizer`` ({} if none)."""
    return dict(getattr(tokenizer, TEMPLATE_KWARGS_ATTR, None) or {})


def chat_template_of(tokenizer: Any) -> str | None:
    """The tokenizer's default chat template text, or ``None``."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the 'default' one renders conversations
        template = template.get("default")
    return template or None


def read_template(value: str) -> str:
    """``chat_template=``: Jinja text is used as is; anything else names a template file."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise BadInputError(f"chat_template={value}: neither Jinja template text nor an existing file")
    return path.read_text()
