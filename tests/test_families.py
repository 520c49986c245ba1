"""Every target family through the whole pipeline, as a user runs it: a random-init target of the
family saved as a Hugging Face directory, prepare (the target's own replies) -> dump -> standardize
-> train (offline, then online) -> export -> eagle3-check -> eagle3-eval (batched).

Each family is checked against independent references: the dump against a plain forward, the
export against every engine rule, batched speculative decoding against one-prompt greedy decoding,
online training against offline training on the dump of the same data.
"""

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from data_prep.dump import DumpConfig, Dumper
from data_prep.prepare import PrepareConfig, Preparer
from data_prep.regenerate import RegenConfig
from data_prep.standardize import StandardizeConfig, Standardizer
from eagle3_train.engines.rules import ENGINES, resolve, rules_for
from eagle3_train.evaluation.eval import EvalConfig, Evaluator
from eagle3_train.serving.check import CheckConfig, run_check
from eagle3_train.serving.export import ExportConfig, Exporter
from eagle3_train.targets import load_target
from eagle3_train.targets.tiny import FAMILIES, save_tiny
from eagle3_train.training.online import PreparedConfig
from test_online import assert_same_training
from test_trainer import train

WORDS = ["apple", "river", "stone", "cloud", "seven", "tiger", "music", "paper", "green", "window", "quick", "silver"]
DEFAULT_AUX = [2, 4, 5]  # [2, N//2, N-3] for the 8-layer tiny targets
VOCAB, EVAL = 320, 0.2


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module", params=list(FAMILIES))
def fam(request, tmp_path_factory):
    """The family's tiny target saved in fp32 and every stage run on it with defaults but sizes."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    target = str(save_tiny(f"tiny:{family}", root / "target", dtype="float32"))
    rng = random.Random(0)
    rows = [
        {"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))}]}
        for _ in range(20)
    ]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    Preparer(
        PrepareConfig(
            target=target,
            input=str(root / "prompts.jsonl"),
            out=str(root / "prep"),
            regenerate=True,
            regen=RegenConfig(max_new_tokens=24),
            on_bad_row="skip",
            progress=False,
        )
    ).run()
    Dumper(DumpConfig(target=target, data=str(root / "prep"), out=str(root / "dump"), progress=False)).run()
    Standardizer(
        StandardizeConfig(
            dumps=[str(root / "dump")],
            out=str(root / "std"),
            draft_vocab_size=VOCAB,
            eval_fraction=EVAL,
            progress=False,
        )
    ).run()
    train(root / "std", root / "train", target=target)
    Exporter(ExportConfig(run=str(root / "train"), out=str(root / "export"))).run()
    return {"family": family, "root": root, "target": target}


@pytest.mark.slow
def test_dump_equals_a_plain_forward(fam):
    """The dump's default dtype on the CPU is the stage's ``auto`` (fp32): every stored state is
    the one transformers' own forward computes, the post-norm last state as ``last_hidden``."""
    manifest = json.loads((fam["root"] / "dump" / "manifest.json").read_text())
    assert manifest["capture"]["aux_indices"] == DEFAULT_AUX
    model = load_target(fam["target"], cache_dir=None).model
    n = model.config.num_hidden_layers
    for shard in sorted((fam["root"] / "dump" / "shards").glob("*.safetensors")):
        t = load_file(str(shard))
        stored = sorted(int(k.split(".")[1]) for k in t if k.startswith("hidden."))
        assert set(DEFAULT_AUX) <= set(stored)
        cu = t["cu_seqlens"].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            with torch.no_grad():
                hs = model(input_ids=t["input_ids"][a:b].long()[None], output_hidden_states=True).hidden_states
            for k in stored:
                torch.testing.assert_close(t[f"hidden.{k}"][a:b].float(), hs[k][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(t["last_hidden"][a:b].float(), hs[n][0], rtol=1e-5, atol=1e-5)


def test_export_resolves_to_the_trained_capture_in_every_engine(fam):
    """By each engine's rule for this family, the exported config captures exactly the trained HF
    indices; engines without an EAGLE-3 rule for the family are named as such."""
    config = json.loads((fam["root"] / "export" / "config.json").read_text())
    mt = json.loads((fam["root"] / "target" / "config.json").read_text())["model_type"]
    assert config["eagle3_train"]["capture"]["aux_indices"] == DEFAULT_AUX
    for engine in ENGINES:
        if not rules_for(engine, mt):
            continue
        resolutions = resolve(config, engine, mt, 8)
        assert resolutions, (engine, mt)
        for r in resolutions:
            assert (r.hf_indices, r.pre_norm_final) == (DEFAULT_AUX, False), (engine, r.rule.versions, r.describe())
    assert rules_for("vllm", mt) and rules_for("sglang", mt), f"{mt}: every tiny family is one both engines serve"


def test_check_accepts_the_export_and_refuses_broken_copies(fam, tmp_path, said):
    target = fam["target"]
    assert run_check(CheckConfig(draft=str(fam["root"] / "export"), target=target)) == 0
    config = json.loads((fam["root"] / "export" / "config.json").read_text())

    def broken(name, edit):
        bad = tmp_path / name
        shutil.copytree(fam["root"] / "export", bad)
        c = json.loads(json.dumps(config))
        edit(c)
        (bad / "config.json").write_text(json.dumps(c))
        return str(bad)

    def shift(c):
        c["eagle_aux_hidden_state_layer_ids"] = [v + 1 for v in c["eagle_aux_hidden_state_layer_ids"]]
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [
            v + 1 for v in c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        ]

    said()
    assert run_check(CheckConfig(draft=broken("shifted", shift), target=target)) == 1
    assert "MISMATCH" in said()
    # only where vLLM reads them: SGLang silently falls back to its default (here the trained one,
    # which the check reports as a warning only), vLLM reads them
    assert (
        run_check(
            CheckConfig(
                draft=broken("nested_only", lambda c: c.pop("eagle_aux_hidden_state_layer_ids")),
                target=target,
                engines=["sglang"],
            )
        )
        == 0
    )


@pytest.mark.slow
def test_batched_eval_is_lossless_and_feeds_the_trained_capture(fam):
    """Batched speculative decoding (prompts of mixed lengths, longer than gpt-oss's window) gives
    exactly the tokens of one-prompt greedy decoding, for every family, at fp32."""
    reports = {}
    for engine in ("vllm", "sglang"):
        reports[engine] = Evaluator(
            EvalConfig(
                draft=str(fam["root"] / "export"),
                target=fam["target"],
                engine=engine,
                prompts=str(fam["root"] / "prompts.jsonl"),
                limit=6,
                max_new_tokens=24,
                batch_size=6,
                k=3,
                progress=False,
                out=str(fam["root"] / f"eval-{engine}"),
            )
        ).run()
    for r in reports.values():
        assert r["lossless"] == "identical", r
        assert r["captured_hf_indices"] == r["fed"] == DEFAULT_AUX and r["warnings"] == []
    assert reports["vllm"]["tau"] == pytest.approx(reports["sglang"]["tau"])


def test_online_training_equals_offline_training(fam, tmp_path):
    """The target of the family in the training loop trains exactly as offline on its dump."""
    root = fam["root"]
    train(
        root / "prep",
        tmp_path / "on",
        target=fam["target"],
        source="online",
        prepared=PreparedConfig(draft_vocab_size=VOCAB, eval_fraction=EVAL),
    )
    assert_same_training(root / "train", tmp_path / "on", rel=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compiled_layers_capture_what_the_eager_forward_does_batch_1_and_batched(fam):
    """``online.compile=true`` (and the dump's ``compile=true``) on the family's target: every decoder
    layer compiled, and each row of a right-padded batch of two gets the states its eager forward
    alone gives (batch 1), the post-norm last state too."""
    from eagle3_train.core.capture import capture, compile_layers

    # compile afresh: a layer class's forward is one code object for all its models, and earlier tests in
    # this process may have spent its recompile limit, past which dynamo runs it eager (and this would pass)
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model = load_target(fam["target"], cache_dir=None).model.eval()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(model.config.vocab_size, (t,), generator=g) for t in (11, 7)]
    with torch.no_grad():
        eager = [capture(model, r[None], None, DEFAULT_AUX) for r in rows]
        compile_layers(model, "online.compile=true")
        assert all(layer._compiled_call_impl is not None for layer in model.base_model.layers)
        batched = capture(model, torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), None, DEFAULT_AUX)
        alone = capture(model, rows[1][None], None, DEFAULT_AUX)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # (the layers ran as compiled graphs)
    for i, r in enumerate(rows):
        t = len(r)
        torch.testing.assert_close(batched.aux(DEFAULT_AUX)[i, :t], eager[i].aux(DEFAULT_AUX)[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batched.last_hidden[i, :t], eager[i].last_hidden[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone.last_hidden, eager[1].last_hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_served_training_equals_offline_training(fam, tmp_path):
    """The target of the family served by a stand-in vLLM (the engine ids vLLM's rule gives for
    the trained capture, the final norm the family's own) trains exactly as offline on its dump."""
    from transformers import AutoModelForCausalLM

    from eagle3_train.engines.vllm import dump_layer_ids
    from eagle3_train.training.served import EngineConfig
    from standin_engines import StandinVllm

    root = fam["root"]
    model = AutoModelForCausalLM.from_pretrained(fam["target"], dtype=torch.float32)
    mt, n = model.config.model_type, model.config.num_hidden_layers
    with StandinVllm(model, dump_layer_ids(DEFAULT_AUX, mt, n), tmp_path / "storage", write_delay_s=0.005) as server:
        train(
            root / "prep",
            tmp_path / "served",
            target=fam["target"],
            source="served",
            prepared=PreparedConfig(draft_vocab_size=VOCAB, eval_fraction=EVAL),
            engine=EngineConfig(urls=[server.url], dtype="float32", files_dir=str(tmp_path / "files"), backoff_s=0.01),
        )
    assert_same_training(root / "train", tmp_path / "served", rel=1e-4, atol=1e-4)
