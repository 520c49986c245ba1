"""Faults at every stage (issue #33): every stage killed with SIGKILL at varied points, then run
again, ends with the output of an uninterrupted run; a second process on one output directory is
refused, naming the first; a full disk during a checkpoint save leaves the previous checkpoint
usable; a served engine that dies mid-dump or mid-regeneration stops with an error naming it, keeps
what finished, and the rerun continues.

The kills are real and cheap: the stage runs in a forked child of the test process (no second
import of torch) with ``EAGLE3_FAULT_AT=<point>:<n>`` (eagle3_train/core/faults.py), which SIGKILLs
(``:stop``: SIGSTOPs) the child the n-th time it passes the point; the rerun runs in the test
process. docs/guide/faults.md tabulates every fault tried here.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from data_prep.dump import CaptureConfig, ClientConfig, DumpConfig, Dumper, ServerConfig
from data_prep.prepare import PrepareConfig, Preparer
from data_prep.regenerate import RegenConfig
from data_prep.served_regen import ServedRegenConfig
from data_prep.standardize import StandardizeConfig, Standardizer
from data_prep.synthesize import SynthConfig
from eagle3_train.core.errors import ContractError, Eagle3Error
from eagle3_train.core.faults import FAULT_ENV
from eagle3_train.evaluation.eval import EvalConfig, Evaluator
from eagle3_train.serving.export import ExportConfig, Exporter
from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer
from eagle3_train.training.online import PreparedConfig
from standin_engines import StandinVllm
from test_dump import mixed_conversations, prepare_tiny, stored_samples
from test_standardize import make_dump
from test_trainer import metrics, standardized, train

CHILD_TIMEOUT_S = 120.0
TIMING = (
    "tokens_per_s",
    "loop_s",
    "gpu_peak_alloc_gib",
    "gpu_peak_reserved_gib",
)  # metrics that measure the machine, not the run


# -- killing a stage --------------------------------------------------------------------------------


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _child(spec: str, work: Callable[[], Any]) -> None:
    # no torch.set_num_threads here: the child inherits the one thread the module fixture set, and
    # touching OpenMP's settings in a forked child can crash it
    os.environ[FAULT_ENV] = spec
    _new_port()  # not the parent's: it may train while this child holds its group's port
    work()


def _drop_process_group() -> None:
    """Before a fork, drop the test process's group of one (if a test trained in process): its
    gloo threads would not be copied by the fork, so a child's collectives would wait forever, and
    destroying the group in the child crashes it (segfaults in the full suite on CI). DeepSpeed's
    groups cut from it go too; training in the child, or here later, forms a new group on a free
    port."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    dist.destroy_process_group()
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(groups, name, None)
        elif name.isupper() and isinstance(value, dict):  # e.g. _EXPERT_PARALLEL_GROUP: name -> group
            value.clear()
    _new_port()


def _new_port() -> None:
    """A free port for the next process group this process forms."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def _fork(spec: str, work: Callable[[], Any]) -> multiprocessing.Process:
    _drop_process_group()
    child = multiprocessing.get_context("fork").Process(target=_child, args=(spec, work), daemon=True)
    child.start()
    return child


def in_child(work: Callable[[], Any]) -> None:
    """Run ``work`` to its end in a forked child: a process of its own, whose locks end with it
    (this process keeps every lock it takes)."""
    child = _fork("", work)
    child.join(CHILD_TIMEOUT_S)
    assert child.exitcode == 0, f"exit status {child.exitcode}"


def kill_at(point: str, n: int, work: Callable[[], Any]) -> None:
    """Run ``work`` in a forked child that SIGKILLs itself the n-th time it passes ``point``;
    fails unless it died that way (a point never reached is a broken test, not a pass)."""
    child = _fork(f"{point}:{n}", work)
    child.join(CHILD_TIMEOUT_S)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"the child did not reach {point}:{n} within {CHILD_TIMEOUT_S} s")
    assert child.exitcode == -signal.SIGKILL, f"{point}:{n} was never reached (exit status {child.exitcode})"


@contextmanager
def stopped_at(point: str, n: int, work: Callable[[], Any]) -> Iterator[int]:
    """A forked child running ``work``, stopped (SIGSTOP) the n-th time it passes ``point`` and
    holding what it holds there; yields its pid, then SIGKILLs it."""
    child = _fork(f"{point}:{n}:stop", work)
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while _state(child.pid) != "T":
            assert child.exitcode is None, f"{point}:{n} was never reached (exit status {child.exitcode})"
            assert time.monotonic() < deadline, f"the child did not reach {point}:{n} within {CHILD_TIMEOUT_S} s"
            time.sleep(0.02)
        yield child.pid
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()


def _state(pid: int) -> str:
    """A process's state letter (T: stopped) from /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def refused_naming(pid: int) -> str:
    """The lock's refusal, naming the holder's pid and host."""
    return rf"is in use: another process is writing this .*\(pid {pid} on {socket.gethostname()}, since "


