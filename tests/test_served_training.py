"""Training fed by a serving engine (``source=served``) against stand-in vLLM servers fed by the
tiny target: it trains exactly as ``source=online`` on the same data (the reference: the target in
this process), across a kill, an engine death, a lost replica; it stays within its prefetch bound,
deletes the engine's files, and refuses what it cannot work with in seconds."""

import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eagle3_train.core.errors import ConfigError, Eagle3Error
from eagle3_train.core.faults import FAULT_ENV
from eagle3_train.core.prepared import prepared_data
from eagle3_train.engines import launcher
from eagle3_train.engines.http import EngineError, Transient
from eagle3_train.serving.check import CheckConfig, ServingConfig, run_check
from eagle3_train.serving.export import ExportConfig, Exporter
from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer
from eagle3_train.training.config import TrainConfig
from eagle3_train.training.online import OnlineConfig
from eagle3_train.training.served import EngineConfig, flag_values
from standin_engines import StandinVllm
from test_online import ONLINE, ONLINE_ARGS, assert_same_training, last_weights
from test_standardize import make_dump
from test_trainer import TINY_ARGS, _torchrun, train

AUX = [1, 2, 3]
N = 4  # the tiny target's layers
REPO = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """48 conversations prepared for the tiny target, and the online run on them (the reference)."""
    root = tmp_path_factory.mktemp("served")
    make_dump(root, "d", n=48)
    prep = root / "d-prep"
    train(prep, root / "online", source="online", prepared=ONLINE, save_every=2)
    return {"prep": prep, "online": root / "online"}


def standin(tmp_path, ids=(*AUX, N), **kw):
    return StandinVllm(build_tiny_model(), list(ids), tmp_path / "engine_storage", write_delay_s=0.005, **kw)


def engine(urls, tmp_path, **kw):
    return EngineConfig(
        urls=list(urls),
        dtype="float32",
        files_dir=str(tmp_path / "files"),
        backoff_s=0.01,
        retries=kw.pop("retries", 2),
        request_timeout_s=kw.pop("request_timeout_s", 20.0),
        file_timeout_s=kw.pop("file_timeout_s", 5.0),
        concurrency=4,
        **kw,
    )


def served(prep, out, eng, **opt):
    return train(prep, out, source="served", prepared=ONLINE, engine=eng, **opt)


@pytest.mark.slow
def test_served_training_equals_online_training(data, tmp_path):
    """The same losses, accuracies and weights as the target in this process (float32 both ways:
    the stand-in's states are the transformers forward's), the same vocab map and capture, the
    engine's files deleted as read, and the run records what fed it."""
    with standin(tmp_path) as server:
        served(data["prep"], tmp_path / "run", engine([server.url], tmp_path), save_every=2)
        posts = server.posts
    assert_same_training(data["online"], tmp_path / "run", rel=1e-5, atol=1e-5)
    assert (tmp_path / "run" / "vocab_map.safetensors").read_bytes() == (
        data["online"] / "vocab_map.safetensors"
    ).read_bytes()
    (_, _, online), (_, _, state) = last_weights(data["online"]), last_weights(tmp_path / "run")
    assert state["capture"] == online["capture"]
    record = state["states_from"]
    assert record["engine"] == "vllm" and record["version"] == "0.0.0+standin" and record["dtype"] == "float32"
    assert (
        record["layer_ids"] == [*AUX, N]
        and record["aux_indices"] == AUX
        and record["replicas"] == 1
        and record["quantization"] is None
    )
    assert online["states_from"]["engine"] == "transformers"
    # every sample of 2 epochs and of 2 evaluations was asked for once (48 samples, 15 % held out)
    assert posts > 48
    assert not list((tmp_path / "files").rglob("*.safetensors")), "state files left behind"
    # export carries the record; check compares it with the serving engine named
    config = Exporter(ExportConfig(run=str(tmp_path / "run"), out=str(tmp_path / "x"))).run()
    assert config["eagle3_train"]["states_from"] == record
    # every exported file, the weights included, is readable as a plain open() would leave it
    from eagle3_train.core.fileio import umask_mode

    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "x").iterdir() if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {umask_mode()}, modes


