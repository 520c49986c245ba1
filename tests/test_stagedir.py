"""eagle3_train.core.stagedir: finished? same request? claim, replace, the record written last."""

import json

import pytest

from eagle3_train.core.errors import ContractError
from eagle3_train.core.stagedir import REQUEST_NAME, StageDir

REQUEST = {"capture": {"aux_indices": (1, 2), "dtype": "float32"}, "seed": 0}


def test_claim_then_manifest_then_finished(tmp_path):
    d = StageDir(tmp_path / "out", "dump", REQUEST)
    assert d.finished() is None
    assert d.claim() is False
    assert json.loads((tmp_path / "out" / REQUEST_NAME).read_text()) == {
        "capture": {"aux_indices": [1, 2], "dtype": "float32"},
        "seed": 0,
    }
    assert d.finished() is None  # claimed, not finished
    written = d.write_manifest({"counts": 3})
    assert written["stage"] == "dump" and written["counts"] == 3 and written["request"]["seed"] == 0
    again = StageDir(tmp_path / "out", "dump", dict(REQUEST)).finished()  # tuples equal their JSON lists
    assert again == written


def test_another_request_is_refused_naming_every_field(tmp_path):
    StageDir(tmp_path, "dump", REQUEST).claim()
    other = {"capture": {"aux_indices": [1, 3], "dtype": "float32"}, "seed": 1}
    with pytest.raises(
        ContractError,
        match=r"(?s)holds an unfinished dump made otherwise \(left: the directory, right: "
        r"this run\):\n  capture\.aux_indices: \[1, 2\] != \[1, 3\]\n  seed: 0 != 1\n"
        r"use another out=",
    ):
        StageDir(tmp_path, "dump", other).claim()
    StageDir(tmp_path, "dump", REQUEST).write_manifest({})
    with pytest.raises(
        ContractError, match=r"(?s)holds a finished training run made otherwise.*\n  seed: 0 != 1\nonly seed"
    ):
        StageDir(
            tmp_path, "dump", other, what="training run", hint=lambda diffs: f"only {diffs[-1].split(':')[0]}"
        ).finished()


def test_replace_clears_before_recording(tmp_path):
    StageDir(tmp_path, "regen", REQUEST).claim()
    (tmp_path / "chunk-0.json").write_text("{}")
    seen = []

    def clear():  # runs while the old request is still recorded
        seen.append(json.loads((tmp_path / REQUEST_NAME).read_text())["seed"])
        (tmp_path / "chunk-0.json").unlink()

    other = REQUEST | {"seed": 5}
    assert StageDir(tmp_path, "regen", other).claim(replace=True, clear=clear) is True
    assert seen == [0] and not (tmp_path / "chunk-0.json").exists()
    assert json.loads((tmp_path / REQUEST_NAME).read_text())["seed"] == 5
    assert StageDir(tmp_path, "regen", other).claim(replace=True, clear=clear) is False and seen == [0]


def test_finished_with_replace_removes_the_old_record(tmp_path):
    StageDir(tmp_path, "eval", REQUEST, record="report.json").write_manifest({"tau": 2.0})
    assert StageDir(tmp_path, "eval", REQUEST, record="report.json").finished()["tau"] == 2.0
    assert StageDir(tmp_path, "eval", REQUEST | {"seed": 1}, record="report.json").finished(replace=True) is None
    assert not (tmp_path / "report.json").exists()


def test_atomic_writes_are_readable_as_the_umask_allows(tmp_path):
    """mkstemp creates 0600 files; an atomic write must end as a plain open() would (0644 under
    umask 022, 0640 under 027), or a serving process of another user cannot read an export."""
    import os
    import stat

    import torch

    from eagle3_train.core.fileio import atomic_write_bytes, atomic_write_json, save_safetensors

    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "a.bin", b"x")
        atomic_write_json(tmp_path / "m.json", {"a": 1})
        save_safetensors({"w": torch.zeros(2)}, tmp_path / "w.safetensors")  # safetensors alone leaves 0600
        os.umask(0o027)
        atomic_write_bytes(tmp_path / "b.bin", b"x")
        save_safetensors({"w": torch.zeros(2)}, tmp_path / "v.safetensors")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE((tmp_path / p).stat().st_mode)  # noqa: E731
    assert (mode("a.bin"), mode("m.json"), mode("w.safetensors")) == (0o644, 0o644, 0o644)
    assert (mode("b.bin"), mode("v.safetensors")) == (0o640, 0o640)


def test_a_second_process_on_one_directory_is_refused_naming_the_first(tmp_path):
    """An exclusive stage directory is held by one process: a second one (another process) is
    refused with the first's pid and host; once the first dies (kill -9), the lock is gone."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    from eagle3_train.core.errors import ContractError
    from eagle3_train.core.stagedir import StageDir

    code = (
        "import sys, time; from eagle3_train.core.stagedir import StageDir; "
        "StageDir(sys.argv[1], 'train', {'a': 1}, exclusive=True).claim(); print('held', flush=True); time.sleep(60)"
    )
    first = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        with pytest.raises(
            ContractError,
            match=rf"run is in use: another process is writing this training run "
            rf"\(pid {first.pid} on {socket.gethostname()}, since ",
        ):
            StageDir(tmp_path / "run", "train", {"a": 1}, what="training run", exclusive=True).claim()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    time.sleep(0.1)
    StageDir(tmp_path / "run", "train", {"a": 1}, exclusive=True).claim()  # free again: taken
    StageDir(tmp_path / "run", "train", {"a": 1}, exclusive=True).claim()  # this process again: fine
