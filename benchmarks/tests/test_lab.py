"""The peers harness and the staging scripts of benchmarks/ (the benchmark programs: test_programs.py;
the product's tests under tests/ import nothing from here)."""

import json
import os
import shutil
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(LAB),
    str(LAB.parent),
]  # the lab's scripts import each other as top-level modules or as benchmarks.*


def test_peers_results_reads_the_polls_memory_phases_and_trainer_metrics(tmp_path):
    """benchmarks/peers_results.py: the GPU memory peak inside a phase's start..end (nvidia-smi's
    timestamps in UTC), HF Trainer's metrics of a named run, the session's sizes."""
    import peers_results as pr

    (tmp_path / "smi.csv").write_text(
        "2026/12/05 10:00:00.000, 500 MiB\n2026/12/05 10:00:02.000, 9000 MiB\n2026/12/05 10:00:04.000, 700 MiB\n"
    )
    trace = pr.memory_trace(tmp_path)
    start = datetime(2026, 12, 5, 10, 0, 1, tzinfo=timezone.utc).timestamp()
    assert pr.peak(trace, start, start + 2) == 9000 and pr.peak(trace, start + 2.5, start + 5) == 700
    assert pr.peak(trace, start + 10, start + 11) is None
    log = (
        "{'train_runtime': '3.3', 'train_samples_per_second': '1.2', 'x': 1}\npeers_gpu: modelopt_probe train done\n"
        "{'train_runtime': '300.5', 'train_samples_per_second': '14.5'}\npeers_gpu: modelopt train done\n"
    )
    assert pr.trainer_rate(log, "modelopt_probe") == {"train_runtime_s": 3.3, "samples_per_s": 1.2}
    assert pr.trainer_rate(log, "modelopt") == {"train_runtime_s": 300.5, "samples_per_s": 14.5}
    (tmp_path / "session.txt").write_text(
        "peers_gpu: ModelOpt ran 12.5 steps/s in its probe: 3750 steps, 3750 conversations\n"
        "peers_gpu: ModelOpt trained 355.1 s: ours 1349 steps over 73728 conversations\n"
    )
    assert pr.session_numbers(tmp_path) == {
        "modelopt_probe_steps_per_s": 12.5,
        "modelopt_steps": 3750,
        "ours_same_minutes_steps": 1349,
        "all_conversations": 73728,
    }
    (tmp_path / "session.txt").write_text(  # session_pair's lines: speculators' probe is not ModelOpt's
        "peers_gpu: speculators ran 2.5 steps/s in its probe: 750 steps (one epoch of 8192 conversations at most)\n"
        "peers_gpu: speculators' fused loss did not compile; again with --loss-implementation eager\n"
        "peers_gpu: speculators' compiled forward failed in torch's compiler; again with TORCHDYNAMO_DISABLE=1\n"
        "peers_gpu: ModelOpt for speculators' 95.5 s of loop at 1.46 steps/s: 139 steps, 139 conversations\n"
        "peers_gpu: speculators trained 170.2 s (1.592 minutes of loop): ours for 1.592 minutes over 73728 conversations\n"
    )
    assert pr.session_numbers(tmp_path) == {
        "speculators_probe_steps_per_s": 2.5,
        "speculators_steps": 750,
        "speculators_conversations": 8192,
        "speculators_loop_s": 95.5,
        "modelopt_steps_per_s_assumed": 1.46,
        "modelopt_steps": 139,
        "speculators_retried_with_eager_loss": 1,
        "speculators_forward_not_compiled": 1,
        "peer_loop_minutes": 1.592,
        "all_conversations": 73728,
    }


