"""Export, check and eval on the tiny target: a head trained on the target's own generations,
served through the right config and through an off-by-one one."""

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from data_prep.dump import CaptureConfig, DumpConfig, Dumper
from data_prep.prepare import PrepareConfig, Preparer
from data_prep.regenerate import RegenConfig
from data_prep.standardize import StandardizeConfig, Standardizer
from eagle3_train.check import CheckConfig, run_check
from eagle3_train.errors import BadInputError, ContractError
from eagle3_train.eval import EvalConfig, Evaluator
from eagle3_train.export import ExportConfig, Exporter
from eagle3_train.trainer import OptimConfig, TrainConfig, Trainer

WORDS = "apple river stone cloud seven tiger music paper green window quick silver".split()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A tiny target whose layers differ (init std 0.1) and which never emits special tokens but
    its end-of-turn (so regenerated text re-tokenises to the target's own trajectory)."""
    from eagle3_train.targets import build_tiny_model, build_tiny_tokenizer, tiny_config

    root = tmp_path_factory.mktemp("e2e")
    cfg = tiny_config()
    cfg.initializer_range = 0.1
    model = build_tiny_model(cfg)
    with torch.no_grad():
        model.lm_head.weight[256:259] = 0  # specials other than <|im_end|> (259)
        model.lm_head.weight[260:] = 0
    model.save_pretrained(root / "target")
    build_tiny_tokenizer().save_pretrained(root / "target")
    target = str(root / "target")
    rng = random.Random(0)
    rows = [{"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))}]}
            for _ in range(80)]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    Preparer(PrepareConfig(target=target, input=str(root / "prompts.jsonl"), out=str(root / "prep"), regenerate=True,
                           regen=RegenConfig(max_new_tokens=48), progress=False)).run()
    Dumper(DumpConfig(target=target, data=str(root / "prep"), out=str(root / "dump"), dtype="float32", progress=False,
                      capture=CaptureConfig(aux_indices=[1, 2, 3]))).run()
    Standardizer(StandardizeConfig(dumps=[str(root / "dump")], out=str(root / "std"), draft_vocab_size=320,
                                   eval_fraction=0.1, progress=False)).run()
    trainer = Trainer(TrainConfig(data=str(root / "std"), target=target, out=str(root / "train"), progress=False,
                                  train=OptimConfig(ttt_length=3, epochs=20, lr=3e-3, max_tokens_per_batch=800)))
    trainer.run()
    trainer.close()
    Exporter(ExportConfig(run=str(root / "train"), out=str(root / "export"))).run()
    return root


def evaluate(root, draft, engine="vllm"):
    return Evaluator(EvalConfig(draft=str(draft), target=str(root / "target"), engine=engine,
                                prompts=str(root / "prompts.jsonl"), limit=10, max_new_tokens=48, progress=False,
                                out=str(draft.parent / f"eval-{draft.name}-{engine}"))).run()


def off_by_one(root, name, edit):
    bad = root / name
    shutil.copytree(root / "export", bad, dirs_exist_ok=True)
    config = json.loads((bad / "config.json").read_text())
    edit(config)
    (bad / "config.json").write_text(json.dumps(config))
    return bad


def test_export_layout(pipeline):
    config = json.loads((pipeline / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["eagle3_train"]["capture"]["aux_indices"] == [1, 2, 3]
    assert config["draft_vocab_size"] == 320 and config["target_hidden_size"] == 64
    names = set(load_file(str(pipeline / "export" / "model.safetensors")))
    assert "embed_tokens.weight" not in names and {"fc.weight", "d2t", "t2d", "lm_head.weight"} <= names


def test_eval_warns_when_the_chain_is_longer_than_training(pipeline):
    """The pipeline trains 3 TTT steps; export records it, and eval (k=5 by default) warns."""
    from eagle3_train.eval import short_training_warning

    config = json.loads((pipeline / "export" / "config.json").read_text())
    assert config["eagle3_train"]["training"]["ttt_length"] == 3
    assert "trained with ttt_length=3 but drafts chains of k=5: draft positions 4..5" in short_training_warning(config, 5)
    assert short_training_warning(config, 3) is None
    assert short_training_warning({"eagle3_train": {}}, 5) is None  # a config that does not say: no guess


def test_right_config_beats_off_by_one_and_both_are_lossless(pipeline):
    right = evaluate(pipeline, pipeline / "export")
    wrong = evaluate(pipeline, off_by_one(pipeline, "wrong", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2])))
    assert right["captured_hf_indices"] == [1, 2, 3] and wrong["captured_hf_indices"] == [0, 1, 2]
    assert right["lossless"] == wrong["lossless"] == "identical"  # fp32: token for token
    assert right["tau"] > wrong["tau"] + 0.2, (right["tau"], wrong["tau"])
    assert right["tau"] > 2.0
    assert (pipeline / "eval-export-vllm" / "acceptance.png").stat().st_size > 1000
    # SGLang reads the nested ids (+1): the same capture, the same result
    assert evaluate(pipeline, pipeline / "export", "sglang")["tau"] == pytest.approx(right["tau"])
    # run again unchanged: the report is reused, not recomputed
    again = evaluate(pipeline, pipeline / "export")
    assert again == json.loads((pipeline / "eval-export-vllm" / "report.json").read_text())
    assert again["target_seconds"] == right["target_seconds"]


def test_check_flags_what_engines_would_get_wrong(pipeline, capsys):
    run = lambda d, **kw: run_check(CheckConfig(draft=str(d), target=str(pipeline / "target"), **kw))  # noqa: E731
    assert run(pipeline / "export") == 0
    top_only = off_by_one(pipeline, "top_only", lambda c: c.pop("eagle_config"))
    assert run(top_only) == 1
    out = capsys.readouterr().out
    assert "sglang 0.5.23: no ids where it reads -> engine default" in out and "silently uses the default" in out
    shifted = off_by_one(pipeline, "shifted", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 3]))
    assert run(shifted) == 1
    assert "captures HF [2, 3, 4], the draft was trained on [1, 2, 3]" in capsys.readouterr().out
    zeros = off_by_one(pipeline, "zeros", lambda c: None)
    w = load_file(str(zeros / "model.safetensors"))
    w["d2t"] = torch.zeros(200, dtype=torch.int64)  # a 200-token draft vocab mapped to ids 0..199
    save_file(w, str(zeros / "model.safetensors"))
    assert run(zeros) == 1
    assert "d2t is all zeros" in capsys.readouterr().out
    # a third-party draft without our block: the user says what it was trained on
    foreign = off_by_one(pipeline, "foreign", lambda c: c.pop("eagle3_train"))
    assert run(foreign, trained=[1, 2, 3]) == 0 and run(foreign, trained=[2, 3]) == 1


