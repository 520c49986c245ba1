"""The side-by-side harness (benchmarks/peers_gpu.py) and its results (benchmarks/peers_results.py):
budgets into steps, compile time apart, the sweep's choice, seed spreads, merging partial results."""

import argparse
import dataclasses
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(LAB), str(LAB.parent)]

import peers_gpu as pg  # noqa: E402
import peers_results as pr  # noqa: E402


@pytest.fixture(autouse=True)
def no_cache_here(tmp_path, monkeypatch):
    """plan reads no compile cache this checkout may hold (.peers_cache) unless a test gives one."""
    monkeypatch.setattr(pg, "PEERS_CACHE", tmp_path / "no_peers_cache")


TARGET = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
          "vocab_size": 49152, "rope_theta": 100000, "num_hidden_layers": 30}  # fmt: skip


def run(fw="ours", head="recipe", budget=180.0, lr=1e-3, seed=0, planned=100, **measured) -> pr.Run:
    """A run as the job plans it (``planned`` steps): the recipe's head family for ours and speculators,
    EAGLE-3 for ModelOpt."""
    measured.setdefault("head_shape", {"variant": "eagle3" if fw == "modelopt" else "eagle3.1"})
    return pr.Run(
        fw, head, "sweep" if budget == 180.0 else "final", budget, lr, seed, planned, 16384, device="h100", **measured
    )


def probe(fw="ours", head="recipe", lr=1e-3, seed=0, **measured) -> pr.Run:
    """A probe that ended (its start-up measured) and measured its step."""
    r = run(fw, head, None, lr, seed, startup_s=60.0, **measured)
    r.kind = "probe"
    return r


def test_a_budget_becomes_steps_at_the_steady_step_time_and_epochs_hold_them():
    assert pr.plan_steps(180, 0.06) == 3000 and pr.plan_steps(600, 0.7) == 857 and pr.plan_steps(1, 9.0) == 1
    with pytest.raises(ValueError):
        pr.plan_steps(180, 0.0)
    assert [pr.epochs_for(s, 270) for s in (1, 270, 271, 3000)] == [1, 1, 2, 12]


def test_a_raw_folders_gzipped_training_log_reads_as_the_plain_one(tmp_path):
    """The polls kept before session 44 hold their large logs gzipped; merging them again gives the same run."""
    import gzip

    d = tmp_path / "speculators-matched-x"
    d.mkdir()
    (d / "spec.json").write_text(json.dumps(pr.asdict(run("speculators", "matched", planned=20))))
    (d / "train.log").write_text("".join(f"  profile/step_ms={t},\n  profile/tokens_per_s=1e5,\n"
                                         for t in [9000.0] + [60.0] * 19) + "Epoch 0 100% ━━ 20/270  [ 0:00:10 < 0:00:00 , 16 it/s ]\n")  # fmt: skip
    plain = pr.read_run(d, [], [])
    (d / "train.log.gz").write_bytes(gzip.compress((d / "train.log").read_bytes()))
    (d / "train.log").unlink()
    zipped = pr.read_run(d, [], [])
    assert plain.steps == 20 and plain.steady_step_s == pytest.approx(0.06) and plain.steps_per_epoch == 270
    assert pr.asdict(zipped) == pr.asdict(plain)


def test_compile_time_is_what_the_loop_took_above_its_steady_steps():
    """The first reading holds the compilation (40 s for 10 steps); the steady step is the median of
    the later intervals (a slow one among them does not move it)."""
    pts = [(10, 40.0), (20, 43.0), (30, 46.0), (40, 49.5), (50, 52.5), (60, 55.5)]
    loop, compile_s, step = pr.split_compile(pts)
    assert (loop, step) == (55.5, pytest.approx(0.3)) and compile_s == pytest.approx(55.5 - 60 * 0.3)
    assert pr.split_compile(pts[:2]) is None  # two readings: no steady interval to trust
    flat = [(i, 0.5 * i) for i in range(1, 101)]  # no compilation: nothing above the steady steps
    assert pr.split_compile(flat)[1] == pytest.approx(0.0, abs=1e-9)


def test_speculators_log_gives_its_step_times_without_validation_and_its_epoch_size():
    step_ms = [1.28e05, 448.0] + [60.0] * 18
    text = "".join(
        f"  profile/step_ms={t},\n  profile/tokens_per_s={1e5 if i > 1 else 62.7},\n" for i, t in enumerate(step_ms)
    )
    text += "Epoch 0 100% ━━ 20/270  [ 0:02:10 < 0:00:00 , 16 it/s ]\n"
    text += "Validation epoch 1/1 started\n  profile/step_ms=9000.0,\nEpoch 0 100% ━ 30/30 [ 0:00:09 ]\nValidation epoch 1/1 completed\n"
    pts, tokens, per_epoch = pr.speculators_points(text)
    assert len(pts) == 20 and pts[-1][1] == pytest.approx(sum(step_ms) / 1000) and per_epoch == 270 and tokens == 1e5
    loop, compile_s, step = pr.split_compile(pts)
    assert step == pytest.approx(0.06) and compile_s == pytest.approx(128.448 + 1.08 - 20 * 0.06)


def test_hf_trainers_bar_readings_of_its_training_bar():
    log = ("Map: 100%|##| 16384/16384 [00:03<00:00]\r" + "".join(f" {i}%|#| {i}/500 [00:{10 + i // 10:02d}<00:40]\r"
           for i in range(0, 501, 50)) + "\nSaving: 1/1 [00:03<00:00]\n")  # fmt: skip
    pts = pr.trainer_points(log, 500)  # (not the data's bar, nor step 0; readings 10 s apart, and the last)
    assert pts == [(50, 15.0), (150, 25.0), (250, 35.0), (350, 45.0), (450, 55.0), (500, 60.0)]
    # a bar redrawn every step, its clock in whole seconds: 20 s of compilation, then 0.67 s a step
    log = "".join(
        f" {i}/200 [00:{int(20 + 0.67 * i) // 60:02d}:{int(20 + 0.67 * i) % 60:02d}<00:10]\r" for i in range(201)
    )
    loop, compile_s, step = pr.split_compile(pr.trainer_points(log, 200))
    assert step == pytest.approx(0.67, abs=0.02) and compile_s == pytest.approx(20, abs=3)
    # a fast run: 300 steps at 0.03 s after 30 s of compilation, its loop 39.1 s by the trainer's own clock
    log = "".join(f" {i}/300 [00:00:{int(30 + 0.03 * i):02d}<00:10]\r" for i in range(1, 301))
    pts = pr.trainer_points(log, 300) + [(300, 39.1)]
    assert pr.split_compile(pts) is None  # (its first reading and its last, under 10 s apart: no interval)
    loop, compile_s, step = pr.bar_split(pts)
    assert loop == 39.1 and step == pytest.approx(9.1 / 299) and compile_s == pytest.approx(39.1 - 300 * step)


def test_the_sweeps_best_goes_on_and_a_final_plans_two_seeds_of_it():
    runs = [run(lr=1e-3, tau_heldout=1.9), run(lr=2e-3, tau_heldout=2.1), run(lr=4e-3),  # (not evaluated)
            run(budget=600.0, lr=4e-3, tau_heldout=3.0),  # a final: not the sweep's
            run("speculators", "default", lr=1e-3, tau_heldout=1.5), run("speculators", "matched", lr=3e-4, tau_heldout=1.6)]  # fmt: skip
    assert pr.best(runs, "ours").lr == 2e-3 and pr.best(runs, "speculators").head == "matched"
    assert pr.best(runs, "modelopt") is None
    explicit = argparse.Namespace(what="final", frameworks=["modelopt:default"], lrs=[3e-4], seeds=[7])
    assert pg.runs_wanted(explicit, runs) == [("modelopt", "default", 600.0, [3e-4], [7])]
    a = argparse.Namespace(what="final", frameworks=["ours", "speculators"], lrs=None, seeds=None)
    assert pg.runs_wanted(a, runs) == [("ours", "recipe", 600.0, [2e-3], [0, 1]),
                                       ("speculators", "matched", 600.0, [3e-4], [42, 43])]  # fmt: skip
    with pytest.raises(SystemExit, match="no 3-minute sweep of modelopt"):
        pg.runs_wanted(argparse.Namespace(what="final", frameworks=["modelopt"], lrs=None, seeds=None), runs)
    sweep = pg.runs_wanted(
        argparse.Namespace(what="sweep", frameworks=["speculators", "modelopt:matched"], lrs=None, seeds=None), []
    )
    assert [(fw, h, lrs) for fw, h, _, lrs, _ in sweep] == [("speculators", "default", [3e-4, 1e-3, 3e-3]),
        ("speculators", "matched", [3e-4, 1e-3, 3e-3]), ("modelopt", "matched", [1e-4, 3e-4, 1e-3])]  # fmt: skip


def test_a_difference_counts_only_beyond_the_seed_spread():
    assert pr.spread([2.0, 2.1]) == 0.1 and pr.spread([2.0]) is None
    assert pr.compare([2.0, 2.1], [1.9, 1.95]) == {"diff": 0.125, "spread": 0.1, "beyond_spread": True}
    assert pr.compare([2.0, 2.1], [2.0, 2.2]) == {"diff": -0.05, "spread": 0.2, "beyond_spread": False}
    assert pr.compare([2.0], [1.0, 1.1])["beyond_spread"] is None  # one seed: no spread to judge by
    assert pr.compare([], [1.0])["diff"] is None
    runs = [
        run(budget=600.0, lr=2e-3, seed=s, tau_heldout=t, vllm_acceptance=t - 0.01, budget_loop_s=b, data_sha256="a")
        for s, t, b in ((0, 2.5, 600.0), (1, 2.6, 590.0))
    ]
    runs += [
        run("speculators", "default", 600.0, 1e-3, s, tau_heldout=t, data_sha256="a") for s, t in ((42, 2.0), (43, 2.2))
    ]
    runs += [run(lr=2e-3, tau_heldout=2.0), run("speculators", "default", lr=1e-3, seed=42, tau_heldout=1.9)]
    # (ours' Muon: lower in the sweep, higher at 10 minutes: the verdict takes what the sweep chose, not the
    # better of ours' two final configurations)
    runs += [run("ours", "muon", lr=0.02, tau_heldout=1.5)]
    runs += [run("ours", "muon", 600.0, 0.02, s, tau_heldout=3.0, data_sha256="a") for s in (0, 1)]
    short, row = pr.verdict(runs)["rows"]
    assert short[:7] == ["3 min", "speculators", "default lr 0.001", 1, 0.1, None, None]  # (one seed a side)
    assert row[:4] == ["10 min", "speculators", "default lr 0.001", 2] and row[4:7] == [0.45, 0.2, True]
    assert row[7:13] == [None] * 6  # MT-bench and vLLM: not measured for the peer
    # each side's loop alone (the peer's: not measured here); both trained on the same conversations
    assert row[13:17] == ["recipe lr 0.002", 595.0, None, True]
    # (ours' recipe sweep has one lr of its three; every other head of a framework the file holds has its whole grid)
    assert row[17] == ("ours recipe 0.001; ours recipe 0.004; ours muon 0.04; ours muon 0.08; "
                       "speculators default 0.0003; speculators default 0.003; "
                       "speculators matched 0.0003; speculators matched 0.001; speculators matched 0.003")  # fmt: skip
    runs[3].data_sha256 = "b"  # a peer's seed on other conversations (a shared set synthesized again)
    assert pr.verdict(runs)["rows"][1][16] is False
    runs[3].data_sha256 = ""  # a run that does not say
    assert pr.verdict(runs)["rows"][1][16] is None


def test_sessions_merged_in_any_order_give_one_file_their_sessions_in_time(tmp_path):
    """Session 46 merged older polls again (to keep phases they had dropped), and the sessions moved to
    the file's end: the file holds them in time, so merging its polls in any order gives it byte for byte."""
    folders = []
    for sid, lr in (("h100-20261206T2300", 1e-3), ("h100-20261207T0100", 2e-3), ("h100-20261207T0900", 4e-3)):
        d = tmp_path / sid
        (d / "r").mkdir(parents=True)
        (d / "session.json").write_text(json.dumps({"id": sid, "device": "h100"}))
        (d / "r/spec.json").write_text(json.dumps(pr.asdict(run(lr=lr, session=sid))))
        folders.append(d)
    files = []
    for order in (folders, folders[::-1], [folders[1], folders[0], folders[2], folders[0]]):
        out = tmp_path / f"peers_{len(files)}.json"
        for d in order:
            pr.main(["merge", str(d), str(out)])
        files.append(out.read_bytes())
    assert files[0] == files[1] == files[2]
    assert [x["id"] for x in json.loads(files[0])["sessions"]] == [d.name for d in folders]


def test_merging_replaces_a_run_unless_the_new_one_got_less_far():
    old = [run(lr=1e-3, steps=3000, tau_heldout=2.0), run(lr=2e-3, steps=3000)]
    new = [run(lr=1e-3, steps=10), run(lr=2e-3, steps=3000, tau_heldout=2.2), run(lr=4e-3)]
    by = {r.lr: r for r in pr.merge(old, new)}
    assert by[1e-3].tau_heldout == 2.0 and by[2e-3].tau_heldout == 2.2 and set(by) == {1e-3, 2e-3, 4e-3}


def test_an_older_sessions_folder_merged_again_leaves_a_later_run_of_the_name_and_a_run_read_again_keeps_its_file_fields():
    """Re-merging every raw folder, oldest first, must give the file again: an older session's run of
    the same name that got as far does not replace the later one (nor drop its note), and the later
    one read again keeps its note and the data seconds and peak it took from others when first merged."""
    later = run(steps=100, tau_heldout=2.6, session="h100-20261206T1337", reinstated="why it holds", data_s=28.5,
                peak_gpu_mib=32563, peak_from="probe")  # fmt: skip
    older = run(steps=100, tau_heldout=2.5, session="h100-20261206T1041")
    (kept,) = pr.merge([later], [older])
    assert kept is later
    again = run(steps=100, tau_heldout=2.6, session="h100-20261206T1337")  # (as read_run gives it: nothing derived)
    (read,) = pr.merge([later], [again])
    assert read is again and (read.reinstated, read.data_s, read.peak_gpu_mib, read.peak_from) == (
        "why it holds",
        28.5,
        32563,
        "probe",
    )
    further = run(steps=100, tau_heldout=2.5, tau_mtbench=2.4, session="h100-20261206T1041")
    assert pr.merge([later], [further])[0] is further  # (an older run that got further still wins)
    assert pr.merge([older], [later])[0] is later


def _session(po: Path) -> pr.RunSpec:
    """A session folder as the job leaves it: one probe trained, its export failed."""
    spec = pr.RunSpec("ours", "recipe", "probe", None, 2e-3, 0, 600, 16384, device="h100", session="h100-x")
    (po / spec.name / "run/train").mkdir(parents=True)
    (po / spec.name / "spec.json").write_text(json.dumps(pr.asdict(spec)))
    rows = [{"step": 10 * i, "loop_s": 20.0 + 3.0 * i, "tokens_per_s": 1e5} for i in range(1, 61)]
    (po / spec.name / "run/train/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    phases = [{"run": "ours_data", "phase": "prepare", "seconds": 30.0, "start": 0, "end": 30, "rc": 0},
              {"run": spec.name, "phase": "train", "seconds": 230.0, "start": 1796414180.0, "end": 1796414410.0, "rc": 0},
              {"run": spec.name, "phase": "export", "seconds": 5.0, "start": 1796414410.0, "end": 1796414415.0, "rc": 1}]  # fmt: skip
    (po / "phases.jsonl").write_text("".join(json.dumps(p) + "\n" for p in phases))
    (po / "smi.csv").write_text("2026/12/04 19:56:30.000, 9000 MiB\n2026/12/04 20:10:00.000, 70000 MiB\n")
    (po / "session.json").write_text(json.dumps({"id": "h100-x", "device": "h100"}))
    return spec


def test_a_poll_leaves_the_archive_and_partial_results_that_merge_into_the_file(tmp_path, monkeypatch):
    po, dest = tmp_path / "po", tmp_path / "out"
    spec = _session(po)
    monkeypatch.setattr(pg, "PO", po)
    pg.packed(dest)
    with tarfile.open(dest / "poll.tgz") as tar:
        assert f"{spec.name}/run/train/metrics.jsonl" in tar.getnames() and "phases.jsonl" in tar.getnames()
    partial = json.loads((dest / "peers_partial.json").read_text())
    (r,) = partial["frameworks"]
    assert (r["steps"], r["steady_step_s"], r["steady_loop_s"]) == (600, pytest.approx(0.3), 180.0)
    assert r["compile_s"] == pytest.approx(200.0 - 180.0) and r["startup_s"] == 30.0 and r["data_s"] == 30.0
    assert r["peak_gpu_mib"] == 9000 and r["failed"] == ["export"] and r["tau_heldout"] is None
    assert partial["tables"][0]["rows"] == []  # no peer yet: no verdict
    out = tmp_path / "peers_h100.json"
    pr.main(["merge", str(dest / "peers_partial.json"), str(out)])
    pr.main(["merge", str(po), str(out)])  # the same session read again from its folder: one run, one session
    runs, sessions = pr.load(out)
    assert [x.name for x in runs] == [spec.name] and [s["id"] for s in sessions] == ["h100-x"]
    assert pr.step_time(runs, "ours", "recipe", "h100") is None  # a probe whose export failed sizes nothing
    runs[0].failed = []
    assert pr.step_time(runs, "ours", "recipe", "h100") == (pytest.approx(0.3), None)
    assert pr.step_time(runs, "ours", "recipe", "h200") is None  # another GPU: its own probe
    # the poll.tgz itself: read as its folder is, and kept beside the results file, from where it merges again
    by_folder, by_archive = tmp_path / "f" / "peers_h100.json", tmp_path / "a" / "peers_h100.json"
    pr.main(["merge", str(po), str(by_folder)])
    pr.main(["merge", str(dest / "poll.tgz"), str(by_archive)])
    kept = tmp_path / "a" / "raw" / "peers_h100" / "h100-x.tgz"
    assert by_archive.read_text() == by_folder.read_text() and kept.read_bytes() == (dest / "poll.tgz").read_bytes()
    pr.main(["merge", str(kept), str(by_archive)])
    assert by_archive.read_text() == by_folder.read_text()
    with tarfile.open(tmp_path / "not_a_poll.tgz", "w:gz") as tar:
        tar.add(po / spec.name, arcname=spec.name)  # (a run, no session.json)
    with pytest.raises(SystemExit, match="holds no session.json"):
        pr.main(["merge", str(tmp_path / "not_a_poll.tgz"), str(by_archive)])


