"""Export's engine keys, resolved back by every engine rule, give the trained HF indices."""

import pytest

from eagle3_train.contract import CaptureSpec, TargetIdentity
from eagle3_train.engines import ids_for, resolve
from eagle3_train.errors import ContractError
from eagle3_train.export import engine_keys


def spec(model_type, aux, n=32, h=4096):
    ident = TargetIdentity("t", model_type, "c" * 64, "t" * 64, "h" * 64)
    return CaptureSpec(tuple(aux), n, h, 128256, "bfloat16", ident)


CASES = [
    ("llama", [2, 16, 29]), ("llama", [1, 5, 9, 31]), ("qwen3", [2, 18, 33]), ("qwen3_moe", [3, 24, 45]),
    ("qwen2", [1, 2]), ("deepseek_v2", [2, 30, 58]), ("deepseek_v2", [0, 30, 58]), ("deepseek_v3", [3, 31, 57]),
    ("gpt_oss", [2, 12, 21]),
]


@pytest.mark.parametrize("model_type, aux", CASES)
def test_exported_keys_resolve_to_the_trained_indices(model_type, aux):
    n = {"qwen3": 36, "qwen3_moe": 48, "deepseek_v2": 61, "deepseek_v3": 61, "gpt_oss": 24}.get(model_type, 32)
    config = engine_keys(spec(model_type, aux, n), ["sglang", "vllm"])
    for engine in ("sglang", "vllm"):
        for r in resolve(config, engine, model_type, n):
            assert r.hf_indices == aux, (engine, r.rule.versions, r.source, r.ids)


def test_worked_example_llama31():
    config = engine_keys(spec("llama", [2, 16, 29]), ["sglang", "vllm"])
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]


def test_vllm_only_export_works_for_any_family_and_embeddings():
    config = engine_keys(spec("mixtral", [0, 16, 29]), ["vllm"])
    assert [r.hf_indices for r in resolve(config, "vllm", "mixtral", 32)] == [[0, 16, 29]] * 2


@pytest.mark.parametrize("model_type, aux, engines, message", [
    ("llama", [0, 16, 29], ["sglang"], "HF index 0 \\(the embeddings\\) cannot be captured"),
    ("deepseek_v2", [1, 16, 29], ["sglang", "vllm"], "a first HF index of 1 cannot be written"),
    ("llama", [16], ["sglang"], "SGLang would skip fc"),
    ("mixtral", [2, 16, 29], ["sglang"], "no rule covers target model_type 'mixtral'"),
])
def test_unrepresentable_captures_are_refused(model_type, aux, engines, message):
    with pytest.raises(ContractError, match=message):
        engine_keys(spec(model_type, aux), engines)


def test_defaults_and_rule_quirks():
    # no ids anywhere: every engine captures [2, N//2, N-3]
    assert [r.hf_indices for r in resolve({}, "sglang", "llama", 32)] == [[2, 16, 29]]
    assert {r.source for r in resolve({}, "vllm", "llama", 32)} == {"default"}
    # the DeepSeek guess: ids starting at 1 are shifted, others are not
    assert resolve({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}, "sglang", "deepseek_v2", 61)[0].hf_indices == [2, 30, 58]
    assert resolve({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 29, 57]}}, "sglang", "deepseek_v2", 61)[0].hf_indices == [2, 29, 57]
    # gpt_oss: no shift when the largest id is N
    assert resolve({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 12, 24]}}, "sglang", "gpt_oss", 24)[0].hf_indices == [1, 12, 24]
    # vLLM V1 falls back to the nested key, V2 to eagle_config.layer_ids
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28], "layer_ids": [3, 4, 5]}}
    assert [r.hf_indices for r in resolve(nested, "vllm", "llama", 32)] == [[1, 15, 28], [3, 4, 5]]
    assert ids_for([2, 16, 29], "trtllm", "llama", 32) == {("eagle3_layers_to_capture",): [1, 15, 28]}


def test_check_warns_about_unknown_families():
    from types import SimpleNamespace

    from eagle3_train.check import check

    target = SimpleNamespace(model_type="mixtral", num_hidden_layers=32, hidden_size=4096, vocab_size=32000)
    config = {"eagle_aux_hidden_state_layer_ids": [2, 16, 29], "draft_vocab_size": 32000}
    lines, findings = check(config, {}, target, [2, 16, 29], ["sglang", "vllm"])
    assert [f.level for f in findings] == ["warning"] and "no rule known for model_type 'mixtral'" in findings[0].text
    assert any("vllm" in line and "OK" in line for line in lines)
