"""The engines, by name: the one place every consumer asks (export, check, eval, the served dump,
served regeneration, served acceptance). Adding an engine is one module and one line here."""

from __future__ import annotations

from eagle3_train.core.errors import ConfigError
from eagle3_train.engines import hf, sglang, trtllm, vllm
from eagle3_train.engines.base import Engine

ENGINES: dict[str, Engine] = {
    "hf": hf.ENGINE,
    "sglang": sglang.ENGINE,
    "vllm": vllm.ENGINE,
    "trtllm": trtllm.ENGINE,
}


def names(role: str) -> list[str]:
    """The engines that play ``role`` (see :attr:`Engine.roles`), in registry order."""
    return [name for name, engine in ENGINES.items() if role in engine.roles]


def engine(name: str, role: str, option: str) -> Engine:
    """The engine ``name``, which must play ``role``; else a ConfigError naming ``option`` and
    the engines that would do."""
    found = ENGINES.get(name)
    if found is None or role not in found.roles:
        raise ConfigError(f"{option} must be one of {names(role)}, got {name!r}")
    return found
