"""Export's engine keys, resolved back by every engine rule, give the trained HF indices."""

import pytest

from eagle3_train.core.contract import CaptureSpec, TargetIdentity
from eagle3_train.core.errors import ContractError
from eagle3_train.engines.rules import ids_for, resolve, unservable
from eagle3_train.serving.export import engine_keys


def spec(model_type, aux, n=32, h=4096):
    ident = TargetIdentity("t", model_type, "c" * 64, "t" * 64, "h" * 64)
    return CaptureSpec(tuple(aux), n, h, 128256, "bfloat16", ident)


CASES = [
    ("llama", [2, 16, 29]),
    ("llama", [1, 5, 9, 31]),
    ("qwen3", [2, 18, 33]),
    ("qwen3_moe", [3, 24, 45]),
    ("qwen2", [1, 2]),
    ("deepseek_v2", [2, 30, 58]),
    ("deepseek_v3", [3, 31, 57]),
    ("kimi_k2", [2, 31, 58]),
    ("gpt_oss", [2, 12, 21]),
    ("gpt_oss", [1, 12, 23]),
]


@pytest.mark.parametrize("model_type, aux", CASES)
def test_exported_keys_resolve_to_the_trained_indices(model_type, aux):
    n = {"qwen3": 36, "qwen3_moe": 48, "deepseek_v2": 61, "deepseek_v3": 61, "kimi_k2": 61, "gpt_oss": 24}.get(
        model_type, 32
    )
    config = engine_keys(spec(model_type, aux, n), ["sglang", "vllm"])
    for engine in ("sglang", "vllm"):
        for r in resolve(config, engine, model_type, n):
            assert r.hf_indices == aux, (engine, r.rule.versions, r.source, r.ids)


def test_worked_example_llama31():
    config = engine_keys(spec("llama", [2, 16, 29]), ["sglang", "vllm"])
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]


def test_no_engine_serves_the_embeddings():
    """HF index 0 reaches no draft: SGLang's id would be -1, and vLLM's id 0 arrives overwritten (its
    llama-family capture keeps the embedding tensor, which the in-place residual update turns into
    the last layer's pre-norm output; measured with vLLM 0.26.0, results/vllm_h200.json) or crashes
    (DeepSeek). Export and the served dump refuse it; resolve says what vLLM really feeds."""
    for model_type in ("llama", "qwen3", "mistral"):
        with pytest.raises(ContractError, match="HF index 0 .*vLLM's id 0 arrives overwritten.*in place"):
            engine_keys(spec(model_type, [0, 16, 29]), ["vllm"])
        for r in resolve({"eagle_aux_hidden_state_layer_ids": [0, 16, 29]}, "vllm", model_type, 32):
            assert (r.hf_indices, r.pre_norm_final, r.fed, r.problem) == ([16, 29], True, [32, 16, 29], None)
            assert "cannot use id 0" in r.note and "overwritten" in r.note
        for r in resolve({"eagle_aux_hidden_state_layer_ids": [1, 16, 29]}, "vllm", model_type, 32):
            assert (r.fed, r.note, r.problem) == ([1, 16, 29], None, None)
    assert unservable([0, 16, 29], "llama", 32).keys() == {"sglang", "vllm", "trtllm"}
    assert unservable([1, 16, 29], "llama", 32) == {}
    assert set(unservable([1, 16, 29], "deepseek_v3", 61)) == {"sglang"}  # a first index of 1 (SGLang's guess)