def test_peers_verdict_pairs_each_peer_with_each_of_ours_and_signs_the_difference():
    """The verdict table: ours minus the peer (negative where ours trails), by eval and by vLLM; a figure
    not measured is a dash, never a zero; runs of ours absent from the session give no row."""
    import peers_results as pr

    runs = {
        "speculators": {"eval_heldout": {"tau": 1.448}, "vllm_acceptance_length": 1.4574},
        "modelopt": {"eval_heldout": {"tau": 1.001}},  # not served
        "ours_same_minutes": {"eval_heldout": {"tau": 1.9}, "vllm_acceptance_length": 1.88},
        "ours_same_data": {"eval_heldout": {"tau": 1.222}, "vllm_acceptance_length": 1.2209},
    }
    (table,) = pr.verdict(runs)
    by = {(r[1], r[3]): r for r in table["rows"]}
    assert set(by) == {(p, o) for p in ("speculators", "modelopt") for o in ("ours_same_minutes", "ours_same_data")}
    assert by["speculators", "ours_same_minutes"][5:] == [0.45, 1.457, 1.88, 0.42]
    assert by["speculators", "ours_same_data"][5] == -0.23 and by["speculators", "ours_same_data"][8] == -0.24
    assert by["modelopt", "ours_same_data"][6:] == ["—", 1.221, "—"]
    assert pr.verdict({"ours_same_data": runs["ours_same_data"]}) == []  # no peer in the session
    assert [pr.cell(x) for x in (None, "", 0, 0.0, 1.23456, "online")] == ["—", "—", 0, 0.0, 1.235, "online"]


def test_peers_results_reads_each_runs_own_log_and_a_trainer_curve():
    """HF Trainer's final metrics belong to the run whose 'train done' closes their part of the log
    (a run without them has none, not the previous run's); a curve row takes the step and seconds
    of the progress bar before it; the session's loop minutes."""
    import peers_results as pr

    log = (
        "{'train_runtime': '133.2', 'train_samples_per_second': '1.8'}\npeers_gpu: modelopt train done\n"
        "step 2/2 loss 60.5\npeers_gpu: ours_same_data train done\n"
    )
    assert pr.trainer_rate(log, "modelopt") == {"train_runtime_s": 133.2, "samples_per_s": 1.8}
    assert pr.trainer_rate(log, "ours_same_data") is None
    bars = " 8%|8  | 49/600 [00:47<04:30,  2.04it/s]\r 8%|8  | 50/600 [00:48<04:30,  2.04it/s]\n"
    row = "{'loss': '41.83', 'learning_rate': '4.9e-06', 'train_acc/parallel_0_step_0': '0.25', 'train_acc/parallel_0_step_1': '0.5'}\n"
    later = " 17%|#  | 100/600 [01:15<04:37,  1.80it/s]\n" + row.replace("41.83", "29.3")
    assert pr.trainer_curve(row + bars + row + later) == [  # (a row before any bar has no step: left out)
        {"step": 50, "seconds": 48, "loss": 41.83, "lr": 4.9e-06, "acc": [0.25, 0.5]},
        {"step": 100, "seconds": 75, "loss": 29.3, "lr": 4.9e-06, "acc": [0.25, 0.5]},
    ]


