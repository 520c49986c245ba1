"""What every command shares: where ``conf/`` is, and how user errors are reported."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagle3_train.core.errors import Eagle3Error
from eagle3_train.core.log import setup_logging

T = TypeVar("T")
logger = logging.getLogger(__name__)


def conf_dir() -> str:
    """Absolute path of the Hydra configs: ``<repo>/conf`` in a checkout or editable install,
    ``eagle3_train/conf`` inside an installed wheel (pyproject maps one onto the other)."""
    here = Path(__file__).resolve().parents[1]  # the eagle3_train package
    for candidate in (here.parent / "conf", here / "conf"):
        if (candidate / "prepare.yaml").is_file():
            return str(candidate)
    raise RuntimeError(f"eagle3_train's conf/ directory is missing (looked beside {here})")


CONF_DIR = conf_dir()


# set by eagle3-run in each stage's process: the stage's name and the command the user typed, so
# that the stage's errors, hints and Ctrl-C line are written as eagle3-run takes them
RUN_STAGE_ENV = "EAGLE3_RUN_STAGE"
RUN_COMMAND_ENV = "EAGLE3_RUN_COMMAND"
INTERRUPTED_STATUS = 130  # a command stopped by Ctrl-C (SIGINT) or SIGTERM, as shells report it


def as_typed(text: str) -> str:
    """An option (``loop.min_steps``) or an assignment (``loop.min_steps=200``) of this stage as the
    user writes it: as it is, or under eagle3-run ``train.loop.min_steps=200`` (``overwrite=true``:
    ``redo=train``, which starts the stage over from eagle3-run)."""
    stage = os.environ.get(RUN_STAGE_ENV)
    if not stage:
        return text
    if text == "overwrite=true":
        return f"redo={stage}"
    return f"{stage}.{text}"


def in_run_syntax(message: str, stage: str, keys: list[str]) -> str:
    """A stage's message with its options (``keys``: the schema's dotted fields) written as
    eagle3-run takes them: ``optim.lr`` -> ``train.optim.lr`` anywhere, ``out=`` -> ``train.out=``
    where assigned, ``overwrite=true`` -> ``redo=train``."""
    import re

    message = re.sub(r"(?<![\w.+-])overwrite=true\b", f"redo={stage}", message)
    dotted = sorted({k for key in keys for k in _prefixes(key) if "." in k}, key=len, reverse=True)
    plain = sorted({key.split(".")[0] for key in keys}, key=len, reverse=True)
    pattern = "|".join([rf"{re.escape(k)}(?![\w])" for k in dotted] + [rf"{re.escape(k)}(?==)" for k in plain])
    if pattern:
        message = re.sub(rf"(?<![\w.+/-])(\+{{0,2}})({pattern})", lambda m: f"{m[1]}{stage}.{m[2]}", message)
    first = message.split(" ", 1)[0]
    if first in plain:  # "max_length must be positive"
        message = f"{stage}.{message}"
    return message


def _prefixes(key: str) -> list[str]:
    """``a.b.c`` -> ``a.b.c``, ``a.b``."""
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 1, -1)]


def continue_command(command: str) -> str:
    """The command that continues this one: the user's eagle3-run line under eagle3-run, else this
    command with its arguments (under torchrun: the same launch again)."""
    import shlex

    if typed := os.environ.get(RUN_COMMAND_ENV):
        return f"`{typed}` continues"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return "the same launch again continues"
    return f"`{shlex.join([command, *sys.argv[1:]])}` continues"


def interrupted(command: str, said: str | None) -> None:
    """One line for a stop by Ctrl-C or SIGTERM (global rank 0 only): what was kept, and the command
    that continues; then exit with status 130."""
    if int(os.environ.get("RANK", "0")) == 0:
        stage = os.environ.get(RUN_STAGE_ENV)
        who = f"eagle3-run: {stage}" if stage else command
        kept = said or "what it finished is kept (a rerun reuses it)"
        logger.warning(f"{who}: interrupted: {kept}; {continue_command(command)}")
    sys.exit(INTERRUPTED_STATUS)


@contextlib.contextmanager
def user_errors(command: str, schema: type | None = None) -> Iterator[None]:
    """Log an :class:`Eagle3Error` (or an OmegaConf error) as one message and exit with status 2;
    Ctrl-C or SIGTERM (``Interrupted`` saying what was kept) as one line, exit 130. Under eagle3-run,
    the message names the options as eagle3-run takes them."""
    from eagle3_train.core.errors import Interrupted

    try:
        yield
    except (Eagle3Error, OmegaConfBaseException) as e:
        stage = os.environ.get(RUN_STAGE_ENV)
        if stage and schema is not None:
            from eagle3_train.core.fingerprint import flatten

            logger.error(
                f"eagle3-run: error: {stage}: {in_run_syntax(str(e), stage, list(flatten(config_dict(schema))))}"
            )
        else:
            logger.error(f"{command}: error: {e}")
        sys.exit(2)
    except KeyboardInterrupt as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while it exits: no traceback
        interrupted(command, str(e) if isinstance(e, Interrupted) else None)


def _sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (a scheduler's stop, eagle3-run passing one on) stops a command as Ctrl-C does."""
    raise KeyboardInterrupt