def test_bad_drafts(pipeline, tmp_path):
    with pytest.raises(BadInputError, match="lacks config.json or model.safetensors"):
        evaluate(pipeline, tmp_path)
    bad = off_by_one(pipeline, "outside", lambda c: None)
    w = load_file(str(bad / "model.safetensors"))
    w["d2t"][-1] = 1000
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(ContractError, match="d2t maps draft ids outside the target vocab"):
        evaluate(pipeline, bad)
    wide = off_by_one(pipeline, "wide", lambda c: c.update(hidden_size=128))
    with pytest.raises(ContractError, match="do not fit target"):
        evaluate(pipeline, wide)
    two = off_by_one(pipeline, "two_layers", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2]))
    with pytest.raises(ContractError, match="fc takes 192: the engine would fail"):
        evaluate(pipeline, two)
    with pytest.raises(ContractError, match="HF index 0 \\(the embeddings\\)"):
        state = json.loads((pipeline / "train" / "checkpoints").glob("step*").__next__().joinpath("state.json").read_text())
        state["capture"]["aux_indices"] = [0, 1, 2]
        ck = tmp_path / "ck"
        shutil.copytree(next((pipeline / "train" / "checkpoints").glob("step*")), ck)
        (ck / "state.json").write_text(json.dumps(state))
        Exporter(ExportConfig(run=str(ck), out=str(tmp_path / "x"), engines=["sglang"])).run()
    assert not (tmp_path / "x").exists()  # nothing written on refusal
