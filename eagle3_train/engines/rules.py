"""What serving engines do with a draft's layer ids: the rules, as data, in one place (docs/concepts/engines.md).

Facts read from the engines' source (SGLang 0.5.23, vLLM 0.33.0, TensorRT-LLM main of 2026-08).
Each rule says for which targets it holds, where an engine reads the ids in the draft's
``config.json``, and which HF hidden-state indices (docs/concepts/hf-index.md) the ids it finds make it capture.
With no ids, every engine captures the default HF indices ``[2, N//2, N-3]``.

Engines capture residual streams, never a normed state: an id that lands on N is the last layer's
output *before* the final norm, which no HF index names (HF index N is the post-norm state). vLLM's
id N and SGLang's gpt_oss id N do exactly that; :func:`resolve` reports it as ``pre_norm_final``,
never as HF index N.

vLLM runs EAGLE-3 drafts (and ``extract_hidden_states``) only for the target classes that implement
its EAGLE-3 interface (:data:`VLLM_EAGLE3`); it refuses any other target at load. Its default runner
in 0.33 is V2, listed first. No vLLM id 0 gives the embeddings: the DeepSeek code (DeepSeek-V2/V3,
Kimi-K2) crashes on it, and the llama-family code hands over the embedding tensor itself, which the
first layer takes as its residual and ``fused_add_rms_norm`` then updates in place, so the draft gets
the last layer's pre-norm output instead (measured with vLLM 0.26.0 on an H200: a draft whose ids
start at 0 accepted 1.17 tokens per step; eagle3-eval predicted 1.39 feeding the embeddings and 1.16
feeding that state; ids without 0 agreed within 0.02; tests/benchmarks/results/vllm_h200.json).

``resolve`` answers "what will this engine capture given this config"; ``ids_for`` answers "what
must the config say so that this engine captures these HF indices", or raises :class:`Unexpressible`
with the reason. Export uses the second, check and eval the first; ``unservable`` (the second, over
every engine) lets the dump and the online trainer warn before a capture no engine serves is trained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from eagle3_train.core.errors import ContractError

RULES_VERSION = "sglang-0.5.23/vllm-0.33.0/trtllm-2026-08"

TOP_KEY = "eagle_aux_hidden_state_layer_ids"
NESTED = ("eagle_config", "eagle_aux_hidden_state_layer_ids")
NESTED_V2 = ("eagle_config", "layer_ids")

# The target model_types whose vLLM 0.33.0 classes implement its EAGLE-3 interface (llama, mistral,
# qwen2, qwen3, qwen3_moe, deepseek_v2/v3 -- Kimi-K2 runs in the DeepSeek-V3 class -- and gpt_oss);
# vLLM refuses every other target at load, for drafts and for extract_hidden_states alike.
VLLM_DEEPSEEK = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2"})
VLLM_EAGLE3 = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss"}) | VLLM_DEEPSEEK

# Target model_type -> the family whose engine code serves it.
FAMILIES = {
    # SGLang's MistralForCausalLM is its LlamaForCausalLM (models/mistral.py, 0.5.17)
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "qwen3_moe": "llama",
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
        versions: the engine versions the rule was read from (and which runner).
        family: a value of :data:`FAMILIES`, or ``*`` for every family.
        keys: where the ids are read, in order (the first present wins); each a key path.
        to_hf: config ids -> captured HF indices, given N (a result N is the pre-norm final state).
        note: what to tell the user about this engine.
        model_types: the target model_types the engine serves with this rule (None: every one of
            the family); for another the engine refuses the target.
        id0: why id 0 (the embeddings) fails in this engine ("": it does not).
        id0_is_final: id 0 runs but feeds, in its slot, the last layer's output before the final
            norm (the residual buffer the captured embedding tensor became); else id 0 crashes.
    """

    engine: str
    versions: str
    family: str
    keys: tuple[tuple[str, ...], ...]
    to_hf: Callable[[list[int], int], list[int]]
    note: str = ""
    model_types: frozenset[str] | None = None
    id0: str = ""
    id0_is_final: bool = False

    @property
    def min_id(self) -> int:
        """The smallest id for which the engine captures what the id names."""
        return 1 if self.id0 else 0


_VLLM_ID0 = ("vLLM's id 0 arrives overwritten: its capture keeps the embedding tensor, which the first layer makes "
             "its residual and fused_add_rms_norm updates in place (measured, vLLM 0.26.0)")
