"""The console (eagle3_train.core.log) and the metrics trackers (eagle3_train.training.tracking); the
trackers of a training run are tested in test_trainer.py."""

import json
import logging
import sys
import time
import warnings

import pytest

from eagle3_train.core.log import PACKAGES, ConsoleHandler, LogConfig, progress_bar, setup_logging
from eagle3_train.training.config import LoggingConfig
from eagle3_train.training.tracking import TRACKER_FILE, open_tracker, wandb_run_id, wandb_settings


@pytest.fixture
def console():
    """Whatever a test's setup_logging installs is removed afterwards (root handler, levels)."""
    yield
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, ConsoleHandler)]:
        root.removeHandler(h)
    for name in PACKAGES:
        logging.getLogger(name).setLevel(logging.NOTSET)


# -- the console ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
def test_a_command_shows_info_on_rank_0_and_warnings_and_errors_on_every_rank(
    rank, console, monkeypatch, capsys, tmp_path
):
    """The entry point of a real command sets the console up from its config and $RANK: a module's
    INFO line shows on rank 0 only (stdout), a warning and the command's error on every rank (stderr)."""
    from eagle3_train.serving.export import main

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(sys, "argv", ["eagle3-export", f"run={tmp_path / 'missing'}", f"out={tmp_path / 'x'}"])
    with pytest.raises(SystemExit) as exit:
        main()
    assert exit.value.code == 2
    assert capsys.readouterr().err.startswith("eagle3-export: error: ")  # no level, path or time before it
    module = logging.getLogger("eagle3_train.core.prepared")
    module.info("a note")
    module.warning("warning: a warning")
    out, err = capsys.readouterr()
    assert out == ("a note\n" if rank == 0 else "")
    assert err == "warning: a warning\n"


def test_level_and_all_ranks_come_from_the_config(console, monkeypatch, capsys, tmp_path):
    from eagle3_train.serving.export import main

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "eagle3-export",
            f"run={tmp_path / 'missing'}",
            f"out={tmp_path / 'x'}",
            "logging.level=DEBUG",
            "logging.all_ranks=true",
        ],
    )
    with pytest.raises(SystemExit):
        main()
    assert capsys.readouterr().err.startswith("[rank 1] eagle3-export: error: ")
    logging.getLogger("data_prep.prepare").debug("a detail")
    logging.getLogger("transformers").info("not ours")  # other libraries: warnings and above only
    assert capsys.readouterr().out == "[rank 1] a detail\n"
    with pytest.raises(Exception, match="logging.level must be one of DEBUG, INFO, WARNING, ERROR, got 'LOUD'"):
        LogConfig(level="LOUD")


def test_warnings_of_other_libraries_are_log_records_without_source_paths(console, capsys):
    setup_logging(LogConfig(), rank=0)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("something is deprecated", FutureWarning, stacklevel=1)
    assert capsys.readouterr() == ("", "FutureWarning: something is deprecated\n")


# -- progress ------------------------------------------------------------------------------------


def test_no_bar_frames_without_a_terminal_but_log_lines(console, capsys):
    """progress=null (the default) where stderr is not a terminal (here: captured): no tqdm frame,
    a log line when the bar starts, every logging.progress_every_s seconds, and at the end."""
    setup_logging(LogConfig(progress_every_s=3600), rank=0)
    bar = progress_bar(show=None, total=5, desc="work", unit="step")
    for _ in range(5):
        bar.update(1)
    bar.close()
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert (
        len(lines) == 2 and lines[0].startswith("work: 0/5 step (0%)") and lines[1].startswith("work: 5/5 step (100%)")
    )
    setup_logging(LogConfig(progress_every_s=0.01), rank=0)
    for _ in progress_bar(range(4), show=None, desc="slow"):
        time.sleep(0.02)
    assert [line.split(" ")[1] for line in capsys.readouterr().out.splitlines()] == ["0/4", "1/4", "2/4", "3/4", "4/4"]
    # on another rank the lines are INFO records: not shown
    setup_logging(LogConfig(progress_every_s=0.01), rank=1)
    for _ in progress_bar(range(3), show=None, desc="quiet"):
        time.sleep(0.02)
    assert capsys.readouterr() == ("", "")


