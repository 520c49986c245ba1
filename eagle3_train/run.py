"""``eagle3-run``: a recipe's stages in order, one command per model.

    eagle3-run recipe=smollm2 out=runs/smol                            # the embedded target, synthesized data
    eagle3-run recipe=llama3_8b target=/models/Llama-3.1-8B-Instruct data=chats.jsonl out=runs/l8
    eagle3-run recipe=qwen3_8b target=... data=... out=... until=train gpus=8
    eagle3-run recipe=smollm2 out=runs/smol dry_run=true               # the stage commands, nothing run
    eagle3-run recipe=smollm2 out=runs/smol --cfg job                  # the composed job
    eagle3-run -m recipe=smollm2 out=runs/sweep train.optim.lr=1e-3,2e-3

A recipe (``conf/recipe/<name>.yaml``) holds each stage's options under the stage's name
(``prepare``, ``dump``, ``standardize``, ``train``, ``export``, ``check``, ``eval``), exactly as
that stage's own command takes them; ``eagle3-run`` adds what joins the stages (``target``, each
stage's ``out`` under ``out=``, the data each reads) and runs every stage as its own command (a
process of its own, under torchrun for the stages that take ranks when ``gpus > 1``). Each stage
reuses its finished output, so a rerun continues where a crash stopped. Stage times go to
``<out>/run.jsonl``.

``data=`` names conversations to prepare (the recipe's regeneration applies); without it the
recipe's ``prepare.synthesize`` has the target write them. ``source`` is how training gets the
target's states: ``online`` (the target in the training loop), ``offline`` (dump + standardize
first) or ``served`` (vLLM replicas: ``train.engine.*``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from data_prep.dump.config import DumpConfig
from data_prep.prepare import PrepareConfig
from data_prep.standardize import StandardizeConfig
from eagle3_train.core.cli import (
    INTERRUPTED_STATUS,
    RUN_COMMAND_ENV,
    RUN_STAGE_ENV,
    SWEEP_CHILD_ENV,
    compose,
    entry_point,
)
from eagle3_train.core.contract import MANIFEST_NAME, read_manifest
from eagle3_train.core.errors import ConfigError, Eagle3Error, Interrupted
from eagle3_train.core.log import LogConfig
from eagle3_train.core.prompt_files import shipped_prompts
from eagle3_train.core.reports import read_eval_report
from eagle3_train.evaluation.eval import EvalConfig
from eagle3_train.serving.check import CheckConfig
from eagle3_train.serving.export import ExportConfig
from eagle3_train.training.config import RENAMED, TrainConfig

logger = logging.getLogger(__name__)

SOURCES = ("online", "offline", "served")
# stage -> (its module, whether it takes ranks under torchrun, its schema); its config in conf/ is
# <stage>.yaml, which eagle3-run composes each stage's options against before any runs
STAGE_TABLE: dict[str, tuple[str, bool, type]] = {
    "prepare": ("data_prep.prepare", True, PrepareConfig),
    "dump": ("data_prep.dump", True, DumpConfig),
    "standardize": ("data_prep.standardize", False, StandardizeConfig),
    "train": ("eagle3_train.training.trainer", True, TrainConfig),
    "export": ("eagle3_train.serving.export", False, ExportConfig),
    "check": ("eagle3_train.serving.check", False, CheckConfig),
    "eval": ("eagle3_train.evaluation.eval", False, EvalConfig),
}
STAGES = tuple(STAGE_TABLE)
DIST_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# ${shipped:heldout.jsonl}: a prompt file shipped in data_prep/prompts (recipes name them so)
if not OmegaConf.has_resolver("shipped"):
    OmegaConf.register_new_resolver("shipped", lambda name: str(shipped_prompts(name)))


@dataclass
class RunConfig:
    """Options of ``eagle3-run`` (``conf/run.yaml`` with ``recipe=<name>``)."""

    out: str = MISSING  # every stage's output goes under it: prepared/, dump/, std/, train/, export/, eval/
    target: str = "embedded"  # the target every stage uses (any form the stages take)
    data: str | None = None
    """conversations to prepare (a .jsonl file, a directory, a dataset); null: the recipe's prepare.synthesize=N conversations written by the target"""
    source: str = (
        "online"  # how training gets the target's states: online | offline (dump + standardize first) | served
    )
    until: str | None = None  # stop after this stage (prepare | dump | standardize | train | export | check | eval)
    gpus: int = 1  # processes for the stages that take ranks (synthesis, dump, train), under torchrun when > 1
    dry_run: bool = False  # print the stage commands and run nothing
    redo: str | None = None
    """start over from this stage: it and every later stage write their output anew (overwrite=true where the stage takes it; dump/ and std/ under out= are removed); the stages before it are reused"""
    recipe: str = ""  # the recipe's name (set by conf/recipe/<name>.yaml)
    about: str = ""  # what the recipe is for, and which of its values were measured and which derived
    prepare: Any = field(default_factory=dict)  # eagle3-prepare options (target, input and out are set here)
    dump: Any = field(default_factory=dict)  # eagle3-dump options (source=offline)
    standardize: Any = field(default_factory=dict)  # eagle3-standardize options (source=offline)
    train: Any = field(
        default_factory=dict
    )  # eagle3-train options (its objective.*, optim.*, loop.*, model.*, prepared.*, online.*, engine.*, ...)
    export: Any = field(default_factory=dict)  # eagle3-export options
    check: Any = field(default_factory=dict)  # eagle3-check options
    eval: Any = field(default_factory=dict)  # eagle3-eval options (prompts: the shipped held-out ones unless given)
    logging: LogConfig = field(default_factory=LogConfig)
    """the console (logging.level, logging.all_ranks, logging.progress_every_s)"""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(f"source must be one of {SOURCES}, got {self.source!r}")
        if self.until is not None and self.until not in self.stages():
            raise ConfigError(
                f"until={self.until} is not a stage of this run (source={self.source}): one of {list(self.stages())}"
            )
        if self.redo is not None and self.redo not in self.stages():
            raise ConfigError(
                f"redo={self.redo} is not a stage of this run (source={self.source}): one of {list(self.stages())}"
            )
        if self.gpus < 1:
            raise ConfigError(f"gpus must be >= 1, got {self.gpus}")
        for stage in STAGES:
            if not isinstance(getattr(self, stage), dict):
                raise ConfigError(
                    f"{stage} must hold eagle3-{stage}'s options as a mapping, got {getattr(self, stage)!r}"
                )
        if self.data is None and not self.prepare.get("synthesize"):
            raise ConfigError(
                f"give data=<conversations> or a recipe that synthesizes them (prepare.synthesize=N); recipe "
                f"{self.recipe or '(none)'} has neither"
            )

    def stages(self) -> tuple[str, ...]:
        """The stages this run goes through, in order (dump and standardize only offline)."""
        skip = () if self.source == "offline" else ("dump", "standardize")
        return tuple(s for s in STAGES if s not in skip)


