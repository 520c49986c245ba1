"""Every conf/ file composes into its typed config; the package ships conf/ and the prompts."""

import dataclasses
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import MISSING, OmegaConf

import data_prep.dump  # noqa: F401  (registers dump_schema)
import data_prep.prepare  # noqa: F401  (registers prepare_schema)
import data_prep.standardize  # noqa: F401  (registers standardize_schema)
import eagle3_train.evaluation.bench  # noqa: F401  (registers bench_schema)
import eagle3_train.evaluation.eval  # noqa: F401  (registers eval_schema)
import eagle3_train.evaluation.served_acceptance  # noqa: F401  (registers served_acceptance_schema)
import eagle3_train.run  # noqa: F401  (registers run_schema)
import eagle3_train.serving.check  # noqa: F401  (registers check_schema)
import eagle3_train.serving.export  # noqa: F401  (registers export_schema)
import eagle3_train.training.config  # noqa: F401  (registers train_schema)
from eagle3_train.core.cli import CONF_DIR, to_config

PRIMARY = {
    "prepare.yaml": (data_prep.prepare.PrepareConfig, ["input=x.jsonl", "out=/tmp/o"]),
    "dump.yaml": (data_prep.dump.DumpConfig, ["data=/tmp/p", "out=/tmp/o", "capture.aux_indices=[1,15,28]"]),
    "standardize.yaml": (data_prep.standardize.StandardizeConfig, ["dumps=[/tmp/d]", "out=/tmp/o"]),
    "train.yaml": (eagle3_train.training.config.TrainConfig, ["data=/tmp/s", "out=/tmp/o"]),
    "export.yaml": (eagle3_train.serving.export.ExportConfig, ["run=/tmp/r", "out=/tmp/o"]),
    "check.yaml": (eagle3_train.serving.check.CheckConfig, ["draft=/tmp/d", "target=tiny"]),
    "eval.yaml": (eagle3_train.evaluation.eval.EvalConfig, ["draft=/tmp/d", "prompts=/tmp/p.jsonl"]),
    "served_acceptance.yaml": (
        eagle3_train.evaluation.served_acceptance.ServedAcceptanceConfig,
        ["server=http://127.0.0.1:8000", "prompts=/tmp/p.jsonl", "out=/tmp/o"],
    ),
    "bench.yaml": (eagle3_train.evaluation.bench.BenchConfig, ["target=/tmp/t", "draft=/tmp/d", "out=/tmp/o"]),
    "run.yaml": (eagle3_train.run.RunConfig, ["out=/tmp/o"]),
}
ROOT = Path(__file__).resolve().parents[1]


def compose_config(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name=name.removesuffix(".yaml"), overrides=overrides)


def test_every_primary_config_composes():
    found = sorted(p.name for p in Path(CONF_DIR).glob("*.yaml") if p.name != "common.yaml")
    assert found == sorted(PRIMARY)
    for name, (schema, overrides) in PRIMARY.items():
        cfg = compose_config(name, overrides)
        assert isinstance(to_config(cfg, schema), schema)
        if hasattr(schema, "cache_dir"):
            assert OmegaConf.select(cfg, "cache_dir")


def test_every_group_option_composes():
    schema, overrides = PRIMARY["train.yaml"]
    # the train groups (recipes are eagle3-run's: tests/test_run.py composes each)
    for group in sorted(
        g for g in Path(CONF_DIR).iterdir() if g.is_dir() and g.name not in ("recipe",) and not g.name.startswith("_")
    ):
        for option in sorted(group.glob("*.yaml")):
            obj = to_config(compose_config("train.yaml", overrides + [f"{group.name}={option.stem}"]), schema)
            assert isinstance(obj, schema)
    assert to_config(compose_config("train.yaml", overrides + ["deepspeed=zero3"]), schema).deepspeed.zero_stage == 3
    assert to_config(compose_config("train.yaml", overrides + ["logging=wandb"]), schema).logging.tracker == "wandb"
    assert (
        to_config(compose_config("train.yaml", overrides + ["logging=tensorboard"]), schema).logging.tracker
        == "tensorboard"
    )