def interrupt(point: str, n: int, work: Callable[[], Any], lock: bool = False) -> None:
    """Kill ``work`` the n-th time it passes ``point``. With ``lock``: stop it there instead,
    check that the same work started again (here, on the same directory) is refused naming the
    stopped process, then kill it."""
    if not lock:
        kill_at(point, n, work)
        return
    with stopped_at(point, n, work) as pid, pytest.raises(ContractError, match=refused_naming(pid)):
        work()


def listing(root: Path) -> list[str]:
    """Every file under ``root`` (less the lock files), by relative path: a killed run's leftovers
    (a temporary file, a partial checkpoint) show here."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def files(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under ``root`` by relative path (less the lock files and ``skip``), with its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.endswith(".lock") and p.name not in skip
    }


def record(path: Path, *drop: str) -> dict[str, Any]:
    """A JSON record less the fields that say when or how fast (``created_at`` always)."""
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in ("created_at", *drop)}


# -- prepare: synthesis and regeneration ------------------------------------------------------------


def synthesize(out: Path) -> dict[str, Any]:
    """6 conversations written by the tiny target (ending its turns soon: :func:`ends_soon`; its
    replies sampled too, since greedy ones would all be the end-of-turn token), in chunks of 2."""
    return Preparer(
        PrepareConfig(
            target="tiny",
            out=str(out),
            synthesize=6,
            progress=False,
            device="cpu",
            synth=SynthConfig(chunk_size=2, max_new_tokens=32, min_tokens=1, max_tokens=32, max_repeated_ngrams=1),
            regen=RegenConfig(max_new_tokens=8, batch_size=2, do_sample=True, temperature=1.0),
        )
    ).run()


@pytest.fixture(scope="module")
def ends_soon():
    """The tiny target with its end-of-turn logit raised by 3 (a turn ends after ~16 tokens): the
    random model would end few user turns within the limit, and synthesis would generate chunk
    after chunk to keep 6 (a patch of the class, so forked children have it too)."""
    real = Preparer._load_generator
    end = build_tiny_tokenizer().convert_tokens_to_ids("<|im_end|>")

    def raise_end(module: Any, args: Any, logits: torch.Tensor) -> None:
        logits[..., end] += 3.0

    def load(self: Preparer) -> tuple[Any, list[int]]:
        model, eos = real(self)
        if self.cfg.synthesize:  # regeneration keeps the plain target
            model.lm_head.register_forward_hook(raise_end)
        return model, eos

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Preparer, "_load_generator", load)
        yield


def assert_same_prepared(a: Path, b: Path, chunks: str, same_request: bool = True) -> None:
    """The same files, the same dataset and the same chunks of generated conversations (less their
    timing); with ``same_request``, the same manifest (less when and how fast)."""
    assert listing(a) == listing(b)
    da, db = load_from_disk(str(a / "dataset")), load_from_disk(str(b / "dataset"))
    assert len(da) == len(db) > 0
    for column in ("sample_id", "input_ids", "loss_mask", "source"):
        assert da[column] == db[column], column
    names = sorted(p.name for p in (a / chunks).glob("chunk-*.json"))
    assert names == sorted(p.name for p in (b / chunks).glob("chunk-*.json")) and names
    assert [record(a / chunks / n, "seconds") for n in names] == [record(b / chunks / n, "seconds") for n in names]
    if same_request:
        drop = ("config", "tokenize", "regeneration")
        assert record(a / "manifest.json", *drop) == record(b / "manifest.json", *drop)


@pytest.fixture(scope="module")
def synthesized(ends_soon, tmp_path_factory):
    out = tmp_path_factory.mktemp("faults_synth") / "p"
    synthesize(out)
    return out


@pytest.mark.parametrize(
    "point, n, lock",
    [
        ("synth.chunk", 1, True),  # the first chunk saved; a second prepare on the directory is refused meanwhile
        ("write", 3, False),  # the second chunk complete in its temporary file, not renamed
        ("synth.chunk", 3, False),  # every chunk saved, the dataset not yet written
    ],
)
def test_synthesis_killed_anywhere_resumes_to_the_uninterrupted_output(
    ends_soon, synthesized, tmp_path, point, n, lock
):
    out = tmp_path / "p"
    interrupt(point, n, lambda: synthesize(out), lock)
    assert not (out / "manifest.json").exists()
    synthesize(out)
    assert_same_prepared(synthesized, out, "synth")


REGEN_ROWS = [
    {"messages": [{"role": "user", "content": text}]}
    for text in ("Hi", "Tell me a story.", "q" * 30, "What is 2+2?", "abc def ghi", "The quick brown fox")
]


def regenerate(data: Path, out: Path, **regen: Any) -> dict[str, Any]:
    """Six one-turn prompts answered by the tiny target, in chunks of 2."""
    return Preparer(
        PrepareConfig(
            target="tiny",
            input=str(data),
            out=str(out),
            regenerate=True,
            progress=False,
            regen=RegenConfig(max_new_tokens=10, chunk_size=2, **regen),
        )
    ).run()


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults_regen")
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in REGEN_ROWS))
    regenerate(root / "in.jsonl", root / "p")
    return root


@pytest.mark.parametrize(
    "point, n, lock",
    [
        ("regen.chunk", 1, True),  # the first chunk saved; a second prepare on the directory is refused meanwhile
        ("write", 3, False),  # the second chunk complete in its temporary file, not renamed
        ("regen.chunk", 3, False),  # every chunk saved, the dataset not yet written
    ],
)
def test_regeneration_killed_anywhere_resumes_to_the_uninterrupted_output(regenerated, tmp_path, point, n, lock):
    out = tmp_path / "p"
    interrupt(point, n, lambda: regenerate(regenerated / "in.jsonl", out), lock)
    assert not (out / "manifest.json").exists()
    regenerate(regenerated / "in.jsonl", out)
    assert_same_prepared(regenerated / "p", out, "regen")


def test_an_engine_that_dies_mid_regeneration_is_named_and_the_rerun_continues(regenerated, tmp_path):
    """The served engine dies in the second of three chunks: the error names the engine, its URL
    and the chunks kept; against the engine restarted (another port), the rerun regenerates only
    the chunks missing, and the dataset equals transformers' (the hf reference)."""
    out = tmp_path / "p"
    served = dict(backend="vllm", batch_size=4)
    with StandinVllm(build_tiny_model()) as engine:
        engine.die_at = 4  # chunk 1 (prompts 1-2) answered, chunk 2's second prompt finds the engine gone
        url = engine.url
        with pytest.raises(
            Eagle3Error,
            match=rf"regeneration through vllm at regen.server.url={url} stopped in "
            rf"chunk 2 of 3: .*{url}/v1/completions.*attempts failed.*\n  the 1 "
            rf"finished chunks are kept under {out}/regen; once the engine answers",
        ):
            regenerate(
                regenerated / "in.jsonl", out, **served, server=ServedRegenConfig(url=url, backoff_s=0.01, retries=2)
            )
    assert sorted(p.name for p in (out / "regen").glob("chunk-*.json")) == ["chunk-00000.json"]
    with StandinVllm(build_tiny_model()) as restarted:
        regenerate(regenerated / "in.jsonl", out, **served, server=ServedRegenConfig(url=restarted.url, backoff_s=0.01))
        assert len(restarted.bodies) == 4  # the two chunks missing, not the one kept
    assert_same_prepared(regenerated / "p", out, "regen", same_request=False)


