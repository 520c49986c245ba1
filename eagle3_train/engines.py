"""What serving engines do with a draft's layer ids: the rules, as data, in one place (DESIGN §2).

Facts read from the engines' source (SGLang 0.5.23, vLLM 0.33.0, TensorRT-LLM main of 2026-08).
Each rule says where an engine reads the ids in the draft's ``config.json`` and which HF
hidden-state indices (DESIGN §1) the ids it finds make it capture. With no ids, every engine
captures the default HF indices ``[2, N//2, N-3]``.

``resolve`` answers "what will this engine capture given this config"; ``ids_for`` answers "what
must the config say so that this engine captures these HF indices", or raises :class:`Unexpressible`
with the reason. Export uses the second, check and eval the first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from eagle3_train.errors import ContractError

RULES_VERSION = "sglang-0.5.23/vllm-0.33.0/trtllm-2026-08"

TOP_KEY = "eagle_aux_hidden_state_layer_ids"
NESTED = ("eagle_config", "eagle_aux_hidden_state_layer_ids")
NESTED_V2 = ("eagle_config", "layer_ids")

# Target model_type -> the family whose engine code serves it.
FAMILIES = {
    "llama": "llama", "qwen2": "llama", "qwen3": "llama", "qwen3_moe": "llama",
    # SGLang's DeepSeek-V3 / Kimi-K2 classes live in its deepseek_v2 code and share its rule
    "deepseek_v2": "deepseek", "deepseek_v3": "deepseek", "kimi_k2": "deepseek", "glm4_moe_lite": "deepseek",
    "gpt_oss": "gpt_oss",
}


class Unexpressible(ContractError):
    """An engine cannot be told to capture these HF indices."""


def _plus_one(ids: list[int], n: int) -> list[int]:
    return [v + 1 for v in ids]


def _deepseek(ids: list[int], n: int) -> list[int]:
    # SGLang's DeepSeek code guesses: a list starting at 1 is taken as 0-based layer numbers
    return [v + 1 for v in ids] if ids and ids[0] == 1 else list(ids)


def _gpt_oss(ids: list[int], n: int) -> list[int]:
    return list(ids) if ids and max(ids) == n else [v + 1 for v in ids]


def _identity(ids: list[int], n: int) -> list[int]:
    return list(ids)


@dataclass(frozen=True)
class Rule:
    """How one engine reads the ids for one target family.

    Args:
        engine: ``sglang``, ``vllm`` or ``trtllm``.
        versions: the engine versions the rule was read from.
        family: a value of :data:`FAMILIES`, or ``*`` for every family.
        keys: where the ids are read, in order (the first present wins); each a key path.
        to_hf: config ids -> captured HF indices, given N.
        note: what to tell the user about this engine.
    """

    engine: str
    versions: str
    family: str
    keys: tuple[tuple[str, ...], ...]
    to_hf: Callable[[list[int], int], list[int]]
    note: str = ""


RULES = (
    Rule("sglang", "0.5.23", "llama", (NESTED,), _plus_one, "reads only eagle_config; a top-level key is ignored"),
    Rule("sglang", "0.5.23", "deepseek", (NESTED,), _deepseek, "adds 1 only when the first id is 1"),
    Rule("sglang", "0.5.23", "gpt_oss", (NESTED,), _gpt_oss, "adds 1 unless the largest id is N"),
    Rule("vllm", "0.33.0 (V1 runner)", "*", ((TOP_KEY,), NESTED), _identity, "top-level key first"),
    Rule("vllm", "0.33.0 (V2 runner)", "*", ((TOP_KEY,), NESTED_V2), _identity, "top-level key first"),
    Rule("trtllm", "main 2026-08", "*", (("eagle3_layers_to_capture",),), _plus_one,
         "reads eagle3_layers_to_capture from its own decoding config, not config.json"),
)
ENGINES = ("sglang", "vllm", "trtllm")


def engine_default(num_hidden_layers: int) -> list[int]:
    """What engines capture with no ids: [2, N//2, N-3], computed as they do (unchecked, so a
    shallow target gives what the engine would really take)."""
    n = num_hidden_layers
    return sorted([2, n // 2, n - 3])


def family_of(model_type: str) -> str | None:
    return FAMILIES.get(model_type)


def rules_for(engine: str, model_type: str) -> list[Rule]:
    """The rules of ``engine`` that apply to a target of ``model_type`` (several runners may)."""
    if engine not in ENGINES:
        raise ContractError(f"unknown engine {engine!r}; known: {list(ENGINES)}")
    fam = family_of(model_type)
    return [r for r in RULES if r.engine == engine and (r.family == "*" or r.family == fam)]


def _get(config: dict, path: tuple[str, ...]):
    node = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


@dataclass
class Resolution:
    """What one engine runner captures for a config."""

    rule: Rule
    ids: list[int] | None  # what it read (None: nothing, so the default)
    source: str  # the key path it read, or "default"
    hf_indices: list[int]


def resolve(config: dict, engine: str, model_type: str, num_hidden_layers: int) -> list[Resolution]:
    """The HF indices each runner of ``engine`` captures given the draft's ``config``."""
    out = []
    for rule in rules_for(engine, model_type):
        for path in rule.keys:
            ids = _get(config, path)
            if ids is not None:
                out.append(Resolution(rule, list(ids), ".".join(path), sorted(rule.to_hf(list(ids), num_hidden_layers))))
                break
        else:
            out.append(Resolution(rule, None, "default", engine_default(num_hidden_layers)))
    return out


