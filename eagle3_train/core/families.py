"""Every target family the project knows, one row each: what the engine rules, the served dump, the
static decoder, the tiny test targets, the stand-in engines and the generated docs need to know
about a ``model_type``. Adding a family is one row here and its tests.

The engines' own facts that hold for every family (how SGLang maps ids, which flags vLLM takes) stay
in the engine's module; what differs by family is here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# the tiny MoE blocks' shared sizes (targets/tiny.py builds the configs)
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 256, "norm_topk_prob": True}


@dataclass(frozen=True)
class Family:
    """One target ``model_type``.

    Args:
        model_type: the transformers ``model_type`` of the target's config.
        engine_code: whose model code serves it in the engines (an engine rule names one, or ``*``):
            ``llama`` (SGLang's MistralForCausalLM is its LlamaForCausalLM, Qwen's follow it),
            ``deepseek`` (DeepSeek-V2/V3, Kimi-K2 and GLM-4-MoE-Lite classes in SGLang's
            deepseek_v2 code) or ``gpt_oss``.
        vllm_eagle3: vLLM's class for it implements the EAGLE-3 interface (others it refuses at load).
        vllm_deepseek_code: vLLM runs it in its DeepSeek code, which crashes on layer id 0.
        final_norm: how transformers applies its final RMSNorm: ``llama`` (multiplies in the model
            dtype) or ``fp32`` (gpt_oss); the served dump recomputes the final state so.
        sglang_final_post_norm: SGLang's ``--enable-return-hidden-states`` returns the post-norm
            final state for it (its model code hands the normed state to the logits processor).
        static_qk_norm: the static decoder (targets/static.py: dense, full attention) runs it, with
            an RMSNorm over each head's query and key (Qwen3) or without; None: it does not.
        tiny: the tiny test target's config beyond the shared shape (targets/tiny.py), None: no
            tiny target of this family.
    """

    model_type: str
    engine_code: str
    vllm_eagle3: bool = True
    vllm_deepseek_code: bool = False
    final_norm: str = "llama"
    sglang_final_post_norm: bool = True
    static_qk_norm: bool | None = None
    tiny: dict[str, Any] | None = field(default=None, hash=False, compare=False)


FAMILIES: tuple[Family, ...] = (
    Family("llama", "llama", static_qk_norm=False, tiny={"tie_word_embeddings": False}),
    Family(
        "mistral",
        "llama",
        static_qk_norm=False,
        tiny={"head_dim": 64, "sliding_window": None, "tie_word_embeddings": False},
    ),
    Family("qwen2", "llama", static_qk_norm=False, tiny={"tie_word_embeddings": True}),
    Family("qwen3", "llama", static_qk_norm=True, tiny={"head_dim": 64, "tie_word_embeddings": True}),
    Family(
        "qwen3_moe",
        "llama",
        # transformers 5.17 names the expert count num_experts, later releases num_local_experts
        tiny={
            **_MOE,
            "num_experts": 4,
            "num_local_experts": 4,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "head_dim": 64,
            "tie_word_embeddings": False,
        },
    ),
    Family("deepseek_v2", "deepseek", vllm_deepseek_code=True),
    Family(
        "deepseek_v3",
        "deepseek",
        vllm_deepseek_code=True,
        # MLA with DeepSeek-V3's per-head dimensions (the MLA kernels of the engines assume them); MLA
        # needs as many key/value heads as query heads
        tiny={
            **_MOE,
            "num_key_value_heads": 4,
            "q_lora_rank": 128,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "head_dim": 64,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "num_nextn_predict_layers": 0,
            # what DeepSeek-V3's own config.json says and transformers always computes (sigmoid
            # scores, bias-corrected top-k); vLLM 0.26 reads them and, without topk_method, builds
            # no e_score_correction_bias and fails at load on the checkpoint's (seen on an H200)
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            # DeepSeek-V3's config.json has it and SGLang 0.5.17's deepseek_v2.py reads it
            # (AttributeError at load without; seen on an H200); transformers ignores it
            "moe_layer_freq": 1,
            "tie_word_embeddings": False,
        },
    ),
    # Kimi-K2 runs in the DeepSeek-V3 classes of both engines
    Family("kimi_k2", "deepseek", vllm_deepseek_code=True),
    Family("glm4_moe_lite", "deepseek", vllm_eagle3=False),
    Family(
        "gpt_oss",
        "gpt_oss",
        final_norm="fp32",
        # attention sinks as transformers builds them; sliding window 32 alternating with full
        # attention, shorter than a byte-tokenized prompt, so the windowed layers really cut
        tiny={
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 256,
            "head_dim": 64,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"] * 4,
            "tie_word_embeddings": False,
        },
    ),
)

BY_TYPE: dict[str, Family] = {f.model_type: f for f in FAMILIES}


def family(model_type: str) -> Family | None:
    """The row of ``model_type`` (None: a model_type no part of the project was written for)."""
    return BY_TYPE.get(model_type)


def model_types(**where: Any) -> frozenset[str]:
    """The model_types whose rows have every field of ``where`` at the value given
    (``model_types(vllm_eagle3=True)``)."""
    return frozenset(f.model_type for f in FAMILIES if all(getattr(f, k) == v for k, v in where.items()))