# -- dump (hf and served) and standardize -----------------------------------------------------------


def dump_config(prepared: Path, out: Path, backend: str = "hf", url: str | None = None, retries: int = 2) -> DumpConfig:
    """Small shards (several per run), one writer thread and, served, one request at a time: the
    n-th shard and the n-th request are the same on every run."""
    return DumpConfig(
        target="tiny",
        data=str(prepared),
        out=str(out),
        backend=backend,
        dtype="float32",
        progress=False,
        capture=CaptureConfig(aux_indices=[1, 2, 3]),
        max_tokens_per_batch=200,
        shard_size_mb=0.05,
        writer_threads=1,
        server=ServerConfig(url=url) if url else ServerConfig(),
        client=ClientConfig(concurrency=1, retries=retries, backoff_s=0.01, wait_for_server_s=5.0),
    )


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    """16 conversations prepared for the tiny target, and their uninterrupted dumps: hf, and
    served (vLLM's API; each sample alone, so its states differ from hf's in the last bits)."""
    root = tmp_path_factory.mktemp("faults_dump")
    prepared = prepare_tiny(root, mixed_conversations(16, seed=3, max_user=40, max_words=15))
    Dumper(dump_config(prepared, root / "hf")).run()
    with StandinVllm(build_tiny_model(), [1, 2, 3, 4], root / "engine") as engine:
        Dumper(dump_config(prepared, root / "vllm", "vllm", engine.url)).run()
    return {"prepared": prepared, "hf": root / "hf", "vllm": root / "vllm"}