def test_config_checks_run_on_final_values():
    from eagle3_train.core.errors import ConfigError

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="prepare", overrides=["input=x", "out=y", "on_bad_row=ignore"])
    with pytest.raises(ConfigError, match="on_bad_row must be one of"):
        to_config(cfg, data_prep.prepare.PrepareConfig)
    schema, overrides = PRIMARY["train.yaml"]
    with pytest.raises(ConfigError, match=r"^optim\.lr must be > 0, got -1"):
        to_config(compose_config("train.yaml", overrides + ["optim.lr=-1"]), schema)


def test_keys_the_schema_lacks_are_refused_naming_the_nearest():
    """``+train.learning_rate=...`` (what Hydra suggests for a key the schema lacks) was dropped and
    the run trained at the default lr: every command refuses such a key, whatever its depth."""
    from eagle3_train.core.errors import ConfigError

    schema, overrides = PRIMARY["train.yaml"]
    cases = (
        ("+train.learning_rate=1e-3", r"unknown option train.learning_rate \(did you mean optim.lr\?\)"),
        ("+online.dtypo=x", r"unknown option online.dtypo \(did you mean online.dtype\?\)"),
        ("+deepspeed.zero=3", r"unknown option deepspeed.zero \(did you mean deepspeed.zero_stage\?\)"),
        ("+xylophone=1", r"unknown option xylophone: not a field of TrainConfig"),
    )
    for override, message in cases:
        with pytest.raises(ConfigError, match=message):
            to_config(compose_config("train.yaml", overrides + [override]), schema)
    for name, (schema, overrides) in PRIMARY.items():  # every command, and its real keys still compose
        with pytest.raises(ConfigError, match=rf"unknown option zzz_extra: not a field of {schema.__name__}"):
            to_config(compose_config(name, overrides + ["+zzz_extra=1"]), schema)


def test_options_without_a_default_are_named_together_in_the_syntax_typed():
    """A command run without its required options (``data``, ``out``...) said OmegaConf's "Structured
    config of type ... has missing mandatory value" for the first only. Each command names every one it
    lacks, as the user would type them; the options PRIMARY gives are exactly those."""
    from eagle3_train.core.cli import compose as checked
    from eagle3_train.core.errors import ConfigError

    for name, (schema, overrides) in PRIMARY.items():
        given = [o.split("=", 1)[0] for o in overrides]
        no_default = [f.name for f in dataclasses.fields(schema) if f.default is MISSING]
        assert set(no_default) <= set(given), name
        if not no_default:
            continue
        said = no_default[0] if len(no_default) == 1 else f"{', '.join(no_default[:-1])} and {no_default[-1]}"
        with pytest.raises(ConfigError, match=rf"^{said} (is|are) required \(no default\): add "
                           + " ".join(f"{k}=..." for k in no_default) + " to the command$"):  # fmt: skip
            to_config(compose_config(name, []), schema)
        left = [o for o in overrides if o.split("=", 1)[0] != no_default[-1]]
        with pytest.raises(ConfigError, match=rf"^train\.{no_default[-1]} is required \(no default\)"):
            checked(name.removesuffix(".yaml"), left, schema, prefix="train.")


def test_shipped_prompts():
    rows = {}
    for split in ("train", "heldout"):
        path = ROOT / "data_prep" / "prompts" / f"{split}.jsonl"
        rows[split] = [json.loads(line) for line in path.read_text().splitlines()]
    every = rows["train"] + rows["heldout"]
    assert len(every) >= 300 and len(rows["heldout"]) >= 30
    firsts = [r["messages"][0]["content"] for r in every]
    assert len(set(firsts)) == len(firsts)  # no prompt twice, so held-out is really held out
    cats = {r["category"] for r in every}
    assert cats == {"coding", "math", "reasoning", "writing", "extraction", "chat", "multi_turn"}
    assert {r["category"] for r in rows["heldout"]} == cats
    assert all(len(r["messages"]) > 1 for r in every if r["category"] == "multi_turn")


