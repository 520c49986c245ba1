"""The optional extras (``pip install -e '.[served]'``, ...): packages that only some commands or
options need, imported where they are used, and failing with the extra's name when missing."""

from __future__ import annotations

import importlib
from types import ModuleType

from eagle3_train.core.errors import Eagle3Error

# top-level module -> (the extra in pyproject.toml that installs it, what needs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "wandb": ("wandb", "logging=wandb"),
    "aiohttp": (
        "served",
        "a served engine (the served dump, served regeneration, eagle3-served-acceptance, eagle3-bench)",
    ),
    "prometheus_client": ("served", "reading a served engine's /metrics (eagle3-served-acceptance, eagle3-bench)"),
    "matplotlib": ("plots", "eagle3-eval's acceptance.png and eagle3-bench's speedup.png (plot=false skips them)"),
    "datasketch": ("synthesis", "synthesis's near-duplicate filter"),
    "tensorboard": ("tensorboard", "logging=tensorboard"),
}


class MissingExtraError(Eagle3Error):
    """An optional package that is not installed; the message names the extra that installs it."""


def optional_import(name: str) -> ModuleType:
    """Import ``name``, a module of one of :data:`EXTRAS` (``matplotlib.pyplot``), or raise
    :class:`MissingExtraError` saying what needs it and which extra installs it."""
    top = name.partition(".")[0]
    extra, needed_by = EXTRAS[top]
    try:
        importlib.import_module(top)  # the package first: a submodule imported earlier stays in sys.modules
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.partition(".")[0] != top:  # the package is there; something it imports is not
            raise
        raise MissingExtraError(
            f"{needed_by} needs {top}, which is not installed: install the {extra!r} extra "
            f"(pip install -e '.[{extra}]' in a clone) or {top} itself"
        ) from None