def _harness(function: str, *args: str) -> str:
    """One of peers_gpu.sh's functions, run alone in bash."""
    script = (
        f"repo={LAB.parent}; source <(sed -n '/^{function}() {{/,/^}}/p' {LAB / 'peers_gpu.sh'}); {function} \"$@\""
    )
    run = subprocess.run(["bash", "-c", script, "bash", *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_peers_harness_reads_rates_and_loop_minutes_off_the_peers_progress_bars(tmp_path):
    """The steady rate leaves out the bar's first tenth (compilation) and bars of other totals (the
    data loading's, the save's); speculators' bar counts the epoch, so its tenth is of the steps run;
    the loop minutes are HF Trainer's train_runtime, or speculators' last bar's elapsed time."""
    hf = tmp_path / "hf.log"
    hf.write_text(
        "Map: 100%|##| 100/100 [00:00<00:00, 9000 examples/s]\n"
        + "".join(f" {i}%|#| {i}/100 [00:{10 + i // 2:02d}<00:40, 2it/s]\r" for i in range(0, 101, 5))
        + "\n{'train_runtime': '61.5', 'train_samples_per_second': '1.6'}\nSaving: 1/1 [00:03<00:00]\n"
    )
    assert float(_harness("steady_rate", str(hf), "100")) == 2.0  # 10 -> 100 steps in 15 -> 60 s
    assert float(_harness("loop_minutes", str(hf))) == round(61.5 / 60, 3)
    spec = tmp_path / "spec.log"
    spec.write_text(
        "Epoch 0   0% ━  0/2048  [ 0:00:00 < -:--:-- , ? it/s ]\r"
        "Epoch 0   1% ━  4/2048  [ 0:00:09 < 1:00:00 , 1 it/s ]\r"
        "Epoch 0   2% ━  40/2048  [ 0:00:18 < 1:00:00 , 4 it/s ]\n"
        "Validation 100% ━ 1/1 [ 0:00:02 < 0:00:00 , ? it/s ]\n"
    )
    assert float(_harness("steady_rate", str(spec), "epoch")) == 4.0  # 4 -> 40 steps in 9 -> 18 s
    assert float(_harness("loop_minutes", str(spec))) == round(18 / 60, 3)
    # as speculators 0.9.0 writes it to a file: one bar per epoch at its end, each step's time in its
    # logged metrics, and a validation bar that reads 'Epoch N' too (its 46 s once counted as the loop's)
    logged = tmp_path / "spec_file.log"
    step_ms = [1.08e05, 333.2] + [50.0 + i % 3 for i in range(18)]  # compile in the first two steps
    logged.write_text(
        "           INFO     Training epoch 1/2 started                    trainer.py:737\n"
        + "".join(
            f"                    profile/step_ms={t},\n                    global_step={i}\n"
            for i, t in enumerate(step_ms[:10])
        )
        + "Epoch 0 100% ━━━━━━━ 10/10  [ 0:01:57 < 0:00:00 , 16 it/s ]\n"
        "           INFO     Training epoch 1/2 completed                  trainer.py:739\n"
        "           INFO     Validation epoch 1/2 started                  trainer.py:754\n"
        "Epoch 0 100% ━━━━━━━ 17/17  [ 0:00:46 < 0:00:00 , 46 it/s ]\n"
        "                    val/loss_epoch=10.059, profile/step_ms=9000.0,\n"
        "           INFO     Validation epoch 1/2 completed                trainer.py:756\n"
        "           INFO     Training epoch 2/2 started                    trainer.py:737\n"
        + "".join(f"                    profile/step_ms={t},\n" for t in step_ms[10:])
        + "Epoch 1 100% ━━━━━━━ 10/10  [ 0:00:01 < 0:00:00 , 20 it/s ]\n"
        "           INFO     Training epoch 2/2 completed                  trainer.py:739\n"
        "           INFO     Validation epoch 2/2 started                  trainer.py:754\n"
        "Epoch 1 100% ━━━━━━━ 17/17  [ 0:00:30 < 0:00:00 , 46 it/s ]\n"
    )
    assert float(_harness("loop_minutes", str(logged))) == round((117 + 1) / 60, 3)
    steady = statistics.median(step_ms[2:])  # (the first tenth of 20 steps: 2)
    assert float(_harness("steady_rate", str(logged), "epoch")) == round(1000 / steady, 3)
    import peers_results as pr  # the results read the same log alike

    assert pr.speculators_log(logged.read_text()) == {"loop_s": 118, "steps": 10, "steady_step_ms": steady}
    sf = tmp_path / "specforge.log"  # SpecForge: no bar; its last logged step times its median step time
    sf.write_text(
        "step 50: {'acc_0': 0.1, 'loss': 9.1, 'perf/optimizer_step_time_s': 0.2, 'lr': 1e-05}\n"
        "step 100: {'acc_0': 0.2, 'loss': 8.0, 'perf/optimizer_step_time_s': 0.3, 'lr': 2e-05}\n"
        "step 150: {'acc_0': 0.3, 'loss': 7.2, 'perf/optimizer_step_time_s': 9.0, 'lr': 3e-05}\n"
    )
    assert float(_harness("loop_minutes", str(sf))) == round(150 * 0.3 / 60, 3)


def test_peers_harness_phase_fails_with_its_command_and_the_results_say_so(tmp_path):
    """A phase whose command fails returns its status even where the caller tests the pipeline (set -e
    is off there: the old phase said 'done' and the session went on to evaluate a draft never written);
    phases.jsonl records rc, and the results keep the retry's seconds and list the failed attempt."""
    import peers_results as pr

    script = (
        f"set -euo pipefail; source <(sed -n '/^phase() {{/,/^}}/p' {LAB / 'peers_gpu.sh'}); po={tmp_path}; "
        "if phase spec train bash -c 'exit 3' | cat; then echo went-on; else echo stopped; fi; phase spec train true"
    )
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "spec train failed (rc 3)" in run.stdout and "stopped" in run.stdout and "went-on" not in run.stdout
    ph = pr.phases(tmp_path)
    assert [(p["phase"], p["rc"]) for p in ph] == [("train", 3), ("train", 0)]
    out = pr.framework(tmp_path, "spec", ph, [], "", {})
    assert out["seconds"] == {"train": ph[1]["seconds"]}
    assert out["failed_phases"] == [{"phase": "train", "seconds": ph[0]["seconds"], "rc": 3}]


def test_speculators_training_retries_once_with_its_eager_loss_when_the_fused_one_fails(tmp_path):
    """On torch 2.11 speculators' default fused loss fails inside its compiled forward: spec_train runs it
    once more with --loss-implementation eager (the failed log kept, the session told); should that fail
    in torch's compiler, once more with its forward uncompiled (TORCHDYNAMO_DISABLE=1); a failure that
    is neither (an OOM raised through the compiled frame, say) is not retried."""
    real = shutil.which("python3")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    fake = bin_dir / "python3"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1 $2" != "-m speculators" ]; then exec {real} "$@"; fi\n'
        f'echo "${{TORCHDYNAMO_DISABLE:-compiled}} $*" >> {calls}\n'
        'if [[ " $* " == *" --loss-implementation eager "* ]]; then\n'
        '  if [ "$FAIL_IN" = compile ] && [ -z "${TORCHDYNAMO_DISABLE:-}" ]; then\n'
        '    echo "  File "/t/torch/_dynamo/eval_frame.py", line 929, in compile_wrapper"\n'
        '    echo "torch._dynamo.exc.BackendCompilerFailed: backend=inductor raised:"; exit 1; fi\n'
        '  if [ "$FAIL_IN" = oom ]; then  # raised through the compiled frame, not by the compiler\n'
        '    echo "  File "/t/torch/_dynamo/eval_frame.py", line 929, in compile_wrapper"\n'
        '    echo "torch.OutOfMemoryError: CUDA out of memory."; exit 1; fi\n'
        '  while [ "$1" != --save-path ]; do shift; done; mkdir -p "$2/0"; echo trained; exit 0; fi\n'
        'echo "  File "/s/speculators/losses/$(case $FAIL_IN in compile|oom) echo fused;; *) echo "$FAIL_IN";; esac).py", line 343, in backward"; exit 1\n'
    )
    fake.chmod(0o755)

    def spec_train(fail_in: str) -> subprocess.CompletedProcess:
        po = tmp_path / f"po_{fail_in}"
        (po / "speculators" / "data").mkdir(parents=True)
        functions = "".join(
            f"source <(sed -n '/^{f}() {{/,/^}}/p' {LAB / 'peers_gpu.sh'}); " for f in ("phase", "spec_train")
        )
        script = (
            f"set -euo pipefail; {functions} target_dir() {{ echo /target; }}; po={po}; "
            "spec_train speculators speculators epoch"
        )
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAIL_IN": fail_in}
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env)

    run = spec_train("fused")
    assert run.returncode == 0, run.stdout + run.stderr
    po = tmp_path / "po_fused"
    tries = calls.read_text().splitlines()
    assert len(tries) == 2 and "eager" not in tries[0] and tries[1].endswith("--loss-implementation eager")
    assert "fused loss did not compile" in (po / "session.txt").read_text()
    assert "losses/fused.py" in (po / "speculators" / "train_fused_failed.log").read_text()
    assert (po / "speculators" / "train.log").read_text().splitlines()[0] == "trained"
    assert (po / "speculators" / "export").resolve() == (po / "speculators" / "ckpt" / "0").resolve()
    assert tries[0].startswith("compiled ") and tries[1].startswith("compiled ")
    calls.unlink()
    run = spec_train("compile")  # its eager loss too fails, in dynamo: then its forward uncompiled
    assert run.returncode == 0, run.stdout + run.stderr
    po = tmp_path / "po_compile"
    tries = calls.read_text().splitlines()
    assert len(tries) == 3 and tries[2].startswith("1 ") and tries[2].endswith("--loss-implementation eager")
    said = (po / "session.txt").read_text()
    assert "fused loss did not compile" in said and "failed in torch's compiler" in said
    assert "torch/_dynamo" in (po / "speculators" / "train_compile_failed.log").read_text()
    assert (po / "speculators" / "export").resolve() == (po / "speculators" / "ckpt" / "0").resolve()
    calls.unlink()
    run = spec_train("oom")  # an error merely raised through the compiled forward: no third try
    assert run.returncode != 0 and len(calls.read_text().splitlines()) == 2
    assert "failed in torch's compiler" not in (tmp_path / "po_oom" / "session.txt").read_text()
    calls.unlink()
    run = spec_train("other")
    assert run.returncode != 0 and len(calls.read_text().splitlines()) == 1
    assert not (tmp_path / "po_other" / "speculators" / "export").exists()