def test_vllm_serves_only_targets_with_its_eagle3_interface():
    """vLLM 0.33.0 runs EAGLE-3 (and extract_hidden_states) for llama/mistral, qwen2, qwen3,
    qwen3_moe, deepseek_v2/v3 (Kimi-K2) and gpt_oss only; any other target fails at load."""
    for model_type in ("mixtral", "qwen2_moe", "gemma2", "gemma3_text", "glm4_moe", "glm4_moe_lite"):
        assert resolve({"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}, "vllm", model_type, 32) == []
        with pytest.raises(
            ContractError,
            match=f"runs EAGLE-3 drafts only for targets whose class implements its "
            f"EAGLE-3 interface .*it refuses model_type '{model_type}' at load",
        ):
            engine_keys(spec(model_type, [2, 16, 29]), ["vllm"])
    assert [r.hf_indices for r in resolve({}, "vllm", "mistral", 32)] == [[2, 16, 29]] * 2


def test_vllm_deepseek_refuses_the_embeddings():
    """vLLM's DeepSeek code crashes on id 0; SGLang's DeepSeek rule takes [0, ...] as is."""
    for model_type in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
        with pytest.raises(ContractError, match="HF index 0 .*vLLM's DeepSeek code crashes on id 0"):
            engine_keys(spec(model_type, [0, 30, 58], 61), ["vllm"])
        bad = resolve({"eagle_aux_hidden_state_layer_ids": [0, 30, 58]}, "vllm", model_type, 61)
        assert [r.problem is not None and "crashes on id 0" in r.problem for r in bad] == [True, True]
    config = engine_keys(spec("deepseek_v2", [0, 30, 58], 61), ["sglang"])
    assert [r.hf_indices for r in resolve(config, "sglang", "deepseek_v2", 61)] == [[0, 30, 58]]


def test_an_id_landing_on_n_is_the_pre_norm_final_state_not_hf_index_n():
    """vLLM's id N and SGLang's gpt_oss id N are the last layer's output before the final norm;
    HF index N is after it, so no HF index names what they capture."""
    v2, v1 = resolve({"eagle_aux_hidden_state_layer_ids": [2, 16, 32]}, "vllm", "llama", 32)
    assert (v2.hf_indices, v2.pre_norm_final) == (v1.hf_indices, v1.pre_norm_final) == ([2, 16], True)
    (oss,) = resolve({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 12, 24]}}, "sglang", "gpt_oss", 24)
    assert (oss.hf_indices, oss.pre_norm_final) == ([1, 12], True)
    (llama,) = resolve({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 31]}}, "sglang", "llama", 32)
    assert (llama.hf_indices, llama.pre_norm_final) == ([2, 16], True)
    assert resolve({"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}, "vllm", "llama", 32)[0].pre_norm_final is False


@pytest.mark.parametrize(
    "model_type, aux, engines, message",
    [
        ("llama", [0, 16, 29], ["sglang"], "HF index 0 \\(the embeddings\\) cannot be captured"),
        ("deepseek_v2", [1, 16, 29], ["sglang", "vllm"], "a first HF index of 1 cannot be written"),
        ("llama", [16], ["sglang"], "SGLang would skip fc"),
        ("mixtral", [2, 16, 29], ["sglang"], "no rule covers target model_type 'mixtral'"),
    ],
)
def test_unrepresentable_captures_are_refused(model_type, aux, engines, message):
    with pytest.raises(ContractError, match=message):
        engine_keys(spec(model_type, aux), engines)


def test_defaults_and_rule_quirks():
    # no ids anywhere: every engine captures [2, N//2, N-3]
    assert [r.hf_indices for r in resolve({}, "sglang", "llama", 32)] == [[2, 16, 29]]
    assert {r.source for r in resolve({}, "vllm", "llama", 32)} == {"default"}
    # the DeepSeek guess: ids starting at 1 are shifted, others are not
    assert resolve({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}, "sglang", "deepseek_v2", 61)[
        0
    ].hf_indices == [2, 30, 58]
    assert resolve({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 29, 57]}}, "sglang", "deepseek_v2", 61)[
        0
    ].hf_indices == [2, 29, 57]
    # gpt_oss: no shift when the largest id is N
    assert resolve({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 12, 24]}}, "sglang", "gpt_oss", 24)[
        0
    ].hf_indices == [1, 12]
    shifted = resolve({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 12, 23]}}, "sglang", "gpt_oss", 24)[0]
    assert (shifted.hf_indices, shifted.pre_norm_final) == ([2, 13], True)  # 23 + 1 lands on N: pre-norm
    # vLLM's default runner, V2, first: it falls back to eagle_config.layer_ids, V1 to the nested key
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28], "layer_ids": [3, 4, 5]}}
    assert [(r.rule.versions, r.hf_indices) for r in resolve(nested, "vllm", "llama", 32)] == [
        ("0.33.0 (V2 runner, the default)", [3, 4, 5]),
        ("0.33.0 (V1 runner)", [1, 15, 28]),
    ]
    assert ids_for([2, 16, 29], "trtllm", "llama", 32) == {("eagle3_layers_to_capture",): [1, 15, 28]}