ConfigStore.instance().store(name="run_schema", node=RunConfig)


def hydra_value(value: Any) -> str:
    """``value`` written as a Hydra override's value (quoted strings, lists, maps, null)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if PLAIN.fullmatch(text) and not _typed(text):  # a path or a name: as it is
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


PLAIN = re.compile(r"[A-Za-z0-9_./@~-]+")  # strings Hydra reads unquoted as the same string


def _typed(text: str) -> bool:
    """Would Hydra read ``text`` unquoted as a number, a boolean or null?"""
    if text.lower() in ("true", "false", "null", "nan", "inf", "-inf", "+inf"):
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True


def overrides(options: dict[str, Any], prefix: str = "") -> list[str]:
    """A stage's options as Hydra overrides, one per leaf: ``++key=value`` (set whether or not the
    stage's config names the key already; a key its schema lacks is still refused by name)."""
    out = []
    for key, value in options.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += overrides(value, name + ".")
        else:
            out.append(f"++{name}={hydra_value(value)}")
    return out


def wiring(cfg: RunConfig, stage: str) -> dict[str, Any]:
    """What joins the stages: each stage's target, input and output under ``out``."""
    out = Path(cfg.out).expanduser()
    prepared = str(out / "prepared")
    if stage == "prepare":
        w: dict[str, Any] = {"target": cfg.target, "out": prepared}
        if cfg.data is not None:
            w |= {"input": cfg.data, "synthesize": None}
        else:
            w["synthesize"] = cfg.prepare["synthesize"]
        return w
    if stage == "dump":
        return {"target": cfg.target, "data": prepared, "out": str(out / "dump")}
    if stage == "standardize":
        return {"dumps": [str(out / "dump")], "out": str(out / "std")}
    if stage == "train":
        data = str(out / "std") if cfg.source == "offline" else prepared
        return {"target": cfg.target, "data": data, "source": cfg.source, "out": str(out / "train")}
    if stage == "export":
        return {"run": str(out / "train"), "out": str(out / "export")}
    if stage == "check":
        return {"draft": str(out / "export"), "target": cfg.target}
    return {"draft": str(out / "export"), "target": cfg.target, "out": str(out / "eval")}


