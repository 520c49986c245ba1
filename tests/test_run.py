"""eagle3-run: every recipe composes into each stage's own typed config, and a run equals the stage
commands typed by hand."""

import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from eagle3_train.core.cli import CONF_DIR, to_config
from eagle3_train.core.errors import ConfigError, Eagle3Error
from eagle3_train.run import RunConfig, command, hydra_value, read_arguments, run
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
         "train.loop.eval_every=0", "train.prepared.draft_vocab_size=64", "train.model.intermediate_size=256",
         "+train.prepared.aux_indices=[1,2,3]", "eval.max_new_tokens=8", "+eval.limit=3", "eval.batch_size=3"]  # fmt: skip


@pytest.mark.slow
def test_a_run_equals_the_stages_run_by_hand(tmp_path, monkeypatch, said):
    """eagle3-run recipe=smollm2 on the tiny target with a conversations file (sizes cut for the CPU)
    gives the export and the eval report of the same stages run by hand through their Python API
    with the recipe's options written out; its stages ignore a process group the caller has."""
    from data_prep.prepare import PrepareConfig, Preparer
    from eagle3_train.evaluation.eval import EvalConfig, Evaluator
    from eagle3_train.serving.export import ExportConfig, Exporter
    from eagle3_train.training.config import ModelOptions
    from eagle3_train.training.online import PreparedConfig
    from test_trainer import train

    data = conversations(tmp_path / "chats.jsonl")
    monkeypatch.setenv("MASTER_PORT", "1")  # a caller's group: no stage may join it
    assert run(run_config(["recipe=smollm2", "target=tiny", f"data={data}", f"out={tmp_path / 'run'}", *SMALL])) == 0
    stages = [json.loads(x)["stage"] for x in (tmp_path / "run" / "run.jsonl").read_text().splitlines()]
    assert stages == ["prepare", "train", "export", "check", "eval"]
    summary = said().split("eagle3-run: summary")[1]  # the run's own summary, from each stage's record
    assert "data: 24 samples" in summary and "held-out accuracy per TTT step [" in summary
    assert re.search(r"eagle3-eval \(sglang, HF layers \[1, 2, 3\], k=5, 3 prompts\): tau [\d.]+, acceptance", summary)
    monkeypatch.delenv("MASTER_PORT")

    hand = tmp_path / "hand"
    Preparer(PrepareConfig(target="tiny", input=str(data), out=str(hand / "prepared"), progress=False)).run()
    online = PreparedConfig(draft_vocab_size=64, eval_fraction=0.02, aux_indices=[1, 2, 3])
    train(hand / "prepared", hand / "train", target="tiny", source="online", prepared=online, ttt_length=5,
          epochs=1, lr=2e-3, warmup_fraction=0.0134, schedule="wsd", max_tokens_per_batch=600, min_steps=160, head_chunk=32768,
          keep_best=True, log_every=50, model=ModelOptions(variant="eagle3.1", lm_head_init="target", intermediate_size=256))  # fmt: skip
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


def test_a_bad_value_of_a_later_stage_is_refused_before_the_first_stage(tmp_path):
    cfg = run_config(["recipe=smollm2", "target=tiny", f"out={tmp_path}", "+eval.limit=0", "+prepare.max_length=-1"])
    with pytest.raises(ConfigError, match=r"^prepare\.max_length must be positive, got -1$"):
        run(cfg)
    cfg = run_config(["recipe=smollm2", "target=tiny", f"out={tmp_path}", "+eval.limit=0"])
    with pytest.raises(ConfigError, match=r"^eval\.limit must be positive, got 0$"):
        run(cfg)
    assert not any(tmp_path.iterdir())