def test_check_warns_about_unknown_families_and_vllm_refusals():
    from types import SimpleNamespace

    from eagle3_train.serving.check import check

    target = SimpleNamespace(model_type="mixtral", num_hidden_layers=32, hidden_size=4096, vocab_size=32000)
    config = {"eagle_aux_hidden_state_layer_ids": [2, 16, 29], "draft_vocab_size": 32000}
    lines, findings = check(config, {}, target, [2, 16, 29], ["sglang", "vllm"])
    assert [f.level for f in findings] == ["warning", "error"]
    assert "sglang: no rule covers target model_type 'mixtral'" in findings[0].text
    assert (
        "vllm 0.33.0 runs EAGLE-3 drafts only for targets whose class implements its EAGLE-3 interface"
        in findings[1].text
    )
    assert "it refuses model_type 'mixtral' at load" in findings[1].text
    assert not any(line.startswith("vllm") for line in lines)


def _check(model_type, config, trained, n=32):
    from types import SimpleNamespace

    from eagle3_train.serving.check import check

    target = SimpleNamespace(model_type=model_type, num_hidden_layers=n, hidden_size=4096, vocab_size=32000)
    return check(config | {"draft_vocab_size": 32000}, {}, target, trained, ["vllm"])


def test_check_reports_vllm_v2_first_and_what_each_runner_reads():
    """vLLM 0.33's default runner, V2, never reads eagle_config.eagle_aux_hidden_state_layer_ids."""
    lines, findings = _check("llama", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}}, [2, 16, 29])
    assert lines[1].startswith("vllm 0.33.0 (V2 runner, the default): no ids where it reads -> engine default")
    assert lines[2].startswith("vllm 0.33.0 (V1 runner): eagle_config.eagle_aux_hidden_state_layer_ids=[2, 16, 29]")
    assert lines[2].endswith("OK")
    assert [f.level for f in findings] == ["warning"]  # the default happens to be the trained capture
    assert (
        "V2 runner, the default): the ids are not where it reads (eagle_aux_hidden_state_layer_ids or "
        "eagle_config.layer_ids)" in findings[0].text
    )


def test_check_flags_pre_norm_final_and_deepseek_id_0():
    lines, findings = _check("llama", {"eagle_aux_hidden_state_layer_ids": [2, 16, 32]}, [2, 16, 29])
    assert "captures HF [2, 16] + the pre-norm final state (no HF index)  MISMATCH" in lines[1]
    assert any(f.level == "error" and "the draft was trained on [2, 16, 29]" in f.text for f in findings)
    assert any("one id lands on N=32, the last layer's output before the final norm" in f.text for f in findings)
    _, findings = _check("deepseek_v3", {"eagle_aux_hidden_state_layer_ids": [0, 30, 58]}, [0, 30, 58], 61)
    assert [f.level for f in findings] == ["error", "error"] and all(
        "cannot use id 0" in f.text and "crashes on id 0" in f.text for f in findings
    )


def test_every_verified_rule_names_its_results_file_and_family():
    """A rule counts as verified only with the run's results file in the repository, which names
    that target family; every other pair reads 'from source only'."""
    import json
    import re
    from pathlib import Path

    from eagle3_train.engines.registry import ENGINES
    from eagle3_train.engines.rules import verification

    root = Path(__file__).resolve().parents[1]
    verified = {(name, mt): text for name, e in ENGINES.items() for mt, text in e.verified.items()}
    assert {e for e, _ in verified} == {"sglang", "vllm"}
    for (engine, model_type), text in verified.items():
        files = re.findall(r"benchmarks/results/[\w.]+\.json", text)
        assert files, (engine, model_type)
        found = [json.loads((root / f).read_text()) for f in files]
        assert any(model_type in json.dumps(r) for r in found), (engine, model_type, files)
        assert verification(engine, model_type).startswith("verified by a run")
    assert verification("sglang", "qwen2").startswith("verified by a run: SGLang 0.5.17")
    assert verification("vllm", "kimi_k2").startswith("read from source only: vllm ")
    assert verification("vllm", "glm4_moe").startswith("no rule")