def assert_same_dump(a: Path, b: Path) -> None:
    """Every sample stored once, with the same states bit for bit (whatever shard holds it), and
    the same manifest but for the shards (how many, their names) and the run."""
    outside = lambda d: [p for p in listing(d) if not p.startswith("shards/")]  # noqa: E731  (shard names are random)
    assert outside(a) == outside(b) and not [p for p in listing(b) if Path(p).name.startswith(".")]
    sa, sb = stored_samples(a), stored_samples(b)
    assert sorted(sa) == sorted(sb) == list(range(16))
    for sid in sa:
        assert sa[sid].keys() == sb[sid].keys() and all(torch.equal(sa[sid][k], sb[sid][k]) for k in sa[sid]), sid
    ma, mb = (record(d / "manifest.json", "config", "shards", "run") for d in (a, b))
    for m in (ma, mb):
        m["counts"] = {k: v for k, v in m["counts"].items() if not k.startswith("bytes")}  # shard headers
    assert ma == mb


@pytest.mark.parametrize(
    "point, n, lock",
    [
        ("shard", 1, False),  # the first shard renamed into place, its record not yet written
        (
            "write",
            3,
            True,
        ),  # the second shard's record complete in its temporary file; a second dump is refused meanwhile
        ("shard", 4, False),  # three shards finished, the fourth without its record
    ],
)
def test_dump_killed_anywhere_resumes_to_the_uninterrupted_dump(dumped, tmp_path, point, n, lock):
    out = tmp_path / "dump"
    interrupt(point, n, lambda: Dumper(dump_config(dumped["prepared"], out)).run(), lock)
    assert not (out / "manifest.json").exists()
    Dumper(dump_config(dumped["prepared"], out)).run()
    assert_same_dump(dumped["hf"], out)