_VLLM_DEEPSEEK_ID0 = "vLLM's DeepSeek code crashes on id 0 (its residual is still None there)"
RULES = (
    Rule("sglang", "0.5.17, 0.5.23", "llama", (NESTED,), _plus_one, "reads only eagle_config; a top-level key is ignored"),
    Rule("sglang", "0.5.17, 0.5.23", "deepseek", (NESTED,), _deepseek, "adds 1 only when the first id is 1"),
    Rule("sglang", "0.5.17, 0.5.23", "gpt_oss", (NESTED,), _gpt_oss, "adds 1 unless the largest id is N"),
    # V2, vLLM 0.33's default runner, never reads eagle_config.eagle_aux_hidden_state_layer_ids
    Rule("vllm", "0.33.0 (V2 runner, the default)", "*", ((TOP_KEY,), NESTED_V2), _identity,
         "top-level key first", VLLM_EAGLE3 - VLLM_DEEPSEEK, id0=_VLLM_ID0, id0_is_final=True),
    Rule("vllm", "0.33.0 (V2 runner, the default)", "*", ((TOP_KEY,), NESTED_V2), _identity,
         "top-level key first", VLLM_DEEPSEEK, id0=_VLLM_DEEPSEEK_ID0),
    Rule("vllm", "0.33.0 (V1 runner)", "*", ((TOP_KEY,), NESTED), _identity, "top-level key first",
         VLLM_EAGLE3 - VLLM_DEEPSEEK, id0=_VLLM_ID0, id0_is_final=True),
    Rule("vllm", "0.33.0 (V1 runner)", "*", ((TOP_KEY,), NESTED), _identity,
         "top-level key first", VLLM_DEEPSEEK, id0=_VLLM_DEEPSEEK_ID0),
    Rule("trtllm", "main 2026-08", "*", (("eagle3_layers_to_capture",),), _plus_one,
         "reads eagle3_layers_to_capture from its own decoding config, not config.json"),
)
ENGINES = ("sglang", "vllm", "trtllm")