def eagle3_run(*args, env=None, check=False):
    """``eagle3-run <args>`` as a user types it: its exit status and what it printed."""
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled", **(env or {}))
    env.pop("EAGLE3_RUN_COMMAND", None)
    got = subprocess.run([sys.executable, "-m", "eagle3_train.run", *args], capture_output=True, text=True, env=env)
    assert not check or got.returncode == 0, got.stdout + got.stderr
    return got.returncode, got.stdout + got.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["train.optim.lrr=1"], r"unknown option train\.optim\.lrr \(did you mean train\.optim\.lr\?\)"),
        (["+train.learning_rate=1"], r"unknown option train\.learning_rate \(did you mean train\.optim\.lr\?\)"),
        (["train.loop.epochs=three"], r"train\.loop\.epochs=three: Value 'three' of type 'str' could not be converted"),
        (["recipe=smolm2"], r"recipe=smolm2: no such recipe; one of .*smollm2"),
        (["outt=x"], r"unknown option outt \(did you mean out\?\)"),
        (["gpus=two"], r"gpus=two: Value 'two'"),
        (["train.train.lr=1"], r"train\.train\.lr is now train\.optim\.lr: write train\.optim\.lr=1"),
        (["prepare.on_bad_row=maybe"], r"prepare\.on_bad_row must be one of \('error', 'skip'\), got 'maybe'"),
        (["train.optim.lr=[1"], r"no viable alternative at input '\[1'"),
        (["redo=dump"], r"redo=dump is not a stage of this run \(source=online\)"),
    ],
)  # fmt: skip
def test_every_error_is_one_line_in_eagle3_runs_syntax_and_exit_2(tmp_path, args, message):
    """A typo, a wrong type or a bad value of any stage is refused before anything runs, dry_run or
    not: one line ``eagle3-run: error: ...`` with the option as eagle3-run takes it, exit status 2."""
    data = conversations(tmp_path / "chats.jsonl")
    rc, printed = eagle3_run("recipe=smollm2", "target=tiny", f"data={data}", f"out={tmp_path / 'run'}", *args)
    assert rc == 2 and len(printed.strip().splitlines()) == 1, printed
    assert re.match(rf"eagle3-run: error: {message}", printed), printed
    assert not (tmp_path / "run").exists()