def test_the_session_sizes_each_run_from_the_step_time_its_probe_measured(tmp_path, monkeypatch):
    s = object.__new__(pg.Session)
    s.a = argparse.Namespace(n=16384, variant="eagle3", session="h100-x", lanes=3)
    s.device, s.size_on, s.t, s.sha = "h100", "h100", TARGET, "abc"
    s.known = [probe("speculators", "matched", 1e-3, 42, steady_step_s=0.06, steps_per_epoch=270, steps=200)]
    assert s.spec("speculators", "matched", "sweep", 180.0, 1e-3, 42) is None  # another head family: probe it again
    s.a.n = 2048
    s.a.variant = None  # (the recipe's: EAGLE-3.1, as the probe)
    assert s.spec("speculators", "matched", "sweep", 180.0, 1e-3, 42) is None  # fewer conversations: their epochs
    s.a.n = 16384
    assert s.spec("speculators", "default", "sweep", 180.0, 1e-3, 42) is None  # its head has no step time: a probe
    first = s.spec("speculators", "default", "probe", None, 1e-3, 42)
    assert (first.steps_planned, first.epochs) == (200, 1)
    m = s.spec("speculators", "matched", "sweep", 180.0, 3e-3, 42)
    assert (m.steps_planned, m.epochs, m.head_shape["draft_vocab"], m.head_shape["ttt"]) == (3000, 12, 16384, 5)
    cmd = pg.speculators_cmd(m, tmp_path, Path("/target"))
    for flag, value in (("--max-steps", "3000"), ("--epochs", "12"), ("--draft-vocab-size", "16384"), ("--ttt-steps", "5"),
                        ("--checkpoint-freq", "12"),
                        ("--lr", "0.003"), ("--loss-implementation", "eager")):  # fmt: skip
        assert cmd[cmd.index(flag) + 1] == value
    assert m.missing == ["lm_head training: speculators keeps the draft lm_head frozen"]
    assert m.head_shape["residual"] == "raw" and "--no-norm-before-residual" in cmd  # (ours' residual: h)
    s.known.append(probe("modelopt", "default", 1e-4, 42, steady_step_s=0.25, steps=300))
    mo = s.spec("modelopt", "default", "final", 600.0, 3e-4, 43)
    assert (mo.steps_planned, mo.warmup_steps, mo.head_shape["mlp"], mo.head_shape["ttt"]) == (2400, 120, 1536, 3)
    cmd = pg.modelopt_cmd(mo, tmp_path, Path("/target"), tmp_path / "c.jsonl", TARGET)
    for opt in ("training.max_steps=2400", "training.warmup_steps=120", "training.seed=43", "training.tf32=false",
                "eagle.eagle_architecture_config.num_attention_heads=9", "eagle.eagle_architecture_config.head_dim=64"):  # fmt: skip
        assert opt in cmd
    ours = pg.ours_cmd(
        pr.RunSpec("ours", "recipe", "sweep", 180.0, 2e-3, 0, 700, 16384), tmp_path, tmp_path / "c.jsonl"
    )
    assert {"++train.optim.lr=0.002", "++train.loop.max_steps=700", "++train.loop.seed=0"} <= set(ours)
    assert pg.ours_head() == {"mlp": 6144, "draft_vocab": 16384, "ttt": 5, "lm_head": "target, trained",
                              "variant": "eagle3.1"}  # fmt: skip
    assert (m.planned_step_s, m.lanes, first.planned_step_s, first.lanes) == (0.06, 3, None, 1)


def stand_in_session(monkeypatch, po: Path, phase, known: list, gpu: str = "h100") -> None:
    """The job on an H100 (``gpu``) with ``phase`` standing in for every command and ``known`` as the results."""

    def init(self, a, device):
        self.a, self.device, self.t, self.sha, self.known, self.ready = a, device, TARGET, "abc", list(known), set()
        self.size_on = a.size_on or device
        self.convs, self.target = po / "c.jsonl", Path("/target")
        self.prep_locks, self.lanes, self.prep_failed = {fw: threading.Lock() for fw in pr.FRAMEWORKS}, None, set()

    monkeypatch.setattr(pg, "PO", po)
    monkeypatch.setattr(pg, "phase", phase)
    monkeypatch.setattr(pg, "gpu_kind", lambda: gpu)
    monkeypatch.setattr(pg, "yardstick", lambda: None)  # (its own test runs it)
    monkeypatch.setattr(pg.Session, "__init__", init)
    monkeypatch.setattr(pg.Session, "serve", lambda self, name, export, lane=0: None)  # (vLLM: its own tests)


def stand_in_job(monkeypatch, po: Path, known: list, train) -> None:
    """The job as ``stand_in_session`` has it, every framework's data prepared and ``train`` standing in
    for each run (no command runs)."""
    stand_in_session(monkeypatch, po, None, known)
    monkeypatch.setattr(pg.Session, "prepare", lambda self, fw, head: True)
    monkeypatch.setattr(pg.Session, "train", train)
    monkeypatch.setattr(sys, "argv", ["peers_gpu.py", "job"])


