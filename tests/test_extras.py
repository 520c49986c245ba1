"""The optional extras: the base install imports every module, a command that needs a missing extra
names it, and pyproject.toml's extras install what eagle3_train.core.extras says they do."""

import asyncio
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from data_prep.synthesize import DuplicateFilter
from eagle3_train.core.extras import EXTRAS, MissingExtraError
from eagle3_train.engines.http import wait_ready
from eagle3_train.evaluation.plots import plot_acceptance
from eagle3_train.evaluation.served_acceptance import parse_prometheus
from eagle3_train.training.config import LoggingConfig
from eagle3_train.training.tracking import open_tracker
from test_imports import ROOT, project_modules

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def test_every_module_imports_without_the_extras():
    """A fresh interpreter where none of the extras' packages can be imported still imports every
    module of both packages (but the ``__main__`` ones, which run a command): no extra is imported
    at module level."""
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in EXTRAS)
    modules = sorted(m for m in project_modules() if not m.endswith("__main__"))
    code = f"import importlib, sys; {blocked}\nfor m in {modules!r}: importlib.import_module(m)"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]


CALLS = {
    "wandb": lambda tmp: open_tracker(
        SimpleNamespace(tracker="wandb", wandb_project="p", wandb_entity=None, wandb_mode="offline", run_name=None),
        tmp,
        {},
        0,
        True,
    ),
    "tensorboard": lambda tmp: LoggingConfig(tracker="tensorboard"),  # refused as the config is read
    "aiohttp": lambda tmp: asyncio.run(wait_ready(None, ["http://127.0.0.1:9"], 0.1)),
    "matplotlib": lambda tmp: plot_acceptance({}, tmp / "acceptance.png"),
    "datasketch": lambda tmp: DuplicateFilter(0.8),
    "prometheus_client": lambda tmp: parse_prometheus("vllm:x_total 1\n"),
}


@pytest.mark.parametrize("module", sorted(EXTRAS))
def test_a_missing_extra_is_named_by_what_needs_it(module, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, module, None)
    extra, needed_by = EXTRAS[module]
    with pytest.raises(
        MissingExtraError, match=rf"needs {module}, .*the '{extra}' extra \(pip install -e '\.\[{extra}\]'"
    ):
        CALLS[module](tmp_path)


def test_each_extra_installs_its_package_and_dev_installs_them_all():
    project = tomllib.loads((Path(ROOT) / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    base = {r.split(">")[0].split("=")[0].split("[")[0] for r in project["dependencies"]}
    for module, (extra, _) in EXTRAS.items():
        assert any(r.startswith(f"{module}>") for r in extras[extra]), (module, extras[extra])
        assert module not in base  # an extra's package is not a plain dependency too
    assert "eagle3_train[all,docs]" in extras["dev"]
    assert extras["all"] == [f"eagle3_train[{','.join(dict.fromkeys(e for e, _ in EXTRAS.values()))}]"]