def test_check_flags_a_serving_engine_other_than_the_one_that_fed_training(data, tmp_path, said):
    with standin(tmp_path) as server:
        served(data["prep"], tmp_path / "run", engine([server.url], tmp_path), max_steps=2)
    Exporter(ExportConfig(run=str(tmp_path / "run"), out=str(tmp_path / "x"))).run()
    check = lambda **kw: run_check(  # noqa: E731
        CheckConfig(draft=str(tmp_path / "x"), target="tiny", serving=ServingConfig(**kw))
    )
    said()
    assert check(engine="vllm", dtype="float32", quantization="none") == 0
    text = said()
    assert "states: the draft trained on states from engine vllm, version 0.0.0+standin, dtype float32" in text
    assert "WARNING" not in text
    assert check(engine="sglang", quantization="fp8") == 0  # warnings, not errors
    text = said()
    assert "trained on states with engine vllm, it will be served with engine sglang" in text
    assert "with quantization None, it will be served with quantization fp8" in text


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_same_finish(data, tmp_path):
    """Killed after its step-4 checkpoint, the same command continues at the exact data position
    and ends where the uninterrupted online run ended."""
    with standin(tmp_path) as server:
        args = [
            *ONLINE_ARGS,
            "source=served",
            f"engine.urls=[{server.url}]",
            "engine.dtype=float32",
            f"engine.files_dir={tmp_path / 'files'}",
            "checkpoint.save_every=2",
        ]
        killed = _torchrun(data["prep"], tmp_path / "cut", 1, args, {FAULT_ENV: "train.step:5"})
        assert killed.returncode != 0 and last_weights(tmp_path / "cut")[0] == "step4", killed.stderr[-3000:]
        served(data["prep"], tmp_path / "cut", engine([server.url], tmp_path), save_every=2)
    assert_same_training(data["online"], tmp_path / "cut", rel=1e-5, atol=1e-5)


def test_an_engine_that_dies_stops_the_run_naming_it_and_the_run_resumes(data, tmp_path):
    """The only replica dies mid-run: the run stops with an error naming the endpoint and the
    sample; the checkpoints before it are kept; with the engine back, the same command finishes
    as the uninterrupted run did."""
    with standin(tmp_path) as server:
        port = int(server.url.rsplit(":", 1)[1])
        server.die_at = 60  # past the step-2 checkpoint
        with pytest.raises(EngineError) as err:
            served(data["prep"], tmp_path / "run", engine([server.url], tmp_path), save_every=2)
    message = str(err.value)
    assert "no engine replica is left to answer sample" in message and server.url in message
    assert "3 attempts failed" in message
    kept_and_resumed(data, tmp_path, port)


def kept_and_resumed(data, tmp_path, port):
    """The checkpoints before the fault are kept; with the engine back on its port the same command
    finishes as the uninterrupted run did."""
    assert sorted((tmp_path / "run" / "checkpoints").glob("step*")), "the checkpoints before the fault are kept"
    with standin(tmp_path, port=port) as back:
        served(data["prep"], tmp_path / "run", engine([back.url], tmp_path), save_every=2)
    assert_same_training(data["online"], tmp_path / "run", rel=1e-5, atol=1e-5)


def test_losing_one_of_two_replicas_slows_the_run_instead_of_stopping_it(data, tmp_path, said):
    with standin(tmp_path) as a, standin(tmp_path) as b:
        b.die_at = 20
        served(data["prep"], tmp_path / "run", engine([a.url, b.url], tmp_path), save_every=2)
        assert a.posts > 20 and b.posts >= 19  # both took requests until b died
    text = said()
    assert f"dropped replica {b.url}" in text and "1 left" in text
    assert_same_training(data["online"], tmp_path / "run", rel=1e-5, atol=1e-5)


def test_a_hung_engine_counts_as_failed_after_the_request_timeout(data, tmp_path):
    with standin(tmp_path) as server:
        server.slow_posts = {n: 30.0 for n in range(5, 200)}
        start = time.monotonic()
        with pytest.raises(EngineError, match=r"TimeoutError"):
            served(data["prep"], tmp_path / "run", engine([server.url], tmp_path, retries=1, request_timeout_s=1.0))
        assert time.monotonic() - start < 25


HUNG = {"request_timeout_s": 600.0, "file_timeout_s": 600.0, "health_every_s": 1.0}  # the default timeouts


