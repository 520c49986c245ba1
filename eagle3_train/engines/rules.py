"""What serving engines do with a draft's layer ids, asked by engine name (docs/concepts/engines.md).

The rules themselves are data in each engine's module (:mod:`eagle3_train.engines.sglang`,
:mod:`~eagle3_train.engines.vllm`, :mod:`~eagle3_train.engines.trtllm`), with the versions each
was read from and the runs that verified it; these are the pure queries over them, by name, for
every engine of the registry (:mod:`eagle3_train.engines.registry`).

``resolve`` answers "what will this engine capture given this config"; ``ids_for`` answers "what
must the config say so that this engine captures these HF indices", or raises :class:`Unexpressible`
with the reason. Export uses the second, check and eval the first; ``unservable`` (the second, over
every engine) lets the dump and the online trainer warn before a capture no engine serves is trained.
"""

from __future__ import annotations

from eagle3_train.core.errors import ContractError
from eagle3_train.engines import registry
from eagle3_train.engines.base import (  # noqa: F401  (re-exported: the names every consumer uses)
    FAMILIES,
    NESTED,
    NESTED_V2,
    TOP_KEY,
    Engine,
    Resolution,
    Rule,
    Unexpressible,
    engine_default,
    family_of,
)
from eagle3_train.engines.heads import Flags
from eagle3_train.engines.registry import ENGINES  # noqa: F401  (re-exported)


def _engine(name: str) -> Engine:
    engine = registry.ENGINES.get(name)
    if engine is None:
        raise ContractError(f"unknown engine {name!r}; known: {registry.names('rules')}")
    return engine


def rules_version() -> str:
    """The engine versions the rules were read from, for an export's record (``sglang-0.5.23/...``)."""
    return "/".join(f"{name}-{registry.ENGINES[name].version}" for name in registry.names("rules"))


def rules_for(engine: str, model_type: str) -> list[Rule]:
    """The rules of ``engine`` that apply to a target of ``model_type`` (several runners may;
    the engine's default runner first); none: the engine does not serve EAGLE-3 for it."""
    return _engine(engine).rules_for(model_type)


def verification(engine: str, model_type: str) -> str:
    """How this project knows the rule of ``engine`` for ``model_type``: a real run (which), the
    engines' source only (which versions), or no rule at all."""
    return _engine(engine).verification(model_type)


def resolve(config: dict, engine: str, model_type: str, num_hidden_layers: int) -> list[Resolution]:
    """What each runner of ``engine`` captures given the draft's ``config`` (default runner first);
    empty when the engine does not serve EAGLE-3 for ``model_type``."""
    return _engine(engine).resolve(config, model_type, num_hidden_layers)


def ids_for(
    hf_indices: list[int], engine: str, model_type: str, num_hidden_layers: int
) -> dict[tuple[str, ...], list[int]]:
    """The config entries that make ``engine`` capture ``hf_indices``: {key path: ids}.

    Raises :class:`Unexpressible` naming the engine, the family and what would work instead.
    """
    return _engine(engine).ids_for(hf_indices, model_type, num_hidden_layers)


def unservable(
    hf_indices: list[int], model_type: str, num_hidden_layers: int, engines: list[str] | None = None
) -> dict[str, str]:
    """{engine: why no config makes it capture ``hf_indices``} for each of ``engines`` (None: every
    engine with rules) that cannot (empty: all can)."""
    out = {}
    for engine in registry.names("rules") if engines is None else engines:
        try:
            ids_for(hf_indices, engine, model_type, num_hidden_layers)
        except Unexpressible as e:
            out[engine] = str(e)
    return out


def serving_warning(hf_indices: list[int], model_type: str, num_hidden_layers: int) -> str | None:
    """A warning when no engine export writes for can serve a draft trained on ``hf_indices``
    (None: one can)."""
    exporting = registry.names("export")
    bad = unservable(hf_indices, model_type, num_hidden_layers, exporting)
    if len(bad) < len(exporting):
        return None
    return (
        f"no serving engine can feed a draft the capture {list(hf_indices)}; eagle3-export will refuse it:\n  "
        + "\n  ".join(bad[e] for e in exporting)
    )


def fc_skipped(engine: str, num_aux: int, target_hidden: int, draft_hidden: int) -> bool:
    """Whether ``engine`` would skip ``fc``: it applies it only when the incoming width
    (``num_aux * target_hidden``) differs from the draft's hidden size."""
    return _engine(engine).skips_fc and num_aux * target_hidden == draft_hidden


# The weights SGLang 0.5.23 and vLLM 0.33.0 load into a one-layer LlamaForCausalLMEagle3 (their
# llama_eagle3.py; embeddings aside, which the target provides). Any other name is dropped without
# a word by SGLang's load_weights and is a KeyError in vLLM's, so an exported draft holds these only.
DRAFT_WEIGHTS = frozenset(
    {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    | {f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"}
    | {f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    | {f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")}
)


# The norms of the draft's forward flags (input_norm.weight, fc_norm.<i>.weight) are loaded only
# when their flag is on: each engine version's row says so (eagle3_train/engines/heads.py).
def flag_weights(flags: Flags, num_aux: int, engines: list[str]) -> dict[str, str]:
    """{our weight name: the name ``engines`` load} for the norms ``flags`` add; every version of
    every engine must load it under one name (raises :class:`ContractError` otherwise)."""
    out: dict[str, str] = {}
    for row in (row for e in engines for row in _engine(e).forwards):
        for ours, theirs in row.weight_names(flags, num_aux).items():
            if out.setdefault(ours, theirs) != theirs:
                raise ContractError(f"{row.name} loads {ours} as {theirs}, another engine as {out[ours]}")
    return out


def unloadable_weights(names: set[str], allowed: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The weight names neither engine would load (see :data:`DRAFT_WEIGHTS`; ``allowed``: the
    norms the draft's flags add, under the engines' names), sorted."""
    return sorted(set(names) - DRAFT_WEIGHTS - set(allowed))


def foreign_weights_text(engines: list[str]) -> str:
    """What ``engines`` do with a weight their draft class lacks (``SGLang 0.5.23 would silently
    drop and vLLM 0.33.0 would fail on``), for export's refusal."""
    found = [registry.ENGINES[e] for e in engines]
    return " and ".join(f"{e.title} {e.version} {e.foreign_weights}" for e in found if e.foreign_weights)