def test_other_libraries_bars_are_off_without_a_terminal(console, capsys, monkeypatch):
    """datasets' bars (prepare's save_to_disk, map) would write their frames into a SLURM log."""
    import datasets
    from transformers.utils import logging as transformers_logging

    # an earlier setup_logging in this process set the variables: the libraries read them at import
    monkeypatch.setattr(sys.modules["datasets.utils.tqdm"], "HF_DATASETS_DISABLE_PROGRESS_BARS", None)
    monkeypatch.setattr(sys.modules["huggingface_hub.utils.tqdm"], "HF_HUB_DISABLE_PROGRESS_BARS", None)

    rows = datasets.Dataset.from_dict({"a": list(range(300))})
    datasets.enable_progress_bars()
    transformers_logging.enable_progress_bar()
    rows.map(lambda r: r)
    assert "Map" in capsys.readouterr().err  # the control: a frame where bars are on
    setup_logging(LogConfig(), rank=0)  # stderr is captured here: not a terminal
    assert not datasets.is_progress_bar_enabled() and not transformers_logging.is_progress_bar_enabled()
    rows.map(lambda r: r)
    assert capsys.readouterr().err == ""
    # a user who asked for the bars (the library's own variable) keeps them, and no warning
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "0")
    datasets.enable_progress_bars()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        setup_logging(LogConfig(), rank=0)
    assert datasets.is_progress_bar_enabled()


def test_the_bar_shows_on_a_terminal_or_when_forced(console, monkeypatch, capsys):
    setup_logging(LogConfig(), rank=0)
    for _ in progress_bar(range(3), show=True, desc="forced"):
        pass
    out, err = capsys.readouterr()
    assert out == "" and "\rforced: 100%" in err and "3/3" in err
    for _ in progress_bar(range(3), show=False, desc="off"):
        pass
    assert capsys.readouterr() == ("", "")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    for _ in progress_bar(range(3), show=None, desc="tty"):
        pass
    out, err = capsys.readouterr()
    assert out == "" and "\rtty: 100%" in err


# -- trackers ------------------------------------------------------------------------------------


def test_wandb_settings_the_config_sets_win_over_the_environment(tmp_path):
    env = {"WANDB_PROJECT": "theirs", "WANDB_ENTITY": "team", "WANDB_MODE": "online", "WANDB_NAME": "n"}
    assert wandb_settings(LoggingConfig(), tmp_path / "run", env) == {
        "mode": "online",
        "project": "theirs",
        "entity": "team",
        "name": "n",
        "dir": str(tmp_path / "run"),
    }
    mine = LoggingConfig(wandb_project="mine", wandb_mode="offline", run_name="r")
    assert wandb_settings(mine, tmp_path / "run", env) | {"entity": None} == {
        "mode": "offline",
        "project": "mine",
        "entity": None,
        "name": "r",
        "dir": str(tmp_path / "run"),
    }
    assert wandb_settings(LoggingConfig(), tmp_path / "run", {}) == {
        "mode": "offline",
        "project": "eagle3_train",
        "entity": None,
        "name": "run",
        "dir": str(tmp_path / "run"),
    }
    assert wandb_settings(LoggingConfig(), tmp_path, {"WANDB_DISABLED": "true"})["mode"] == "disabled"


def test_wandb_disabled_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "run"
    out.mkdir()
    assert open_tracker(LoggingConfig(tracker="wandb"), out, {}, 0, True) is None
    assert list(out.iterdir()) == []


def test_the_wandb_run_id_is_kept_in_the_run_directory(tmp_path):
    made = iter(["first", "second"])
    assert wandb_run_id(tmp_path, lambda: next(made)) == "first"
    assert wandb_run_id(tmp_path, lambda: next(made)) == "first"  # resumed: the same run
    assert json.loads((tmp_path / TRACKER_FILE).read_text()) == {"wandb_run_id": "first"}


def test_every_command_has_the_console_options():
    """The entry point sets the console up from ``config.logging``: every command's schema has one."""
    import typing

    from test_configs import PRIMARY

    for name, (schema, _) in PRIMARY.items():
        assert issubclass(typing.get_type_hints(schema)["logging"], LogConfig), name