def test_served_starts_vllm_once_more_with_fa2_when_fa3_refuses_the_drafts_attention_shape(tmp_path):
    """vLLM 0.26's FA3 plans the draft's attention with the target's shape and stops at start
    ('scheduler_metadata must have shape'): served() starts it once more with FA2 (the failed log
    kept, the session told); any other failure to start is not retried."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    (bin_dir / "vllm").write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {calls}\n'
        'if [[ " $* " == *" --attention-config.flash_attn_version=2 "* ]] && [ "$FAIL" = fa3 ]; then\n'
        f'  exec {sys.executable} -c \'import http.server as h; h.HTTPServer(("127.0.0.1", 8766), type("H", '
        '(h.BaseHTTPRequestHandler,), {"do_GET": lambda s: (s.send_response(200), s.end_headers())})).serve_forever()\'\n'
        "fi\n"
        'if [ "$FAIL" = fa3 ]; then echo "RuntimeError: scheduler_metadata must have shape (metadata_size)"; '
        'else echo "RuntimeError: CUDA out of memory"; fi; exit 1\n'
    )
    (bin_dir / "vllm").chmod(0o755)

    def served(fail: str) -> tuple[subprocess.CompletedProcess, Path]:
        po = tmp_path / f"po_{fail}"
        (po / "modelopt").mkdir(parents=True)
        functions = "".join(
            f"source <(sed -n '/^{f}() {{/,/^}}/p' {LAB / 'peers_gpu.sh'}); " for f in ("wait_http", "served")
        )
        script = (
            f"set -euo pipefail; {functions} target_dir() {{ echo /target; }}; "
            f'phase() {{ echo "phase $*" >> {calls}; }}; po={po}; repo={LAB.parent}; served modelopt'
        )
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAIL": fail}
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120), po

    run, po = served("fa3")
    assert run.returncode == 0, run.stdout + run.stderr
    tries = calls.read_text().splitlines()
    assert len(tries) == 3 and "flash_attn_version" not in tries[0]
    assert "--attention-config.flash_attn_version=2 --speculative-config" in tries[1]
    assert tries[2].startswith("phase modelopt served python3 -m eagle3_train.evaluation.served_acceptance")
    assert "again with --attention-config.flash_attn_version=2" in (po / "session.txt").read_text()
    assert "scheduler_metadata" in (po / "modelopt" / "vllm_serve_fa3.log").read_text()
    calls.unlink()
    run, po = served("other")
    assert run.returncode != 0 and len(calls.read_text().splitlines()) == 1
    assert not (po / "session.txt").exists()


def test_the_poll_leaves_an_archive_while_it_waits_and_the_last_one_at_its_end(tmp_path):
    """A poll call cut short by the device's limit still brings back what the session had so far:
    the archive is written as the poll starts waiting (then each minute), and again at its end."""
    import tarfile
    import time

    po, dest = tmp_path / "po", tmp_path / "out"
    (po / "speculators" / "served").mkdir(parents=True)
    (po / "session.txt").write_text("peers_gpu: started\n")
    (po / "log").write_text("")
    env = {**os.environ, "PO": str(po), "PEERS": str(tmp_path / "peers")}
    poll = subprocess.Popen(["bash", str(LAB / "peers_gpu.sh"), "poll", "30", str(dest)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        for _ in range(100):  # the first archive, long before the 30 s are up
            if (dest / "poll.tgz").is_file():
                break
            time.sleep(0.1)
        assert poll.poll() is None and (dest / "poll.tgz").is_file()
        with tarfile.open(dest / "poll.tgz") as tar:
            assert "./session.txt" in tar.getnames() and "./speculators_served_report.json" not in tar.getnames()
        (po / "speculators" / "served" / "report.json").write_text("{}")
        (po / "rc").write_text("0\n")  # the session ends: the poll packs once more and returns
        out, _ = poll.communicate(timeout=30)
    finally:
        poll.kill()
    assert "ended: rc=0" in out
    with tarfile.open(dest / "poll.tgz") as tar:
        assert {"./rc", "./speculators_served_report.json"} <= set(tar.getnames())
    assert sorted(p.name for p in dest.iterdir()) == ["poll.tgz"]  # no half-written archive left


def test_peers_results_takes_our_trainers_memory_peaks_from_its_metrics(tmp_path):
    """Beside nvidia-smi's device total, ours reports what its tensors and its allocator held: the
    largest of each over the run's records (records without them, e.g. a CPU run's, add nothing)."""
    import peers_results as pr

    rows = [
        {"step": 10, "tokens_per_s": 100.0, "gpu_peak_alloc_gib": 9.5, "gpu_peak_reserved_gib": 12.0},
        {"step": 20, "tokens_per_s": 120.0, "gpu_peak_alloc_gib": 11.25, "gpu_peak_reserved_gib": 12.0},
        {"step": 20, "eval_acc": [0.5]},
    ]
    (tmp_path / "ours_run_train_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = pr.framework(tmp_path, "ours", [], [], "", {})
    assert (
        out["steps"] == 20 and out["train_gpu_peak_alloc_gib"] == 11.25 and out["train_gpu_peak_reserved_gib"] == 12.0
    )
    (tmp_path / "ours_run_train_metrics.jsonl").write_text(json.dumps(rows[0] | {"gpu_peak_alloc_gib": 0}) + "\n")
    assert pr.framework(tmp_path, "ours", [], [], "", {})["train_gpu_peak_alloc_gib"] == 0
    (tmp_path / "ours_run_train_metrics.jsonl").write_text(json.dumps({"step": 5, "tokens_per_s": 1.0}) + "\n")
    assert "train_gpu_peak_alloc_gib" not in pr.framework(tmp_path, "ours", [], [], "", {})


def test_a_staging_part_still_fits_in_one_device_call_beside_the_working_tree():
    """A device call carries at most 64 MiB: the tracked tree plus the carried part. The vLLM parts were
    60 MiB until the tree passed 4 MiB and three of four calls were refused; a part's size leaves room."""
    import re

    ls = subprocess.run(["git", "ls-files", "-z"], cwd=LAB.parent, capture_output=True)
    if ls.returncode != 0:
        pytest.skip("not a git checkout")
    tree = sum(
        (LAB.parent / f).stat().st_size for f in ls.stdout.decode().split("\0") if f and (LAB.parent / f).is_file()
    )
    for script in ("stage_vllm.sh", "stage_sglang.sh"):
        part_mib = int(re.search(r"^part_mib=\$\{PART_MIB:-(\d+)\}", (LAB / "staging" / script).read_text(), re.M)[1])
        assert tree + part_mib * 2**20 <= 62 * 2**20, (script, tree)  # (2 MiB for the tree's growth between packs)