def test_a_hung_engine_stops_the_run_within_its_health_probes_and_the_run_resumes(data, tmp_path):
    """The only replica hangs mid-run (stopped: nothing answers, /health included, no state file is
    released) with the default 600 s request and file timeouts: its failed /health probes stop the
    run in seconds, naming the endpoint; the checkpoints are kept, and with the engine back the same
    command finishes as the uninterrupted run did."""
    with standin(tmp_path) as server:
        port = int(server.url.rsplit(":", 1)[1])
        server.hang_at = 60  # past the step-2 checkpoint
        with pytest.raises(EngineError) as err:
            served(data["prep"], tmp_path / "run", engine([server.url], tmp_path, **HUNG), save_every=2)
        assert server.hung_since is not None
        stopped_after = time.monotonic() - server.hung_since
    message = str(err.value)
    assert "no engine replica is left to answer sample" in message, message
    assert f"{server.url}: no answer to /health for" in message and "(2 probes" in message, message
    assert stopped_after < 15, stopped_after  # 2 probes 1 s apart, not 600 s timeouts
    kept_and_resumed(data, tmp_path, port)


def test_a_hung_replica_of_two_is_dropped_on_its_health_probes_and_the_run_goes_on(data, tmp_path, said):
    with standin(tmp_path) as a, standin(tmp_path) as b:
        b.hang_at = 20
        served(data["prep"], tmp_path / "run", engine([a.url, b.url], tmp_path, **HUNG), save_every=2)
        assert b.hung and a.posts > 20
    text = said()
    assert f"dropped replica {b.url} (no answer to /health for" in text and "1 left" in text
    assert_same_training(data["online"], tmp_path / "run", rel=1e-5, atol=1e-5)


def test_a_slow_engine_that_answers_health_is_not_dropped(data, tmp_path, said):
    """Answers seconds late, /health on time: the watchdog probes and leaves it alone (no retries
    either: a drop would stop the run)."""
    with standin(tmp_path) as server:
        server.slow_posts = {n: 4.0 for n in range(5, 9)}
        served(data["prep"], tmp_path / "run", engine([server.url], tmp_path, retries=0, **HUNG), max_steps=2)
        probes = server.health_probes
    assert probes >= 2 + 3, probes  # the 2 readiness probes, and those while the slow answers were awaited
    text = said()
    assert "dropped replica" not in text and "did not answer /health" not in text


def test_a_sample_waiting_for_its_file_fails_as_soon_as_the_last_replica_is_dropped(data, tmp_path):
    """A sample of an earlier micro-batch, answered but its state file never released (the lock
    held), stops waiting when a later micro-batch's failures drop the last replica: the trainer
    waiting on the earlier one gets the usual error at once, not after engine.file_timeout_s; the
    thread that waited for the file stops too."""
    from eagle3_train.core.dist import DistInfo
    from eagle3_train.engines.vllm import wait_and_load
    from eagle3_train.training.served import ServedSource

    with standin(tmp_path) as server:
        eng = engine([server.url], tmp_path, file_timeout_s=600.0, health_every_s=0.0)
        cpu = DistInfo(0, 1, 0, torch.device("cpu"))
        source = ServedSource(str(data["prep"]), "tiny", None, ONLINE, eng, 600, tmp_path / "run", cpu, torch.float32)
        try:
            split = source.train_split
            server.held_posts = {1}
            first = source.stream.submit(split.batch(torch.arange(0, 2).numpy()))
            deadline = time.monotonic() + 30
            while server.requests < 2 and time.monotonic() < deadline:  # both answered, one file held
                time.sleep(0.05)
            server.fail_from = server.posts + 1  # 503s: its retries drop the replica, the held lock stays
            later = source.stream.submit(split.batch(torch.arange(2, 4).numpy()))
            start = time.monotonic()
            with pytest.raises(EngineError, match=rf"no engine replica is left to answer sample \d+: {server.url}: "):
                first.result(timeout=30)
            assert time.monotonic() - start < 10
            with pytest.raises(EngineError):
                later.result(timeout=30)
        finally:
            source.close()
    # the wait itself: a held lock, then the request is cancelled (the stream sets stop)
    path = tmp_path / "held.safetensors"
    lock = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    stop, stopped = threading.Event(), []

    def wait() -> None:
        with pytest.raises(Transient, match="the wait was cancelled"):
            wait_and_load(path, 600.0, stop)
        stopped.append(True)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    stop.set()
    waiter.join(timeout=2)
    os.close(lock)
    assert not waiter.is_alive() and stopped