def test_engine_command_lines_take_only_their_flags():
    """Each engine's command line is built from the flags its module read from the engine's CLI
    and parses back to what was asked; a flag it does not know is refused both ways."""
    import shlex

    from eagle3_train.engines.registry import ENGINES

    vllm, sglang = ENGINES["vllm"], ENGINES["sglang"]
    argv = vllm.serve_command("org/target", "org/draft", 4, port=8001)
    assert vllm.command.parse(argv) == {
        "model": "org/target",
        "--port": 8001,
        "--speculative-config": {"method": "eagle3", "model": "org/draft", "num_speculative_tokens": 4},
    }
    argv = sglang.serve_command("org/target", "org/draft", 4)
    assert sglang.command.parse(argv)["--speculative-num-draft-tokens"] == 5
    with pytest.raises(ValueError, match="--swap-space is not a flag of vllm serve"):
        vllm.serve_command("t", "d", 4, swap_space=8)
    with pytest.raises(ValueError, match="'--tp' is not a flag of python -m sglang.launch_server"):
        sglang.command.parse(argv + ["--tp", "2"])
    with pytest.raises(ValueError, match="--port takes int"):
        sglang.command.parse(argv + ["--port", "x"])
    # served acceptance's hint is each engine's own serve command
    for engine in (vllm, sglang):
        hint = engine.metrics.enable.split(" (and ")[0]
        assert engine.command.parse(shlex.split(hint))


def test_check_warns_where_sglang_would_run_the_draft_in_another_dtype_than_the_target():
    """SGLang 0.5.17 runs the draft in its own config's dtype and stopped at the first request on
    an H200 with a float16 target and a bfloat16 draft; vLLM follows the target."""
    from types import SimpleNamespace

    import torch

    from eagle3_train.serving.check import check

    config = {"eagle_aux_hidden_state_layer_ids": [2, 16, 29], "draft_vocab_size": 32000, "torch_dtype": "bfloat16"}

    def warnings(dtype):
        target = SimpleNamespace(
            model_type="llama", num_hidden_layers=32, hidden_size=4096, vocab_size=32000, dtype=dtype
        )
        _, findings = check(config, {}, target, [2, 16, 29], ["sglang", "vllm"])
        return [f.text for f in findings if "dtype" in f.text]

    (found,) = warnings(torch.float16)
    assert found.startswith("SGLang: the draft's config names bfloat16, the target's float16")
    assert "--dtype bfloat16" in found
    assert warnings(torch.bfloat16) == [] and warnings(None) == []


def test_a_crashed_runs_files_are_removed_though_one_vanishes_during_the_walk(tmp_path, monkeypatch):
    """vLLM's client clears a crashed run's state files; a file the engine renames away between the
    walk's listing and its unlink (a write finishing) is already gone, and the rest is still removed."""
    import shutil

    from eagle3_train.engines import vllm

    root = tmp_path / "00000"
    (root / "sub").mkdir(parents=True)
    for name in ("a.safetensors", ".tmpX", "sub/b.safetensors"):
        (root / name).write_bytes(b"x")
    real, calls = shutil.rmtree, []

    def racing(path, *a, **k):  # the first walk: the engine renames .tmpX away under it
        calls.append(path)
        if len(calls) == 1:
            (root / ".tmpX").unlink()
            raise FileNotFoundError(2, "No such file or directory", ".tmpX")
        return real(path, *a, **k)

    monkeypatch.setattr(vllm.shutil, "rmtree", racing)
    vllm.remove_tree(root)
    assert not root.exists() and len(calls) == 2
    (root / "sub").mkdir(parents=True)

    def always(path, *a, **k):
        raise FileNotFoundError(2, "No such file or directory", "x")

    monkeypatch.setattr(vllm.shutil, "rmtree", always)
    with pytest.raises(FileNotFoundError):  # a tree that never stops vanishing is not passed over in silence
        vllm.remove_tree(root)