# names other trainers give our options (a misspelt key is matched by spelling otherwise)
SYNONYMS = {
    "learning_rate": "lr",
    "num_epochs": "epochs",
    "num_train_epochs": "epochs",
    "warmup": "warmup_steps",
    "warmup_ratio": "warmup_fraction",
    "gradient_accumulation_steps": "grad_accum",
    "max_grad_norm": "grad_clip",
    "output_dir": "out",
}


def unknown_keys(cfg: DictConfig, schema: type) -> list[str]:
    """Keys of the composed config that ``schema`` (a dataclass, nested) has no field for, dotted;
    ``hydra`` and ``defaults`` are Hydra's own. A key below a field whose value is free-form (a
    dict or list option) is that field's."""
    from eagle3_train.core.fingerprint import flatten

    known = set(flatten(config_dict(schema)))
    composed = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(composed, dict)  # a composed config is a mapping
    given = flatten({str(k): v for k, v in composed.items() if k not in ("hydra", "defaults")})
    parents = lambda key: {key.rsplit(".", i)[0] for i in range(key.count(".") + 1)}  # noqa: E731  (a.b.c, a.b, a)
    return [key for key in given if not parents(key) & known]


def unknown_options(unknown: list[str], schema: type, prefix: str = "") -> str:
    """The message for options ``schema`` has no field for, each with the nearest field's name
    (another trainer's name for it, a moved key, or the closest spelling); all written with
    ``prefix`` (``train.`` under eagle3-run)."""
    import difflib

    from eagle3_train.core.fingerprint import flatten

    known = list(flatten(config_dict(schema)))
    said = []
    for key in unknown:
        leaf = SYNONYMS.get(key.rpartition(".")[2], key.rpartition(".")[2])
        same_leaf = [k for k in known if k.rpartition(".")[2] == leaf]  # another trainer's name, or a moved key
        near = same_leaf if len(same_leaf) == 1 else difflib.get_close_matches(key, known, n=1, cutoff=0.5)
        said.append(f"{prefix}{key}" + (f" (did you mean {prefix}{near[0]}?)" if near else ""))
    owner = f"eagle3-{prefix.rstrip('.')}" if prefix else schema.__name__
    return (
        f"unknown option{'s' if len(said) > 1 else ''} {', '.join(said)}: not a field of {owner}; "
        f"the reference page of {'that stage' if prefix else 'this command'} lists them all"
    )


def to_config(cfg: DictConfig, schema: type[T], prefix: str = "") -> T:
    """The composed Hydra config as its dataclass, so ``__post_init__`` checks run on final values.
    A key the schema has no field for (``+train.learning_rate=...``, which Hydra suggests for a
    misspelt key) is refused, naming the nearest field, instead of dropped. ``prefix``: how the
    messages write the options (``train.`` when eagle3-run checks a stage's)."""
    from eagle3_train.core.errors import ConfigError

    if unknown := unknown_keys(cfg, schema):
        raise ConfigError(unknown_options(unknown, schema, prefix))
    if missing := OmegaConf.missing_keys(cfg):
        from eagle3_train.core.fingerprint import flatten

        order = list(flatten(config_dict(schema)))  # (as the schema declares them)
        raise ConfigError(required(sorted(missing, key=lambda k: order.index(k) if k in order else len(order)), prefix))
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, schema):
        raise TypeError(f"config composed into {type(obj).__name__}, expected {schema.__name__}")
    return obj