def test_a_session_probes_once_then_sizes_its_runs_and_a_failing_framework_does_not_stop_the_next(
    tmp_path, monkeypatch
):
    """The job with each command stood in: ours has no step time on this GPU, so a probe runs first
    and the sweep's runs take 180 s / 0.3 s steps; speculators' data fails and only its runs go."""
    trained = []

    def phase(run_name, name, cmd, env, cwd=None, log=None, shared=False, timeout=None):
        if name == "train":
            out = Path(next(c for c in cmd if c.startswith("out="))[4:])
            steps = int(next(c for c in cmd if "max_steps=" in c).split("=")[1])
            trained.append(steps)
            (out / "train").mkdir(parents=True)
            rows = [{"step": s, "loop_s": 30.0 + 0.3 * s} for s in range(10, steps + 1, 10)]
            (out / "train/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            with (tmp_path / "phases.jsonl").open("a") as f:  # (as the real phase records it)
                f.write(json.dumps({"run": run_name, "phase": name, "seconds": 30 + 0.3 * steps + 9, "start": 0.0,
                                    "end": 1.0, "rc": 0}) + "\n")  # fmt: skip
        return True

    stand_in_session(monkeypatch, tmp_path, phase, [])
    served: list[str] = []
    monkeypatch.setattr(pg.Session, "serve", lambda self, name, export, lane=0: served.append(name))
    monkeypatch.setattr(pg.Session, "speculators_data", lambda self: False)
    monkeypatch.setattr(sys, "argv", ["peers_gpu.py", "job", "sweep", "speculators:default", "ours"])
    pg.main(["job", "sweep", "speculators:default", "ours:recipe", "--lrs", "1e-3", "2e-3"])
    assert trained == [300, 600, 600]  # the probe, then two runs sized from it
    runs, session = pr.read_session(tmp_path)
    assert sorted(r.kind for r in runs) == ["probe", "sweep", "sweep"] and session["id"].startswith("h100-")
    assert sorted(served) == sorted(r.name for r in runs if r.kind == "sweep")  # (every sized run, not a probe)
    assert all(r.steady_step_s == pytest.approx(0.3) for r in runs)


def test_a_missing_shared_set_is_synthesized_once_and_polls_bring_it_out_in_parts_pack_joins(tmp_path, monkeypatch):
    """The first session writes the set in a phase of its own (outside every budget); a poll before
    that phase ends brings no part; after it, parts that ``pack`` joins back into the same bytes."""
    po, peers, dest = tmp_path / "po", tmp_path / "peers", tmp_path / "out"
    po.mkdir()
    dest.mkdir()
    blob = bytes(range(256)) * 1000  # 256,000 bytes: three parts of 100,000
    asked = []

    def parts_out():
        return sorted(dest.glob(f"{pg.DATA_SET}.part-*"), key=lambda f: int(f.name.rsplit("-", 1)[1]))

    def phase(run_name, name, cmd, env, cwd=None, log=None, shared=False, timeout=None):
        asked.append(cmd)
        save = Path(next(c for c in cmd if c.startswith("prepare.save_conversations=")).split("=", 1)[1])
        save.write_bytes(blob[:1000])  # half written: a poll now brings out nothing
        pg.data_parts(dest)
        assert not parts_out()
        save.write_bytes(blob)
        (po / "phases.jsonl").write_text(json.dumps({"run": run_name, "phase": name, "rc": 0}) + "\n")
        return True

    monkeypatch.setattr(pg, "PO", po)
    monkeypatch.setattr(pg, "PEERS", peers)
    monkeypatch.setattr(pg, "DATA_PART", 100_000)
    monkeypatch.setattr(pg, "phase", phase)
    pg.data_parts(dest)
    assert not parts_out()  # no synthesis this session: nothing to bring out
    assert pg.synthesize(peers / "data" / pg.DATA_SET)
    (cmd,) = asked
    assert "recipe=smollm2" in cmd and "until=prepare" in cmd and f"prepare.synthesize={pg.DATA_N}" in cmd
    pg.data_parts(dest)
    parts = parts_out()
    assert [p.stat().st_size for p in parts] == [100_000, 100_000, 56_000]
    here = tmp_path / "here"
    (here / "data").mkdir(parents=True)
    for p in parts:
        (here / "data" / p.name).write_bytes(p.read_bytes())
    pg.join_data_parts(here, committed=tmp_path / "none")
    assert (here / "data" / pg.DATA_SET).read_bytes() == blob and not list((here / "data").glob("*.part-*"))
    committed = tmp_path / "committed" / pg.DATA_SET  # (a fresh checkout: no parts, the committed set)
    committed.parent.mkdir()
    committed.write_bytes(b"the committed set")
    pg.join_data_parts(here, committed=committed)  # a set already there stays
    assert (here / "data" / pg.DATA_SET).read_bytes() == blob
    fresh = tmp_path / "fresh"
    pg.join_data_parts(fresh, committed=committed)
    assert (fresh / "data" / pg.DATA_SET).read_bytes() == b"the committed set"


def test_the_committed_shared_set_is_the_one_the_results_trained_on():
    """The set a fresh checkout packs is the one every run in the results trained on (their sha256 is
    over the conversations the job reads from it)."""
    with gzip.open(pg.SHARED_SET, "rt") as f:
        rows = [line for _, line in zip(range(pg.DATA_N), f)]
    sha = hashlib.sha256("".join(rows).encode()).hexdigest()
    known, _ = pr.load(pg.REPO / "benchmarks/results/peers_h100.json")
    assert len(rows) == pg.DATA_N and {r.data_sha256 for r in known} == {sha}


def test_the_peers_compile_into_a_cache_polls_bring_out_in_parts_and_cache_in_puts_back_without_tritons_own(
    tmp_path, monkeypatch
):
    """The processes of the peers with runs left compile into the carried cache, ModelOpt's (its runs
    done, unless PEERS_CACHED names it) and ours' not; a poll packs its graphs (not Triton's
    cache of every autotuned candidate) in parts a call's files can hold, none over the cap, replacing
    an earlier poll's, and packs it again only once it changed (else its last parts again); a later
    session's cache-in (or stage, from .peers/cache) joins and unpacks them, never over a cache already
    there, and its polls bring the cache out only once it changed from what came in."""
    cache, dest, carried = tmp_path / "m" / "inductor_peers", tmp_path / "out", tmp_path / ".peers_cache"
    monkeypatch.setattr(pg, "COMPILE_CACHE", cache)
    assert all(pg.env_for(fw)["TORCHINDUCTOR_CACHE_DIR"] == str(cache) for fw in ("speculators", "specforge"))
    assert all(pg.env_for(fw).get("TORCHINDUCTOR_CACHE_DIR") != str(cache) for fw in ("ours", "modelopt"))
    monkeypatch.setattr(pg, "CACHED", ("modelopt",))  # (PEERS_CACHED=modelopt: its graphs, as sessions 37-48)
    assert pg.env_for("modelopt")["TORCHINDUCTOR_CACHE_DIR"] == str(cache)
    dest.mkdir()
    pg.compile_cache_out(dest)
    assert not list(dest.iterdir())  # nothing compiled this session
    (cache / "fxgraph" / "ab").mkdir(parents=True)
    graph = os.urandom(5000)  # (incompressible: the archive takes more than one part)
    (cache / "fxgraph" / "ab" / "entry").write_bytes(graph)
    (cache / "fxgraph" / "ab" / "triton_bundle").write_bytes(b"kernels")  # (bundled in the graph's entry: kept)
    (cache / "triton" / "0" / "k").mkdir(parents=True)
    (cache / "triton" / "0" / "k" / "k.cubin").write_bytes(os.urandom(4096))
    monkeypatch.setattr(pg, "CACHE_PART_BYTES", 2048)
    (dest / f"{pg.COMPILE_CACHE_TGZ}.part-7").write_bytes(b"an earlier poll's")
    pg.compile_cache_out(dest)
    parts = sorted(dest.iterdir(), key=lambda f: int(f.name.rsplit("-", 1)[1]))
    assert [f.name for f in parts] == [f"{pg.COMPILE_CACHE_TGZ}.part-{i}" for i in range(3)]
    assert all(f.stat().st_size <= 2048 for f in parts)
    with tarfile.open(fileobj=io.BytesIO(b"".join(f.read_bytes() for f in parts))) as tar:
        assert sorted(m.name for m in tar.getmembers() if m.isfile()) == [
            "inductor_peers/fxgraph/ab/entry",
            "inductor_peers/fxgraph/ab/triton_bundle",
        ]
    packed = [f.read_bytes() for f in parts]
    again = tmp_path / "again"
    again.mkdir()
    (again / f"{pg.COMPILE_CACHE_TGZ}.part-5").write_bytes(b"an earlier poll's")
    with monkeypatch.context() as m:  # (unchanged since the last poll: its parts again, nothing packed)
        m.setattr(pg.tarfile, "open", lambda *a, **k: pytest.fail("packed again"))
        pg.compile_cache_out(again)
    assert [f.read_bytes() for f in pg.part_files(again / pg.COMPILE_CACHE_TGZ)] == packed
    assert len(list(again.iterdir())) == len(packed)
    carried.mkdir()
    for f in parts:
        (carried / f.name).write_bytes(f.read_bytes())
    fresh = tmp_path / "fresh" / "inductor_peers"
    monkeypatch.setattr(pg, "COMPILE_CACHE", fresh)
    pg.main(["cache-in", str(carried)])
    assert (fresh / "fxgraph/ab/entry").read_bytes() == graph and not (fresh / "triton").exists()
    brought = tmp_path / "brought"
    brought.mkdir()
    pg.compile_cache_out(brought)
    assert not list(brought.iterdir())  # (unchanged since it was carried in: the parts carried hold it)
    (fresh / "fxgraph/cd").mkdir()
    (fresh / "fxgraph/cd/entry").write_bytes(b"a graph compiled here")
    pg.compile_cache_out(brought)
    with tarfile.open(
        fileobj=io.BytesIO(b"".join(f.read_bytes() for f in pg.part_files(brought / pg.COMPILE_CACHE_TGZ)))
    ) as tar:
        assert "inductor_peers/fxgraph/cd/entry" in tar.getnames()  # (changed: brought out whole)
    (fresh / "fxgraph/cd/entry").unlink()
    (fresh / "fxgraph/ab/entry").write_bytes(b"newer")
    pg.compile_cache_in(carried)  # (a cache already there is this machine's own: kept)
    assert (fresh / "fxgraph/ab/entry").read_bytes() == b"newer"
    shutil.rmtree(fresh)
    (tmp_path / "peers" / "cache").mkdir(parents=True)  # (a small one, whole, in .peers/cache: stage's)
    with tarfile.open(tmp_path / "peers" / "cache" / pg.COMPILE_CACHE_TGZ, "w:gz") as tar:
        tar.add(cache / "fxgraph", arcname="inductor_peers/fxgraph")
    pg.compile_cache_in(tmp_path / "peers" / "cache")
    assert (fresh / "fxgraph/ab/entry").read_bytes() == graph
    monkeypatch.setattr(pg, "COMPILE_CACHE", cache)
    monkeypatch.setattr(pg, "COMPILE_CACHE_MIB", 0)
    for f in parts:
        f.unlink()
    (cache / "fxgraph/ab/entry").write_bytes(os.urandom(5001))  # (changed since the last poll packed it)
    pg.compile_cache_out(dest)
    assert not list(dest.iterdir())  # over the cap: left on the machine
    monkeypatch.setattr(pg, "COMPILE_CACHE_MIB", 48)

    def gone(*a, **k):  # a file the compile renames away while the poll reads it
        raise FileNotFoundError("fxgraph/ab/.tmp_entry")

    monkeypatch.setattr(tarfile.TarFile, "add", gone)
    (cache / "fxgraph/ab/entry").write_bytes(os.urandom(5002))
    pg.compile_cache_out(dest)  # (the poll goes on; the next one packs it)
    assert not list(dest.iterdir())


def test_the_cache_names_the_heads_that_trained_into_it_and_their_runs_are_counted_compiling_warm(
    tmp_path, monkeypatch, capsys
):
    """A poll names in the cache the heads of its frameworks (``CACHED``) whose training ended here (not
    a failed one, nor another framework's); the names travel in its parts and come back with cache-in. A job, or plan over the parts
    cache-in will bring, then counts such a head's compile as a warm one's: the median of its sized
    runs' compiles under half its probe's, or a carried cache's (ModelOpt: 90 s), whichever is longer;
    cold for a framework no carried cache has been measured for yet."""
    po, cache, dest = tmp_path / "po", tmp_path / "m" / "inductor_peers", tmp_path / ".peers_cache"
    monkeypatch.setattr(pg, "PO", po)
    monkeypatch.setattr(pg, "COMPILE_CACHE", cache)
    monkeypatch.setattr(pg, "CACHED", ("modelopt", "speculators"))
    specs = [pr.RunSpec("modelopt", "default", "sweep", 180.0, 3e-4, 43, 2799, 16384, device="h100"),
             pr.RunSpec("modelopt", "matched", "sweep", 180.0, 3e-4, 42, 1927, 16384, device="h100"),
             pr.RunSpec("ours", "muon", "final", 600.0, 0.02, 0, 2069, 16384, device="h100"),
             pr.RunSpec("speculators", "matched", "sweep", 180.0, 3e-3, 43, 2247, 16384, device="h100")]  # fmt: skip
    rows = []
    for spec, rc in zip(specs, (0, 1, 0, 0)):
        (po / spec.name).mkdir(parents=True)
        (po / spec.name / "spec.json").write_text(json.dumps(pr.asdict(spec)))
        rows.append({"run": spec.name, "phase": "train", "seconds": 9.0, "start": 0, "end": 9, "rc": rc})
    (po / "phases.jsonl").write_text("".join(json.dumps(p) + "\n" for p in rows))
    (cache / "fxgraph").mkdir(parents=True)
    (cache / "fxgraph" / "entry").write_bytes(b"graph")
    dest.mkdir()
    pg.compile_cache_out(dest)
    assert pg.cached_heads() == pg.carried_heads(dest) == {"modelopt:default@h100", "speculators:matched@h100"}
    fresh = tmp_path / "fresh" / "inductor_peers"
    monkeypatch.setattr(pg, "COMPILE_CACHE", fresh)
    assert pg.cached_heads() == set()
    pg.main(["cache-in", str(dest)])
    assert pg.cached_heads() == {"modelopt:default@h100", "speculators:matched@h100"}
    shutil.rmtree(cache)  # (a cache brought out before heads were named: none counted warm)
    (cache / "fxgraph").mkdir(parents=True)
    with tarfile.open(tmp_path / "old.tgz", "w:gz") as tar:
        tar.add(cache, arcname=cache.name)
    (tmp_path / "old").mkdir()
    pg.write_parts((tmp_path / "old.tgz").read_bytes(), tmp_path / "old" / pg.COMPILE_CACHE_TGZ, 1 << 20)
    assert pg.carried_heads(tmp_path / "old") == pg.carried_heads(tmp_path / "none") == set()

    known = [probe("modelopt", "default", steps=300, steady_step_s=0.06, compile_s=381.0),  # start-up 60 s
             run("modelopt", "default", lr=1e-4, compile_s=16.75), run("modelopt", "default", lr=3e-4, compile_s=20.4),
             run("modelopt", "default", lr=1e-3, compile_s=21.7), run("modelopt", "default", seed=43, compile_s=421.6),
             run("modelopt", "matched", compile_s=5.0)]  # (cold, and another head: neither counts)  # fmt: skip
    final = pr.RunSpec("modelopt", "default", "final", 600.0, 3e-4, 42, 10000, 16384, device="h100",
                       planned_step_s=0.06, lanes=1)  # fmt: skip
    rest = 10000 * 0.06 + 60.0 + 2 * pg.EVAL_S + pg.SERVE_S
    assert pg.expected_s(known, final) == pytest.approx(rest + 381.0)
    assert pg.expected_s(known, final, warm=True) == pytest.approx(rest + 90.0)  # (carried: 90 s)
    speculators = [dataclasses.replace(r, framework="speculators") for r in known]
    spec_final = dataclasses.replace(final, framework="speculators")
    assert pg.expected_s(speculators, spec_final, warm=True) == pytest.approx(rest + 381.0)  # (none carried: cold)
    monkeypatch.setitem(pg.CARRIED_COMPILE_S, "speculators", 30.0)
    assert pg.expected_s(speculators, spec_final, warm=True) == pytest.approx(rest + 30.0)  # (its warm runs: ~20 s)
    monkeypatch.setitem(pg.CARRIED_COMPILE_S, "modelopt", 0.0)
    assert pg.expected_s(known, final, warm=True) == pytest.approx(rest + 20.4)  # (the warm runs' median)
    assert pg.expected_s(known[:1], final, warm=True) == pytest.approx(rest + 381.0)  # (no warm run measured yet)
    s = object.__new__(pg.Session)
    s.a, s.known = argparse.Namespace(slowdown=None), known
    assert s.expected(final) == pytest.approx(rest + 20.4)  # (the cache here names it)
    elsewhere = dataclasses.replace(final, device="h200", sized_on="h100")  # (graphs of another GPU)
    assert s.expected(elsewhere) == pytest.approx(rest + 381.0)
    monkeypatch.setattr(pg, "load", lambda path: (known, None))
    plan = ["plan", "final", "modelopt:default", "--lrs", "3e-4", "--lanes", "1", "--device", "h100", "--cache"]
    pg.main([*plan, str(dest)])
    assert "(compiling warm: .peers_cache holds its graphs)" in capsys.readouterr().out
    pg.main([*plan, str(tmp_path / "old")])
    assert "compiling warm" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--cache .*typo: no such folder"):
        pg.main([*plan, str(tmp_path / "typo")])
    with pytest.raises(SystemExit, match=f"cache-in .*none: no {pg.COMPILE_CACHE_TGZ} or its .part-N there"):
        pg.main(["cache-in", str(tmp_path / "none")])
    monkeypatch.setattr(pg, "CACHED", ("speculators", "specforg"))  # (PEERS_CACHED with a typo: refused, named)
    with pytest.raises(SystemExit):
        pg.main(["cache-in", str(dest)])
    assert "PEERS_CACHED=speculators specforg: specforg is no framework here" in capsys.readouterr().err


def test_the_recipes_head_family_goes_to_ours_and_to_speculators_flags_for_it(tmp_path):
    """No --variant: the recipe's head (EAGLE-3.1), which speculators builds with per-state norms
    before fc in place of its single norm; ModelOpt, which has no such option, says so."""
    shape, missing = pg.head_shape("speculators", "default", TARGET, None)
    spec = pr.RunSpec("speculators", "default", "sweep", 180.0, 1e-3, 42, 900, 16384, head_shape=shape, epochs=4)
    cmd = pg.speculators_cmd(spec, tmp_path, Path("/target"))
    assert shape["variant"] == "eagle3.1" and shape["residual"] == "normed" and not missing
    assert "--fc-norm" in cmd and "--no-norm-before-fc" in cmd and "--draft-config" not in cmd
    assert "--no-norm-before-residual" not in cmd  # (its own default: the residual normed)
    plain, _ = pg.head_shape("speculators", "matched", TARGET, "eagle3")
    assert "--fc-norm" not in pg.speculators_cmd(pr.RunSpec("speculators", "matched", "sweep", 180.0, 1e-3, 42, 9,
                                                            16384, head_shape=plain), tmp_path, Path("/t"))  # fmt: skip
    ours, _ = pg.head_shape("ours", "recipe", TARGET, None)
    assert "++train.model.variant=eagle3.1" in pg.ours_cmd(
        pr.RunSpec("ours", "recipe", "sweep", 180.0, 2e-3, 0, 9, 16384, head_shape=ours), tmp_path, tmp_path / "c"
    )
    assert (
        "model variant eagle3.1: ModelOpt has no such option" in pg.head_shape("modelopt", "matched", TARGET, None)[1]
    )


def test_runs_that_shared_the_gpu_are_judged_by_their_steps_at_the_step_time_measured_alone():
    """A sized run in a lane trained slower (0.5 s a step) than its probe alone (0.3 s): its budget
    is its steps at 0.3 s, its peak memory is the probe's, and the next plan still uses 0.3 s."""
    alone = probe(steps=60, steady_step_s=0.3, peak_gpu_mib=20000, peak_from="run")
    shared = run(lr=2e-3, steps=600, steady_step_s=0.5, planned_step_s=0.3, lanes=4)
    assert pr.step_time([alone, shared], "ours", "recipe", "h100") == (0.3, None)
    assert pr.step_time([shared], "ours", "recipe", "h100") is None  # only a run that had company: probe again
    pr.with_probe_peaks([alone, shared])
    assert (shared.peak_gpu_mib, shared.peak_from) == (20000, "probe")


def test_a_lane_reads_its_budget_from_the_planned_step_and_takes_no_device_peak(tmp_path):
    spec = pr.RunSpec("ours", "recipe", "sweep", 180.0, 2e-3, 0, 600, 16384, planned_step_s=0.3, lanes=4)
    d = tmp_path / spec.name
    (d / "run/train").mkdir(parents=True)
    (d / "spec.json").write_text(json.dumps(pr.asdict(spec)))
    rows = [{"step": 10 * i, "loop_s": 40.0 + 5.0 * i} for i in range(1, 61)]  # 0.5 s a step with company
    (d / "run/train/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    phases = [{"run": spec.name, "phase": "train", "seconds": 400.0, "start": 0.0, "end": 400.0, "rc": 0}]
    r = pr.read_run(d, phases, [(10.0, 70000)])
    assert (r.steps, r.budget_loop_s, r.steady_loop_s) == (600, 180.0, 300.0) and r.peak_gpu_mib is None


def spec(fw: str) -> pr.RunSpec:
    return pr.RunSpec(fw, "default", "sweep", 180.0, 1e-3, 0, 9, 16384)


def test_the_lanes_run_a_mix_of_frameworks_at_once_on_their_own_ports_and_skip_what_is_done(tmp_path, monkeypatch):
    """Two lanes: never more than two trainings at once, each on a port no other running one holds;
    the runs alternate between frameworks; a run the results hold evaluated is not run again."""
    active, most, order, ports, lock = set(), [0], [], [], threading.Lock()

    def phase(run_name, name, cmd, env, cwd=None, log=None, shared=False, timeout=None):
        if name == "train":
            with lock:
                assert env["MASTER_PORT"] not in {p for _, p in active}
                active.add((run_name, env["MASTER_PORT"]))
                most[0] = max(most[0], len(active))
                order.append(run_name)
            time.sleep(0.05)
            with lock:
                active.discard((run_name, env["MASTER_PORT"]))
                ports.append(env["MASTER_PORT"])
        return False  # (trained nothing: no export, no eval)

    known = [
        probe(steps=300, steady_step_s=0.3, peak_gpu_mib=25000, peak_from="run"),
        probe("modelopt", "default", 1e-4, 42, steady_step_s=0.25, steps=300, peak_gpu_mib=5000, peak_from="run"),
    ]
    known.append(
        run(lr=1e-3, planned=600, steps=600, tau_heldout=1.8, planned_step_s=0.3, lanes=2)
    )  # done in an earlier session

    stand_in_session(monkeypatch, tmp_path, phase, known)
    monkeypatch.setattr(pg.Session, "prepare", lambda self, fw, head: True)
    monkeypatch.setattr(sys, "argv", ["peers_gpu.py", "job"])
    pg.main(["job", "sweep", "ours:recipe", "modelopt:default", "--lanes", "2"])
    assert most[0] == 2 and set(ports) == {str(pg.PORT_DIST), str(pg.PORT_DIST + 1)}
    assert (
        sorted(n.split("-lr")[0] for n in order)
        == ["modelopt-default-eagle3-n16384-180s"] * 3 + ["ours-recipe-eagle3.1-n16384-180s"] * 2
    )
    assert "ours-recipe-eagle3.1-n16384-180s-lr0.001-seed0" not in order and len(order) == 5


def test_on_another_gpu_runs_are_sized_by_the_probes_named_and_a_framework_never_probed_there_is_left_out(
    tmp_path, monkeypatch
):
    """On an H200 with --size-on h100: ours' runs take the steps its H100 probe sized (the same drafts
    as there), are recorded as trained on the H200 and sized on the H100, and hold that probe's peak;
    ModelOpt, never probed on an H100, is neither probed here nor run."""
    trained: list[tuple[str, str]] = []

    def phase(run_name, name, cmd, env, cwd=None, log=None, shared=False, timeout=None):
        if name == "train":
            trained.append((run_name, next(c for c in cmd if "max_steps=" in c).split("=")[1]))
        return False

    known = [probe(steps=300, steady_step_s=0.3, peak_gpu_mib=25000, peak_from="run")]
    stand_in_session(monkeypatch, tmp_path, phase, known, gpu="h200")
    monkeypatch.setattr(pg.Session, "prepare", lambda self, fw, head: True)
    monkeypatch.setattr(sys, "argv", ["peers_gpu.py", "job"])
    pg.main(["job", "sweep", "ours", "modelopt:default", "--lrs", "1e-3", "--size-on", "h100"])
    assert trained == [("ours-recipe-eagle3.1-n16384-180s-lr0.001-seed0", "600")]  # 180 s at H100's 0.3 s
    spec = pr.RunSpec(**json.loads((tmp_path / trained[0][0] / "spec.json").read_text()))
    assert (spec.device, spec.sized_on, spec.planned_step_s) == ("h200", "h100", 0.3)
    assert pg.lane_peak(known, spec, 143771) == 25000  # the H100 probe's peak holds its lane
    assert pg.expected_s(known, spec) > 600 * 0.3  # its H100 probe's overheads and loop, not a guess
    got = pr.Run.from_dict({**json.loads((tmp_path / trained[0][0] / "spec.json").read_text()), "steps": 600})
    pr.with_probe_peaks([*known, got])
    assert (got.peak_gpu_mib, got.peak_from) == (25000, "probe")
    table = next(t for t in pr.results([*known, got], [])["tables"] if t["title"].startswith("Every run"))
    assert table["rows"][-1][table["header"].index("device")] == "h200 (sized on h100)"
    assert json.loads((tmp_path / "session.json").read_text())["size_on"] == "h100"


def test_a_run_starts_only_where_the_peaks_measured_alone_fit_beside_those_running():
    """Three lanes, a 64 GiB cap: two 30 GiB runs at once, never three; a 5 GiB one beside them;
    a run whose peak is unknown has the GPU to itself."""
    peaks = {"a": 30 * 1024, "b": 30 * 1024, "c": 30 * 1024, "d": 5 * 1024, "e": None}
    active, seen, lock = {}, [], threading.Lock()

    def work(spec, lane):
        with lock:
            assert lane not in active
            active[lane] = spec.framework
            seen.append(sorted(active.values()))
        time.sleep(0.05)
        with lock:
            del active[lane]

    lanes = pg.Lanes(3, 64 * 1024, lambda spec: peaks[spec.framework])
    lanes.run([("all", lambda: [spec(x) for x in "abcde"])], work)
    assert len(seen) == 5 and max(map(len, seen)) <= 3
    assert all(sum(peaks[x] or 64 * 1024 for x in now) <= 64 * 1024 or len(now) == 1 for now in seen)
    assert ["e"] in seen and not any(len(now) == 3 and "d" not in now for now in seen)


def test_a_preparation_holds_its_memory_beside_the_lanes_and_its_runs_join_them_in_turn():
    """Group b writes its data (40 GiB held) while group a's runs go; a's runs never take more than
    the cap leaves beside it; b's runs start only after, then the two groups alternate; a group whose
    preparation fails loses its runs, not the others'."""
    lanes = pg.Lanes(2, 64 * 1024, lambda spec: 20 * 1024)
    events, lock = [], threading.Lock()

    def work(x, lane):
        with lock:
            held = sum(lanes.running.values())
            events.append((x.framework, x.lr, held))
        time.sleep(0.03)

    def b():
        with lanes.hold("b_data", 40 * 1024):
            with lock:
                events.append(("b_data", None, sum(lanes.running.values())))
            time.sleep(0.15)
        return [pr.RunSpec("b", "default", "sweep", 180.0, lr, 0, 9, 16384) for lr in (1, 2)]

    def broken():
        raise RuntimeError("no states")

    a_runs = [pr.RunSpec("a", "default", "sweep", 180.0, lr, 0, 9, 16384) for lr in (1, 2, 3, 4, 5, 6, 7, 8)]
    lanes.run([("a", lambda: a_runs), ("b", b), ("c", broken)], work)
    assert all(held <= 64 * 1024 for _, _, held in events)
    names = [e[0] for e in events]
    assert names.count("a") == 8 and names.count("b") == 2 and "c" not in names
    assert names.index("b") > names.index("b_data")
    first_b = names.index("b")
    assert "a" in names[first_b + 1 :]  # a's remaining runs went on beside b's, in turn


def test_data_written_beside_the_lanes_is_reported_at_its_seconds_alone_from_an_earlier_session():
    alone = [{"run": "speculators_data", "phase": "render", "seconds": 67.0, "rc": 0, "shared": False},
             {"run": "speculators_data", "phase": "states", "seconds": 104.0, "rc": 0, "shared": False},
             {"run": "modelopt_data", "phase": "vocab", "seconds": 25.0, "rc": 0}]  # fmt: skip
    shared = [{**p, "seconds": 150.0, "shared": True} for p in alone[:2]]
    assert (
        pr.data_seconds(alone, "speculators", "default") == 171.0
        and pr.data_seconds(shared, "speculators", "x") is None
    )
    assert (
        pr.data_seconds(alone, "modelopt", "matched") == 25.0 and pr.data_seconds(alone, "modelopt", "default") is None
    )
    later = run("speculators", "default", steps=100, data_s=pr.data_seconds(shared, "speculators", "default"))
    out = pr.results([later], [{"id": "h100-1", "phases": alone}, {"id": "h100-2", "phases": shared}])
    assert out["frameworks"][0]["data_s"] == 171.0


def test_a_preparation_waiting_for_room_is_not_overtaken_by_runs_asked_after_it():
    """A 40 GiB run holds the GPU; a preparation (30 GiB) asks next, then a second 40 GiB run: when
    the first ends, the preparation starts, and the second run (which cannot fit beside it) waits."""
    lanes, order, lock = pg.Lanes(3, 64 * 1024, lambda spec: 40 * 1024), [], threading.Lock()
    big_started, small_given = threading.Event(), threading.Event()

    def work(x, lane):
        with lock:
            order.append(x.framework)
        if x.framework == "big":
            big_started.set()
            assert small_given.wait(5)
            time.sleep(0.1)  # (a lane has taken the small run and waits for room)

    def prep():
        assert big_started.wait(5)
        with lanes.hold("data", 30 * 1024), lock:
            order.append("data")
        return []

    def later():
        while not lanes.waiting:  # (the preparation has asked)
            time.sleep(0.005)
        small_given.set()
        return [spec("small")]

    lanes.run([("big", lambda: [spec("big")]), ("data", prep), ("small", later)], work)
    assert order == ["big", "data", "small"]
    idle = pg.Lanes(3, 64 * 1024, lambda spec: 40 * 1024)
    idle.waiting = {"data": 30 * 1024}  # nothing running, a preparation asking: a run that cannot fit beside it waits
    assert not idle._fits(40 * 1024, True) and idle._fits(20 * 1024, True) and idle._fits(30 * 1024, False)


def test_a_preparation_reserved_before_the_runs_start_keeps_its_room_until_it_asks():
    """Two 30 GiB runs would fill the 64 GiB at once, but speculators' states (24 GiB) are reserved:
    one run goes beside the reservation, the other waits until the preparation is over; a reservation
    given back unused frees its room."""
    lanes, order, lock = pg.Lanes(3, 64 * 1024, lambda x: 30 * 1024), [], threading.Lock()
    lanes.reserve("speculators_data", 24 * 1024)
    first_running, asked = threading.Event(), threading.Event()

    def work(x, lane):
        with lock:
            order.append((x.framework, dict(lanes.running)))
        first_running.set()
        assert asked.wait(5) or x.framework == "b"

    def prep():
        assert first_running.wait(5)  # (its engine installs while the first run trains)
        time.sleep(0.1)  # (the second run has had its chance to start, and did not)
        with lanes.hold("speculators_data", 24 * 1024), lock:
            order.append(("data", dict(lanes.running)))
        asked.set()
        return []

    lanes.run([("runs", lambda: [spec("a"), spec("b")]), ("data", prep)], work)
    assert [o[0] for o in order] == ["a", "data", "b"] and "speculators_data" in order[1][1]
    assert not lanes.reserved and not lanes.waiting
    idle = pg.Lanes(3, 64 * 1024, lambda x: 40 * 1024)
    idle.reserve("d", 30 * 1024)
    assert not idle._fits(40 * 1024, True)
    idle.release("d")
    assert idle._fits(40 * 1024, True)


def test_a_job_reserves_room_for_data_written_beside_the_lanes_and_a_later_one_reuses_that_data(tmp_path, monkeypatch):
    """A sweep of speculators' default head reserves its states' room before any run starts (and
    gives it back once they are written); the folder is marked written, so a second job on the same
    machine from the same conversations writes nothing again, while other conversations would."""
    seen, wrote = [], []

    def speculators_data(self):
        seen.append(dict(self.lanes.reserved))
        wrote.append(self.sha)
        (tmp_path / "speculators_data").mkdir(exist_ok=True)
        return True

    def train(self, spec, lane=0):
        seen.append(dict(self.lanes.reserved))

    known = [probe("speculators", "default", 3e-4, 42, steady_step_s=0.06, steps=200, steps_per_epoch=270)]
    stand_in_session(monkeypatch, tmp_path, None, known)
    monkeypatch.setattr(pg, "gpu_memory_mib", lambda: 80000)
    monkeypatch.setattr(pg, "install", lambda *x: True)
    monkeypatch.setattr(pg.Session, "speculators_data", speculators_data)
    monkeypatch.setattr(pg.Session, "train", train)
    monkeypatch.setattr(sys, "argv", ["peers_gpu.py", "job"])
    pg.main(["job", "sweep", "speculators:default", "--lanes", "1"])
    assert seen[0] == {"speculators_data": pytest.approx(0.30 * 80000)} and seen[1:] == [{}, {}, {}]
    assert json.loads((tmp_path / "speculators_data" / pg.WRITTEN).read_text()) == {"sha256": "abc", "n": 16384}
    (tmp_path / "speculators_data" / "hs").mkdir()  # (its states)
    (tmp_path / "modelopt_data").mkdir()
    pg.clear_session_folder()  # what ``start`` does before the next job: the written states stay, nothing else
    assert sorted(p.name for p in tmp_path.iterdir()) == ["speculators_data"]
    assert (tmp_path / "speculators_data" / "hs").is_dir()
    seen.clear()
    pg.main(["job", "sweep", "speculators:default", "--lanes", "1"])
    assert wrote == ["abc"] and seen == [{}, {}, {}]  # (nothing reserved: nothing to write)
    draft = json.loads((tmp_path / "speculators_draft.json").read_text())  # (the matched head's, on reuse too)
    assert draft["num_hidden_layers"] == 1 and draft["intermediate_size"] == pg.ours_head()["mlp"]
    (tmp_path / "speculators_data" / pg.WRITTEN).unlink()  # written in part (the marker comes last): not kept
    pg.clear_session_folder()
    assert list(tmp_path.iterdir()) == []
    s = object.__new__(pg.Session)
    s.sha, s.a = "other", argparse.Namespace(n=16384)
    assert not s.written("speculators")


def test_no_run_starts_past_the_admission_deadline():
    started = []
    lanes = pg.Lanes(1, 64 * 1024, lambda spec: 1024, last=time.time() + 0.1)
    lanes.run([("g", lambda: [spec("a"), spec("b"), spec("c")])], lambda x, lane: (started.append(x), time.sleep(0.15)))
    assert [x.framework for x in started] == ["a"]  # b and c would have started after the deadline


def test_specforge_trains_its_own_config_its_head_derived_from_the_target_as_it_derives_one(tmp_path):
    """Its default head: the target's MLP, its 32,000-token vocabulary, 7 TTT steps; matched: ours.
    The draft config takes SpecForge's fields from the target (rope theta where transformers 5 keeps
    it), and the run's config its steps, lr, seed and the session's data."""
    shape, missing = pg.head_shape("specforge", "default", TARGET, None)
    assert (shape["mlp"], shape["draft_vocab"], shape["ttt"], shape["variant"]) == (1536, 32000, 7, "eagle3.1")
    assert missing == ["the chain fed its normed output: SpecForge 0.2.0's next step takes the pre-norm output"]
    matched, why = pg.head_shape("specforge", "matched", TARGET, "eagle3")
    assert (matched["mlp"], matched["draft_vocab"], matched["ttt"]) == (6144, 16384, 5)
    assert why == ["lm_head init from the target: SpecForge starts the draft lm_head at random"]
    t5 = {k: v for k, v in TARGET.items() if k != "rope_theta"} | {"rope_parameters": {"rope_theta": 1e5}}
    d = pg.specforge_draft(t5, shape)
    assert (d["rope_theta"], d["intermediate_size"], d["draft_vocab_size"], d["num_hidden_layers"]) == (
        1e5,
        1536,
        32000,
        1,
    )
    assert (
        d["fc_norm"] is True
        and d["architectures"] == ["LlamaForCausalLMEagle3"]
        and "fc_norm" not in pg.specforge_draft(t5, matched)
    )
    sf = tmp_path / "sf"
    run_m = pr.RunSpec("specforge", "matched", "sweep", 180.0, 3e-4, 43, 500, 16384, head_shape=matched)
    c = pg.specforge_config(run_m, tmp_path / "r", sf, tied=True)
    assert c["training"] | {"strategy": "eagle3"} == {"strategy": "eagle3", "num_epochs": 1000, "max_steps": 500,
        "learning_rate": 3e-4, "seed": 43, "ttt_length": 5, "log_interval": 10}  # fmt: skip
    assert c["model"]["vocab_mapping_path"] == str(sf / "vocab16384/vocab_mapping.pt")
    assert c["model"]["lm_head_key"] == "model.embed_tokens.weight" and c["data"]["hidden_states_path"] == str(
        sf / "hs"
    )
    run_d = pr.RunSpec("specforge", "default", "sweep", 180.0, 1e-4, 42, 900, 16384, head_shape=shape)
    c = pg.specforge_config(run_d, tmp_path / "r", sf, tied=False)
    assert c["model"]["vocab_mapping_path"] == str(sf / "hs/vocab_mapping/vocab_mapping.pt")
    assert c["model"]["lm_head_key"] == "lm_head.weight" and c["model"]["draft_model_config"] == str(
        sf / "draft_default.json"
    )


def test_specforge_log_gives_its_step_times_its_first_window_compiling():
    lines = ["step 10: {'loss': 9.1, 'perf/optimizer_step_time_s': 6.0, 'lr': 1e-05}"]  # (compilation in it)
    lines += [f"step {s}: {{'loss': 3.0, 'perf/optimizer_step_time_s': 0.2}}" for s in range(20, 201, 10)]
    text = "Training:  5%|5| 10/200\n" + "\n".join(lines) + "\nstep 200 saved\n"
    pts = pr.specforge_points(text)
    assert pts[0] == (10, 60.0) and pts[-1] == (200, pytest.approx(60.0 + 190 * 0.2)) and len(pts) == 20
    loop, compile_s, step = pr.split_compile(pts)
    assert step == pytest.approx(0.2) and compile_s == pytest.approx(loop - 200 * 0.2)


def test_specforge_tokens_a_second_are_its_rows_mean_length_over_its_steady_step(tmp_path):
    """A batch of one conversation a step (its default): the capture's rows' mean length, written by
    the vocab phase beside its states, over the steady step its log gives; none without that mean."""
    po = tmp_path / "po"
    spec = pr.RunSpec("specforge", "default", "probe", None, 1e-4, 42, 200, 16384, device="h100")
    (po / spec.name).mkdir(parents=True)
    (po / spec.name / "spec.json").write_text(json.dumps(pr.asdict(spec)))
    lines = ["step 10: {'loss': 9.1, 'perf/optimizer_step_time_s': 6.0}"]
    lines += [f"step {s}: {{'loss': 3.0, 'perf/optimizer_step_time_s': 0.05}}" for s in range(20, 201, 10)]
    (po / spec.name / "train.log").write_text("\n".join(lines) + "\n")
    assert pr.read_run(po / spec.name, [], []).tokens_per_s is None
    (po / "specforge_data").mkdir()
    (po / "specforge_data" / pr.STEP_TOKENS).write_text(json.dumps({"tokens_per_step": 170.0}))
    r = pr.read_run(po / spec.name, [], [])
    assert r.steady_step_s == pytest.approx(0.05) and r.tokens_per_s == pytest.approx(170.0 / 0.05, rel=1e-3)


def test_specforge_vocab_phase_writes_its_rows_mean_length(tmp_path):
    """The vocab phase's script, run with SpecForge's functions stood in (the rows its template would
    give: 3 and 6 tokens), writes their mean where read_run looks for it."""
    (tmp_path / "specforge" / "data").mkdir(parents=True)
    (tmp_path / "datasets.py").write_text(
        "class Dataset:\n    @staticmethod\n    def from_generator(gen, gen_kwargs):\n        return Rows()\n"
        "class Rows:\n    def select(self, r):\n        return self\n"
    )
    (tmp_path / "specforge/__init__.py").write_text("")
    (tmp_path / "specforge/data/__init__.py").write_text("")
    (tmp_path / "specforge/data/preprocessing.py").write_text(
        "import torch\ndef build_eagle3_dataset(chats, tok, chat_template, max_length):\n"
        "    return {'input_ids': [torch.zeros(1, 3), torch.zeros(1, 6)]}\n"
        "def generate_vocab_mapping_file(rows, target_vocab_size, draft_vocab_size, cache_dir):\n    pass\n"
    )
    (tmp_path / "specforge/utils.py").write_text(
        "def load_tokenizer(p):\n    return None\ndef safe_conversations_generator(file_path):\n    yield {}\n"
    )
    out = tmp_path / "specforge_data" / pr.STEP_TOKENS
    out.parent.mkdir()
    args = ["c.jsonl", "target", "2", "49152", "16384", str(tmp_path / "vocab"), str(out)]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run([sys.executable, "-c", pg.SPECFORGE_VOCAB, *args], check=True, env=env)
    assert json.loads(out.read_text()) == {"tokens_per_step": 4.5}


def test_specforge_reads_the_target_through_a_weight_index_it_is_given(tmp_path):
    import torch
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(
        {"model.embed_tokens.weight": torch.zeros(4, 2), "model.norm.weight": torch.ones(2)}, hf / "model.safetensors"
    )
    (hf / "config.json").write_text(json.dumps({"dtype": "float32", "torch_dtype": "float32", "hidden_size": 2}))
    (tmp_path / "t").mkdir()
    (tmp_path / "t/config.json").symlink_to(hf / "config.json")  # (an earlier session's layout: a link)
    pg.specforge_target(hf, tmp_path / "t")
    pg.specforge_target(hf, tmp_path / "t")  # (again: the same)
    index = json.loads((tmp_path / "t/model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "model.embed_tokens.weight": "model.safetensors",
        "model.norm.weight": "model.safetensors",
    }
    # its capture writes states in the dtype the config names, and its target head is bf16 only
    assert json.loads((tmp_path / "t/config.json").read_text()) == {"dtype": "bfloat16", "hidden_size": 2}
    assert json.loads((hf / "config.json").read_text())["dtype"] == "float32"  # the target itself untouched
    assert (tmp_path / "t/model.safetensors").resolve() == (hf / "model.safetensors").resolve()


def test_specforge_runs_take_whole_windows_of_its_step_log():
    """It prints a step line each 10 steps only: a run sized to 2,917 steps takes 2,920."""
    s = object.__new__(pg.Session)
    s.a = argparse.Namespace(n=16384, variant=None, session="h100-x", lanes=5)
    s.device, s.size_on, s.t, s.sha = "h100", "h100", TARGET, "abc"
    s.known = [probe("specforge", "default", 1e-4, 42, steady_step_s=180.0 / 2917, steps=200)]
    x = s.spec("specforge", "default", "sweep", 180.0, 1e-4, 42)
    assert x.steps_planned == 2920 and x.steps_planned % pg.SPECFORGE_LOG_EVERY == 0
    assert pg.specforge_config(x, Path("/r"), Path("/sf"), True)["training"]["log_interval"] == pg.SPECFORGE_LOG_EVERY


def test_a_framework_leaves_the_not_run_list_once_the_file_holds_a_run_of_it():
    assert "specforge" in pr.results([], [])["not_run"]
    assert "specforge" not in pr.results([run("specforge", "default", steps=10)], [])["not_run"]


def test_a_final_runs_lane_holds_its_training_peak_then_moves_to_room_for_vllm_serving_its_draft(monkeypatch):
    """A lane holds its probe's peak while it trains (a final as a sweep run); serving, it gives that
    back and waits for vLLM's room ahead of runs not yet started: a 20 GiB run asked while it waits
    would fit beside the 40 GiB one running, but not beside both, so it starts only once that one ends."""
    s = object.__new__(pg.Session)
    s.known = [probe("modelopt", "default", steps=300, peak_gpu_mib=4000, peak_from="run")]
    monkeypatch.setattr(pg, "gpu_memory_mib", lambda: 80000)
    final = pr.RunSpec("modelopt", "default", "final", 600.0, 1e-4, 42, 9, 16384, device="h100")
    sweep = pr.RunSpec("modelopt", "default", "sweep", 180.0, 1e-4, 42, 9, 16384, device="h100")
    assert s.peak(sweep) == 4000 and s.peak(final) == 4000 and pg.serve_mib(80000) == int(0.18 * 80000)
    assert s.peak(pr.RunSpec("ours", "recipe", "final", 600.0, 1e-3, 0, 9, 16384, device="h100")) is None
    peaks = {"final": 4 * 1024, "big": 40 * 1024, "late": 20 * 1024}
    lanes, order, lock = pg.Lanes(3, 64 * 1024, lambda x: peaks[x.framework]), [], threading.Lock()
    big_running, moving, big_over = threading.Event(), threading.Event(), threading.Event()

    def work(x, lane):
        with lock:
            order.append((x.framework, sum(lanes.running.values()) / 1024, big_over.is_set()))
        if x.framework == "big":
            big_running.set()
            assert moving.wait(5)
            time.sleep(0.1)  # (the late run has been asked while the final waits for vLLM's room)
            big_over.set()
        elif x.framework == "final":
            assert big_running.wait(5)
            threading.Timer(0.05, moving.set).start()
            lanes.move(lane, 30 * 1024)  # (40 + 30 > 64: it waits for the big run)
            with lock:
                order.append(("served", lanes.running[lane] / 1024, big_over.is_set()))
            time.sleep(0.1)

    def late():
        assert moving.wait(5)
        return [spec("late")]

    lanes.run([("f", lambda: [spec("final"), spec("big")]), ("late", late)], work)
    assert {o[:2] for o in order[:2]} <= {("final", 4.0), ("big", 44.0), ("big", 40.0), ("final", 44.0)}
    (late,) = [o for o in order if o[0] == "late"]
    assert ("served", 30.0, True) in order and late[2] and late[1] in (20.0, 50.0)  # (beside vLLM's 30, asked or held)


def test_a_preparation_that_failed_is_not_tried_again_and_none_runs_for_runs_already_done(tmp_path, monkeypatch):
    """speculators' states fail once: its second head does not write them again. ours' runs are all
    in the results already: its data is not prepared at all."""
    calls, trained = [], []

    def phase(run_name, name, cmd, env, cwd=None, log=None, shared=False, timeout=None):
        trained.append(run_name)
        return True

    known = [probe(steps=300, steady_step_s=0.3)] + [
        run(lr=lr, planned=600, steps=600, tau_heldout=1.8, planned_step_s=0.3) for lr in (1e-3, 2e-3)
    ]
    stand_in_session(monkeypatch, tmp_path, phase, known)
    monkeypatch.setattr(pg.Session, "speculators_data", lambda self: calls.append("states") or False)
    monkeypatch.setattr(sys, "argv", ["peers_gpu.py", "job"])
    pg.main(["job", "sweep", "speculators", "ours:recipe", "ours:recipe", "--lrs", "1e-3", "2e-3"])
    assert calls == ["states"]  # (its second head: not again)
    assert trained == []  # no phase at all: ours' tokenizing neither (ours named twice: one group)


def test_a_final_for_a_named_head_takes_that_heads_best_lr():
    runs = [run("speculators", "default", lr=1e-3, tau_heldout=1.5), run("speculators", "matched", lr=3e-4, tau_heldout=1.7),
            run("speculators", "default", lr=3e-3, tau_heldout=1.4)]  # fmt: skip
    a = argparse.Namespace(what="final", frameworks=["speculators:default"], lrs=None, seeds=None)
    assert pg.runs_wanted(a, runs) == [("speculators", "default", 600.0, [1e-3], [42, 43])]


def test_a_hung_phase_is_stopped_with_its_children_and_frees_its_lane(tmp_path, monkeypatch):
    monkeypatch.setattr(pg, "PO", tmp_path)
    child = tmp_path / "child.pid"
    cmd = ["bash", "-c", f"sleep 30 & echo $! > {child}; wait"]
    start = time.time()
    assert not pg.phase("r", "train", cmd, dict(os.environ), timeout=1.0)
    assert time.time() - start < 20
    (rec,) = [json.loads(x) for x in (tmp_path / "phases.jsonl").read_text().splitlines()]
    assert rec["rc"] == 124
    time.sleep(0.2)
    stat = Path(f"/proc/{child.read_text().strip()}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z"  # the group's child went too (a zombie at most)


def test_a_run_cut_off_before_its_steps_does_not_replace_one_that_trained_them():
    whole = run(steps=100)  # (100 planned)
    cut = run(steps=40)
    assert pr.merge([whole], [cut])[0].steps == 100 and pr.merge([cut], [whole])[0].steps == 100


def test_merging_from_a_path_that_is_not_there_says_so_and_writes_nothing(tmp_path):
    with pytest.raises(SystemExit, match="missing.json: no such file or folder"):
        pr.main(["merge", str(tmp_path / "missing.json"), str(tmp_path / "out.json")])
    assert not (tmp_path / "out.json").exists()


def swept_before(fw: str, head: str, step_s: float, tau: float) -> list[pr.Run]:
    """A head's probe and its whole 3-minute sweep, done by an earlier job (its middle lr at ``tau``, the
    two others 0.05 below: its best inside the grid, so it goes no further)."""
    lrs, seed = pr.LRS.get(f"{fw}:{head}", pr.LRS[fw]), pr.SEED[fw]
    steps = pg.sized_steps(fw, 180.0, step_s)
    shape = {"variant": pg.head_shape(fw, head, TARGET, "eagle3.1")[0].get("variant", "eagle3")}
    epoch = {"steps_per_epoch": 270} if fw == "speculators" else {}  # (speculators' probe: its epoch's steps)
    return [probe(fw, head, lrs[0], seed, steps=300, steady_step_s=step_s, head_shape=shape, **epoch),
            *(run(fw, head, 180.0, lr, seed, steps, steps=steps, tau_heldout=tau - 0.05 * (i != 1), head_shape=shape)
              for i, lr in enumerate(lrs))]  # fmt: skip


def test_a_sweep_then_its_finals_in_one_job_each_final_after_its_frameworks_whole_sweep(tmp_path, monkeypatch):
    """--then-final: ours' and ModelOpt's sweeps run; each framework's finals (its best lr, two seeds,
    600 s) start only once its every sweep run is over; speculators' sweep has a run that failed, so
    it gets no final."""
    events, lock = [], threading.Lock()
    tau = {("ours", 1e-3): 1.9, ("ours", 2e-3): 2.1, ("ours", 4e-3): 1.7, ("modelopt", 1e-4): 1.2,
           ("modelopt", 3e-4): 1.5, ("modelopt", 1e-3): 1.4, ("speculators", 3e-4): 1.6, ("speculators", 1e-3): 1.8}  # fmt: skip

    def train(self, spec, lane=0):
        with lock:
            events.append(("start", spec.name))
        time.sleep(0.02)
        failed = spec.framework == "speculators" and spec.lr == 3e-3
        r = pr.Run.from_dict(
            {
                **pr.asdict(spec),
                "steps": spec.steps_planned,
                "tau_heldout": None if failed else tau[spec.framework, spec.lr],
            }
        )
        with lock:
            self.known.append(r)
            events.append(("end", spec.name))

    known = [probe(steps=300, steady_step_s=0.3), probe("modelopt", "default", 1e-4, 42, steady_step_s=0.06, steps=300),
             probe("speculators", "default", 3e-4, 42, steady_step_s=0.06, steps=200, steps_per_epoch=270),
             *swept_before("ours", "muon", 0.3, 1.5), *swept_before("modelopt", "matched", 0.06, 1.3)]  # fmt: skip
    stand_in_job(monkeypatch, tmp_path, known, train)
    pg.main(["job", "sweep", "ours:recipe", "modelopt:default", "speculators:default", "--lanes", "3", "--then-final"])
    started = [n for e, n in events if e == "start"]
    finals = [n for n in started if "-600s-" in n]
    assert sorted(finals) == ["modelopt-default-eagle3-n16384-600s-lr0.0003-seed42",
                              "modelopt-default-eagle3-n16384-600s-lr0.0003-seed43",
                              "ours-recipe-eagle3.1-n16384-600s-lr0.002-seed0",
                              "ours-recipe-eagle3.1-n16384-600s-lr0.002-seed1"]  # fmt: skip
    for fw in ("ours", "modelopt"):
        last_sweep_end = max(i for i, (e, n) in enumerate(events) if e == "end" and n.startswith(fw) and "-180s-" in n)
        first_final = min(i for i, (e, n) in enumerate(events) if e == "start" and n.startswith(fw) and "-600s-" in n)
        assert first_final > last_sweep_end
    assert len([n for n in started if "-180s-" in n]) == 9


def test_a_sweeps_finals_take_the_frameworks_best_head_whichever_this_job_swept(tmp_path, monkeypatch):
    """--then-final after a sweep of ours:muon alone: ours' recipe head, swept by an earlier job, did
    better, so its best lr goes on (two seeds), after the muon sweep is over; none goes on while a
    head of the framework has no sweep."""
    events = []

    def train(self, spec, lane=0):
        events.append(spec.name)
        tau = 1.4 if spec.lr == 0.04 else 1.3  # (muon's best inside its grid: nothing past its edges)
        self.known.append(pr.Run.from_dict({**pr.asdict(spec), "steps": spec.steps_planned, "tau_heldout": tau}))

    recipe = swept_before("ours", "recipe", 0.3, 2.0)
    recipe[2].tau_heldout = 2.6  # (lr 2e-3)
    muon_probe = probe("ours", "muon", 0.02, steps=300, steady_step_s=0.3)
    stand_in_job(monkeypatch, tmp_path, [*recipe, muon_probe], train)
    pg.main(["job", "sweep", "ours:muon", "--lanes", "1", "--then-final"])
    assert events == [*(f"ours-muon-eagle3.1-n16384-180s-lr{lr:g}-seed0" for lr in pr.LRS["ours:muon"]),
                      "ours-recipe-eagle3.1-n16384-600s-lr0.002-seed0", "ours-recipe-eagle3.1-n16384-600s-lr0.002-seed1"]  # fmt: skip
    events.clear()
    stand_in_session(monkeypatch, tmp_path, None, [muon_probe, *recipe[:1]])  # (the recipe head probed, never swept)
    monkeypatch.setattr(pg.Session, "train", train)
    pg.main(["job", "sweep", "ours:muon", "--lanes", "1", "--then-final"])
    assert all("-180s-" in n for n in events) and len(events) == 3


def test_then_seed_runs_each_frameworks_best_at_3_minutes_with_both_seeds_served_once_its_sweep_is_whole(
    tmp_path, monkeypatch, capsys
):
    """--then-seed: once ours' sweep (both heads) is in, its best (the recipe at 2e-3, swept earlier) runs
    at 180 s with seeds 1 and 2, each on MT-bench and served, after the last sweep run (seed 0's sweep run, which chose
    it, is not run again); ModelOpt's sweep has a failed run, so it gets none; a second job finds the
    pair held and runs nothing, as plan says. A seed's run held unserved (or without MT-bench) trains
    again; one that vLLM failed to serve is held (not trained again for it)."""
    events, sessions = [], []

    def train(self, spec, lane=0):
        events.append(spec.name)
        sessions.append(self)
        tau = None if spec.framework == "modelopt" and spec.lr == 1e-3 else (1.4 if spec.lr == 0.04 else 1.3)
        got = pr.Run.from_dict({**pr.asdict(spec), "steps": spec.steps_planned, "tau_heldout": tau})
        got.tau_mtbench = got.vllm_acceptance = 1.5 if tau else None
        self.known = [r for r in self.known if r.name != got.name] + [got]  # (as train replaces a run of its name)

    recipe = swept_before("ours", "recipe", 0.3, 2.0)
    recipe[2].tau_heldout = 2.6  # (lr 2e-3)
    known = [*recipe, probe("ours", "muon", 0.02, steps=300, steady_step_s=0.3),
             probe("modelopt", "default", 1e-4, 42, steady_step_s=0.06, steps=300),
             *swept_before("modelopt", "matched", 0.06, 1.3)]  # fmt: skip
    stand_in_job(monkeypatch, tmp_path, known, train)
    pg.main(["job", "sweep", "ours:muon", "modelopt:default", "--lanes", "1", "--then-seed"])
    pair = ["ours-recipe-eagle3.1-n16384-180s-lr0.002-seed1", "ours-recipe-eagle3.1-n16384-180s-lr0.002-seed2"]
    assert events[-2:] == pair
    assert [n for n in events if not n.endswith(("-seed0", "-seed42"))] == pair  # (none for ModelOpt)
    assert len(events) == 3 + 3 + 2
    events.clear()
    stand_in_session(monkeypatch, tmp_path, None, sessions[-1].known)  # (the next job reads what this one ran)
    monkeypatch.setattr(pg.Session, "train", train)
    pg.main(["job", "sweep", "ours:muon", "--lanes", "1", "--then-seed"])
    assert events == []
    monkeypatch.setattr(pg, "load", lambda path: (sessions[-1].known, None))
    capsys.readouterr()
    pg.main(["plan", "sweep", "ours", "modelopt", "--then-seed", "--then-final", "--device", "h100"])
    out = capsys.readouterr().out
    assert "ours: once its sweep is whole, its best (now recipe lr 0.002) at 180 s, seeds 1 and 2, each on MT-bench " \
           "and served by vLLM (held in the results)" in out  # fmt: skip
    assert "ours: once its sweep is whole, its best (now recipe lr 0.002) at 600 s, seeds 0 and 1" in out
    assert "modelopt: once its sweep is whole, its best (now matched lr 0.0003) at 180 s, seeds 43 and 44, each " \
           "on MT-bench and served by vLLM\n" in out  # fmt: skip
    spec = next(r for r in sessions[-1].known if r.name == pair[0])
    spec.vllm_acceptance = None
    assert not pg.done(sessions[-1].known, spec, whole=True) and pg.done(sessions[-1].known, spec)
    pg.main(["plan", "sweep", "ours", "--then-seed", "--device", "h100"])
    assert "seeds 1 and 2, each on MT-bench and served by vLLM (seed 2 held in the results)" in capsys.readouterr().out
    spec.failed = ["served"]
    assert pg.done(sessions[-1].known, spec, whole=True)
    spec.tau_mtbench = None
    assert not pg.done(sessions[-1].known, spec, whole=True)


@pytest.mark.parametrize("early", [True, False])
def test_seed_early_pairs_the_best_head_swept_whole_beside_the_sweep_the_other_head_still_lacks(
    tmp_path, monkeypatch, early
):
    """--seed-early: ours' recipe head was swept whole by an earlier job (its best 2e-3 at 2.6) and this
    job sweeps its muon head; the recipe's pair (seeds 1 and 2) starts beside muon's sweep runs. Muon
    then does better (0.04 at 2.8), so its pair is left for a later job. Without it, the pair waits for
    the whole sweep and is muon's."""
    events, lock, paired = [], threading.Lock(), threading.Event()

    def train(self, spec, lane=0):
        with lock:
            events.append(("start", spec.name))
        if spec.seed:
            paired.set()
        else:  # (a sweep run lasts until a pair's run has started, or 2 s)
            paired.wait(2.0)
        tau = 2.8 if (spec.head, spec.lr) == ("muon", 0.04) else 1.3
        got = pr.Run.from_dict({**pr.asdict(spec), "steps": spec.steps_planned, "tau_heldout": tau})
        got.tau_mtbench = got.vllm_acceptance = 1.5
        with lock:
            self.known = [r for r in self.known if r.name != got.name] + [got]
            events.append(("end", spec.name))

    recipe = swept_before("ours", "recipe", 0.3, 2.0)
    recipe[2].tau_heldout = 2.6  # (lr 2e-3)
    recipe[0].peak_gpu_mib, recipe[0].peak_from = 8000, "run"  # (each head's probe measured its peak: its
    muon = probe("ours", "muon", 0.02, steps=300, steady_step_s=0.3, peak_gpu_mib=8000, peak_from="run")  # runs share)
    stand_in_job(monkeypatch, tmp_path, [*recipe, muon], train)
    pg.main(["job", "sweep", "ours:muon", "--lanes", "5", "--then-seed", *(["--seed-early"] if early else [])])
    pairs = [n for e, n in events if e == "start" and not n.endswith("-seed0")]
    sweep_ends = [i for i, (e, n) in enumerate(events) if e == "end" and "-muon-" in n and n.endswith("-seed0")]
    first_pair = min(i for i, (e, n) in enumerate(events) if e == "start" and not n.endswith("-seed0"))
    assert len(sweep_ends) == 3
    if early:
        assert sorted(pairs) == [f"ours-recipe-eagle3.1-n16384-180s-lr0.002-seed{k}" for k in (1, 2)]
        assert first_pair < sweep_ends[0]  # (beside the sweep, not after it)
    else:
        assert sorted(pairs) == [f"ours-muon-eagle3.1-n16384-180s-lr0.04-seed{k}" for k in (1, 2)]
        assert first_pair > sweep_ends[-1]


def test_plan_names_the_head_seed_early_would_pair(monkeypatch, capsys):
    """``plan``: with --seed-early the pair is the best of the heads swept whole (the recipe, 2.6), not
    a head ahead of it whose sweep still lacks runs (muon, 2.8 at 0.04 alone)."""
    recipe = swept_before("ours", "recipe", 0.3, 2.0)
    recipe[2].tau_heldout = 2.6  # (lr 2e-3)
    muon = run("ours", "muon", 180.0, 0.04, 0, 600, steps=600, tau_heldout=2.8)
    monkeypatch.setattr(pg, "load", lambda path: ([*recipe, muon], None))
    for flags, now in (([], "muon lr 0.04"), (["--seed-early"], "recipe lr 0.002")):
        capsys.readouterr()
        pg.main(["plan", "sweep", "ours", "--then-seed", *flags, "--device", "h100"])
        assert f"(now {now}) at 180 s, seeds 1 and 2" in capsys.readouterr().out
    for words in (["sweep", "ours", "--seed-early"], ["final", "ours", "--then-seed", "--seed-early"]):
        with pytest.raises(SystemExit):  # (without a pair to start early, the flag is refused, not ignored)
            pg.main(["plan", *words, "--device", "h100"])
        assert "--seed-early: it starts --then-seed's pair early" in capsys.readouterr().err


def test_no_run_starts_that_would_end_past_the_end_deadline():
    """--end-by-s: a run expected to take longer than what is left waits out; a short one still goes."""
    started = []
    lanes = pg.Lanes(2, 64 * 1024, lambda spec: 1024, end=time.time() + 100.0,
                     expected=lambda x: 500.0 if x.framework == "long" else 10.0)  # fmt: skip
    lanes.run([("g", lambda: [spec("long"), spec("short")])], lambda x, lane: started.append(x.framework))
    assert started == ["short"]


def test_a_runs_expected_time_is_its_loop_shared_its_probes_overheads_and_its_evaluations():
    s = object.__new__(pg.Session)
    s.a = argparse.Namespace(slowdown=None)
    s.known = [probe("modelopt", "default", steps=300, steady_step_s=0.06, compile_s=381.0)]  # start-up 60 s
    shape = {"device": "h100", "planned_step_s": 0.06, "lanes": 5}
    sweep = pr.RunSpec("modelopt", "default", "sweep", 180.0, 1e-4, 42, 3000, 16384, **shape)
    final = pr.RunSpec("modelopt", "default", "final", 600.0, 1e-4, 42, 10000, 16384, **shape)
    loop, scored = 3000 * 0.06 * pg.SHARED_SLOWDOWN, 2 * pg.EVAL_S + pg.SERVE_S  # (a sweep's draft scored as a final's)
    assert s.expected(sweep) == pytest.approx(loop + 60.0 + 381.0 + scored)
    assert s.expected(final) == pytest.approx(10000 * 0.06 * pg.SHARED_SLOWDOWN + 441.0 + scored)
    unknown = pr.RunSpec("ours", "recipe", "sweep", 180.0, 1e-3, 0, 360, 16384, **{**shape, "planned_step_s": 0.5})
    assert s.expected(unknown) == pytest.approx(360 * 0.5 * pg.SHARED_SLOWDOWN + 120.0 + scored)  # no probe: 60 + 60
    s.known += [run("modelopt", "default", lanes=5, steady_step_s=0.078), run("modelopt", "default", lanes=5,
                steady_step_s=0.066), run("modelopt", "default", lanes=1, steady_step_s=0.2),
                run("modelopt", "matched", lanes=5, steady_step_s=0.3)]  # (alone; another head)  # fmt: skip
    assert s.expected(sweep) == pytest.approx(3000 * 0.06 * 1.3 + 441.0 + scored)  # its slowest shared run: 1.3x
    sweep.lanes = 1
    assert s.expected(sweep) == pytest.approx(3000 * 0.06 + 441.0 + scored)  # one lane: the GPU to itself


def test_a_new_job_refuses_while_one_runs_and_folds_an_ended_ones_runs_into_the_results_it_reads(tmp_path, monkeypatch):
    po = tmp_path / "po"
    spec = _session(po)
    monkeypatch.setattr(pg, "PO", po)
    out = tmp_path / "peers_h100.json"
    (po / "rc").unlink(missing_ok=True)
    (po / "log").write_text("peers_gpu: started\n")  # (start writes it before the job writes anything)
    with pytest.raises(SystemExit, match="still running"):
        pg.fold_earlier_job(out)
    assert not out.exists()
    (po / "rc").write_text("0\n")
    pg.fold_earlier_job(out)
    runs, sessions = pr.load(out)
    assert [r.name for r in runs] == [spec.name] and [s["id"] for s in sessions] == ["h100-x"]
    pg.fold_earlier_job(out)  # the same job folded again: still one run, one session
    assert len(pr.load(out)[0]) == 1 and len(pr.load(out)[1]) == 1


def test_what_start_leaves_running_holds_none_of_its_streams(tmp_path):
    """``start ... 2>&1 | tail`` on the GPU hung until the call's limit: the memory trace it left
    running held the pipe. A detached command writes to its file, and the caller's pipe ends."""
    script = (f"import sys; sys.path[:0] = [{str(LAB)!r}, {str(LAB.parent)!r}]; from pathlib import Path; "
              "import peers_gpu as pg; "
              f"p = pg.detach(['bash', '-c', 'echo to-err >&2; echo to-out; exec sleep 60'], Path({str(tmp_path / 'log')!r})); "
              f"Path({str(tmp_path / 'pid')!r}).write_text(str(p.pid)); print('back')")  # fmt: skip
    t0 = time.time()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    try:
        assert done.stdout.strip() == "back" and done.stderr == "" and time.time() - t0 < 40
        for _ in range(100):
            if "to-out" in (tmp_path / "log").read_text():
                break
            time.sleep(0.05)
        assert (tmp_path / "log").read_text().split() == ["to-err", "to-out"]
    finally:
        os.kill(int((tmp_path / "pid").read_text()), 9)


def test_only_a_probe_as_long_as_the_probe_now_sizes_runs_and_a_run_alone_reports_its_own_loop(tmp_path):
    """ours' 60-step probe read 0.51 s a step, its 353-step run alone 0.315 s: the short probe sizes
    nothing (probe again, 200 steps), and the run, a sized one, sizes nothing either (it would re-size
    its own sweep), but its budget column is the loop it had. A run in one lane with another's phase
    beside it, or in a session that prepared data beside the lanes, is not alone."""
    short = probe(steps=60, steady_step_s=0.51)
    assert pr.step_time([short], "ours", "recipe", "h100", min_steps=200) is None
    spec = pr.RunSpec("ours", "recipe", "sweep", 180.0, 1e-3, 0, 353, 16384, device="h100", planned_step_s=0.51)
    d = tmp_path / spec.name
    (d / "run/train").mkdir(parents=True)
    (d / "spec.json").write_text(json.dumps(pr.asdict(spec)))
    rows = [{"step": 10 * i, "loop_s": 40.0 + 3.15 * i} for i in range(1, 36)] + [{"step": 353, "loop_s": 151.2}]
    (d / "run/train/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = {"run": spec.name, "phase": "train", "seconds": 220.0, "start": 100.0, "end": 320.0, "rc": 0}
    alone = pr.read_run(d, [train], [])
    assert alone.alone and pr.step_time([short, alone], "ours", "recipe", "h100", min_steps=200) is None
    assert alone.budget_loop_s == pytest.approx(353 * 0.315, abs=0.1)  # what it had, not 353 x 0.51
    beside = {"run": "speculators_data", "phase": "states", "seconds": 100.0, "start": 300.0, "end": 400.0, "rc": 0}
    company = pr.read_run(d, [train, beside], [])
    assert company.alone is False and company.budget_loop_s == pytest.approx(353 * 0.51, abs=0.1)
    before = {
        "run": "ours_data",
        "phase": "prepare",
        "seconds": 40.0,
        "start": 50.0,
        "end": 90.0,
        "rc": 0,
        "shared": True,
    }
    hold = {"run": "lanes_hold", "phase": "speculators_data", "seconds": 200.0, "start": 310.0, "end": 510.0, "rc": 0,
            "shared": True}  # (an engine beside the lanes, started before its first phase)  # fmt: skip
    assert pr.read_run(d, [before, train], []).alone and pr.read_run(d, [train, hold], []).alone is False
    assert pr.step_time([short, company], "ours", "recipe", "h100") == (0.51, None)


def test_a_speculators_probe_capped_at_its_one_epoch_still_sizes_its_runs():
    capped = probe("speculators", "default", 3e-4, 42, steady_step_s=0.06, steps=150, steps_per_epoch=150)
    assert pr.step_time([capped], "speculators", "default", "h100", min_steps=200) == (0.06, 150)
    short = probe("speculators", "default", 3e-4, 42, steady_step_s=0.06, steps=150, steps_per_epoch=300)
    assert pr.step_time([short], "speculators", "default", "h100", min_steps=200) is None


def test_a_final_waits_for_every_run_of_a_group_named_twice():
    """Two groups of one name (ours and ours:recipe): the final is released after both groups' runs."""
    events, lock = [], threading.Lock()
    lanes = pg.Lanes(2, 64 * 1024, lambda x: 1024)

    def work(x, lane):
        with lock:
            events.append(("start", x.framework))
        time.sleep(0.05 if x.framework == "slow" else 0.01)
        with lock:
            events.append(("end", x.framework))

    def final():
        lanes.over(["g"])
        return [spec("final")]

    lanes.run([("g", lambda: [spec("fast")]), ("g", lambda: [spec("slow")]), ("f", final)], work)
    assert events.index(("start", "final")) > events.index(("end", "slow")) and lanes.left == {"g": 0, "f": 0}


def test_a_run_sized_from_an_earlier_step_time_is_not_done_and_runs_again():
    old = run(lr=1e-3, planned=353, steps=353, tau_heldout=2.2, planned_step_s=0.51)
    now = pr.RunSpec("ours", "recipe", "sweep", 180.0, 1e-3, 0, 571, 16384, device="h100",
                     head_shape={"variant": "eagle3.1"})  # fmt: skip
    assert now.name == old.name and not pg.done([old], now)
    now.steps_planned = 353
    assert pg.done([old], now)
    # within 5 % of the steps it is sized to now (ours' sweep before and after the attention switch: 750, 720)
    old.steps_planned, now.steps_planned = 750, 720
    assert pg.done([old], now)
    now.steps_planned = 714  # (750 is 36 over: more than 5 % of 714)
    assert not pg.done([old], now)


def test_modelopts_tokens_per_second_are_its_samples_mean_tokens_over_its_steady_step(tmp_path, monkeypatch):
    """One sample a step, padded to 512: its tokens are the rendered conversation's, cut at 512 (a row
    holding U+2028 stays one row)."""

    class Tok:
        def apply_chat_template(self, messages, tokenize):
            assert tokenize is False
            return " ".join(m["content"] for m in messages)

        def __call__(self, texts, add_special_tokens):
            return {"input_ids": [t.split(" ") for t in texts]}

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda path: Tok())
    convs = tmp_path / "c.jsonl"
    rows = [[{"role": "user", "content": "a b\u2028c"}, {"role": "assistant", "content": "d"}],
            [{"role": "user", "content": " ".join(["w"] * 600)}]]  # fmt: skip
    convs.write_text("".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in rows))
    assert pg.sample_tokens(convs, tmp_path, 512) == (3 + 512) / 2
    po = tmp_path / "po"
    spec = pr.RunSpec("modelopt", "default", "probe", None, 1e-4, 42, 300, 16384, device="h100")
    (po / spec.name).mkdir(parents=True)
    (po / spec.name / "spec.json").write_text(json.dumps(pr.asdict(spec)))
    bar = "".join(f"{s}/300 [00:{s // 10:02d}<00:10, 9.0it/s]\n" for s in range(10, 301, 10))  # (1 s / 10 steps)
    (po / spec.name / "train.log").write_text(bar + "{'train_runtime': '31.0'}\n")
    assert pr.read_run(po / spec.name, [], []).tokens_per_s is None  # (no mean: not reported)
    (po / "modelopt_data").mkdir()
    (po / "modelopt_data" / pr.STEP_TOKENS).write_text(json.dumps({"tokens_per_step": 164.5}))
    r = pr.read_run(po / spec.name, [], [])
    assert r.tokens_per_s == pytest.approx(164.5 / r.steady_step_s, rel=1e-3)


def test_a_final_job_takes_the_best_of_the_whole_sweep_as_sized_now_and_none_from_a_stale_one(tmp_path, monkeypatch):
    """ours' lr 4e-3 run was sized from an earlier step time (353 steps, tau 2.5): it is not part of
    the sweep as sized now (600 steps), so no final; once it runs again at 600 steps (tau 1.7), the
    final takes lr 2e-3 (tau 2.1), two seeds, 600 s."""
    trained = []

    def train(self, spec, lane=0):
        trained.append(spec.name)

    sweep = [run(lr=lr, planned=600, steps=600, tau_heldout=tau) for lr, tau in ((1e-3, 1.9), (2e-3, 2.1))]
    stale = run(lr=4e-3, planned=353, steps=353, tau_heldout=2.5)
    stand_in_job(monkeypatch, tmp_path, [probe(steps=300, steady_step_s=0.3), *sweep, stale], train)
    pg.main(["job", "final", "ours:recipe"])
    assert trained == []
    stand_in_session(monkeypatch, tmp_path, None, [probe(steps=300, steady_step_s=0.3), *sweep,
                     run(lr=4e-3, planned=600, steps=600, tau_heldout=1.7)])  # fmt: skip
    monkeypatch.setattr(pg.Session, "train", train)
    pg.main(["job", "final", "ours:recipe"])
    assert sorted(trained) == [  # (the two seeds share the GPU: either may start first)
        "ours-recipe-eagle3.1-n16384-600s-lr0.002-seed0",
        "ours-recipe-eagle3.1-n16384-600s-lr0.002-seed1",
    ]


def test_a_shared_run_faster_than_the_step_alone_does_not_shrink_the_expected_time():
    s = object.__new__(pg.Session)
    s.known = [probe(steps=300, steady_step_s=0.3), run(lanes=4, steady_step_s=0.25)]
    s.a = argparse.Namespace(slowdown=None)
    x = pr.RunSpec("ours", "recipe", "sweep", 180.0, 1e-3, 0, 600, 16384, device="h100", planned_step_s=0.3, lanes=4)
    assert s.expected(x) == pytest.approx(600 * 0.3 + 120.0 + 2 * pg.EVAL_S + pg.SERVE_S)  # (slowdown 1, not 0.83)
    s.a.slowdown = 1.3  # (the operator's, e.g. two seeds of one framework)
    assert s.expected(x) == pytest.approx(600 * 0.3 * 1.3 + 120.0 + 2 * pg.EVAL_S + pg.SERVE_S)


def test_a_slowdown_at_a_jobs_lanes_is_the_slowest_met_in_no_more_and_at_least_the_line_to_more():
    assert pg.at_lanes([], 4) is None
    assert pg.at_lanes([(2, 1.27), (5, 2.04), (6, 1.9)], 4) == pytest.approx(1.27 + 0.77 * 2 / 3)
    assert pg.at_lanes([(2, 1.27), (5, 2.04), (6, 1.9)], 2) == pytest.approx(1.27)
    assert pg.at_lanes([(2, 1.27), (5, 2.04), (6, 1.9)], 6) == pytest.approx(2.04)  # (the slowest in no more)
    assert pg.at_lanes([(2, 1.5), (4, 1.2)], 3) == pytest.approx(1.5)  # (never below what fewer lanes met)
    assert pg.at_lanes([(5, 2.0), (6, 3.1)], 2) == pytest.approx(3.1)  # (none in so few: the slowest met)


def test_the_expected_slowdown_is_the_slowest_met_in_no_more_lanes_than_the_jobs():
    s = object.__new__(pg.Session)
    s.a = argparse.Namespace(slowdown=None)
    s.known = [probe(steps=300, steady_step_s=0.3), run(lanes=2, steady_step_s=0.39), run(lanes=5, steady_step_s=0.6)]

    def x(lanes: int) -> pr.RunSpec:
        return pr.RunSpec("ours", "recipe", "final", 600.0, 1e-3, 0, 2000, 16384, device="h100", planned_step_s=0.3,
                          lanes=lanes)  # fmt: skip

    rest = 120.0 + 2 * pg.EVAL_S + pg.SERVE_S
    assert s.expected(x(2)) == pytest.approx(2000 * 0.3 * 1.3 + rest)  # (two lanes: 1.3x, not five lanes' 2x)
    assert s.expected(x(3)) == pytest.approx(2000 * 0.3 * (1.3 + 0.7 / 3) + rest)  # (at least the line to five's)
    assert s.expected(x(5)) == pytest.approx(2000 * 0.3 * 2.0 + rest)
    assert s.expected(x(6)) == pytest.approx(2000 * 0.3 * 2.0 + rest)  # (none met in more: five lanes')
    s.known = s.known[:1] + s.known[2:]  # (met only in more lanes than the job's: that, not a guess)
    assert s.expected(x(2)) == pytest.approx(2000 * 0.3 * 2.0 + rest)
    assert s.expected(x(1)) == pytest.approx(2000 * 0.3 + rest)  # (one lane: the GPU to itself)
    # (the framework's other head met two lanes: its slowdown, against its own step alone, before five lanes')
    s.known.append(run("ours", "muon", lanes=2, steady_step_s=0.5, planned_step_s=0.4))
    assert s.expected(x(2)) == pytest.approx(2000 * 0.3 * 1.25 + rest)
    s.known.append(run("speculators", "default", lanes=2, steady_step_s=0.5, planned_step_s=0.1))  # (another framework)
    assert s.expected(x(2)) == pytest.approx(2000 * 0.3 * 1.25 + rest)


def test_start_up_and_compile_beside_the_lanes_slow_as_the_frameworks_runs_met_in_no_more_lanes():
    """Session 46: speculators' matched head started in 180 s and compiled in 230 s beside five lanes,
    against 66 s and 67 s alone. A run's overheads are its probe's times the slowest such ratio its
    framework met (either head, each against its own probe) in no more lanes than the job's, among
    compiles of its kind: a cached compile's ratio does not stand for one from nothing."""
    s = object.__new__(pg.Session)
    s.a = argparse.Namespace(slowdown=None)
    s.known = [probe("speculators", "default", steps=200, steady_step_s=0.06, compile_s=100.0),  # alone: 60 + 100
               probe("speculators", "matched", steps=200, steady_step_s=0.08, compile_s=60.0),  # alone: 60 + 60
               run("speculators", "default", lanes=2, startup_s=72.0, compile_s=120.0),  # 192 / 160 = 1.2
               run("speculators", "matched", lanes=6, startup_s=180.0, compile_s=180.0),  # 360 / 120 = 3.0
               run("ours", "recipe", lanes=2, startup_s=600.0, compile_s=600.0)]  # (another framework)  # fmt: skip

    def x(lanes: int, head: str = "default") -> pr.RunSpec:
        return pr.RunSpec("speculators", head, "sweep", 180.0, 9e-3, 42, 3000, 16384, device="h100",
                          planned_step_s=0.06, lanes=lanes)  # fmt: skip

    scored, loop = 2 * pg.EVAL_S + pg.SERVE_S, 3000 * 0.06 * pg.SHARED_SLOWDOWN  # (no shared step measured)
    assert s.expected(x(2)) == pytest.approx(loop + 160.0 * 1.2 + scored)  # (two lanes: not six lanes' 3x)
    assert s.expected(x(6)) == pytest.approx(loop + 160.0 * 3.0 + scored)  # (the matched's ratio, default's probe)
    assert s.expected(x(6, "matched")) == pytest.approx(3000 * 0.06 * pg.SHARED_SLOWDOWN + 120.0 * 3.0 + scored)
    assert s.expected(x(1)) == pytest.approx(3000 * 0.06 + 160.0 + scored)  # (one lane: the host to itself)
    s.known[2:4] = [run("speculators", "default", lanes=6, startup_s=240.0, compile_s=10.0)]  # (its graphs cached)
    assert s.expected(x(6)) == pytest.approx(loop + 160.0 + scored)  # (a cached compile's ratio: not for a cold one)


def test_a_drafts_scoring_is_counted_as_long_as_its_frameworks_took_beside_no_more_lanes(tmp_path):
    """A run scored the three ways keeps the seconds from its training's end to its last phase (the
    waits between them included: session 46's ModelOpt finals waited 150 s for vLLM); a job counts
    the longest its framework took beside no more lanes than its own (else beside any), and the
    constants only where none was measured."""
    d = tmp_path / "speculators-matched-x"
    d.mkdir()
    (d / "spec.json").write_text(json.dumps(pr.asdict(run("speculators", "matched", planned=20))))
    mine = [
        ("train", 0.0, 750.0),
        ("eval_heldout", 750.0, 805.0),
        ("eval_mtbench", 805.0, 880.0),
        ("served", 950.0, 986.0),
    ]
    phases = [{"run": d.name, "phase": n, "seconds": b - a, "start": a, "end": b, "rc": 0} for n, a, b in mine]
    assert pr.read_run(d, phases, []).scored_s == pytest.approx(236.0)
    assert pr.read_run(d, phases[:3], []).scored_s is None  # (not served: not scored the three ways)
    s = object.__new__(pg.Session)
    s.a = argparse.Namespace(slowdown=None)
    s.known = [probe("speculators", "matched", steps=200, steady_step_s=0.08, compile_s=60.0),
               run("speculators", "default", lanes=6, scored_s=236.0), run("speculators", "matched", lanes=2, scored_s=150.0),
               run("ours", "recipe", lanes=2, scored_s=900.0)]  # (another framework's)  # fmt: skip

    def x(lanes: int, fw: str = "speculators") -> pr.RunSpec:
        return pr.RunSpec(fw, "matched" if fw == "speculators" else "muon", "final", 600.0, 3e-3, 42, 1000, 16384,
                          device="h100", planned_step_s=0.08, lanes=lanes)  # fmt: skip

    loop = 1000 * 0.08 * pg.SHARED_SLOWDOWN
    assert s.expected(x(2)) == pytest.approx(loop + 120.0 + 150.0)  # (two lanes: its two-lane draft's 150 s)
    assert s.expected(x(6)) == pytest.approx(loop + 120.0 + 236.0)  # (the longest beside six)
    assert s.expected(x(1)) == pytest.approx(1000 * 0.08 + 120.0 + 236.0)  # (none alone: the longest of any)
    assert pg.scoring_s(s.known, x(2, "modelopt")) == 2 * pg.EVAL_S + pg.SERVE_S  # (none measured)


def test_a_preparation_beside_the_lanes_leaves_its_hold_as_a_phase(tmp_path, monkeypatch):
    monkeypatch.setattr(pg, "PO", tmp_path)
    monkeypatch.setattr(pg, "gpu_memory_mib", lambda: 80000)
    s = object.__new__(pg.Session)
    s.lanes = None
    with s.beside_lanes("speculators"):  # (before the lanes: alone, no hold)
        pass
    assert pg.phases() == []
    s.lanes = pg.Lanes(2, 64 * 1024, lambda x: 1024)
    with s.beside_lanes("speculators"):
        assert s.lanes.running == {"speculators_data": pytest.approx(0.30 * 80000)}
    (hold,) = pg.phases()
    assert (hold["run"], hold["phase"], hold["shared"]) == (
        "lanes_hold",
        "speculators_data",
        True,
    ) and not s.lanes.running
    kept = pr.read_session(tmp_path)[1]["phases"]  # (kept for a rehearsal's wait: data_ready_s)
    assert kept == [hold] and pr.data_seconds(kept, "speculators", "default") is None  # (not its data seconds)


def test_a_head_a_framework_has_not_is_refused_by_name():
    a = argparse.Namespace(what="sweep", frameworks=["speculators:bogus"], lrs=None, seeds=None)
    with pytest.raises(SystemExit, match="'speculators:bogus': the heads of speculators are default, matched"):
        pg.runs_wanted(a, [])
    with pytest.raises(SystemExit, match="'bogus' is not one of"):
        pg.runs_wanted(argparse.Namespace(what="sweep", frameworks=["bogus"], lrs=None, seeds=None), [])


def test_plan_tells_each_runs_expected_seconds_and_lane_as_the_job_would_judge_them(monkeypatch, capsys):
    """ours' final: 2,000 steps at 0.3 s, slowed 1.5x as its shared run was, its probe's start-up 60 s
    and compile 40 s, evaluation and serving; its lane the larger of its probe's peak and vLLM's share
    of an H100. A framework with no probe is told to probe first."""
    known = [
        probe(steps=300, steady_step_s=0.3, compile_s=40.0, peak_gpu_mib=30000, peak_from="run"),
        run(lr=2e-3, planned=600, steps=600, lanes=3, steady_step_s=0.45, tau_heldout=2.0),
    ]
    monkeypatch.setattr(pg, "load", lambda path: (known, None))
    pg.main(["plan", "final", "ours", "modelopt:default", "--lrs", "2e-3", "--device", "h100"])
    ours, modelopt, lanes = capsys.readouterr().out.splitlines()
    loop = 2000 * 0.3 * 1.5
    assert f"2000 steps each, about {loop + 100 + 2 * pg.EVAL_S + pg.SERVE_S:.0f} s from its start" in ours
    assert f"(loop {loop:.0f} s at 1.50x alone, start-up and compile 100 s at 1.00x, scoring 360 s)" in ours
    assert f"its lane {30000 / 1024:.1f} GiB" in ours
    assert modelopt.startswith("modelopt:default 600 s") and "a 300-step probe first" in modelopt
    assert lanes.startswith("sized runs 5 at a time on the GPU within 64 GiB")
    pg.main(["plan", "sweep", "ours", "--lrs", "2e-3", "4e-3", "--device", "h100", "--slowdown", "2"])
    recipe = capsys.readouterr().out.splitlines()[0]
    assert f"about {600 * 0.3 * 2 + 100 + 2 * pg.EVAL_S + pg.SERVE_S:.0f} s" in recipe  # (the operator's slowdown)
    # lr 2e-3 is held (evaluated at the steps it is sized to now): only 4e-3 is left to run
    assert "lrs [0.004]" in recipe and recipe.endswith("(held in the results: lr 0.002 seed 0)")
    pg.main(["plan", "sweep", "ours:recipe", "--lrs", "2e-3", "--device", "h100"])
    assert capsys.readouterr().out.startswith("ours:recipe 180 s, lrs [0.002], seeds [0]: all held in the results")
    known.append(probe("specforge", "default", steps=200, steady_step_s=0.0607))  # (180 s: 2,965 steps)
    pg.main(["plan", "sweep", "specforge:default", "--device", "h100"])
    assert "2960 steps each" in capsys.readouterr().out  # (as the job sizes it: whole windows of its step log)
    # on an H200 sized by the H100's probes (--size-on): the same steps, and what the H100 ran is held
    read: list = []
    monkeypatch.setattr(pg, "load", lambda path: (read.append(path.name), (known, None))[1])
    pg.main(["plan", "sweep", "ours:recipe", "--lrs", "2e-3", "4e-3", "--device", "h200", "--size-on", "h100"])
    recipe = capsys.readouterr().out.splitlines()[0]
    assert read == ["peers_h100.json"] and "600 steps each" in recipe and "(held in the results: lr 0.002" in recipe


def test_each_session_measures_its_machine_alone_and_the_results_show_it_beside_its_probes(tmp_path):
    """The yardstick's script runs (here on the CPU, small) and gives its three figures; a broken run
    gives none; the results' session table lists each session's figures and the probes it measured."""
    stick = pg.yardstick(64)
    assert set(stick) == set(pr.YARDSTICK_KEYS) and all(v > 0 for v in stick.values())
    assert pg.yardstick("not a size") is None  # type: ignore[arg-type]
    sessions = [
        {"id": "h100-20261206T1337", "device": "h100", "yardstick": stick},
        {"id": "h100-20261206T1018", "device": "h100"},  # (before the yardstick)
    ]
    runs = [
        probe(session="h100-20261206T1337", steps=300, steady_step_s=0.24),
        probe("modelopt", "default", session="h100-20261206T1018", steps=300, steady_step_s=0.06),
        probe("modelopt", "matched", session="h100-20261206T1018", steps=300, steady_step_s=0.09),
        run(session="h100-20261206T1337", steps=100),
    ]
    (table,) = [t for t in pr.results(runs, sessions)["tables"] if t["title"].startswith("Sessions")]
    assert table["rows"] == [
        ["h100-20261206T1018", "h100", "—", "—", "—", "modelopt:default, modelopt:matched"],
        ["h100-20261206T1337", "h100", *[stick[k] for k in pr.YARDSTICK_KEYS], "ours:recipe"],
    ]


def test_a_job_keeps_its_machines_yardstick_in_its_session(tmp_path, monkeypatch):
    """The yardstick runs before anything else of the job and its figures go into session.json (what
    the results' session table reads); a job whose yardstick failed keeps its session without one."""
    order = []
    stand_in_session(monkeypatch, tmp_path, None, [probe(steps=300, steady_step_s=0.3)])
    monkeypatch.setattr(pg, "yardstick", lambda: order.append("yardstick") or {"matmul_tflops": 600.0})
    monkeypatch.setattr(pg.Session, "train", lambda self, spec, lane=0: order.append(spec.name))
    monkeypatch.setattr(pg.Session, "prepare", lambda self, fw, head: True)
    monkeypatch.setattr(sys, "argv", ["peers_gpu.py", "job"])
    pg.main(["job", "sweep", "ours:recipe", "--lrs", "1e-3"])
    assert order[0] == "yardstick" and len(order) == 2
    session = json.loads((tmp_path / "session.json").read_text())
    assert session["yardstick"] == {"matmul_tflops": 600.0} and session["device"] == "h100"
    monkeypatch.setattr(pg, "yardstick", lambda: None)
    pg.main(["job", "sweep", "ours:recipe", "--lrs", "1e-3"])
    assert "yardstick" not in json.loads((tmp_path / "session.json").read_text())


def test_ours_is_swept_as_shipped_and_with_muon_each_a_command_eagle3_run_accepts(tmp_path):
    """``ours`` is two configurations like each peer: the recipe (AdamW, its lrs) and the recipe with
    Muon (its lrs are optim.muon_lr; optim.lr stays the recipe's). Each command composes and checks
    through eagle3-run's dry run, and the train stage it prints runs the optimizer asked."""
    a = argparse.Namespace(what="sweep", frameworks=["ours"], lrs=None, seeds=None)
    assert [(w[1], w[3]) for w in pg.runs_wanted(a, [])] == [
        ("recipe", [1e-3, 2e-3, 4e-3]),
        ("muon", [2e-2, 4e-2, 8e-2]),
    ]
    printed = {}
    for head, lr in (("recipe", 2e-3), ("muon", 2e-2)):
        spec = pr.RunSpec("ours", head, "sweep", 180.0, lr, 0, 750, 16384, head_shape=pg.ours_head())
        cmd = pg.ours_cmd(spec, tmp_path / head, tmp_path / "c.jsonl")
        done = subprocess.run([*cmd, "dry_run=true"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(LAB.parent)}, cwd=LAB.parent)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        printed[head] = next(line for line in done.stdout.splitlines() if "eagle3_train.train" in line
                             or "eagle3-train" in line)  # fmt: skip
    assert "optim.optimizer=muon" in printed["muon"] and "optim.muon_lr=0.02" in printed["muon"]
    assert "optim.lr=0.002" in printed["recipe"] and "muon" not in printed["recipe"]


def test_a_poll_tells_each_of_the_jobs_lines_once_and_the_logs_end_beside_them(tmp_path, monkeypatch, capsys):
    po = tmp_path / "po"
    po.mkdir()
    said = [f"peers_gpu: run {i}: not started" for i in range(20)]
    (po / "log").write_text("\n".join(["noise", *said, "Traceback (most recent call last):", "ValueError: x"]) + "\n")
    (po / "rc").write_text("1\n")
    monkeypatch.setattr(pg, "PO", po)
    monkeypatch.setattr(pg, "packed", lambda dest: None)
    monkeypatch.setattr(pg, "compile_cache_out", lambda dest: None)
    pg.poll(0, tmp_path / "out")
    out = capsys.readouterr().out.splitlines()
    assert out[:15] == said[-15:] and out[15:17] == ["Traceback (most recent call last):", "ValueError: x"]
    assert out[-1] == "ended: rc=1"
    (po / "log").write_text("\n".join(said) + "\n")  # the job's own lines at the end: each once
    pg.poll(0, tmp_path / "out")
    out = capsys.readouterr().out.splitlines()
    assert out[:15] == said[-15:] and out[15].startswith("disk:")


def test_a_shared_set_synthesized_again_is_named_where_it_is_not_the_one_earlier_runs_trained_on():
    """A machine's synthesis may not repeat bytes for bytes: where the set here is not the one runs in
    the results trained on, the job says how many and which, and the verdict's last column flags a
    comparison across sets."""
    known = [run(tau_heldout=2.0, data_sha256="a" * 64), run(lr=2e-3, data_sha256="a" * 64), run(lr=4e-3)]
    assert pg.other_sets(known, "a" * 64) is None  # the same set (a run that does not say is left out)
    msg = pg.other_sets(known, "b" * 64)
    assert msg is not None and "bbbbbbbbbbbb" in msg and "not the one 2 runs" in msg and "aaaaaaaaaaaa" in msg
    assert pg.other_sets([], "b" * 64) is None


def test_a_superseded_head_leaves_the_results_with_its_reason_and_an_old_session_merged_again_does_not_bring_it_back(
    tmp_path,
):
    """ours' step changed: its recipe head's probe and sweep leave the file (into <file>_superseded.json,
    with the reason), so the harness probes and sweeps it again; ours' other head and the peers stay,
    and so do the sessions. Merging an old session's runs again keeps the taken-out ones out; a new
    session's run of the same name comes in."""
    out = tmp_path / "peers_h100.json"
    old = [run(lr=2e-3, session="s1", tau_heldout=2.6, steps=100), probe(session="s1", steady_step_s=0.24),
           run("ours", "muon", lr=0.08, session="s1", tau_heldout=1.6),
           run("speculators", "matched", lr=3e-3, seed=42, session="s2", tau_heldout=2.7)]  # fmt: skip
    out.write_text(json.dumps(pr.results(old, [{"id": "s1"}, {"id": "s2"}])))
    assert pr.main(["supersede", str(out), "ours:recipe", "--reason", "runtime.cudnn_attention off"]) is None
    runs, sessions = pr.load(out)
    assert [(r.framework, r.head) for r in runs] == [("ours", "muon"), ("speculators", "matched")]
    assert [s["id"] for s in sessions] == ["s1", "s2"]
    gone = json.loads(pr.superseded_path(out).read_text())["frameworks"]
    assert sorted(r["kind"] for r in gone) == ["probe", "sweep"]
    assert {r["superseded"] for r in gone} == {"runtime.cudnn_attention off"}
    assert pr.step_time(runs, "ours", "recipe", "h100") is None  # so the harness probes it again
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(pr.results(old[:1], [{"id": "s1"}])))
    pr.merge_into(partial, out)  # the old session's folder merged again
    assert [(r.framework, r.head) for r in pr.load(out)[0]] == [("ours", "muon"), ("speculators", "matched")]
    partial.write_text(json.dumps(pr.results([run(lr=2e-3, session="s3", tau_heldout=2.8, steps=100)], [{"id": "s3"}])))
    pr.merge_into(partial, out)
    assert ("ours", "recipe", "s3") in {(r.framework, r.head, r.session) for r in pr.load(out)[0]}
    with pytest.raises(SystemExit, match="no run of ours:recipe"):
        pr.supersede(tmp_path / "empty.json", "ours", "recipe", "x")


def test_reinstated_runs_come_back_from_the_superseded_file_with_the_reason_and_a_newer_run_stands(tmp_path):
    """A change turned out not to change what some superseded runs measure (a rerun of one of them
    after it, equal): those named come back into the results, each with why and the superseding reason,
    and leave the superseded file; a name the results hold again (measured since) is refused, and so is
    a run the superseded file does not hold."""
    out = tmp_path / "peers_h100.json"
    old = [run(lr=1e-3, session="s1", tau_heldout=2.6, steps=100), run(lr=2e-3, session="s1", tau_heldout=2.62, steps=100),
           run(lr=4e-3, session="s2", tau_heldout=2.16, steps=100), probe(session="s1", steady_step_s=0.24)]  # fmt: skip
    out.write_text(json.dumps(pr.results(old, [{"id": "s1"}, {"id": "s2"}])))
    pr.supersede(out, "ours", "recipe", "attention switched")
    partial = tmp_path / "partial.json"  # the change's own rerun of lr 2e-3
    partial.write_text(json.dumps(pr.results([run(lr=2e-3, session="s3", tau_heldout=2.62, steps=96)], [{"id": "s3"}])))
    pr.merge_into(partial, out)
    lr1, lr2, lr4 = (r.name for r in old[:3])
    with pytest.raises(SystemExit, match="already holds .*session s3"):
        pr.reinstate(out, [f"{lr2}@s1"], "x")
    with pytest.raises(SystemExit, match="holds no run nope@s1"):
        pr.reinstate(out, ["nope@s1"], "x")
    assert pr.main(["reinstate", str(out), f"{lr1}@s1", f"{lr4}@s2", "--reason", "the rerun at 2e-3 equal"]) is None
    runs, _ = pr.load(out)
    got = {(r.lr, r.session): r for r in runs}
    assert set(got) == {(1e-3, "s1"), (2e-3, "s3"), (4e-3, "s2")} and got[(2e-3, "s3")].reinstated is None
    note = got[(1e-3, "s1")].reinstated
    assert note is not None and note.startswith("the rerun at 2e-3 equal") and "attention switched" in note
    assert got[(4e-3, "s2")].tau_heldout == 2.16 and got[(4e-3, "s2")].steps == 100  # as measured
    left = json.loads(pr.superseded_path(out).read_text())["frameworks"]
    assert sorted((r["lr"], r["kind"]) for r in left) == [(1e-3, "probe"), (2e-3, "sweep")]
    table = json.loads(out.read_text())["tables"][-1]
    assert table["title"].startswith("Runs brought back") and [r[1] for r in table["rows"]] == ["s1", "s2"]
    assert pr.best(runs, "ours", pr.SWEEP_S).lr == 2e-3  # the sweep whole again: its best is chosen
    partial.write_text(json.dumps(pr.results(old[:1], [{"id": "s1"}])))
    pr.merge_into(partial, out)  # the old session merged again: the reinstated run stays, once, with its note
    again = pr.load(out)[0]
    assert sorted((r.lr, r.session) for r in again) == [(1e-3, "s1"), (2e-3, "s3"), (4e-3, "s2")]
    assert [r.reinstated for r in again if r.lr == 1e-3] == [note]


def test_a_sessions_note_is_written_here_and_stays_when_its_folder_is_merged_again(tmp_path):
    """A session's note (what its machine did, what was left) is written into the results file; its
    folder carries none, so merging that folder again keeps the note, and a new note replaces it. A
    session the file does not hold is refused with the ones it does."""
    out = tmp_path / "peers_h100.json"
    out.write_text(json.dumps(pr.results([run(session="s1", tau_heldout=2.6)], [{"id": "s1"}, {"id": "s2"}])))
    assert pr.main(["note", str(out), "s1", "--text", "the machine came late"]) is None
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(pr.results([run(session="s1", tau_heldout=2.6)], [{"id": "s1", "device": "h100"}])))
    pr.merge_into(partial, out)
    sessions = {s["id"]: s for s in pr.load(out)[1]}
    assert sessions["s1"] == {"id": "s1", "device": "h100", "note": "the machine came late"}
    assert "note" not in sessions["s2"]
    pr.note(out, "s1", "replaced")
    assert {s["id"]: s.get("note") for s in pr.load(out)[1]} == {"s1": "replaced", "s2": None}
    with pytest.raises(SystemExit, match="holds no session s9 .*s1, s2"):
        pr.note(out, "s9", "x")
    with pytest.raises(SystemExit):
        pr.main(["note", str(out), "s1"])  # (no --text)


def test_a_sweep_whose_best_lr_is_at_its_edge_goes_on_past_it_for_every_framework():
    """The grid first; once it is scored, a best at its top (ties count) adds the next lr up by the ratio
    at that end, rounded to one digit, and so on while the newest stays best, at most PAST_EDGE a side;
    a best at the bottom goes down; an inside best, a grid not yet scored, another seed's or budget's
    runs add nothing. runs_wanted (what a sweep job and plan run) follows it for each head."""
    grid = (3e-4, 1e-3, 3e-3)

    def scored(*pairs, fw="speculators", head="default", **kw):
        return [run(fw, head, lr=lr, seed=42, tau_heldout=t, **kw) for lr, t in pairs]

    assert pr.sweep_lrs([], "speculators", "default", 42) == [3e-4, 1e-3, 3e-3]
    part = scored((3e-4, 2.4), (3e-3, 2.7))  # (1e-3 not scored yet)
    assert pr.sweep_lrs(part, "speculators", "default", 42) == [3e-4, 1e-3, 3e-3]
    inside = scored((3e-4, 2.4), (1e-3, 2.8), (3e-3, 2.7))
    assert pr.sweep_lrs(inside, "speculators", "default", 42) == [3e-4, 1e-3, 3e-3]
    top = scored((3e-4, 2.4), (1e-3, 2.6), (3e-3, 2.7))
    assert pr.sweep_lrs(top, "speculators", "default", 42) == [3e-4, 1e-3, 3e-3, 9e-3]
    assert pr.sweep_lrs(top, "speculators", "default", 43) == list(grid)  # (another seed's runs)
    assert pr.sweep_lrs(top, "speculators", "matched", 42) == list(grid)  # (another head's)
    finals = [run("speculators", "default", budget=600.0, lr=lr, seed=42, tau_heldout=t) for lr, t in
              [(3e-4, 2.4), (1e-3, 2.6), (3e-3, 2.7)]]  # fmt: skip
    assert pr.sweep_lrs(finals, "speculators", "default", 42) == list(grid)  # (not the sweep's budget)
    tie = scored((3e-4, 2.4), (1e-3, 2.7), (3e-3, 2.7))
    assert pr.sweep_lrs(tie, "speculators", "default", 42)[-1] == 9e-3
    still = top + scored((9e-3, 2.8))
    assert pr.sweep_lrs(still, "speculators", "default", 42) == [3e-4, 1e-3, 3e-3, 9e-3, 3e-2]
    capped = still + scored((3e-2, 2.9))
    assert pr.sweep_lrs(capped, "speculators", "default", 42) == [3e-4, 1e-3, 3e-3, 9e-3, 3e-2]
    fell = top + scored((9e-3, 1.0))
    assert pr.sweep_lrs(fell, "speculators", "default", 42) == [3e-4, 1e-3, 3e-3, 9e-3]
    low = scored((1e-4, 1.6), (3e-4, 1.5), (1e-3, 1.4), fw="modelopt")
    assert pr.sweep_lrs(low, "modelopt", "default", 42) == [3e-5, 1e-4, 3e-4, 1e-3]
    ours = [run(lr=lr, tau_heldout=t) for lr, t in [(1e-3, 2.6), (2e-3, 2.62), (4e-3, 2.7)]]
    assert pr.sweep_lrs(ours, "ours", "recipe", 0)[-1] == 8e-3
    a = argparse.Namespace(what="sweep", frameworks=["speculators", "ours:recipe"], lrs=None, seeds=None)
    assert [(fw, h, lrs) for fw, h, _, lrs, _ in pg.runs_wanted(a, top + ours)] == [
        ("speculators", "default", [3e-4, 1e-3, 3e-3, 9e-3]), ("speculators", "matched", [3e-4, 1e-3, 3e-3]),
        ("ours", "recipe", [1e-3, 2e-3, 4e-3, 8e-3])]  # fmt: skip
    a.lrs = [5e-3]  # (lrs given: those)
    assert {tuple(w[3]) for w in pg.runs_wanted(a, top + ours)} == {(5e-3,)}
    for r, mt in zip(ours, (2.5, 2.55, 2.52)):  # (MT-bench would choose 2e-3; speculators' has none: no choice)
        r.tau_mtbench = mt
    (table,) = [t for t in pr.results(top + ours, [])["tables"] if t["title"].startswith("The sweeps")]
    assert table["rows"] == [["ours:recipe", "0.001: 2.600, 0.002: 2.620, 0.004: 2.700", "0.004", "0.008", "0.002"],
                             ["ours:muon", "—", "—", "0.02, 0.04, 0.08", "—"],  # (no run of it yet: its grid)
                             ["speculators:default", "0.0003: 2.400, 0.001: 2.600, 0.003: 2.700", "0.003", "0.009", "—"],
                             ["speculators:matched", "—", "—", "0.0003, 0.001, 0.003", "—"]]  # fmt: skip
    ours[0].tau_mtbench = None
    (table,) = [t for t in pr.results(top + ours, [])["tables"] if t["title"].startswith("The sweeps")]
    assert table["rows"][0][-1] == "—"  # (an lr without it: no choice)


def test_a_server_waits_for_vllms_stage_and_says_what_to_carry_when_it_never_comes(tmp_path, monkeypatch):
    """A job may start before the calls that carry vLLM's parts: a server waits for stage_vllm.sh's
    marker (written once every part is installed) and starts once it is there; where it never comes,
    nothing is launched and the error names the script to run."""
    monkeypatch.setattr(pg, "VSITE", tmp_path / "vsite")
    assert pg.vllm_staged() is False
    threading.Timer(0.3, lambda: (tmp_path / "vsite").mkdir() or (tmp_path / "vsite/.stage_vllm-abc").touch()).start()
    t0 = time.time()
    assert pg.vllm_staged(10.0) is True and time.time() - t0 < 3.0
    monkeypatch.setattr(pg, "VSITE", tmp_path / "never")
    monkeypatch.setattr(pg, "STAGE_WAIT_S", 0.2)
    launched = []
    monkeypatch.setattr(pg.subprocess, "Popen", lambda *a, **k: launched.append(a))
    with pytest.raises(RuntimeError, match="not staged in .*never after 0 s: carry its parts .*stage_vllm.sh install"):
        pg.Server("vllm serve x", tmp_path / "vllm.log", "http://127.0.0.1:1/health").__enter__()
    assert launched == []


def test_the_lanes_servers_start_one_at_a_time_each_after_the_one_before_answers(tmp_path, monkeypatch):
    """vLLM's profile reads the whole GPU's free memory: a second server starts only once the first
    answers its health check (session 46: three at once, one left -0.2 GiB for its KV cache)."""
    (tmp_path / "vsite").mkdir()
    (tmp_path / "vsite/.stage_vllm-abc").touch()
    monkeypatch.setattr(pg, "VSITE", tmp_path / "vsite")
    events, lock = [], threading.Lock()

    class Proc:
        def poll(self):
            return None

    def popen(*a, **k):
        with lock:
            events.append(("start", threading.current_thread().name))
        return Proc()

    def health(url, timeout):
        time.sleep(0.3)  # (the profile and the engine's start)
        with lock:
            events.append(("up", threading.current_thread().name))

    monkeypatch.setattr(pg.subprocess, "Popen", popen)
    monkeypatch.setattr(pg.urllib.request, "urlopen", health)
    monkeypatch.setattr(pg, "stop_group", lambda proc, wait: None)

    def serve(lane: int) -> None:
        with pg.Server("vllm serve x", tmp_path / f"vllm{lane}.log", f"http://127.0.0.1:{lane}/health"):
            time.sleep(0.5)  # (its acceptance measured while the next one starts)

    threads = [threading.Thread(target=serve, args=(i,), name=f"lane{i}") for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [e for e, _ in events] == ["start", "up"] * 3
    assert [n for _, n in events[::2]] == [n for _, n in events[1::2]]  # (each answered before the next began)


def test_a_sweep_job_runs_past_its_edge_once_its_grid_is_scored_and_its_finals_wait_for_that(tmp_path, monkeypatch):
    """speculators' tau rises with the lr: once its grid has ended the job runs 9e-3, then (best again)
    3e-2, the second and last step up; its finals take 3e-2 and start after it. ModelOpt's best is
    inside its grid: nothing past it, and its finals start once its grid has ended. With --lrs given,
    nothing past an edge runs."""
    events, lock = [], threading.Lock()

    def train(self, spec, lane=0):
        with lock:
            events.append(("start", spec.name))
        tau = {"speculators": 2.0 + spec.lr * 10, "modelopt": 1.5 if spec.lr == 3e-4 else 1.4}[spec.framework]
        with lock:
            self.known.append(pr.Run.from_dict({**pr.asdict(spec), "steps": spec.steps_planned, "tau_heldout": tau}))
            events.append(("end", spec.name))

    known = [probe("speculators", "default", 3e-4, 42, steady_step_s=0.06, steps=200, steps_per_epoch=270),
             probe("modelopt", "default", 1e-4, 42, steady_step_s=0.06, steps=300),
             *swept_before("speculators", "matched", 0.06, 2.0), *swept_before("modelopt", "matched", 0.06, 1.3)]  # fmt: skip
    stand_in_job(monkeypatch, tmp_path, known, train)
    pg.main(["job", "sweep", "speculators:default", "modelopt:default", "--lanes", "2", "--then-final"])
    started = [n for e, n in events if e == "start"]

    def lrs(fw, budget):
        names = [n for e, n in events if e == "start" and n.startswith(fw) and f"-{budget}s-" in n]
        return [float(n.split("-lr")[1].split("-")[0]) for n in names]

    assert sorted(lrs("speculators", 180)) == [3e-4, 1e-3, 3e-3, 9e-3, 3e-2]
    assert sorted(lrs("modelopt", 180)) == [1e-4, 3e-4, 1e-3]
    assert lrs("speculators", 600) == [3e-2, 3e-2] and lrs("modelopt", 600) == [3e-4, 3e-4]

    def at(kind, name):
        return events.index((kind, name))

    spec = "speculators-default-eagle3.1-n16384-180s-lr{}-seed42"
    assert at("start", spec.format("0.009")) > max(at("end", spec.format(x)) for x in ("0.0003", "0.001", "0.003"))
    assert at("start", spec.format("0.03")) > at("end", spec.format("0.009"))
    assert min(at("start", n) for n in started if n.startswith("speculators") and "-600s-" in n) > at(
        "end", spec.format("0.03")
    )
    events.clear()
    stand_in_session(monkeypatch, tmp_path, None, known)
    monkeypatch.setattr(pg.Session, "train", train)
    pg.main(["job", "sweep", "speculators:default", "--lrs", "0.001", "0.003", "--lanes", "2"])
    assert sorted(lrs("speculators", 180)) == [1e-3, 3e-3]


def test_runs_short_of_their_end_are_listed_with_where_they_stopped_and_the_job_trains_them_again():
    """A final lost mid-training, a final whose serving alone failed, a sweep whose eval failed, beside
    runs that ended: only the three are listed; the next job trains the lost final and the sweep again
    (``done`` says no), not the one that lacks only vLLM's acceptance."""
    ended = run(lr=1e-3, steps=100, tau_heldout=2.5)
    final = run(budget=600.0, lr=2e-3, planned=400, steps=400, tau_heldout=2.9, tau_mtbench=2.7, vllm_acceptance=2.8)
    lost = run(budget=600.0, lr=2e-3, seed=1, planned=400, steps=310, session="s2")
    unserved = run(budget=600.0, lr=2e-3, seed=2, planned=400, steps=400, tau_heldout=2.9, tau_mtbench=2.7,
                   failed=["serve"])  # fmt: skip
    no_eval = run(lr=2e-3, steps=100, failed=["eval_heldout"])
    runs = [probe(steps=100), ended, final, lost, unserved, no_eval]
    (table,) = [t for t in pr.results(runs, [])["tables"] if t["title"].startswith("Runs not carried through")]
    rows = {row[0]: dict(zip(table["header"], row)) for row in table["rows"]}
    assert set(rows) == {lost.name, unserved.name, no_eval.name}
    assert rows[lost.name]["steps"] == "310 of 400" and rows[lost.name]["session"] == "s2"
    assert rows[lost.name]["missing"] == "tau_heldout, tau_mtbench, vllm_acceptance"
    assert "machine went back" in rows[lost.name]["why"]
    assert (rows[unserved.name]["missing"], rows[unserved.name]["why"]) == ("vllm_acceptance", "serve failed")
    assert rows[no_eval.name]["why"] == "eval_heldout failed"
    assert [rows[n]["trained again"] for n in (lost.name, unserved.name, no_eval.name)] == [True, False, True]
    for r in (lost, unserved, no_eval, ended, final):
        spec = pr.RunSpec(**{k: getattr(r, k) for k in pr.RunSpec.__dataclass_fields__})
        assert pg.done(runs, spec) is not rows.get(r.name, {"trained again": False})["trained again"]
    assert not [t for t in pr.results([ended, final], [])["tables"] if t["title"].startswith("Runs not carried")]


def test_each_runs_first_position_accuracy_is_read_from_its_own_log_by_optimizer_step(tmp_path):
    """ours' metrics.jsonl (acc[0] every 10 steps) and speculators' records (full_acc_0 every step,
    its validation passes left out) give the accuracy at 100 and 300 steps as the mean of what each
    logged over the 20 steps up to there, and at its last step; steps a run never reached are absent;
    the learning table puts them beside the tokens a step carried."""
    ours_dir, spec_dir = tmp_path / "ours-recipe-x", tmp_path / "speculators-matched-x"
    for d, r in ((ours_dir, run(planned=320)), (spec_dir, run("speculators", "matched", planned=320))):
        d.mkdir()
        (d / "spec.json").write_text(json.dumps(pr.asdict(r)))
    (ours_dir / "run/train").mkdir(parents=True)
    rows = [{"step": s, "loop_s": 0.3 * s, "tokens_per_s": 1e5, "acc": [s / 1000, 0.0]} for s in range(10, 330, 10)]
    (ours_dir / "run/train/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = "[t] INFO train/loss_0=1.0,\n  train/full_acc_0={a},\n  profile/step_ms=60.0,\n  global_step={s}\n"
    text = "".join(record.format(a=s / 2000, s=s) for s in range(1, 321))
    text = text.replace("  global_step=150\n", "  global_step=150\nValidation epoch 1/1 started\n[t] INFO "
                        "train/loss_0=9.0,\n  train/full_acc_0=0.99,\n  global_step=295\nValidation epoch 1/1 completed\n")  # fmt: skip
    (spec_dir / "train.log").write_text(text)
    ours, spec = pr.read_run(ours_dir, [], []), pr.read_run(spec_dir, [], [])
    assert ours.first_acc == {"100": 0.095, "300": 0.295, "last": 0.315}  # (steps 90 and 100; 290, 300; 310, 320)
    # (steps 81-100: 0.04525, 281-300: 0.14525, 301-320: 0.15525; the validation's 0.99 is not among them)
    assert spec.first_acc == {"100": 0.045, "300": 0.145, "last": 0.155}
    assert pr.first_acc([]) is None
    table = pr.learning_table([probe(steps=10, first_acc={"last": 0.1}), ours, spec])
    by_name = {row[0]: dict(zip(table["header"], row)) for row in table["rows"]}
    assert set(by_name) == {ours.name, spec.name}  # (a probe is not a run to compare)
    assert (by_name[ours.name]["acc @300"], by_name[ours.name]["acc @600"]) == (0.295, "—")
    assert by_name[ours.name]["tokens a step (about)"] == round(1e5 * ours.steady_step_s)
    # (its steps carry 1e5 tokens/s x its steady step: its 2M mark is the step that reaches 2M, read as above)
    assert ours.acc_by_tokens == pr.acc_by_tokens(pr.ours_acc((ours_dir / "run/train/metrics.jsonl").read_text()),
                                                  1e5 * ours.steady_step_s)  # fmt: skip


def test_each_runs_accuracy_is_also_read_at_so_many_trained_tokens():
    """The same accuracy read where the run had trained 2, 5, ... million tokens: at 8,000 tokens a
    step, 2M is step 250 (the mean over steps 231-250), 15M step 1,875; 20M (step 2,500) lies past its
    last step and is left out. A run read from its folder gets them from its steady tokens a step, and
    the table beside the step one lists the runs, not the probes."""
    pairs = [(s, s / 10000) for s in range(1, 2001)]
    got = pr.acc_by_tokens(pairs, 8000.0)
    assert got == {"2M": round(sum(range(231, 251)) / 20 / 10000, 3), "5M": round(sum(range(606, 626)) / 20 / 10000, 3),
                   "10M": round(sum(range(1231, 1251)) / 20 / 10000, 3), "15M": round(sum(range(1856, 1876)) / 20 / 10000, 3)}  # fmt: skip
    assert pr.acc_by_tokens([], 8000.0) is None and pr.acc_by_tokens(pairs, 0.0) is None
    assert pr.acc_by_tokens(pairs[:10], 8000.0) is None  # (no mark reached)
    ours = run(steps=2000, tokens_per_s=80000.0, steady_step_s=0.1, acc_by_tokens=got, tau_heldout=2.5)
    table = pr.tokens_table([probe(steps=300, acc_by_tokens={"2M": 0.1}), ours])
    assert [row[0] for row in table["rows"]] == [ours.name]
    row = dict(zip(table["header"], table["rows"][0]))
    assert (row["acc @2M tokens"], row["acc @20M tokens"], row["tokens a step (about)"]) == (got["2M"], "—", 8000)


def test_what_the_lanes_say_at_once_comes_out_a_whole_line_each(monkeypatch):
    """The lanes' threads say things together: each line is one write, its newline in it (print()
    wrote the newline apart, and session 45's log ran two lines into one)."""
    writes: list[str] = []
    lock = threading.Lock()

    class Out:
        def write(self, s: str) -> int:
            with lock:
                writes.append(s)
            return len(s)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stdout", Out())
    threads = [threading.Thread(target=pg.say, args=(f"run {i}: not started",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(writes) == sorted(f"peers_gpu: run {i}: not started\n" for i in range(8))


def test_a_rehearsals_data_runs_from_asking_to_ready_its_engines_wait_inside_the_hold_the_session_keeps(tmp_path):
    """Session 46's speculators held room at 0 s, its vLLM came staged and up at 232 s, its states were
    written at 554 s: ready after 554 s, not its phases' 322. Where no hold was kept (alone before the
    lanes, or an older session), its phases summed and its engine's stage (``ENGINE_STAGED_S``); ours
    has no engine to wait for. The session's data phases and holds come into the results file."""
    phases = [{"run": "lanes_hold", "phase": "speculators_data", "seconds": 554.0, "start": 1000.0, "end": 1554.0, "rc": 0},
              {"run": "speculators_data", "phase": "render", "seconds": 128.0, "start": 1232.0, "end": 1360.0, "rc": 0},
              {"run": "speculators_data", "phase": "states", "seconds": 194.0, "start": 1360.0, "end": 1554.0, "rc": 0},
              {"run": "ours_data", "phase": "prepare", "seconds": 30.0, "start": 1000.0, "end": 1030.0, "rc": 0},
              {"run": "ours-recipe-x", "phase": "train", "seconds": 99.0, "start": 1030.0, "end": 1129.0, "rc": 0}]  # fmt: skip
    assert pg.data_ready_s(phases, "speculators") == pytest.approx(554.0)
    assert pg.data_ready_s(phases[1:], "speculators") == pytest.approx(322.0 + pg.ENGINE_STAGED_S)
    assert pg.data_ready_s(phases, "ours") == pytest.approx(30.0)
    assert pg.data_ready_s(phases, "modelopt") is None
    failed = [{**phases[1], "rc": 1}]
    assert pg.data_ready_s(failed, "speculators") is None  # (a preparation that failed readied nothing)
    (tmp_path / "phases.jsonl").write_text("".join(json.dumps(p) + "\n" for p in phases))
    _, session = pr.read_session(tmp_path)
    assert session["phases"] == phases[:4]


def test_a_rehearsal_plays_the_job_over_the_results_held_on_a_faster_clock_and_runs_nothing(monkeypatch, capsys):
    """plan --rehearse: ours' data takes its held sessions' median (200 s: not their mean, 407), each
    final its expected seconds (2,000 steps at 0.3 s alone, start-up and compile 120 s, two evaluations
    and serving: one lane), one after the other; the second would end past --end-by-s, so it is left,
    by how much said in the job's seconds. The best (the recipe at 2e-3) goes on; the held results are
    not written. (The host's own work reads as rehearsed seconds too: each time may come late, never
    early.)"""
    monkeypatch.setattr(pg, "REHEARSAL_SCALE", 300.0)
    known = [*swept_before("ours", "recipe", 0.3, 2.5), *swept_before("ours", "muon", 0.3, 2.0)]
    sessions = [{"id": f"s{i}", "phases": [{"run": "ours_data", "phase": "prepare", "seconds": x, "rc": 0}]}
                for i, x in enumerate((20.0, 200.0, 1000.0))]  # fmt: skip
    monkeypatch.setattr(pg, "load", lambda path: (known, sessions))
    monkeypatch.setattr(pg, "Session", None)  # (a rehearsal builds no real session: no target, no data, no GPU)
    pg.main(["plan", "final", "ours", "--lanes", "1", "--end-by-s", "1500", "--device", "h100", "--rehearse"])
    lines = [x.removeprefix("peers_gpu: ") for x in capsys.readouterr().out.splitlines()]
    took, late = 2000 * 0.3 + 120.0 + 2 * pg.EVAL_S + pg.SERVE_S, 150.0

    def at(pattern: str) -> list[float]:
        (hit,) = [m for x in lines if (m := re.fullmatch(pattern, x.strip()))]
        return [float(g) for g in hit.groups()]

    (ready,) = at(r"(\d+) s  the data of ours ready \(held sessions: 20-1000 s from asking, median 200 s\)")
    assert 199 <= ready <= 200 + late
    start, end = at(
        r"(\d+) s  ours-recipe-eagle3.1-n16384-600s-lr0.002-seed0 starts in lane 0, expected to end at (\d+) s"
    )
    assert ready <= start <= ready + late and end - start == pytest.approx(took, abs=2)
    (ended,) = at(r"(\d+) s  ours-recipe-eagle3.1-n16384-600s-lr0.002-seed0 ends")
    assert end - 1 <= ended <= end + late
    (past,) = at(r"ours-recipe-eagle3.1-n16384-600s-lr0.002-seed1: not started \(it would end (\d+) s past "
                 r"--end-by-s\), left for the next session")  # fmt: skip
    assert ended + took - 1500 - 2 <= past <= ended + took - 1500 + late
    assert not any(r.kind == "final" for r in known)  # (what it ran stayed in the rehearsal)


def test_a_rehearsal_counts_the_shared_sets_synthesis_first_where_the_job_will_not_find_the_set(
    tmp_path, monkeypatch, capsys
):
    """Session 47's checkout was new: no set in .peers/data, so its job synthesized it first (138 s) and
    everything started that much later than rehearsed. A rehearsal now counts the held sessions'
    median synthesis first where the job will not find the set: packed into .peers (the truth once
    pack ran), else the committed copy pack puts there."""
    peers, committed = tmp_path / ".peers", tmp_path / "committed.jsonl.gz"
    assert not pg.set_carried(peers, committed)
    committed.write_bytes(b"set")
    assert pg.set_carried(peers, committed)  # (not packed yet: pack will copy the committed set)
    (peers / "data").mkdir(parents=True)
    assert not pg.set_carried(peers, committed)  # (packed without it: the job synthesizes)
    (peers / "data" / pg.DATA_SET).write_bytes(b"set")
    assert pg.set_carried(peers, committed)
    monkeypatch.setattr(pg, "REHEARSAL_SCALE", 300.0)
    monkeypatch.setattr(pg, "PEERS_HERE", tmp_path / "none")
    monkeypatch.setattr(pg, "SHARED_SET", tmp_path / "none.jsonl.gz")
    known = [*swept_before("ours", "recipe", 0.3, 2.5), *swept_before("ours", "muon", 0.3, 2.0)]
    sessions = [{"id": f"s{i}", "phases": [{"run": "data", "phase": "synthesize", "seconds": x, "rc": 0},
                                           {"run": "ours_data", "phase": "prepare", "seconds": 200.0, "rc": 0}]}
                for i, x in enumerate((138.0, 155.0, 600.0))]  # fmt: skip
    monkeypatch.setattr(pg, "load", lambda path: (known, sessions))
    monkeypatch.setattr(pg, "Session", None)
    pg.main(["plan", "final", "ours", "--lanes", "1", "--end-by-s", "5000", "--device", "h100", "--rehearse"])
    lines = [x.removeprefix("peers_gpu: ").strip() for x in capsys.readouterr().out.splitlines()]
    late = 150.0
    (synth,) = [float(m[1]) for x in lines if (m := re.fullmatch(
        r"(\d+) s  the shared set synthesized, as it is not in .peers/data \(held sessions: 138-600 s, median 155 s\)", x
    ))]  # fmt: skip
    (ready,) = [float(m[1]) for x in lines if (m := re.fullmatch(r"(\d+) s  the data of ours ready .*", x))]
    assert 155 <= synth <= 155 + late and 355 <= ready <= 355 + late


def test_speculators_rows_rendered_here_mask_the_prompt_and_train_the_reply_and_refuse_other_chats(tmp_path):
    """Each chat of one user turn answered once gives one row: the prompt with the assistant's opening
    masked, the rest of the whole chat's render (the reply and what closes it) trained, in the
    file's order, as the template renders each part on its own; a chat of other turns writes nothing."""
    from eagle3_train.targets.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.save_pretrained(tmp_path / "target")
    chats = [[{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}],
             [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4, of course."}]]  # fmt: skip
    convs, rows = tmp_path / "convs.jsonl", tmp_path / "rows.jsonl"
    convs.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in chats))
    assert pg.speculators_rows(convs, str(tmp_path / "target"), rows)
    got = [json.loads(x) for x in rows.read_text().splitlines()]
    for chat, row in zip(chats, got, strict=True):
        ids, mask = row["input_ids"], row["loss_mask"]
        k = mask.index(1)
        assert len(mask) == len(ids) and set(mask[:k]) == {0} and set(mask[k:]) == {1}
        prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
        whole = tok.apply_chat_template(chat, tokenize=False)
        assert whole.startswith(prompt) and chat[1]["content"] in whole[len(prompt) :]
        assert tok.decode(ids[:k]) == prompt and tok.decode(ids[k:]) == whole[len(prompt) :]
    two = [*chats[0], {"role": "user", "content": "And?"}, {"role": "assistant", "content": "That is all."}]
    convs.write_text(json.dumps({"conversations": two}) + "\n")
    rows.unlink()
    assert not pg.speculators_rows(convs, str(tmp_path / "target"), rows) and not rows.exists()
    convs.write_text(json.dumps({"conversations": [{"role": "user"}, chats[0][1]]}) + "\n")  # (no content)
    assert not pg.speculators_rows(convs, str(tmp_path / "target"), rows) and not rows.exists()


def test_two_prepared_datasets_are_the_same_only_with_the_same_rows_in_order_and_token_counts(tmp_path, capsys):
    import torch
    from datasets import Dataset

    def save(name, rows, freq):
        d = tmp_path / name
        cols = {
            "input_ids": [r[0] for r in rows],
            "loss_mask": [r[1] for r in rows],
            "seq_len": [len(r[0]) for r in rows],
        }
        Dataset.from_dict(cols).with_format("torch").save_to_disk(str(d))
        torch.save(freq, d / "token_freq.pt")
        return str(d)

    rows = [([5, 6, 7], [0, 1, 1]), ([8, 9], [0, 1])]
    a = save("a", rows, {6: 1, 7: 1, 9: 1})
    pg.main(["same-prepared", a, save("b", rows, {6: 1, 7: 1, 9: 1})])
    assert "the same rows" in capsys.readouterr().out
    for name, other, freq, why in [("c", [rows[0], ([8, 9], [1, 1])], {6: 1, 7: 1, 9: 1}, "row 1: loss_mask differs"),
                                   ("d", rows[::-1], {6: 1, 7: 1, 9: 1}, "row 0: input_ids differs"),
                                   ("e", rows[:1], {6: 1, 7: 1}, "2 rows against 1"),
                                   ("f", rows, {6: 1, 7: 2, 9: 1}, "token_freq.pt differs")]:  # fmt: skip
        with pytest.raises(SystemExit, match=why):
            pg.main(["same-prepared", a, save(name, other, freq)])
    with pytest.raises(SystemExit, match=f"{tmp_path / 'none'} holds no dataset"):
        pg.main(["same-prepared", a, str(tmp_path / "none")])


def test_speculators_rows_are_rendered_here_only_once_a_held_session_found_them_its_render_endpoints(
    tmp_path, monkeypatch
):
    """No check held for the set: the rows rendered here (before the server) and the endpoint's both,
    compared, and the endpoint's take the states; a check held that ended 0 for this set: the rows
    rendered here alone take them; one that failed, or one for another set, trusts nothing; rows
    that cannot be rendered here, or whose preparation failed, leave speculators' own path."""
    import contextlib

    monkeypatch.setattr(pg, "PO", tmp_path)
    monkeypatch.setattr(pg, "install", lambda *x: True)
    monkeypatch.setattr(pg, "Server", lambda *a: contextlib.nullcontext())
    ran, fail = [], set()

    def phase(run, name, cmd, env, shared=False, timeout=0.0, **kw):
        out = cmd[cmd.index("--output") + 1] if "--output" in cmd else None
        ran.append((name, Path(out).name if out else cmd[-3] if name.startswith(pg.RENDER_CHECK) else None))
        return name not in fail

    monkeypatch.setattr(pg, "phase", phase)
    rendered = {"ok": True}
    monkeypatch.setattr(pg, "speculators_rows", lambda *a: rendered["ok"])
    s = object.__new__(pg.Session)
    s.t, s.a, s.lanes, s.sha, s.target = TARGET, argparse.Namespace(n=16384), None, "abc123def456789", "/t"
    check = f"{pg.RENDER_CHECK}abc123def456"

    def phases_with(sessions):
        s.sessions = sessions
        ran.clear()
        assert s.speculators_data() is ("states" not in fail)
        return ran[:]

    assert phases_with([]) == [("check rows", "data_rows"), ("render", "data"), (check, "same-prepared"),
                               ("states", None)]  # fmt: skip
    held = {"phases": [{"run": "speculators_data", "phase": check, "rc": 0}]}
    assert phases_with([held]) == [("rows", "data"), ("states", None)]
    for other in ({"phases": [{"run": "speculators_data", "phase": check, "rc": 1}]},
                  {"phases": [{"run": "speculators_data", "phase": f"{pg.RENDER_CHECK}0123456789ab", "rc": 0}]}):  # fmt: skip
        assert phases_with([other])[:2] == [("check rows", "data_rows"), ("render", "data")]
    fail.add("rows")
    assert phases_with([held]) == [("rows", "data"), ("render", "data"), ("states", None)]
    rendered["ok"] = False
    assert phases_with([]) == [("render", "data"), ("states", None)]
    monkeypatch.setattr(pg, "speculators_rows", lambda *a: 1 / 0)
    assert phases_with([held]) == [("render", "data"), ("states", None)]
    # the check's two phases are not the framework's data seconds
    timed = [
        {"run": "speculators_data", "phase": p, "seconds": 10.0, "rc": 0}
        for p in ("check rows", "render", check, "states")
    ]
    assert pr.data_seconds(timed, "speculators", "default") == 20.0