def stage_options(cfg: RunConfig, stage: str) -> dict[str, Any]:
    """The stage's options: the recipe's, then the wiring (which the recipe may not set)."""
    own = dict(getattr(cfg, stage))
    clash = sorted(set(own) & set(wiring(cfg, stage)) - {"synthesize"})
    if clash:
        raise ConfigError(
            f"{stage}.{clash[0]} is set by eagle3-run itself (from target=, data=, source= and out=): leave it out of "
            f"the recipe and the overrides"
        )
    if stage == "prepare":
        own.pop("synthesize" if cfg.data is not None else "input", None)
    if stage == "train":  # a recipe serves every source: what the chosen one does not take is left out
        for group, used in (("prepared", ("online", "served")), ("online", ("online",)), ("engine", ("served",))):
            if cfg.source not in used:
                own.pop(group, None)
    if stage == "standardize":  # offline, the draft vocab and the held-out share are standardize's
        prepared = cfg.train.get("prepared") or {}
        for key in ("draft_vocab_size", "eval_fraction"):
            if key in prepared and key not in own:
                own[key] = prepared[key]
    if stage == "eval" and "prompts" not in own:
        own["prompts"] = str(shipped_prompts("heldout.jsonl"))
    if redone(cfg, stage) and "overwrite" in {f.name for f in fields(STAGE_TABLE[stage][2])}:
        own["overwrite"] = True
    return {**wiring(cfg, stage), **own}  # disjoint: the recipe may not set what the wiring does


def redone(cfg: RunConfig, stage: str) -> bool:
    """Whether ``redo=`` starts this stage over (it, or a stage before it, is named)."""
    stages = cfg.stages()
    return cfg.redo is not None and stages.index(stage) >= stages.index(cfg.redo)


def check_stages(cfg: RunConfig, stages: tuple[str, ...]) -> None:
    """Compose each stage's options against that stage's schema before any stage runs, so that a
    typo or a wrong type in the last stage's options is refused before the first one starts; the
    message writes the options as eagle3-run takes them (``train.optim.lr``)."""
    for stage in stages:
        compose(stage, overrides(stage_options(cfg, stage)), STAGE_TABLE[stage][2], prefix=f"{stage}.")


def command(cfg: RunConfig, stage: str) -> list[str]:
    """The stage's command line: its module with its options, under torchrun where it takes ranks."""
    module, ranks, _ = STAGE_TABLE[stage]
    options = stage_options(cfg, stage)
    if stage == "prepare" and not options.get("synthesize"):
        ranks = False  # reading and regenerating run in one process; synthesis runs on every rank
    launcher = [sys.executable, "-m"]
    if ranks and cfg.gpus > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(cfg.gpus), "-m"]
    return [*launcher, module, *overrides(options)]


def run(cfg: RunConfig) -> int:
    """Run (or print, with ``dry_run``) the stages up to ``until``, each option checked first; stop
    at the first that fails; end with the run's summary."""
    stages = cfg.stages()
    if cfg.until is not None:
        stages = stages[: stages.index(cfg.until) + 1]
    check_stages(cfg, stages)
    plan = [(stage, command(cfg, stage)) for stage in stages]
    if cfg.dry_run:
        for stage, cmd in plan:
            print(f"# {stage}\n{shlex.join(cmd)}")
        return 0
    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    logger.info(f"eagle3-run: recipe {cfg.recipe or '(none)'}: {' -> '.join(stages)} under {out}")
    typed = typed_command(cfg)
    # a stage forms its own process group (torchrun's, or one of one): none this process was given
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARIABLES} | {RUN_COMMAND_ENV: typed}
    done: list[str] = []
    for stage, cmd in plan:
        if redone(cfg, stage) and stage in ("dump", "standardize"):  # (no overwrite of their own)
            shutil.rmtree(wiring(cfg, stage)["out"], ignore_errors=True)
        logger.info(f"eagle3-run: {stage}: {shlex.join(cmd)}")
        start = time.time()
        try:
            rc = run_stage(cmd, env | {RUN_STAGE_ENV: stage})
        except KeyboardInterrupt:  # before the stage's process began
            raise Interrupted(f"{stage} had not begun; {kept(done)}") from None
        seconds = round(time.time() - start, 1)
        with (out / "run.jsonl").open("a") as f:
            f.write(json.dumps({"stage": stage, "seconds": seconds, "rc": rc, "command": cmd}) + "\n")
        if rc in (INTERRUPTED_STATUS, -signal.SIGINT, -signal.SIGTERM):
            return INTERRUPTED_STATUS  # the stage said what it kept and how to continue
        if rc == 2:
            return 2  # the stage's one line (eagle3-run: error: <stage>: ...) is above: nothing to add
        if rc:
            how = f"was killed (signal {-rc})" if rc < 0 else f"stopped with status {rc} (its message is above)"
            raise Eagle3Error(f"{stage} {how} after {seconds} s; {kept(done)}: `{typed}` continues from {stage}")
        done.append(stage)
        logger.info(f"eagle3-run: {stage} done in {seconds} s")
    for line in summary(out, stages):
        logger.info(line)
    return 0


