"""What every command shares: where ``conf/`` is, and how user errors are reported."""

from __future__ import annotations

import contextlib
import logging
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


@contextlib.contextmanager
def user_errors(command: str) -> Iterator[None]:
    """Log an :class:`Eagle3Error` (or an OmegaConf error) as one message and exit with status 2."""
    try:
        yield
    except (Eagle3Error, OmegaConfBaseException) as e:
        logger.error(f"{command}: error: {e}")
        sys.exit(2)


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


def to_config(cfg: DictConfig, schema: type[T]) -> T:
    """The composed Hydra config as its dataclass, so ``__post_init__`` checks run on final values.
    A key the schema has no field for (``+train.learning_rate=...``, which Hydra suggests for a
    misspelt key) is refused, naming the nearest field, instead of dropped."""
    import difflib

    from eagle3_train.core.errors import ConfigError
    from eagle3_train.core.fingerprint import flatten

    unknown = unknown_keys(cfg, schema)
    if unknown:
        known = list(flatten(config_dict(schema)))
        said = []
        for key in unknown:
            leaf = SYNONYMS.get(key.rpartition(".")[2], key.rpartition(".")[2])
            same_leaf = [k for k in known if k.rpartition(".")[2] == leaf]  # another trainer's name, or a moved key
            near = same_leaf if len(same_leaf) == 1 else difflib.get_close_matches(key, known, n=1, cutoff=0.5)
            said.append(f"{key}" + (f" (did you mean {near[0]}?)" if near else ""))
        raise ConfigError(
            f"unknown option{'s' if len(said) > 1 else ''} {', '.join(said)}: not a field of "
            f"{schema.__name__}; the reference page of this command lists them all"
        )
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, schema):
        raise TypeError(f"config composed into {type(obj).__name__}, expected {schema.__name__}")
    return obj


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


def entry_point(
    config_name: str, schema: type[T], run: Callable[[T], Any], renamed: dict[str, str] | None = None
) -> Callable[[], None]:
    """The console entry point ``eagle3-<config_name>`` (``_`` written ``-``): compose
    ``conf/<config_name>.yaml`` with the command-line overrides, check it as ``schema``, set up the
    console as its ``logging.*`` says (:func:`eagle3_train.core.log.setup_logging`), call ``run``;
    user errors print one line and exit 2, and an int that ``run`` returns is the exit status.
    ``renamed``: options that moved (old dotted key -> new), refused by their new name before Hydra
    composes (which would otherwise say only that the old key is not in its struct)."""
    import hydra

    command = f"eagle3-{config_name.replace('_', '-')}"

    @hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        setup_logging()  # the defaults until the config is read (its errors are shown too)
        with user_errors(command):
            code = sweep_job(command, run, cfg)
            if code is None:
                config = to_config(cfg, schema)
                setup_logging(config.logging)  # type: ignore[attr-defined]  # every command's schema has one
                code = run(config)
        if isinstance(code, int) and not isinstance(code, bool) and code:
            sys.exit(code)

    def main() -> None:
        if renamed and (said := renamed_option(sys.argv[1:], renamed)):
            setup_logging()
            logger.error(f"{command}: error: {said}")
            sys.exit(2)
        _main()

    main.__doc__ = f"Console entry point ``{command}``."
    return main