def test_a_wrong_answer_stops_the_run_at_once_naming_the_endpoint_and_the_sample(data, tmp_path):
    """An engine launched for another capture (no id N: three layers where four are asked) is not
    retried: its first answer stops the run."""
    with standin(tmp_path, ids=AUX) as server:
        with pytest.raises(
            EngineError,
            match=rf"{server.url} answered sample \d+ wrongly: .*has shape \[\d+, 3, 64\], expected \[\d+, 4, 64\]",
        ):
            served(data["prep"], tmp_path / "run", engine([server.url], tmp_path))
        assert server.posts <= 8  # the first micro-batches' requests, no retries
    with standin(tmp_path) as server:
        server.shift_tokens = True
        with pytest.raises(EngineError, match=r"token_ids differ from the prompt"):
            served(data["prep"], tmp_path / "run2", engine([server.url], tmp_path))


def test_prefetch_stays_within_its_bound(data, tmp_path):
    """The stream asks for at most prefetch + 1 micro-batches beyond those the trainer took."""
    from eagle3_train.core.dist import DistInfo
    from eagle3_train.training.served import ServedSource

    with standin(tmp_path) as server:
        eng = engine([server.url], tmp_path, prefetch=2)
        cpu = DistInfo(0, 1, 0, torch.device("cpu"))
        source = ServedSource(str(data["prep"]), "tiny", None, ONLINE, eng, 600, tmp_path / "run", cpu, torch.float32)
        try:
            split = source.train_split
            pulled = []

            def host():
                for i in range(0, len(split) - 1, 2):
                    pulled.append(i)
                    yield split.batch(torch.arange(i, i + 2).numpy())

            got = source.device_batches(host())
            for taken in range(1, 6):
                batch = next(got)
                time.sleep(0.2)  # the stream could run ahead now, if unbounded
                assert len(pulled) <= taken + eng.prefetch, (taken, len(pulled))
                assert server.posts <= 2 * (taken + eng.prefetch)
                assert batch.aux_hidden.shape[-1] == 3 * 64
            got.close()
        finally:
            source.close()