def ids_for(hf_indices: list[int], engine: str, model_type: str, num_hidden_layers: int) -> dict[tuple[str, ...], list[int]]:
    """The config entries that make ``engine`` capture ``hf_indices``: {key path: ids}.

    Raises :class:`Unexpressible` naming the engine, the family and what would work instead.
    """
    n, ks = num_hidden_layers, list(hf_indices)
    rules = rules_for(engine, model_type)
    if not rules:
        raise Unexpressible(
            f"{engine}: no rule covers target model_type {model_type!r} (known for {engine}: "
            f"{sorted({m for m, f in FAMILIES.items() if any(r.family == f for r in RULES if r.engine == engine)})}); "
            f"its behaviour is unknown, so no config can be promised to work"
        )
    out: dict[tuple[str, ...], list[int]] = {}
    for rule in rules:
        candidates = [ks, [k - 1 for k in ks]]  # the only shapes the engines' rules take
        good = [v for v in candidates if min(v) >= 0 and sorted(rule.to_hf(v, n)) == ks]
        if not good:
            raise Unexpressible(_why(engine, model_type, rule, ks, n))
        out.setdefault(rule.keys[0], good[0])
    return out


def _why(engine: str, model_type: str, rule: Rule, ks: list[int], n: int) -> str:
    fam = family_of(model_type)
    if 0 in ks and rule.to_hf is _plus_one:
        hint = "HF index 0 (the embeddings) cannot be captured: choose aux layers >= 1, or serve with vLLM"
    elif rule.to_hf is _deepseek and ks[0] == 1:
        hint = ("a first HF index of 1 cannot be written: ids starting at 1 are shifted by one, ids starting "
                "at 0 are not; choose a first layer other than 1, or serve with vLLM")
    else:
        hint = "choose other aux layers, or another engine"
    return f"{engine} ({rule.versions}, {fam or model_type} family, {rule.note}) cannot capture HF indices {ks} (N={n}): {hint}"


def fc_skipped(engine: str, num_aux: int, target_hidden: int, draft_hidden: int) -> bool:
    """SGLang applies ``fc`` only when the incoming width differs from the draft's hidden size."""
    return engine == "sglang" and num_aux * target_hidden == draft_hidden


# The weights SGLang 0.5.23 and vLLM 0.33.0 load into a one-layer LlamaForCausalLMEagle3 (their
# llama_eagle3.py; embeddings aside, which the target provides). Any other name is dropped without
# a word by SGLang's load_weights and is a KeyError in vLLM's, so an exported draft holds these only.
DRAFT_WEIGHTS = frozenset(
    {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    | {f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"}
    | {f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    | {f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")}
)


def unloadable_weights(names: set[str]) -> list[str]:
    """The weight names neither engine would load (see :data:`DRAFT_WEIGHTS`), sorted."""
    return sorted(set(names) - DRAFT_WEIGHTS)