def test_wheel_ships_conf_and_prompts(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "eagle3_train/conf/prepare.yaml",
        "eagle3_train/conf/dump.yaml",
        "eagle3_train/conf/standardize.yaml",
        "eagle3_train/conf/common.yaml",
    } <= names
    assert {"data_prep/prompts/train.jsonl", "data_prep/prompts/heldout.jsonl"} <= names
    sources = {str(p.relative_to(ROOT)) for pkg in ("eagle3_train", "data_prep") for p in (ROOT / pkg).rglob("*.py")}
    assert sources <= names, f"modules missing from the wheel: {sorted(sources - names)}"
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    for cmd in ("prepare", "dump", "standardize", "train", "export", "check", "eval", "served-acceptance", "bench"):
        assert f"eagle3-{cmd} =" in entry_points


@pytest.mark.slow
def test_installed_wheel_finds_conf_without_the_checkout(tmp_path):
    """Installed non-editable, the CLIs compose their configs from the copy inside the wheel."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(tmp_path / "site"),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    code = (
        "import eagle3_train.core.cli as c, data_prep.dump as d, hydra;"
        "from hydra import compose, initialize_config_dir;"
        "initialize_config_dir(config_dir=c.CONF_DIR, version_base='1.3').__enter__();"
        "cfg = compose('dump', overrides=['data=/p', 'out=/o']);"
        "print(c.CONF_DIR, cfg.max_tokens_per_batch)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    conf, budget = out.stdout.split()
    assert conf == str(tmp_path / "site" / "eagle3_train" / "conf") and budget == "16384"


def test_train_recipe_options_compose_from_the_command_line():
    schema, overrides = PRIMARY["train.yaml"]
    cfg = to_config(
        compose_config(
            "train.yaml",
            overrides
            + [
                "model.lm_head_init=target",
                "model.freeze_lm_head=true",
                "model.aux_norm=true",
                "checkpoint.keep_best=true",
                "loop.eval_every=50",
                "loop.early_stop_patience=3",
            ],
        ),
        schema,
    )
    assert (cfg.model.lm_head_init, cfg.model.freeze_lm_head, cfg.model.aux_norm) == ("target", True, True)
    assert (cfg.checkpoint.keep_best, cfg.loop.early_stop_patience) == (True, 3)
    default = to_config(compose_config("train.yaml", overrides), schema)
    assert (default.model.lm_head_init, default.model.freeze_lm_head, default.model.head_flags()["aux_norm"]) == (
        "random",
        False,
        False,
    )
    assert (default.checkpoint.keep_best, default.loop.early_stop_patience) == (False, 0)


def _repeated_defaults(raw, schema, prefix: str = "") -> list[str]:
    """Keys of a raw YAML node whose value is the dataclass default already (written twice)."""
    out = []
    for key in raw:
        if key in ("defaults", "hydra"):
            continue
        node = raw._get_node(key)
        assert key in schema, f"{prefix}{key} is not a field of {type(schema).__name__}"
        if OmegaConf.is_dict(node):
            out += _repeated_defaults(node, schema[key], f"{prefix}{key}.")
            continue
        mine, default = node._value(), schema._get_node(key)._value()
        if OmegaConf.is_list(node):
            mine, default = OmegaConf.to_container(node), OmegaConf.to_container(schema._get_node(key))
        if mine == default:
            out.append(f"{prefix}{key}")
    return out


def test_each_default_is_written_once():
    """A YAML value equal to its dataclass default is written twice: the YAML sets only what the
    dataclass does not (interpolations such as cache_dir, a group option's own values)."""
    repeated = {}
    for name, (schema, _) in PRIMARY.items():
        repeated[name] = _repeated_defaults(OmegaConf.load(Path(CONF_DIR) / name), OmegaConf.structured(schema))
    train = OmegaConf.structured(PRIMARY["train.yaml"][0])
    for group in ("deepspeed", "logging"):
        for option in sorted((Path(CONF_DIR) / group).glob("*.yaml")):
            glob = option.read_text().startswith("# @package _global_")
            raw = OmegaConf.load(option)
            repeated[f"{group}/{option.name}"] = _repeated_defaults(raw, train if glob else train[group])
    assert {k: v for k, v in repeated.items() if v} == {}
    # the check itself sees a repeat
    assert _repeated_defaults(
        OmegaConf.create({"dtype": "auto", "out": "x"}), OmegaConf.structured(PRIMARY["dump.yaml"][0])
    ) == ["dtype"]


@pytest.mark.parametrize(
    "name, override, message",
    [
        ("dump.yaml", "shard_size_mb=nan", r"^shard_size_mb must be positive, got nan$"),
        ("dump.yaml", "dist_timeout_minutes=0", r"^dist_timeout_minutes must be positive, got 0"),
        ("dump.yaml", "client.rank=-1", r"^client\.rank must be >= 0, got -1$"),
        ("dump.yaml", "client.world_size=0", r"^client\.world_size must be positive, got 0$"),
        ("dump.yaml", "dtype=fp8", r"^dtype must be one of auto, float32, bfloat16, float16, got 'fp8'$"),
        (
            "prepare.yaml",
            "regen.server.request_timeout_s=nan",
            r"^regen\.server\.request_timeout_s must be positive, got nan$",
        ),
        ("prepare.yaml", "dtype=fp8", r"^dtype must be one of auto, float32, bfloat16, float16, got 'fp8'$"),
        ("prepare.yaml", "synth.turns=0", r"^synth\.turns must be positive, got 0$"),
        ("prepare.yaml", "synth.long_fraction=1", r"^synth\.long_fraction must be in \[0, 1\) .*, got 1\.0$"),
        ("prepare.yaml", "synth.long_tokens=[0]", r"^synth\.long_tokens must be a non-empty list .*, got \[0\]$"),
        ("standardize.yaml", "workers=-1", r"^workers must be >= 0, got -1$"),
        ("eval.yaml", "limit=0", r"^limit must be positive, got 0$"),
        ("eval.yaml", "tie_threshold=nan", r"^tie_threshold must be >= 0, got nan$"),
        ("export.yaml", "dtype=int8", r"^dtype must be one of float32, bfloat16, float16, got 'int8'$"),
        ("served_acceptance.yaml", "concurrency=0", r"^concurrency must be positive, got 0$"),
        ("bench.yaml", "max_new_tokens=0", r"^max_new_tokens must be positive, got 0$"),
        ("bench.yaml", "concurrency=[1,0]", r"^concurrency levels must be >= 1, got \[1, 0\]$"),
    ],
)
def test_numeric_and_dtype_options_are_checked_in_one_line(name, override, message):
    from eagle3_train.core.errors import ConfigError

    schema, overrides = PRIMARY[name]
    with pytest.raises(ConfigError, match=message):
        to_config(compose_config(name, overrides + [override]), schema)


def test_device_auto_is_resolved_in_one_place(monkeypatch):
    import torch

    from eagle3_train.core.dist import resolve_device
    from eagle3_train.core.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device("auto", 3) == torch.device("cuda:3") and resolve_device("cpu", 3) == torch.device("cpu")
    # more ranks than GPUs: refused by name, unless the work shares GPUs (synthesis), round-robin
    with pytest.raises(ConfigError, match="local rank 5 has no GPU of its own"):
        resolve_device("auto", 5)
    assert [resolve_device("auto", r, share_gpus=True).index for r in range(6)] == [0, 1, 2, 3, 0, 1]
    # a bare "cuda" is the rank's own GPU (torch.cuda.set_device refuses an index-less device)
    assert resolve_device("cuda", 2) == torch.device("cuda:2") and resolve_device("cuda:1", 3).index == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", 3) == torch.device("cpu") and resolve_device("auto", 9, share_gpus=True).type == "cpu"
    with pytest.raises(ConfigError, match="device=cuda, but torch sees no CUDA device"):
        resolve_device("cuda")