@pytest.mark.parametrize("point, n, lock", [("shard", 1, True), ("shard", 3, False)])
def test_served_dump_client_killed_resumes_to_the_uninterrupted_dump(dumped, tmp_path, point, n, lock):
    """The client of a served dump (vLLM's API) killed: a second client of the same rank is
    refused meanwhile (other ranks may share the directory by design)."""
    out = tmp_path / "dump"
    with StandinVllm(build_tiny_model(), [1, 2, 3, 4], tmp_path / "engine") as engine:
        interrupt(point, n, lambda: Dumper(dump_config(dumped["prepared"], out, "vllm", engine.url)).run(), lock)
        Dumper(dump_config(dumped["prepared"], out, "vllm", engine.url)).run()
    assert_same_dump(dumped["vllm"], out)


def test_an_engine_that_dies_mid_dump_is_named_and_the_rerun_continues(dumped, tmp_path):
    """The engine dies at its 7th request: the error names it, its URL and what is kept (six
    samples, in their shards); the rerun against the engine restarted asks only for the rest."""
    out = tmp_path / "dump"
    cfg = lambda url: dump_config(dumped["prepared"], out, "vllm", url)  # noqa: E731
    with StandinVllm(build_tiny_model(), [1, 2, 3, 4], tmp_path / "engine") as engine:
        engine.die_at = 7
        with pytest.raises(
            Eagle3Error,
            match=rf"vllm \(server.url={engine.url}\) stopped client 0/1 of the dump: "
            rf".*3 attempts failed.*\n  6 samples received before the stop are "
            rf"stored \(\d+ shards written by this run, under {out}/shards\)",
        ):
            Dumper(cfg(engine.url)).run()
    assert len(stored_samples(out)) == 6 and not (out / "manifest.json").exists()
    with StandinVllm(build_tiny_model(), [1, 2, 3, 4], tmp_path / "engine") as restarted:
        Dumper(cfg(restarted.url)).run()
        assert len(restarted.bodies) == 10
    assert_same_dump(dumped["vllm"], out)


def standardize(dump: Path, out: Path) -> dict[str, Any]:
    return Standardizer(
        StandardizeConfig(dumps=[str(dump)], out=str(out), draft_vocab_size=40, eval_fraction=0.2, progress=False)
    ).run()


@pytest.fixture(scope="module")
def standardized_whole(std, tmp_path_factory):
    out = tmp_path_factory.mktemp("faults_std") / "s"
    standardize(std.parent / "d", out)
    return out


@pytest.mark.parametrize(
    "point, n, lock",
    [
        ("shard", 2, True),  # a shard without its record; a second standardize is refused meanwhile
        ("write", 5, False),  # a shard's record complete in its temporary file
        ("write", 17, False),  # every shard finished, the vocab map not yet renamed
    ],
)
def test_standardize_killed_anywhere_resumes_to_the_uninterrupted_output(
    std, standardized_whole, tmp_path, point, n, lock
):
    out = tmp_path / "s"
    interrupt(point, n, lambda: standardize(std.parent / "d", out), lock)
    standardize(std.parent / "d", out)
    assert files(standardized_whole, ("manifest.json",)) == files(out, ("manifest.json",))
    assert record(standardized_whole / "manifest.json", "config", "run") == record(
        out / "manifest.json", "config", "run"
    )


# -- offline and online training --------------------------------------------------------------------


