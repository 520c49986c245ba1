"""The benchmark programs of benchmarks/: each answers --help, every results file reads through the one
writer with the command that made it, and the parts that turn a run's output into results."""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1]
ROOT = LAB.parent
sys.path.insert(0, str(ROOT))  # the programs run as python3 -m benchmarks.<name> from the repository root

from benchmarks import recipe, speedup  # noqa: E402
from benchmarks.result import SCHEMA_VERSION, Result  # noqa: E402

PROGRAMS = [
    "dump",
    "train",
    "online",
    "speedup",
    "recipe",
    "heads",
    "peers_gpu",
    "peers_results",
    "faults",
    "step_profile",
]


def test_each_program_answers_help():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in PROGRAMS:
        done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0 and done.stdout.startswith("usage:"), (name, done.stderr[-2000:])


def test_a_result_is_written_and_read_in_one_place(tmp_path):
    r = Result(what="w", command="python3 -m benchmarks.x --y", machine="m", date="2026-12-06", figures={"a": {"b": 1}},
               tables=[{"title": "t", "header": ["h"], "rows": [["1"]]}])  # fmt: skip
    r.write(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["a"] == {"b": 1} and "code_at" not in data
    assert Result.read(tmp_path / "r.json") == r
    del data["command"]
    with pytest.raises(ValueError, match="lacks"):
        Result.from_dict(data)
    with pytest.raises(ValueError, match="newer"):
        Result.from_dict({**data, "schema_version": SCHEMA_VERSION + 1})
    # a file older than the schema: its head fields where they are strings, named commands, the rest figures
    old = Result.from_dict({"what": "w", "commands": {"a": "x"}, "runs": [1, 2], "tau": 2.5})
    assert old.schema_version == 0 and old.command == {"a": "x"} and old.figures == {"runs": [1, 2], "tau": 2.5}


def test_every_results_file_reads_and_names_the_command_that_made_it():
    for path in sorted((LAB / "results").glob("*.json")):
        r = Result.read(path)
        assert r.what and r.command, path.name
        # made before the programs: the commit whose tree the command runs in (the peers' scripts are in the tree)
        if r.schema_version == 0 and not path.name.startswith("peers_"):
            assert r.code_at and len(r.code_at) == 40, path.name


def test_speedup_sets_the_engines_tau_beside_evals_on_the_same_turns(tmp_path):
    """eval's τ over exactly the turns the bench sent the speculating engine at a concurrency, from eval's
    per-turn accepted counts; the summary carries the tables of the steps that ran."""
    w = tmp_path / "w"
    tree, bench = w / "eval_tree_1_5_6", w / "bench_sglang_1_5_6"
    tree.mkdir(parents=True)
    bench.mkdir()
    rows = [("/a/p:1", 1, [2, 0, 1]), ("/a/p:1", 2, [5, 5]), ("/a/p:2", 1, [0, 0, 0, 3]), ("/a/p:3", 1, [4])]
    (tree / "outputs.jsonl").write_text(
        "".join(json.dumps({"source": s, "turn": t, "accepted": a}) + "\n" for s, t, a in rows)
    )
    (tree / "report.json").write_text(json.dumps({"tau": 2.0, "lossless": "identical"}))
    sent = [("baseline", 1, "p:3"), ("spec", 1, "p:1"), ("spec", 1, "p:2"), ("spec", 4, "p:3")]
    (bench / "requests.jsonl").write_text(
        "".join(json.dumps({"engine": e, "concurrency": c, "source": s, "turn": 1}) + "\n" for e, c, s in sent)
    )
    turns = speedup.sent_turns(bench / "requests.jsonl", 1)
    assert turns == {("p:1", 1), ("p:2", 1)}  # another path to the same prompt file still matches
    tau, n = speedup.eval_tau_on(tree / "outputs.jsonl", turns)
    assert n == 2 and tau == pytest.approx(1 + (2 + 0 + 1 + 0 + 0 + 0 + 3) / 7)  # p:1's second turn left out
    assert speedup.eval_tau_on(tree / "outputs.jsonl", {("p:9", 1)}) is None
    side = {"output_tokens_per_s": 100.0}
    (bench / "results.json").write_text(json.dumps({
        "machine": {"gpus": ["H200"]}, "engine": {"spec": {"version": "0.5"}},
        "rows": [{"concurrency": 1, "speedup": 1.5, "baseline": side, "spec": {"output_tokens_per_s": 150.0, "mean_acceptance_length": 2.2}}],
    }))  # fmt: skip
    a = argparse.Namespace(engine="sglang", draft="d", command="python3 -m benchmarks.speedup")
    r = speedup.summarise(w, a)
    assert r.machine == "H200; sglang 0.5" and r.figures["sglang_1_5_6_c1"]["speedup"] == 1.5
    titles = [t["title"] for t in r.tables]
    assert len(titles) == 3 and not any("position" in t for t in titles)  # the long step did not run
    assert r.tables[-1]["rows"] == [["1", "5", "6", "1", "2.200", f"{tau:.3f} (2)", f"{2.2 / tau:.3f}"]]


def test_recipe_results_from_a_run_directory(tmp_path):
    run = tmp_path / "run"
    (run / "train").mkdir(parents=True)
    (run / "eval").mkdir()
    stages = [{"stage": "prepare", "seconds": 60.0, "rc": 0}, {"stage": "train", "seconds": 120.0, "rc": 0}]
    (run / "run.jsonl").write_text("".join(json.dumps(s) + "\n" for s in stages))
    (run / "train" / "best.json").write_text(json.dumps({"eval_tau": 3.28319, "step": 9}))
    report = {"tau": 3.03, "k": 5, "speedup": 1.47, "categories": {"math": {"tau": 3.151}}, "by_reply_position": []}
    (run / "eval" / "report.json").write_text(json.dumps(report))
    (tmp_path / "smi.csv").write_text(
        "2026/12/04 10:00:00.000, 0, 1200 MiB, 5 %\n2026/12/04 10:00:05.000, 0, 44957 MiB, 90 %\n"
    )
    out = tmp_path / "r.json"
    recipe.main(["--from", str(run), "--out", str(out), "--gpu-trace", str(tmp_path / "smi.csv"), "recipe=smollm2"])
    r = Result.read(out)
    assert r.command.startswith("python3 -m benchmarks.recipe --from ") and "recipe=smollm2" in r.what
    assert r.figures["stages_seconds"] == {"prepare": 60.0, "train": 120.0} and r.figures["total_minutes"] == 3.0
    assert r.figures["train"] == {"best_eval_simulated_tau": 3.283} and r.figures["peak_gpu_memory_mib"] == 44957
    assert r.figures["eval"]["tau_by_category"] == {"math": 3.151} and "by_reply_position" not in r.figures["eval"]


def test_a_session_runs_detached_and_each_poll_packs_what_exists(tmp_path):
    env = dict(os.environ, SESSIONS=str(tmp_path / "s"), PATH=f"{tmp_path}:{os.environ['PATH']}")
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nsleep 60\n")  # a trace that never writes
    (tmp_path / "nvidia-smi").chmod(0o755)
    session = [str(LAB / "session.sh")]
    cmd = "mkdir -p run/export && echo '{}' > run/export/config.json && echo '{\"x\": 1}' > r.json && sleep 1"
    start = subprocess.run(["bash", *session, "start", "t", "--", "bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
    assert start.returncode == 0 and "started" in start.stdout, start.stderr
    dest = tmp_path / "dest"
    for _ in range(10):
        poll = subprocess.run(["bash", *session, "poll", "t", "5", str(dest)], env=env, capture_output=True, text=True)
        if "ended" in poll.stdout:
            break
        time.sleep(1)
    assert "ended: rc=0" in poll.stdout, poll.stdout + poll.stderr
    with tarfile.open(dest / "t.tgz") as tar:
        names = tar.getnames()
    assert "./out/r.json" in names and "./rc" in names and not any(n.startswith("./repo") for n in names)
    assert [p.name for p in dest.glob("t-export*")] == ["t-export0.tgz.part-00"]


def test_step_profile_profiles_the_steps_after_its_warmup_and_the_run_ends_with_them(tmp_path):
    """eagle3-train on the tiny target's standardized dump, 6 steps of warm-up then 3 profiled: the
    run stops at step 9, and the summary holds the 3 steps' host time, ops and wall, and the wall of
    warm-up steps the profiler did not record."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_standardize import make_dump
    from test_trainer import standardized

    std = standardized(make_dump(tmp_path, "d", n=48), tmp_path / "std", 320)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), WANDB_MODE="disabled"
    )
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # (this process's own group)
        env.pop(name, None)
    options = [f"++data={std}", "++target=tiny", f"++out={tmp_path / 'run'}", "++objective.ttt_length=3",
               "++loop.max_tokens_per_batch=600", "++loop.epochs=3", "++loop.log_every=1", "++loop.eval_every=0", "++progress=false"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "benchmarks.step_profile", "--out", str(tmp_path / "prof.json"),
                           "--warmup", "6", "--steps", "3", "--stacks", "4", "--", *options], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = Result.read(tmp_path / "prof.json")
    assert got.figures["steps_profiled"] == 3 and got.command.endswith(shlex.join(options))
    assert (
        got.figures["host_s_per_step"] > 0 and got.figures["ops_per_step"] > 10 and got.figures["wall_s_per_step"] > 0
    )
    assert got.figures["wall_s_per_step_unprofiled"] > 0
    assert 0 < got.figures["host_outside_ops_s_per_step"] < got.figures["host_s_per_step"]
    assert 0 < got.figures["attention_host_s_per_step"] < got.figures["host_s_per_step"]  # (on the CPU: SDPA's own)
    assert ".py(" in (tmp_path / "prof.stacks.txt").read_text()  # the host's time in Python's own frames too
    (host,) = got.tables
    assert len(host["rows"]) == 25 and host["rows"][0][2] >= host["rows"][-1][2] > 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 9 and "aten::" in (tmp_path / "prof.host.txt").read_text()


def test_step_profiles_device_time_is_the_kernels_own_as_the_profilers_table_totals_it():
    """An op's share of its kernels and a user annotation's range (ProfilerStep*) on the device are
    not counted again: only the kernels' own events."""
    from types import SimpleNamespace as E

    from benchmarks.step_profile import on_device

    cuda, cpu = E(name="CUDA"), E(name="CPU")
    events = [E(key="aten::mm", device_type=cpu, is_user_annotation=False, self_device_time_total=5),
              E(key="nvjet_gemm", device_type=cuda, is_user_annotation=False, self_device_time_total=5),
              E(key="ProfilerStep*", device_type=cuda, is_user_annotation=True, self_device_time_total=40)]  # fmt: skip
    assert [e.key for e in events if on_device(e)] == ["nvjet_gemm"]


@pytest.mark.slow
def test_step_ab_profiles_the_recipes_own_step_at_each_value_of_an_option(tmp_path):
    """step_ab.sh on the tiny target: the data prepared once, then one profile per value and batch, each
    with the recipe's own trainer options (read from eagle3-run's dry run) and the option's value, the
    options it sets itself given once."""
    convs = tmp_path / "c.jsonl"
    words = ["cat", "dog", "the", "sun"]
    convs.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant",
                     "content": " ".join(words[: 1 + i % 4] * 6)}]}) + "\n" for i in range(120)))  # fmt: skip
    env = dict(os.environ, WORK=str(tmp_path / "w"), WARMUP="3", STEPS="2", WANDB_MODE="disabled",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))  # fmt: skip
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    call = [str(tmp_path / "out"), str(convs), "runtime.cudnn_attention", "true false", "300", "target=tiny",
            "train.prepared.draft_vocab_size=64", "train.prepared.aux_indices=[1,2,3]", "train.runtime.compile=false",
            "train.loop.min_steps=1"]  # fmt: skip
    done = subprocess.run([str(LAB / "step_ab.sh"), *call], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == [
        "runtime.cudnn_attention-true-300",
        "runtime.cudnn_attention-false-300",
    ]
    for value in ("true", "false"):
        got = Result.read(tmp_path / f"out/runtime.cudnn_attention-{value}-300.json")
        args = shlex.split(got.command)
        assert got.figures["steps_profiled"] == 2 and f"++runtime.cudnn_attention={value}" in args
        assert "++model.intermediate_size=6144" in args and "++target=tiny" in args  # the recipe's, and the run's
        assert [a for a in args if a.startswith("++loop.max_tokens_per_batch=")] == ["++loop.max_tokens_per_batch=300"]
        assert len([a for a in args if a.startswith("++out=")]) == 1
    prepared = (tmp_path / "w/prepare.log").stat().st_mtime_ns
    # again into another OUT: the same prepared data, and the run a profile left in WORK starts afresh;
    # PACK=1: OUT holds the profiles' archive alone
    again = [str(tmp_path / "out2"), *call[1:3], "false", *call[4:]]
    done = subprocess.run([str(LAB / "step_ab.sh"), *again], cwd=ROOT, env={**env, "PACK": "1"}, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0 and "failed" not in done.stdout, done.stdout + done.stderr[-3000:]
    assert [f.name for f in (tmp_path / "out2").iterdir()] == ["step_ab.tgz"]
    with tarfile.open(tmp_path / "out2/step_ab.tgz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert Result.read(tmp_path / "unpacked/runtime.cudnn_attention-false-300.json").figures["steps_profiled"] == 2
    assert (tmp_path / "w/prepare.log").stat().st_mtime_ns == prepared  # (not prepared again)


def test_step_ab_refuses_a_pack_it_does_not_know_before_it_writes_anything(tmp_path):
    """PACK other than 0 or 1 is refused, naming the variable and its values, before OUT_DIR or WORK exist."""
    env = dict(os.environ, WORK=str(tmp_path / "w"), PACK="yes")
    args = [str(tmp_path / "out"), str(tmp_path / "c.jsonl"), "online.compile", "false", "300"]
    done = subprocess.run(
        [str(LAB / "step_ab.sh"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "PACK=yes: 0 (" in done.stderr and "or 1 (" in done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "w").exists()


def test_step_profile_refuses_an_out_that_holds_a_run(tmp_path):
    """The trainer would resume a run left in out= (a finished one makes no step to profile): refused
    before anything loads, naming the option."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run/metrics.jsonl").write_text("{}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.step_profile", "--out", str(tmp_path / "p.json"), "--",
                           "++target=tiny", f"++data={tmp_path}", f"++out={tmp_path / 'run'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode != 0 and f"out={tmp_path / 'run'} already holds a run" in done.stderr
    assert not (tmp_path / "p.json").exists()