def required(keys: list[str], prefix: str = "") -> str:
    """The message for options that have no default and were not given."""
    said = [f"{prefix}{k}" for k in keys]
    names = said[0] if len(said) == 1 else f"{', '.join(said[:-1])} and {said[-1]}"
    return (f"{names} {'is' if len(said) == 1 else 'are'} required (no default): add "
            f"{' '.join(f'{k}=...' for k in said)} to the command")  # fmt: skip


def compose_error(error: Exception, schema: type, prefix: str = "") -> str:
    """One line for an error of Hydra's composition (an unknown group option, a key not in the
    config, a value of the wrong type, an override it cannot parse), options written with
    ``prefix``; Hydra's own messages run to several lines and suggest ``+``."""
    import re

    text = str(error)
    if m := re.search(r"Could not find '([\w/]+)/([^']+)'", text):
        group, name = m[1], m[2]
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        return f"{prefix}{group}={name}: no such {group}" + (f"; one of {', '.join(options)}" if options else "")
    if m := re.search(r"Could not (?:override|delete from config)[^']*'([^']+)'", text):
        return unknown_options([m[1]], schema, prefix)
    cause = error.__cause__ or error.__context__
    if m := re.search(r"Error merging override (\S+)", text):
        why = str(cause).splitlines()[0] if cause is not None else text.splitlines()[-1]
        return f"{prefix}{m[1].lstrip('+~')}: {why}"
    if isinstance(error, OmegaConfBaseException) and getattr(error, "full_key", None):
        return f"{prefix}{error.full_key}: {text.splitlines()[0]}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def compose(config_name: str, overrides: list[str], schema: type[T], prefix: str = "", check: bool = True) -> T | None:
    """``conf/<config_name>.yaml`` composed with ``overrides`` and checked as ``schema`` (unless not
    ``check``: composed only, None), inside a running Hydra app or outside one; every error is one
    :class:`ConfigError` line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    from eagle3_train.core.errors import ConfigError

    try:
        if GlobalHydra.instance().is_initialized():
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
        else:
            with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
                cfg = hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(compose_error(e, schema, prefix)) from None
    if not check:
        return None
    try:
        return to_config(cfg, schema, prefix)
    except OmegaConfBaseException as e:
        raise ConfigError(compose_error(e, schema, prefix)) from None
    except ConfigError as e:
        if not prefix or str(e).startswith("unknown option"):
            raise
        from eagle3_train.core.fingerprint import flatten

        stage = prefix.rstrip(".")
        raise ConfigError(in_run_syntax(str(e), stage, list(flatten(config_dict(schema))))) from None


# Hydra flags whose value is the next argument
FLAGS_WITH_VALUE = ("--cfg", "-c", "--package", "-p")


def checked_arguments(config_name: str, schema: type, args: list[str]) -> None:
    """Compose the command line's overrides before Hydra does, so that what Hydra would refuse in
    several lines (exit 1) is one line: an unknown option or group choice, a wrong type, a bad
    override. Left to Hydra: a sweep (``-m``), ``--help`` and other flags that change what it does."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from eagle3_train.core.errors import ConfigError

    overrides, skip = [], False
    shown = any(a in ("--cfg", "-c") for a in args)  # --cfg job: Hydra shows the config as composed, unchecked
    for arg in args:
        if skip:
            skip = False
        elif arg in FLAGS_WITH_VALUE:
            skip = True
        elif arg.startswith("-"):
            return  # -m, --help, --info, -cn ...: Hydra's own
        elif not arg.lstrip("+~").startswith("hydra"):
            overrides.append(arg)
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(compose_error(e, schema)) from None
    if not any(o.is_sweep_override() for o in parsed):
        compose(config_name, overrides, schema, check=not shown)


def config_dict(obj: Any) -> dict:
    """A dataclass config as plain, JSON-ready data (for manifests)."""
    return OmegaConf.to_container(OmegaConf.structured(obj), resolve=True)  # type: ignore[return-value]


SWEEP_CHILD_ENV = "EAGLE3_SWEEP_JOB"  # set in a sweep job's own process