@pytest.fixture(scope="module")
def std(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults_train")
    return standardized(make_dump(root, "d", n=48), root / "std", 320)


TRAIN = dict(save_every=2)


@pytest.fixture(scope="module")
def trained(std, tmp_path_factory):
    """The uninterrupted reference run."""
    out = tmp_path_factory.mktemp("faults_whole") / "run"
    train(std, out, **TRAIN)
    return out


def last_checkpoint(run: Path) -> Path:
    return max((run / "checkpoints").glob("step*"), key=lambda p: int(p.name[4:]))


def assert_same_run(a: Path, b: Path) -> None:
    """The same files (no partial checkpoint left), the same final weights (bit for bit) and the
    same metrics, line for line (each step once), but for the machine's speed."""
    assert listing(a) == listing(b)
    wa, wb = (load_file(str(last_checkpoint(run) / "draft.safetensors")) for run in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    strip = lambda run: [{k: v for k, v in m.items() if k not in TIMING} for m in metrics(run)]  # noqa: E731
    assert strip(a) == strip(b)
    assert record(a / "manifest.json")["eval"] == record(b / "manifest.json")["eval"]


@pytest.mark.parametrize(
    "point, n",
    [
        ("train.step", 4),  # step 4 computed, step 3 logged: the resumed run (from step 2) logs step 3 again
        ("write", 4),  # the step-4 checkpoint's state.json written but not renamed: the checkpoint is unfinished
        ("train.step", 9),  # later: step 9 computed, steps up to 8 logged and saved
    ],
)
def test_training_killed_anywhere_resumes_to_the_uninterrupted_run(std, trained, tmp_path, point, n, said):
    out = tmp_path / "run"
    kill_at(point, n, lambda: train(std, out, **TRAIN))
    assert not (out / "manifest.json").exists()
    said()
    train(std, out, **TRAIN)
    assert "continuing from checkpoint step" in said()  # the user is told where it went on from
    assert_same_run(trained, out)


def test_a_kill_loses_at_most_the_checkpoint_interval_in_minutes(std, trained, tmp_path, said):
    """checkpoint.every_minutes alone (no save_every): a kill at step 5 finds the checkpoint of the
    step before (an interval this short is due at every step), the rerun says it continues there
    and ends with the weights of the uninterrupted run."""
    out = tmp_path / "run"
    kill_at("train.step", 5, lambda: train(std, out, every_minutes=1e-9))
    assert sorted(p.name for p in (out / "checkpoints").glob("step*")) == ["step3", "step4"]  # keep_last=2
    said()
    train(std, out, every_minutes=1e-9)
    assert "continuing from checkpoint step4 of" in said()
    wa, wb = (load_file(str(last_checkpoint(run) / "draft.safetensors")) for run in (trained, out))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_ctrl_c_in_training_says_what_was_kept(std, tmp_path):
    """Ctrl-C (SIGINT) at step 5 stops eagle3-train with Interrupted naming the checkpoint kept.
    SIGINT is a terminal's (Python's own handler): a test run started in the background by a
    non-interactive shell inherits it ignored."""
    from eagle3_train.core import faults
    from eagle3_train.core.errors import Interrupted

    out = tmp_path / "run"
    faults._passed.clear()
    os.environ[FAULT_ENV] = "train.step:5:int"
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(Interrupted, match=r"training stopped at step 5 of \d+; its checkpoint step4 is kept"):
            train(std, out, save_every=2, every_minutes=0)
    finally:
        signal.signal(signal.SIGINT, before)
        del os.environ[FAULT_ENV]
        faults._passed.clear()  # (forked children of later tests count their passages from 0)
        _drop_process_group()


def _full_disk(monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    """The disk fills during the step-4 checkpoint (the second), at the write ``failing``: the
    file is left part written and the writer raises as it does on a full disk."""
    import deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine as ds_engine
    import safetensors.torch

    import eagle3_train.training.checkpoint as checkpoint

    calls = {"n": 0}

    def failing_on(nth: int, real: Callable, error: Exception, path_arg: int) -> Callable:
        def write(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == nth:
                Path(str(args[path_arg])).write_bytes(b"\0" * 100)  # what fitted before the disk was full
                raise error
            return real(*args, **kwargs)

        return write

    # torch.save on a full disk raises this RuntimeError (measured on a 512 KiB tmpfs)
    torch_full = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    no_space = OSError(28, "No space left on device")
    engine_save = ds_engine.TorchCheckpointEngine.save
    if failing in ("model states", "optimizer states"):  # DeepSpeed saves the model, then the optimizer
        nth = 3 if failing == "model states" else 4
        monkeypatch.setattr(ds_engine.TorchCheckpointEngine, "save", failing_on(nth, engine_save, torch_full, 2))
    elif failing == "draft.safetensors":
        monkeypatch.setattr(safetensors.torch, "save_file", failing_on(2, safetensors.torch.save_file, no_space, 1))
    else:  # state.json: the atomic write removes its temporary file and raises
        real = checkpoint.atomic_write_json

        def state_json(path: Path, obj: Any) -> None:
            if Path(path).name == "state.json":
                calls["n"] += 1
                if calls["n"] == 2:
                    raise no_space
            real(path, obj)

        monkeypatch.setattr(checkpoint, "atomic_write_json", state_json)


@pytest.mark.parametrize("failing", ["optimizer states", "draft.safetensors", "state.json"])
def test_a_full_disk_during_a_checkpoint_save_keeps_the_previous_one_and_resume_takes_it(
    std, trained, tmp_path, monkeypatch, failing
):
    out = tmp_path / "run"
    _full_disk(monkeypatch, failing)
    with pytest.raises(
        Eagle3Error,
        match=rf"saving checkpoint step4 of {out} failed \(.*\); its partial files are "
        rf"removed, and the last complete checkpoint, {out}/checkpoints/step2, is "
        rf"intact and resume=auto continues from it",
    ):
        train(std, out, **TRAIN)
    monkeypatch.undo()
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step2"]
    step2 = out / "checkpoints" / "step2"
    assert json.loads((step2 / "state.json").read_text())["step"] == 2 and load_file(str(step2 / "draft.safetensors"))
    train(std, out, **TRAIN)
    assert_same_run(trained, out)


def online(**kw: Any) -> dict[str, Any]:
    """``source=online`` options: the tiny target in the loop over the prepared data of ``std``."""
    return {
        "source": "online",
        "prepared": PreparedConfig(**{"aux_indices": [1, 2, 3], "draft_vocab_size": 12, "eval_fraction": 0.15, **kw}),
    }


@pytest.fixture(scope="module")
def trained_online(std, tmp_path_factory):
    out = tmp_path_factory.mktemp("faults_online") / "run"
    train(std.parent / "d-prep", out, **TRAIN, **online())
    return out


def test_online_training_killed_resumes_and_a_second_run_is_refused_before_it_writes(std, trained_online, tmp_path):
    """Stopped after step 4 (step 3 logged, step 2 saved): a second run on the directory, asking
    another draft vocab, is refused naming the first, before it writes the run's vocab map; killed
    there, the rerun ends as the uninterrupted run."""
    out, prepared = tmp_path / "run", std.parent / "d-prep"
    with stopped_at("train.step", 4, lambda: train(prepared, out, **TRAIN, **online())) as pid:
        vocab = (out / "vocab_map.safetensors").read_bytes()
        with pytest.raises(ContractError, match=refused_naming(pid)):
            train(prepared, out, **TRAIN, **online(draft_vocab_size=20))
        assert (out / "vocab_map.safetensors").read_bytes() == vocab
    train(prepared, out, **TRAIN, **online())
    assert_same_run(trained_online, out)


# -- export and eval --------------------------------------------------------------------------------


def export(run: Path, out: Path) -> dict[str, Any]:
    return Exporter(ExportConfig(run=str(run), out=str(out))).run()


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("faults_export") / "export"
    export(trained, out)
    return out


@pytest.mark.parametrize(
    "point, n, lock",
    [
        ("write", 1, False),  # the new config.json in its temporary file: out= still holds the earlier export, whole
        (
            "export.swap",
            1,
            True,
        ),  # the earlier export moved aside, the new one not in place; a second export is refused
    ],
)
def test_a_killed_re_export_leaves_an_export_or_none_and_the_rerun_writes_the_same(
    trained, exported, tmp_path, point, n, lock
):
    out = tmp_path / "export"
    in_child(lambda: export(trained, out))  # the export that the killed one replaces
    interrupt(point, n, lambda: export(trained, out), lock)
    if point == "write":
        assert files(out, ("manifest.json",)) == files(exported, ("manifest.json",))
    else:
        assert not out.exists()
    export(trained, out)
    assert files(out, ("manifest.json",)) == files(exported, ("manifest.json",))
    assert record(out / "manifest.json", "config") == record(exported / "manifest.json", "config")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".export.lock", "export"]  # no temporary or old copy left


EVAL_PROMPTS = [
    {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "And then?"},
        ]
    },
    {"messages": [{"role": "user", "content": "Tell me a story."}]},
    {"messages": [{"role": "user", "content": "abc def"}, {"role": "user", "content": "ghi"}]},
]
EVAL_TIMING = (
    "speculative_seconds",
    "greedy_seconds",
    "speculative_tokens_per_s",
    "greedy_tokens_per_s",
    "speedup",
    "target_seconds",
    "draft_seconds",
    "config",
)


def evaluate(draft: Path, prompts: Path, out: Path) -> dict[str, Any]:
    return Evaluator(
        EvalConfig(
            draft=str(draft),
            target="tiny",
            engine="vllm",
            prompts=str(prompts),
            out=str(out),
            k=3,
            max_new_tokens=8,
            batch_size=2,
            progress=False,
        )
    ).run()


@pytest.fixture(scope="module")
def evaluated(exported, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults_eval")
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in EVAL_PROMPTS))
    evaluate(exported, root / "prompts.jsonl", root / "eval")
    return root