def test_bad_settings_and_unreachable_engines_fail_in_seconds(data, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    with pytest.raises(Eagle3Error, match=rf"{dead} did not become ready within 0 s"):
        served(data["prep"], tmp_path / "a", engine([dead], tmp_path))
    assert time.monotonic() - start < 10
    assert not (tmp_path / "a").exists()  # refused before the vocab is counted into the run directory
    with pytest.raises(ConfigError, match=r"engine.urls=\[...\] .* or engine.launch=true"):
        served(data["prep"], tmp_path / "b", engine([], tmp_path))
    with pytest.raises(ConfigError, match=r"^engine\.\* options apply to source=served"):
        TrainConfig(data="x", out="y", engine=EngineConfig(urls=["http://h:1"]))
    with pytest.raises(ConfigError, match=r"choose one"):
        EngineConfig(urls=["http://h:1"], launch=True)
    # engine.serve: an engine host of a source=served run, nothing else
    with pytest.raises(ConfigError, match=r"^engine\.\* options apply to source=served"):
        TrainConfig(data="x", out="y", source="online", engine=EngineConfig(serve=True))
    for other, said_ in (
        ({"print_launch": True}, "only prints their commands"),
        ({"launch": True}, "starts them inside a training run"),
        ({"urls": ["http://h:1"]}, "names replicas already running"),
    ):
        with pytest.raises(ConfigError, match=rf"engine.serve=true starts this host's replicas .*{said_}: choose one"):
            EngineConfig(serve=True, **other)
    with pytest.raises(ConfigError, match=r"final_urls needs one URL per engine.urls entry"):
        served(data["prep"], tmp_path / "c", engine([dead], tmp_path, name="sglang"))
    with pytest.raises(ConfigError, match=r"'--tensor-paralel-size' is not a flag of vllm serve"):
        served(data["prep"], tmp_path / "d", engine([dead], tmp_path, engine_args="--tensor-paralel-size 2"))
    with pytest.raises(
        ConfigError,
        match=r"online.\* options set how the target runs in this process \(source=online\); with source=served the engine runs it",
    ):
        TrainConfig(data="x", out="y", source="served", prepared=ONLINE, online=OnlineConfig(dtype="bfloat16"))
    with pytest.raises(ConfigError, match=r"runs in this process: use source=online"):
        served(data["prep"], tmp_path / "e", engine([dead], tmp_path, name="hf"))
    assert flag_values("--tp 8 --quantization=fp8 --enable-expert-parallel") == {
        "--tp": "8",
        "--quantization": "fp8",
        "--enable-expert-parallel": True,
    }


@pytest.mark.slow
def test_launch_starts_the_engine_trains_and_stops_it(data, tmp_path):
    """engine.launch=true starts the printed vLLM command (a stand-in `vllm` on PATH that requires the
    capture's flags), waits for it, trains as source=online does, and stops it at the end; a run
    killed mid-way takes its engine with it, and the same command resumes to the same finish."""
    target = tmp_path / "target"
    build_tiny_model().save_pretrained(target)
    build_tiny_tokenizer().save_pretrained(target)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    vllm = bin_dir / "vllm"
    vllm.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{REPO / "tests" / "standin_engines.py"}" vllm "$@"\n')
    vllm.chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(REPO))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # this process's own group
        env.pop(name, None)
    cmd = [
        sys.executable,
        "-m",
        "eagle3_train.training.trainer",
        f"data={data['prep']}",
        f"target={target}",
        f"out={tmp_path / 'run'}",
        *TINY_ARGS,
        "checkpoint.save_every=2",
        *ONLINE_ARGS[1:],
        "source=served",
        "engine.launch=true",
        f"engine.port={port}",
        "engine.dtype=float32",
        "engine.engine_args=--enforce-eager",
        "engine.launch_timeout_s=120",
    ]
    # killed after its step-4 checkpoint: the engine it started goes with it (no GPU held by an orphan)
    killed = subprocess.run(cmd, env=env | {FAULT_ENV: "train.step:5"}, capture_output=True, text=True, timeout=300)
    assert killed.returncode != 0 and last_weights(tmp_path / "run")[0] == "step4", killed.stderr[-3000:]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            time.sleep(0.2)
        except ConnectionRefusedError:
            break
    else:
        pytest.fail("the engine outlived the killed run")
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    log = tmp_path / "run" / "engine" / "replica0.0.log"
    assert run.returncode == 0, run.stderr[-3000:] + (log.read_text() if log.exists() else "")
    command = log.read_text().splitlines()[0]  # the log holds both starts; the first line is the first command
    longest = min(600, int(prepared_data(str(data["prep"])).num_tokens.max()))
    assert "--gpu-memory-utilization 0.45" in command and f"--max-model-len {longest + 1}" in command
    assert "extract_hidden_states" in command and "--enforce-eager" in command
    with pytest.raises(ConnectionRefusedError):  # stopped: nothing listens on its port
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    (_, _, state) = last_weights(tmp_path / "run")
    assert state["states_from"]["launched"] is True and state["states_from"]["engine_args"] == "--enforce-eager"
    # the same training as the tiny target in this process (the saved directory holds the same weights)
    assert_same_training(data["online"], tmp_path / "run", rel=1e-5, atol=1e-5)


def test_a_launched_engine_that_fails_to_start_is_reported_with_its_log(data, tmp_path):
    target = tmp_path / "target"
    build_tiny_model().save_pretrained(target)
    build_tiny_tokenizer().save_pretrained(target)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text("#!/bin/sh\necho 'error: CUDA out of memory' >&2\nexit 3\n")
    (bin_dir / "vllm").chmod(0o755)
    path = os.environ["PATH"]
    os.environ["PATH"] = f"{bin_dir}:{path}"
    try:
        start = time.monotonic()
        with pytest.raises(EngineError, match=r"exited with status 3(.|\n)*CUDA out of memory"):
            served(
                data["prep"],
                tmp_path / "run",
                replace(engine([], tmp_path), launch=True, port=1, launch_timeout_s=60),
                target=str(target),
            )
        assert time.monotonic() - start < 30
    finally:
        os.environ["PATH"] = path


def test_serve_waits_until_a_server_exits_and_quotes_its_log(tmp_path, monkeypatch, said):
    """launcher.serve (engine.serve=true, eagle3-dump serve=true): a server that exits ends the wait
    with its status (1 for an unasked exit 0), its log quoted, and the others are stopped."""
    monkeypatch.setattr(launcher, "POLL_S", 0.05)
    pid = tmp_path / "pid"
    for last, status in (("exit 3", 3), ("exit 0", 1), ("kill -9 $$", 128 + 9)):
        pid.unlink(missing_ok=True)
        commands = [
            launcher.EngineCommand(f"sh -c 'echo $$ > {pid}; exec sleep 60'", None, tmp_path / "a.log"),
            launcher.EngineCommand(f"sh -c 'echo out of memory; sleep 0.5; {last}'", None, tmp_path / "b.log"),
        ]
        assert launcher.serve(commands, "test serve") == status
        text = said()
        assert "test serve: the engine started by this run exited" in text and "out of memory" in text
        with pytest.raises(ProcessLookupError):  # the other one had started, and was stopped
            os.kill(int(pid.read_text()), 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="test serve starts this host's engine servers once: run it without torchrun"):
        launcher.serve(commands, "test serve")