def test_specforge_draft_config_and_weight_map_are_derived_from_the_target(tmp_path):
    """peers_specforge.py: the draft config carries the target's architecture fields with one layer and
    the draft vocabulary; the linked target directory gains a weight map naming every tensor of its one
    checkpoint file (SpecForge's target head reads lm_head / embeddings through it)."""
    import peers_specforge as sf
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    target = tmp_path / "target"
    target.mkdir()
    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        rope_theta=1e5,
        tie_word_embeddings=True,
    ).save_pretrained(target)
    save_file(
        {"model.embed_tokens.weight": torch.zeros(300, 64), "model.norm.weight": torch.ones(64)},
        str(target / "model.safetensors"),
    )
    cfg = sf.draft_config(str(target), str(tmp_path / "draft.json"), 256)
    assert json.loads((tmp_path / "draft.json").read_text()) == cfg
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (
        64,
        128,
        2,
        300,
    )
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 256 and cfg["rope_theta"] == 1e5
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["tie_word_embeddings"] is False
    sf.tied(str(target), str(tmp_path / "linked"))
    index = json.loads((tmp_path / "linked" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "model.embed_tokens.weight": "model.safetensors",
        "model.norm.weight": "model.safetensors",
    }
    assert (tmp_path / "linked" / "config.json").resolve() == (target / "config.json").resolve()
    assert not (target / "model.safetensors.index.json").exists()


def test_peers_gpu_script_parses():
    assert subprocess.run(["bash", "-n", str(LAB / "peers_gpu.sh")]).returncode == 0


def test_every_lab_script_finds_the_repository_root():
    """A script's ``Path(__file__).resolve().parents[N]`` names the repository (it holds pyproject.toml):
    the lab moved up a floor once, and scripts counting from the old place read files that are not there."""
    import re

    for script in sorted(LAB.glob("*.py")):
        for n in re.findall(r"Path\(__file__\)\.resolve\(\)\.parents\[(\d+)\]", script.read_text()):
            root = script.resolve().parents[int(n)]
            assert (root / "pyproject.toml").is_file(), f"{script.name}: parents[{n}] is {root}, not the repository"


def test_peers_results_says_a_planned_modelopt_run_that_never_ran(tmp_path):
    """A session that ran out of device time before ModelOpt trained: the steps it had planned are kept
    as planned, not as steps ModelOpt ran; a session where it ran keeps them as its steps."""
    phase = {"fw": "speculators", "phase": "train", "seconds": 10.0, "start": 0.0, "end": 10.0, "rc": 0}
    (tmp_path / "phases.jsonl").write_text(json.dumps(phase) + "\n")
    (tmp_path / "session.txt").write_text(
        "peers_gpu: ModelOpt for speculators' 138.0 s of loop at 1.46 steps/s: 201 steps, 201 conversations\n"
    )
    script = Path(__file__).resolve().parents[1] / "peers_results.py"

    def session():
        out = tmp_path / "r.json"
        subprocess.run([sys.executable, str(script), str(tmp_path), str(out), "--machine", "m", "--date", "d"], check=True, capture_output=True)  # fmt: skip
        return json.loads(out.read_text())["session"]

    assert session()["modelopt_steps_planned_not_run"] == 201 and "modelopt_steps" not in session()
    with (tmp_path / "phases.jsonl").open("a") as f:
        f.write(json.dumps(phase | {"fw": "modelopt"}) + "\n")
    assert session()["modelopt_steps"] == 201 and "modelopt_steps_planned_not_run" not in session()