def kept(done: list[str]) -> str:
    return f"the finished stages ({', '.join(done)}) are kept" if done else "no stage had finished"


def typed_command(cfg: RunConfig) -> str:
    """The eagle3-run command that continues this run (without ``redo=``, which would start over
    again): as the user typed it, or written from the run's main options."""
    if typed := os.environ.get(RUN_COMMAND_ENV):
        return typed
    words = [f"recipe={cfg.recipe}", f"out={cfg.out}", f"target={cfg.target}", f"source={cfg.source}"]
    return shlex.join(["eagle3-run", *words, *([f"data={cfg.data}"] if cfg.data else [])])


def read_arguments(args: list[str]) -> list[str]:
    """eagle3-run's command line as Hydra takes it: a stage's option is set whether or not the
    recipe names it (``eval.prompts=p.jsonl`` as ``++eval.prompts=p.jsonl``; the stage's schema
    still refuses a key it lacks). The line as typed, less ``redo=``, is the one that continues."""
    if not os.environ.get(SWEEP_CHILD_ENV):  # (a sweep's job continues with the sweep's line)
        os.environ[RUN_COMMAND_ENV] = shlex.join(["eagle3-run", *(a for a in args if not a.startswith("redo="))])
    stage = re.compile(rf"(?:{'|'.join(STAGES)})\.[^=]+=")
    return [f"++{a}" if stage.match(a) else a for a in args]


def run_stage(cmd: list[str], env: dict[str, str]) -> int:
    """Run one stage's command in a process group of its own and wait for it. Ctrl-C, SIGTERM and
    SIGHUP reach eagle3-run alone (the terminal's group) and are passed on once to the stage's
    group, which stops cleanly and says what it kept; eagle3-run waits for it to finish saying so."""
    caught: list[int] = []
    proc: subprocess.Popen | None = None

    def forward(signum: int, frame: Any) -> None:
        caught.append(signum)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.signal(s, forward) for s in handled}
    try:
        proc = subprocess.Popen(
            cmd, env=env, start_new_session=True
        )  # its own group: a Ctrl-C reaches it once, through forward()
        for signum in caught:  # arrived while it was starting
            os.killpg(proc.pid, signum)
        return proc.wait()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def summary(out: Path, stages: tuple[str, ...]) -> list[str]:
    """What the run made, from each stage's record: the data, training's evaluation (accuracy per
    TTT step), eagle3-eval's report (tau, acceptance per position, lossless)."""
    lines = [f"eagle3-run: summary ({out})"]
    prepared = out / "prepared" / MANIFEST_NAME
    if prepared.is_file():
        c = read_manifest(out / "prepared", "prepare")["counts"]
        lines.append(
            f"  data: {c['rows_written']} samples, {c['tokens']} tokens ({c['loss_tokens']} assistant), "
            f"{c['truncated']} cut at max_length"
        )
    if "train" in stages and (out / "train" / MANIFEST_NAME).is_file():
        t = read_manifest(out / "train", "train")
        acc = [round(a, 3) for a in t["eval"].get("eval_acc", [])]
        lines.append(
            f"  training: {t['step']} steps; held-out accuracy per TTT step {acc}, simulated tau "
            f"{t['eval'].get('eval_tau', float('nan')):.2f}"
        )
    report = out / "eval" / "report.json"
    if "eval" in stages and report.is_file():
        r = read_eval_report(report)
        lines.append(
            f"  eagle3-eval ({r.engine}, HF layers {r.captured_hf_indices}, k={r.k}, {r.prompts} prompts): "
            f"tau {r.tau:.2f}, acceptance per position {[round(a, 3) for a in r.acceptance_per_position]}, "
            f"lossless {r.lossless}"
        )
    return lines


# eagle3-train's options as they were named before they were split by concern (train.train.lr -> train.optim.lr)
main = entry_point(
    "run",
    RunConfig,
    run,
    renamed={f"train.{old}": f"train.{new}" for old, new in RENAMED.items()},
    args=read_arguments,
)

if __name__ == "__main__":
    main()