def fake_cluster(tmp_path: Path) -> tuple[Path, Path]:
    """A target directory, and a bin directory with a stand-in ``vllm`` and SLURM's ``srun`` and
    ``scontrol`` as one host plays them (srun runs its command here; every node list is this host)."""
    target = tmp_path / "target"
    build_tiny_model().save_pretrained(target)
    build_tiny_tokenizer().save_pretrained(target)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "vllm": f'#!/bin/sh\nexec "{sys.executable}" "{REPO / "tests" / "standin_engines.py"}" vllm "$@"\n',
        "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
        "scontrol": "#!/bin/sh\necho 127.0.0.1\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return target, bin_dir


@pytest.mark.slow
def test_print_launch_prints_the_engine_command_the_run_expects(data, tmp_path):
    target, _ = fake_cluster(tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "eagle3_train.training.trainer", f"data={data['prep']}", f"target={target}",
         f"out={tmp_path / 'run'}", *ONLINE_ARGS, "source=served", "engine.print_launch=true", "engine.port=8123",
         "engine.engine_args=--tensor-parallel-size 8", "engine.memory_fraction=null", "engine.files_dir=/shared/f"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "HF indices [1, 2, 3] + the last layer (engine ids [1, 2, 3, 4])" in run.stdout
    assert "--port 8123" in run.stdout and "--tensor-parallel-size 8" in run.stdout
    assert "shared_storage_path" in run.stdout and "/shared/f" in run.stdout
    assert "--gpu-memory-utilization" not in run.stdout and "--max-model-len" in run.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_engine_serve_starts_the_replicas_and_sigterm_stops_them(data, tmp_path):
    """eagle3-train source=served engine.serve=true (an engine host): the printed replica starts,
    logging under <out>/engine/<host>/, answers on its port, and SIGTERM stops it and the command
    (status 0, one line); nothing is trained."""
    target, bin_dir = fake_cluster(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagle3_train.training.trainer", f"data={data['prep']}", f"target={target}",
         f"out={tmp_path / 'run'}", *ONLINE_ARGS, "source=served", "engine.serve=true", f"engine.port={port}",
         "engine.dtype=float32", f"engine.files_dir={tmp_path / 'files'}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except ConnectionRefusedError:
                time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert "eagle3-train engine.serve: stopped by a signal; the engine servers are stopped" in output
    with pytest.raises(ConnectionRefusedError):  # stopped: nothing listens on its port
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    (log,) = (tmp_path / "run" / "engine").glob("*/replica0.0.log")
    assert log.parent.name == socket.gethostname()
    command = log.read_text().splitlines()[0]
    assert f"--port {port}" in command and "extract_hidden_states" in command and str(tmp_path / "files") in command
    assert (tmp_path / "files").is_dir() and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_the_slurm_job_starts_engines_and_trainers_that_find_them(data, tmp_path):
    """launch/slurm/train_served.sbatch as one host plays both components (srun and scontrol
    stand-ins): the engine component serves (engine.serve=true), the trainer component finds it by
    the node list and trains as source=online does, and the engine stops when training ends."""
    target, bin_dir = fake_cluster(tmp_path)
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        PYTHONPATH=str(REPO),
        EAGLE3_TRAIN=f"{sys.executable} -m eagle3_train.training.trainer",
        SLURM_JOB_NODELIST_HET_GROUP_0="engine[0]",
        SLURM_JOB_NODELIST_HET_GROUP_1="trainer[0]",
        SLURM_GPUS_ON_NODE_HET_GROUP_1="1",
        SLURM_JOB_ID="7",
        MASTER_PORT=str(ports[1]),
        ENGINE_WAIT_S="120",
    )
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):  # this process's own group
        env.pop(name, None)
    run = subprocess.run(
        ["bash", str(REPO / "launch" / "slurm" / "train_served.sbatch"), f"data={data['prep']}", f"target={target}",
         f"out={tmp_path / 'run'}", *TINY_ARGS, "checkpoint.save_every=2",
         *ONLINE_ARGS[1:], f"engine.port={ports[0]}", "engine.dtype=float32", f"engine.files_dir={tmp_path / 'files'}",
         "engine.memory_fraction=null"],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert_same_training(data["online"], tmp_path / "run", rel=1e-5, atol=1e-5)
    assert last_weights(tmp_path / "run")[2]["states_from"]["launched"] is False
    assert "eagle3-train engine.serve: stopped by a signal" in run.stdout + run.stderr, run.stdout[-1500:]
    with pytest.raises(ConnectionRefusedError):  # the engine host stopped its replica
        socket.create_connection(("127.0.0.1", ports[0]), timeout=5).close()


@pytest.mark.slow
def test_sglang_replicas_train_as_online_and_old_releases_are_refused_by_name(data, tmp_path):
    """SGLang's two servers per replica (aux states, post-norm final state) feed the same training;
    a release older than the one its state return was read from is refused, naming it."""
    from eagle3_train.training.served import release
    from standin_engines import StandinSglang

    assert release("0.5.23") > release("0.5.17") and release("0.5.23+cu130") == (0, 5, 23)
    aux_server = StandinSglang(build_tiny_model(), [k - 1 for k in AUX], torch.float32)
    final_server = StandinSglang(build_tiny_model(), None, torch.float32)
    with aux_server, final_server:
        for s in (aux_server, final_server):
            s.version = "0.5.23"
        eng = replace(engine([aux_server.url], tmp_path, name="sglang"), final_urls=[final_server.url])
        served(data["prep"], tmp_path / "run", eng, save_every=2)
        for s in (aux_server, final_server):
            s.version = "0.5.17"
        with pytest.raises(ConfigError, match=r"run sglang 0.5.17; training from sglang needs 0.5.23 or later"):
            served(data["prep"], tmp_path / "old", eng)
    assert_same_training(data["online"], tmp_path / "run", rel=1e-5, atol=1e-5)


@pytest.mark.slow
def test_two_trainer_ranks_fed_by_one_engine_train_as_one_rank(data, tmp_path):
    """2 ranks (gloo) x grad_accum 1, each with its own requests to the one replica, train as the
    one-rank online reference with grad_accum 2: the served source assigns micro-batches as online."""
    train(data["prep"], tmp_path / "one", source="online", prepared=ONLINE, grad_accum=2)
    with standin(tmp_path) as server:
        args = [*ONLINE_ARGS, "source=served", f"engine.urls=[{server.url}]", "engine.dtype=float32",
                f"engine.files_dir={tmp_path / 'files'}", "loop.grad_accum=1"]  # fmt: skip
        two = _torchrun(data["prep"], tmp_path / "two", 2, args)
    assert two.returncode == 0, two.stderr[-3000:]
    assert_same_training(tmp_path / "one", tmp_path / "two", rel=1e-4, atol=1e-4)


def test_the_target_distribution_from_the_returned_state_is_the_engines_own(data, tmp_path):
    """The trainer's target distribution, softmax(lm_head(last_hidden)) from the state the engine
    returns and the checkpoint's lm_head, equals the distribution of the logits the target itself
    computes for the same tokens (the engine's logits, which are not asked for)."""
    from eagle3_train.core.dist import DistInfo
    from eagle3_train.training.served import ServedSource

    model = build_tiny_model().float().eval()
    with standin(tmp_path) as server:
        cpu = DistInfo(0, 1, 0, torch.device("cpu"))
        eng = engine([server.url], tmp_path)
        source = ServedSource(str(data["prep"]), "tiny", None, ONLINE, eng, 600, tmp_path / "run", cpu, torch.float32)
        try:
            _, tensors = source.target_tensors(("head",))
            split = source.train_split
            batch = next(source.device_batches(iter([split.batch(torch.arange(0, 3).numpy())])))
        finally:
            source.close()
    for r, n in enumerate(batch.lengths.tolist()):
        ours = torch.softmax(batch.last_hidden[r, :n] @ tensors["head"].float().T, dim=-1)  # [T, V]
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids[r : r + 1, :n]).logits[0]
        torch.testing.assert_close(ours, torch.softmax(logits.float(), dim=-1), atol=1e-5, rtol=0)