def sweep_job(command: str, run: Callable[..., Any], cfg: DictConfig) -> int | None:
    """One job of a Hydra sweep (``-m``), run in its own process, so that no state of an earlier
    job (DeepSpeed's process groups, a CUDA context, a loaded target) reaches it; its ``out=`` is
    ``<out>/<the swept options of this job>``, so every job has its own output directory. None
    outside a sweep (and inside the job's own process): the caller runs the command itself."""
    import os
    import subprocess

    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    from eagle3_train.core.errors import ConfigError

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN or os.environ.get(SWEEP_CHILD_ENV):
        return None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            f"{command} -m under torchrun: start the sweep without torchrun (each job runs in its own "
            "process), or run one torchrun per setting"
        )
    given = [a for a in sys.argv[1:] if not a.startswith("-")]
    swept = {o.key_or_group for o in OverridesParser.create().parse_overrides(given) if o.is_sweep_override()}
    task = list(hc.overrides.task)
    values = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] for o in task if "=" in o}
    if "out" in cfg and not OmegaConf.is_missing(cfg, "out") and swept - {"out"}:
        name = ",".join(f"{k}={values[k]}" for k in sorted(swept - {"out"}) if k in values).replace("/", "_")
        task = [o for o in task if o.split("=", 1)[0] != "out"] + [f"out='{Path(str(cfg.out)) / name}'"]
    module = run.__module__
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec is not None else module
    logger.info(f"{command}: sweep job {hc.job.num}: {' '.join(task)}")
    # a group of one formed earlier in this process (its port may still be bound) is not the job's
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return subprocess.run([sys.executable, "-m", module, *task], env={**env, SWEEP_CHILD_ENV: "1"}).returncode


def renamed_option(args: list[str], renamed: dict[str, str]) -> str | None:
    """The message for the first override in ``args`` that names an option by a name it no longer
    has (``renamed``: old dotted key -> new), or None."""
    for arg in args:
        key = arg.split("=", 1)[0].lstrip("+~")
        if "=" in arg and key in renamed:
            return f"{key} is now {renamed[key]}: write {arg.replace(key, renamed[key], 1).lstrip('+')}"
    return None


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def entry_point(
    config_name: str,
    schema: type[T],
    run: Callable[[T], Any],
    renamed: dict[str, str] | None = None,
    args: Callable[[list[str]], list[str]] | None = None,
) -> Callable[[], None]:
    """The console entry point ``eagle3-<config_name>`` (``_`` written ``-``): compose
    ``conf/<config_name>.yaml`` with the command-line overrides, check it as ``schema``, set up the
    console as its ``logging.*`` says (:func:`eagle3_train.core.log.setup_logging`), call ``run``;
    user errors print one line and exit 2, and an int that ``run`` returns is the exit status.
    ``renamed``: options that moved (old dotted key -> new), refused by their new name before Hydra
    composes (which would otherwise say only that the old key is not in its struct). ``args``: how
    the command's arguments are read before Hydra sees them (eagle3-run lets a stage's option be
    given without ``+``). Every argument is composed and checked first (:func:`checked_arguments`),
    so that Hydra's own errors are one line too."""
    import hydra

    from eagle3_train.core.errors import ConfigError

    command = f"eagle3-{config_name.replace('_', '-')}"

    @hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        setup_logging()  # the defaults until the config is read (its errors are shown too)
        with user_errors(command, schema):
            code = sweep_job(command, run, cfg)
            if code is None:
                config = to_config(cfg, schema)
                setup_logging(config.logging)  # type: ignore[attr-defined]  # every command's schema has one
                code = run(config)
        if isinstance(code, int) and not isinstance(code, bool) and code:
            sys.exit(code)

    def main() -> None:
        import atexit

        setup_logging()
        handlers = threading_main()  # (signal handlers are the main thread's)
        before = signal.signal(signal.SIGTERM, _sigterm) if handlers else None
        if handlers:  # a Ctrl-C while the interpreter exits (the work is done) changes nothing
            atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
        try:
            with user_errors(command, schema):
                if args is not None:
                    sys.argv[1:] = args(sys.argv[1:])
                if renamed and (said := renamed_option(sys.argv[1:], renamed)):
                    raise ConfigError(said)
                checked_arguments(config_name, schema, sys.argv[1:])
                _main()
        finally:
            if handlers:
                signal.signal(signal.SIGTERM, before)

    main.__doc__ = f"Console entry point ``{command}``."
    return main