# (engine, target model_type) -> the real engine run that confirmed its rule: version, machine, date
# and the results file. Every other pair is read from the engines' source only (Rule.versions).
_FAMILIES_RUN = "H200, 2026-12-02, tiny targets and SmolLM2 (tests/benchmarks/results/families_vllm_h200.json)"
_SGLANG_RUN = "H200, 2026-12-02, tiny targets and SmolLM2 (tests/benchmarks/results/families_sglang_h200.json)"
VERIFIED: dict[tuple[str, str], str] = {
    # vLLM's served dump equal to the transformers dump (token ids identical, <= 4.3 % rel L2 per
    # layer in bf16) and its served draft accepting at eval's tau (within 3 % on SmolLM2, the trained
    # target; -11 % .. +5 % on random-init ones, whose greedy paths turn on near-tied logits)
    ("vllm", "llama"): "vLLM 0.26.0, H200, 2026-11-30 (tests/benchmarks/results/vllm_h200.json); "
                       f"served dump and served draft, {_FAMILIES_RUN}",
    **{("vllm", mt): f"vLLM 0.26.0: served dump and served draft, {_FAMILIES_RUN}"
       for mt in ("mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss")},
    # SGLang's acceptance length within 1.7 % of eval's tau for each (SGLang 0.5.17 has no aux-state dump)
    **{("sglang", mt): f"SGLang 0.5.17: served draft, {_SGLANG_RUN}"
       for mt in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss")},
}


def verification(engine: str, model_type: str) -> str:
    """How this project knows the rule of ``engine`` for ``model_type``: a real run (which), the
    engines' source only (which versions), or no rule at all."""
    if (engine, model_type) in VERIFIED:
        return f"verified by a run: {VERIFIED[(engine, model_type)]}"
    rules = rules_for(engine, model_type)
    if not rules:
        return "no rule: the engine serves no EAGLE-3 draft for it, or its code was not read"
    return "read from source only: " + "; ".join(sorted({f"{engine} {r.versions}" for r in rules}))


def engine_default(num_hidden_layers: int) -> list[int]:
    """What engines capture with no ids: [2, N//2, N-3], computed as they do (unchecked, so a
    shallow target gives what the engine would really take)."""
    n = num_hidden_layers
    return sorted([2, n // 2, n - 3])


def family_of(model_type: str) -> str | None:
    return FAMILIES.get(model_type)


def rules_for(engine: str, model_type: str) -> list[Rule]:
    """The rules of ``engine`` that apply to a target of ``model_type`` (several runners may;
    the engine's default runner first); none: the engine does not serve EAGLE-3 for it."""
    if engine not in ENGINES:
        raise ContractError(f"unknown engine {engine!r}; known: {list(ENGINES)}")
    fam = family_of(model_type)
    return [r for r in RULES if r.engine == engine and (r.family == "*" or r.family == fam)
            and (r.model_types is None or model_type in r.model_types)]


def known_model_types(engine: str) -> list[str]:
    """The target model_types some rule of ``engine`` covers."""
    return sorted(m for m in set(FAMILIES) | VLLM_EAGLE3 if rules_for(engine, m))


def _get(config: dict, path: tuple[str, ...]):
    node = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


@dataclass
class Resolution:
    """What one engine runner captures for a config.

    Args:
        rule: the runner's rule.
        ids: what it read (None: nothing, so the default).
        source: the key path it read, or "default".
        hf_indices: the HF indices it captures (ascending), never N.
        pre_norm_final: it also captures the last layer's output before the final norm (an id
            landing on N, or vLLM's id 0), which no HF index names.
        problem: why the engine fails on these ids (None: it runs).
        fed: the states it concatenates, in its order: HF indices, N for the pre-norm final state.
        note: what it does with these ids that the config does not say (None: nothing).
    """

    rule: Rule
    ids: list[int] | None
    source: str
    hf_indices: list[int]
    pre_norm_final: bool = False
    problem: str | None = None
    fed: list[int] = field(default_factory=list)
    note: str | None = None

    def describe(self) -> str:
        """``HF [..]`` (+ the pre-norm final state), for a report line."""
        return f"HF {self.hf_indices}" + (" + the pre-norm final state (no HF index)" if self.pre_norm_final else "")


def resolve(config: dict, engine: str, model_type: str, num_hidden_layers: int) -> list[Resolution]:
    """What each runner of ``engine`` captures given the draft's ``config`` (default runner first);
    empty when the engine does not serve EAGLE-3 for ``model_type``."""
    n = num_hidden_layers
    out = []
    for rule in rules_for(engine, model_type):
        for path in rule.keys:
            ids = _get(config, path)
            if ids is not None:
                ids, source = list(ids), ".".join(path)
                break
        else:
            ids, source = None, "default"
        fed = sorted(rule.to_hf(ids, n)) if ids is not None else engine_default(n)
        problem = note = None
        if ids is not None and ids and min(ids) < rule.min_id:
            why = rule.id0 if min(ids) == 0 else f"ids below {rule.min_id} are outside its rule"
            text = f"{engine} {rule.versions} cannot use id {min(ids)} for a {model_type} target: {why}"
            if rule.id0_is_final and min(ids) == 0:  # it runs, on the pre-norm final state in id 0's slot
                fed, note = [n] + [k for k in fed if k != 0], text
            else:
                problem = text
        out.append(Resolution(rule, ids, source, sorted(k for k in fed if k != n), n in fed, problem, fed, note))
    return out


def ids_for(hf_indices: list[int], engine: str, model_type: str, num_hidden_layers: int) -> dict[tuple[str, ...], list[int]]:
    """The config entries that make ``engine`` capture ``hf_indices``: {key path: ids}.

    Raises :class:`Unexpressible` naming the engine, the family and what would work instead.
    """
    n, ks = num_hidden_layers, list(hf_indices)
    rules = rules_for(engine, model_type)
    if not rules:
        if engine == "vllm":
            raise Unexpressible(
                f"vllm 0.33.0 runs EAGLE-3 drafts only for targets whose class implements its EAGLE-3 interface "
                f"({sorted(VLLM_EAGLE3)}); it refuses model_type {model_type!r} at load"
            )
        raise Unexpressible(
            f"{engine}: no rule covers target model_type {model_type!r} (known for {engine}: "
            f"{known_model_types(engine)}); its behaviour is unknown, so no config can be promised to work"
        )
    out: dict[tuple[str, ...], list[int]] = {}
    for rule in rules:
        candidates = [ks, [k - 1 for k in ks]]  # the only shapes the engines' rules take
        good = [v for v in candidates if min(v) >= rule.min_id and sorted(rule.to_hf(v, n)) == ks]
        if not good:
            raise Unexpressible(_why(engine, model_type, rule, ks, n))
        out.setdefault(rule.keys[0], good[0])
    return out


def unservable(hf_indices: list[int], model_type: str, num_hidden_layers: int,
               engines: tuple[str, ...] = ENGINES) -> dict[str, str]:
    """{engine: why no config makes it capture ``hf_indices``} for each of ``engines`` that cannot (empty: all can)."""
    out = {}
    for engine in engines:
        try:
            ids_for(hf_indices, engine, model_type, num_hidden_layers)
        except Unexpressible as e:
            out[engine] = str(e)
    return out


def serving_warning(hf_indices: list[int], model_type: str, num_hidden_layers: int) -> str | None:
    """A warning when neither SGLang nor vLLM can serve a draft trained on ``hf_indices`` (None: one can)."""
    bad = unservable(hf_indices, model_type, num_hidden_layers, ("sglang", "vllm"))
    if len(bad) < 2:
        return None
    return (f"no serving engine can feed a draft the capture {list(hf_indices)}; eagle3-export will refuse it:\n  "
            + "\n  ".join(bad[e] for e in ("sglang", "vllm")))


def _why(engine: str, model_type: str, rule: Rule, ks: list[int], n: int) -> str:
    fam = family_of(model_type)
    if 0 in ks and rule.to_hf is _plus_one:
        hint = "HF index 0 (the embeddings) cannot be captured: its id would be -1; choose aux layers >= 1"
    elif 0 in ks and rule.min_id > 0:
        hint = f"HF index 0 (the embeddings) cannot be captured: {rule.id0}; choose aux layers >= 1"
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