@pytest.mark.parametrize(
    "point, n, lock",
    [
        ("eval.turn", 1, True),  # the first turns decoded; a second eval to the same out= is refused meanwhile
        ("write", 1, False),  # outputs.jsonl and the plot written, report.json in its temporary file
    ],
)
def test_eval_killed_anywhere_reruns_to_the_same_report(exported, evaluated, tmp_path, point, n, lock):
    out = tmp_path / "eval"
    interrupt(point, n, lambda: evaluate(exported, evaluated / "prompts.jsonl", out), lock)
    assert not (out / "report.json").exists()
    evaluate(exported, evaluated / "prompts.jsonl", out)
    assert listing(out) == listing(evaluated / "eval")
    assert (out / "outputs.jsonl").read_bytes() == (evaluated / "eval" / "outputs.jsonl").read_bytes()
    assert record(out / "report.json", *EVAL_TIMING) == record(evaluated / "eval" / "report.json", *EVAL_TIMING)


def test_a_finished_prepared_dataset_is_reused_while_another_run_holds_its_lock(tmp_path):
    """Several runs may reuse one finished prepared dataset at once (the study's trainings share a
    synthesis): a run of the same options reads it while another process holds out='s lock; a run
    that would write there (overwrite=) is still refused, naming the holder."""
    import multiprocessing as mp

    from data_prep.prepare import PrepareConfig, Preparer

    (tmp_path / "in.jsonl").write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a b"}]})
            + "\n"
            for i in range(4)
        )
    )
    out = tmp_path / "p"

    def prep(**kw):
        return Preparer(
            PrepareConfig(target="tiny", input=str(tmp_path / "in.jsonl"), out=str(out), progress=False, **kw)
        ).run()

    ctx = mp.get_context("fork")
    writer = ctx.Process(target=prep)  # prepared in another process: this one holds no lock of out=
    writer.start()
    writer.join()
    assert writer.exitcode == 0
    first = json.loads((out / "manifest.json").read_text())
    ready, release = ctx.Event(), ctx.Event()

    def holder():
        from eagle3_train.core.stagedir import hold_lock

        hold_lock(out, "prepared dataset")
        ready.set()
        release.wait(60)

    child = ctx.Process(target=holder)
    child.start()
    try:
        assert ready.wait(30)
        assert prep()["counts"] == first["counts"]  # reused, not refused
        with pytest.raises(ContractError, match=refused_naming(child.pid)):
            prep(overwrite=True)
    finally:
        release.set()
        child.join()