def test_an_option_the_recipe_does_not_set_is_given_without_a_plus(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_RUN_COMMAND", "")  # (restored after the test)
    args = read_arguments(
        ["recipe=smollm2", f"out={tmp_path}", "eval.prompts=p.jsonl", "train.optim.lr=1e-3", "redo=train"]
    )
    assert args == [
        "recipe=smollm2",
        f"out={tmp_path}",
        "++eval.prompts=p.jsonl",
        "++train.optim.lr=1e-3",
        "redo=train",
    ]
    cfg = run_config(args)
    assert "++prompts=p.jsonl" in command(cfg, "eval") and "++optim.lr=0.001" in command(cfg, "train")
    assert os.environ["EAGLE3_RUN_COMMAND"] == (
        f"eagle3-run recipe=smollm2 out={tmp_path} eval.prompts=p.jsonl train.optim.lr=1e-3"
    )  # what continues the run: without redo=, which would start it over again


def test_redo_starts_the_named_stage_and_those_after_it_over():
    cfg = run_config(["recipe=smollm2", "out=/tmp/o", "redo=train"])
    assert "++overwrite=true" not in command(cfg, "prepare")
    assert "++overwrite=true" in command(cfg, "train") and "++overwrite=true" in command(cfg, "export")
    assert not any("overwrite" in a for a in command(cfg, "eval"))  # eval redoes a report of another draft itself


@pytest.mark.parametrize(
    "message, typed",
    [
        ("on_bad_row=skip would skip such rows", "prepare.on_bad_row=skip would skip such rows"),
        ("pass overwrite=true to replace it", "pass redo=prepare to replace it"),
        ("regen.max_new_tokens=10 does not fit", "prepare.regen.max_new_tokens=10 does not fit"),
        ("max_length must be positive", "prepare.max_length must be positive"),
        ("the data's content (out=/x/prepared)", "the data's content (prepare.out=/x/prepared)"),
    ],
)  # fmt: skip
def test_a_stages_hints_are_written_as_eagle3_run_takes_them(message, typed):
    from data_prep.prepare import PrepareConfig
    from eagle3_train.core.cli import config_dict, in_run_syntax
    from eagle3_train.core.fingerprint import flatten

    assert in_run_syntax(message, "prepare", list(flatten(config_dict(PrepareConfig)))) == typed


def test_the_demo_recipe_reads_the_shipped_conversations():
    cfg = run_config(["recipe=demo", "out=/tmp/o"])
    assert cfg.source == "offline" and cfg.data.endswith("synth_smollm2.jsonl.gz") and Path(cfg.data).is_file()
    assert cfg.stages() == ("prepare", "dump", "standardize", "train", "export", "check", "eval")
    assert "++limit=400" in command(cfg, "prepare")


@pytest.mark.slow
def test_a_failing_stage_says_one_line_in_eagle3_runs_syntax(tmp_path):
    """A stage that fails on the data (a bad row) says so in one line written as eagle3-run takes
    it; eagle3-run adds nothing (no "run again": the same command fails the same way)."""
    data = conversations(tmp_path / "chats.jsonl")
    with data.open("a") as f:
        f.write(json.dumps({"messages": [{"role": "robot", "content": "beep"}]}) + "\n")
    rc, printed = eagle3_run("recipe=smollm2", "target=tiny", f"data={data}", f"out={tmp_path / 'run'}")
    errors = [line for line in printed.splitlines() if "error" in line]
    assert rc == 2 and len(errors) == 1 and errors[0].startswith("eagle3-run: error: prepare: "), printed
    assert "prepare.on_bad_row=skip would skip such rows" in printed and "again" not in printed
    (line,) = (tmp_path / "run" / "run.jsonl").read_text().splitlines()
    assert json.loads(line)["stage"] == "prepare" and json.loads(line)["rc"] == 2


@pytest.mark.slow
def test_ctrl_c_through_eagle3_run_says_one_line_and_the_rerun_continues(tmp_path):
    """SIGINT to eagle3-run while it trains reaches the training once: one line says the checkpoint
    kept and the command that continues (no traceback), exit 130; that command continues from the
    checkpoint, says so, and ends with the run's summary."""
    data = conversations(tmp_path / "chats.jsonl")
    out = tmp_path / "run"
    args = ["recipe=smollm2", "target=tiny", f"data={data}", f"out={out}", *SMALL, "train.loop.epochs=2", "until=train",
            "train.checkpoint.every_minutes=0.0001"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled", EAGLE3_FAULT_AT="train.step:6:stop")
    env.pop("EAGLE3_RUN_COMMAND", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagle3_train.run", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )  # fmt: skip
    try:
        stage = None
        for _ in range(1200):  # the training stage stops itself at step 6 (SIGSTOP): then Ctrl-C
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            for pid in children:
                if (
                    "trainer" in Path(f"/proc/{pid}/cmdline").read_text()
                    and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
                ):
                    stage = int(pid)
            if stage:
                break
            time.sleep(0.1)
        assert stage, "training never reached step 6"
        proc.send_signal(signal.SIGINT)  # what the terminal sends eagle3-run on Ctrl-C
        time.sleep(1)
        os.killpg(stage, signal.SIGCONT)
        printed = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in printed, printed
    (line,) = [x for x in printed.splitlines() if "interrupted" in x]
    typed = shlex.join(["eagle3-run", *args])
    assert (
        line
        == f"eagle3-run: train: interrupted: training stopped at step 6 of 46; its checkpoint step5 is kept (1 step past it will be trained again); `{typed}` continues"
    ), line
    rc, printed = eagle3_run(*args)
    assert rc == 0 and "continuing from checkpoint step5 of" in printed and "eagle3-run: summary" in printed, printed


@pytest.mark.parametrize(
    "rc, expected",
    [(2, 2), (130, 130), (-signal.SIGINT, 130), (-9, r"train was killed \(signal 9\) after .* s; the finished stages "
     r"\(prepare\) are kept: `eagle3-run recipe=smollm2 out=.* target=tiny source=online` continues from train"),
     (1, r"train stopped with status 1 \(its message is above\)")],
)  # fmt: skip
def test_how_a_stage_stopped_decides_what_eagle3_run_adds(tmp_path, monkeypatch, rc, expected):
    """A stage's own error (2) and a Ctrl-C (130) said their one line: eagle3-run adds nothing and
    exits with that status; a crash or a kill is named, with the command that continues."""
    import eagle3_train.run as run_module

    monkeypatch.delenv("EAGLE3_RUN_COMMAND", raising=False)
    stages = iter([0, rc])
    monkeypatch.setattr(run_module, "run_stage", lambda cmd, env: next(stages))
    cfg = run_config(["recipe=smollm2", "target=tiny", f"out={tmp_path}", "until=export"])
    if isinstance(expected, int):
        assert run(cfg) == expected
    else:
        with pytest.raises(Eagle3Error, match=expected):
            run(cfg)
    assert [json.loads(x)["rc"] for x in (tmp_path / "run.jsonl").read_text().splitlines()] == [0, rc]
