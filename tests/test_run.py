"""eagle3-run: every recipe composes into each stage's own typed config, and a run equals the stage
commands typed by hand."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from eagle3_train.core.cli import CONF_DIR, to_config
from eagle3_train.core.errors import ConfigError, Eagle3Error
from eagle3_train.run import RunConfig, command, hydra_value, run
from test_configs import PRIMARY, compose_config

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (Path(CONF_DIR) / "recipe").glob("*.yaml"))
CONFIG = {"prepare": "prepare.yaml", "dump": "dump.yaml", "standardize": "standardize.yaml", "train": "train.yaml",
          "export": "export.yaml", "check": "check.yaml", "eval": "eval.yaml"}  # fmt: skip
WORDS = ["apple", "river", "stone", "cloud", "seven", "tiger", "music", "paper", "green", "window"]


def run_config(overrides):
    return to_config(compose_config("run.yaml", overrides), RunConfig)


def test_the_recipes_cover_the_model_classes():
    assert {"smollm2", "llama3_8b", "qwen3_8b", "qwen3_30b_a3b", "gpt_oss_20b", "deepseek_v3"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("source", ["recipe", "offline"])
def test_every_recipe_composes_every_stage_into_its_typed_config(recipe, source):
    """Each stage's command line, as eagle3-run writes it, composes into that stage's schema (a key
    a stage lacks, a bad value, would be refused here)."""
    extra = [] if source == "recipe" else ["source=offline"]
    cfg = run_config([f"recipe={recipe}", "out=/tmp/o", "target=/models/t", "data=/tmp/c.jsonl", *extra])
    assert cfg.recipe == recipe and cfg.about
    for stage in cfg.stages():
        argv = command(cfg, stage)
        overrides = argv[argv.index("-m", argv.index("-m") + (2 if cfg.gpus > 1 else 0)) + 2 :]
        schema = PRIMARY[CONFIG[stage]][0]
        typed = to_config(compose_config(CONFIG[stage], overrides), schema)
        if stage == "train":
            assert typed.target == "/models/t" and typed.source == cfg.source and typed.out == "/tmp/o/train"
            assert typed.data == ("/tmp/o/std" if cfg.source == "offline" else "/tmp/o/prepared")
        if stage == "prepare":
            assert typed.input == "/tmp/c.jsonl" and typed.synthesize is None and typed.out == "/tmp/o/prepared"


def test_the_run_options_are_checked():
    with pytest.raises(ConfigError, match="give data=<conversations> or a recipe that synthesizes"):
        run_config(["recipe=llama3_8b", "out=/tmp/o"])
    with pytest.raises(ConfigError, match=r"until=dump is not a stage of this run \(source=online\)"):
        run_config(["recipe=smollm2", "out=/tmp/o", "until=dump"])
    with pytest.raises(ConfigError, match="train.out is set by eagle3-run itself"):
        command(run_config(["recipe=smollm2", "out=/tmp/o", "+train.out=/elsewhere"]), "train")
    cfg = run_config(["recipe=smollm2", "out=/tmp/o", "gpus=2", "prepare.synthesize=1000"])
    assert command(cfg, "prepare")[2:5] == ["torch.distributed.run", "--nproc_per_node", "2"]
    assert "++synthesize=1000" in command(cfg, "prepare")


@pytest.mark.parametrize(
    "value,text",
    [(None, "null"), (True, "true"), (3, "3"), (2e-3, "0.002"), ("wsd", "wsd"), ("/a b/c", "'/a b/c'"),
     ("1e3", "'1e3'"), ("null", "'null'"), ("it's", "'it\\'s'"), ([1, "x"], "[1,x]"), ({"a": False}, "{a:false}")],
)  # fmt: skip
def test_values_are_written_as_hydra_reads_them(value, text):
    assert hydra_value(value) == text


def test_until_stops_after_its_stage(tmp_path, capsys):
    cfg = run_config(["recipe=smollm2", f"out={tmp_path}", "until=train", "dry_run=true", "source=offline"])
    assert run(cfg) == 0
    printed = [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("# ")]
    assert printed == ["prepare", "dump", "standardize", "train"] and not any(tmp_path.iterdir())


def test_dry_run_prints_and_cfg_job_composes(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    got = subprocess.run(
        [sys.executable, "-m", "eagle3_train.run", "recipe=qwen3_8b", f"out={tmp_path}", "data=c.jsonl", "dry_run=true"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout  # fmt: skip
    assert [line for line in got.splitlines() if line.startswith("# ")] == [
        f"# {s}" for s in ("prepare", "train", "export", "check", "eval")
    ]
    assert "++chat_template_kwargs.enable_thinking=true" in got and not (tmp_path / "prepared").exists()
    job = subprocess.run(
        [sys.executable, "-m", "eagle3_train.run", "recipe=qwen3_8b", f"out={tmp_path}", "data=c.jsonl", "--cfg", "job"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout  # fmt: skip
    assert "recipe: qwen3_8b" in job and "enable_thinking: true" in job


def conversations(path):
    rng = random.Random(0)
    rows = [
        {"messages": [{"role": "user", "content": " ".join(rng.choices(WORDS, k=4))},
                      {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=9))}]}
        for _ in range(24)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


SMALL = ["train.loop.epochs=1", "train.runtime.compile=false", "train.loop.max_tokens_per_batch=600",
         "train.loop.eval_every=0", "train.online.draft_vocab_size=64", "train.model.intermediate_size=256",
         "+train.online.aux_indices=[1,2,3]", "eval.max_new_tokens=8", "+eval.limit=3", "eval.batch_size=3"]  # fmt: skip


@pytest.mark.slow
def test_a_run_equals_the_stages_run_by_hand(tmp_path, monkeypatch):
    """eagle3-run recipe=smollm2 on the tiny target with a conversations file (sizes cut for the CPU)
    gives the export and the eval report of the same stages run by hand through their Python API
    with the recipe's options written out; its stages ignore a process group the caller has."""
    from data_prep.prepare import PrepareConfig, Preparer
    from eagle3_train.evaluation.eval import EvalConfig, Evaluator
    from eagle3_train.serving.export import ExportConfig, Exporter
    from eagle3_train.training.config import ModelOptions
    from eagle3_train.training.online import OnlineConfig
    from test_trainer import train

    data = conversations(tmp_path / "chats.jsonl")
    monkeypatch.setenv("MASTER_PORT", "1")  # a caller's group: no stage may join it
    assert run(run_config(["recipe=smollm2", "target=tiny", f"data={data}", f"out={tmp_path / 'run'}", *SMALL])) == 0
    stages = [json.loads(x)["stage"] for x in (tmp_path / "run" / "run.jsonl").read_text().splitlines()]
    assert stages == ["prepare", "train", "export", "check", "eval"]
    monkeypatch.delenv("MASTER_PORT")

    hand = tmp_path / "hand"
    Preparer(PrepareConfig(target="tiny", input=str(data), out=str(hand / "prepared"), progress=False)).run()
    online = OnlineConfig(draft_vocab_size=64, eval_fraction=0.02, aux_indices=[1, 2, 3])
    train(hand / "prepared", hand / "train", target="tiny", source="online", online=online, ttt_length=5,
          epochs=1, lr=2e-3, warmup_fraction=0.0134, schedule="wsd", max_tokens_per_batch=600, min_steps=160, head_chunk=32768,
          keep_best=True, log_every=50, model=ModelOptions(lm_head_init="target", intermediate_size=256))  # fmt: skip
    Exporter(ExportConfig(run=str(hand / "train"), out=str(hand / "export"), engines=["sglang", "vllm"])).run()
    ref = Evaluator(
        EvalConfig(
            draft=str(hand / "export"),
            target="tiny",
            engine="sglang",
            k=5,
            max_new_tokens=8,
            dtype="float32",
            batch_size=3,
            limit=3,
            out=str(hand / "eval"),
            prompts=str(REPO / "data_prep/prompts/heldout.jsonl"),
            progress=False,
        )  # fmt: skip
    ).run()
    ours, theirs = (load_file(str(d / "export" / "model.safetensors")) for d in (tmp_path / "run", hand))
    assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)
    assert json.loads((tmp_path / "run" / "eval" / "report.json").read_text())["tau"] == ref["tau"]


@pytest.mark.slow
def test_a_failing_stage_is_named_and_the_run_stops_there(tmp_path):
    data = conversations(tmp_path / "chats.jsonl")
    cfg = run_config(["recipe=smollm2", "target=tiny", f"data={data}", f"out={tmp_path}", "+prepare.max_length=-1"])
    with pytest.raises(
        Eagle3Error, match=r"prepare stopped with status 2 .* run the same command again to continue from prepare"
    ):
        run(cfg)
    (line,) = (tmp_path / "run.jsonl").read_text().splitlines()
    assert json.loads(line)["stage"] == "prepare" and json.loads(line)["rc"] == 2 and not (tmp_path / "train").exists()
