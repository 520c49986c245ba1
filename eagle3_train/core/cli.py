"""What every command shares: where ``conf/`` is, and how user errors are reported."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagle3_train.core.errors import Eagle3Error

T = TypeVar("T")


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
    """Print an :class:`Eagle3Error` (or an OmegaConf error) as one message and exit with status 2."""
    try:
        yield
    except (Eagle3Error, OmegaConfBaseException) as e:
        print(f"{command}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def to_config(cfg: DictConfig, schema: type[T]) -> T:
    """The composed Hydra config as its dataclass, so ``__post_init__`` checks run on final values."""
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, schema):
        raise TypeError(f"config composed into {type(obj).__name__}, expected {schema.__name__}")
    return obj


def config_dict(obj: Any) -> dict:
    """A dataclass config as plain, JSON-ready data (for manifests)."""
    return OmegaConf.to_container(OmegaConf.structured(obj), resolve=True)  # type: ignore[return-value]



def entry_point(config_name: str, schema: type[T], run: Callable[[T], Any]) -> Callable[[], None]:
    """The console entry point ``eagle3-<config_name>`` (``_`` written ``-``): compose
    ``conf/<config_name>.yaml`` with the command-line overrides, check it as ``schema``, call
    ``run``; user errors print one line and exit 2, and an int that ``run`` returns is the exit status."""
    import hydra

    command = f"eagle3-{config_name.replace('_', '-')}"

    @hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        with user_errors(command):
            code = run(to_config(cfg, schema))
        if isinstance(code, int) and not isinstance(code, bool) and code:
            sys.exit(code)

    def main() -> None:
        _main()

    main.__doc__ = f"Console entry point ``{command}``."
    return main
