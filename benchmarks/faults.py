"""What a user's ``eagle3-train source=served`` run does when its engine fails, with the engine the
run starts itself (``engine.launch=true``): each fault once, what the user saw, what was kept, and
the rerun of the same command ending where an uninterrupted run ends.

    bash benchmarks/session.sh start faults vllm -- python3 -m benchmarks.faults run --out faults.json --work work
    python3 -m benchmarks.faults run --small --out /tmp/faults.json   # CPU: the stand-in engine
    python3 -m benchmarks.faults table faults.json    # the rows of docs/guide/faults.md's table

On the GPU machine staged for vLLM (benchmarks/staging/stage_vllm.sh), session.sh runs it in
$S/out with the repository and the engine's site on PYTHONPATH and vLLM's ``vllm`` on PATH; the
embedded target is converted once into $EAGLE3_CACHE; ``--work work`` puts the runs and their logs
under $S/out, where poll packs them. About 7 minutes on one H100 (``--budget``).

Scenarios, all at once (each its own run directory, port and state-file directory):

- ``baseline``, ``repeat``: the uninterrupted run, twice (their difference is the run-to-run noise
  of the engine's batching);
- ``engine_killed``: the engine's process group SIGKILLed mid-run, then the same command again;
- ``engine_stopped``: the engine SIGSTOPped (a hung engine) under the ``engine.*`` defaults (its
  ``/health`` probes find it), then the same command again;
- ``replica_killed``: two replicas, one SIGKILLed mid-run: the run goes on with the other;
- ``trainer_killed``: the trainer's process group SIGKILLed mid-run (its engine goes with it), then
  the same command again;
- ``files_full``: ``engine.files_dir`` on a small tmpfs (root only) filled mid-run, then the same
  command with ``engine.files_dir`` on a RAM disk with room.

"Mid-run" is the first logged step at or past 60 % of ``--steps``. The target is the embedded one
(SmolLM2-135M, vLLM with ``--enforce-eager``) on its shipped conversations; ``--small`` runs the
tiny target on the CPU against tests/standin_engines.py as ``vllm`` (numbers meaningless, the logic
proven). The results JSON is rewritten after every scenario.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.lab import conversations
from benchmarks.result import Result, machine, this_command

REPO = Path(__file__).resolve().parents[1]
STOP = threading.Event()  # set at the end: no trainer starts after it
LIVE: set[int] = set()  # process groups started here (trainers, the engines they started): killed at the end
NOTABLE = re.compile(r"dropped replica|error|Traceback|Killed")  # the lines a user reads on a fault
RESUMED = re.compile(r"continuing from checkpoint (\S+) of \S+ at step (\d+) of (\d+)")


@dataclass
class Setup:
    """What every scenario shares: the target, the prepared data, the options, the environment."""

    small: bool
    work: Path
    target: Path
    prep: Path
    steps: int
    save_every: int
    deadline: float
    env: dict[str, str] = field(default_factory=dict)

    def args(self, name: str, port: int, *extra: str) -> list[str]:
        """The eagle3-train options of scenario ``name`` (the ones after ``extra`` win)."""
        # the engines that start together on one GPU: their KV cache sized, not profiled against each other
        engine = ["engine.engine_args=--enforce-eager --kv-cache-memory-bytes 1073741824"]
        engine = ["engine.dtype=float32", "prepared.aux_indices=[1,2,3]"] if self.small else engine
        return [
            f"data={self.prep}", f"target={self.target}", f"out={self.work / name}", "source=served",
            "progress=false", "objective.ttt_length=3" if self.small else "objective.ttt_length=5",
            f"loop.max_tokens_per_batch={600 if self.small else 2048}", "loop.epochs=2", f"loop.max_steps={self.steps}",
            "loop.log_every=1", f"checkpoint.save_every={self.save_every}", "checkpoint.every_minutes=0",
            f"prepared.draft_vocab_size={16 if self.small else 8192}", "prepared.eval_fraction=0.1",
            "engine.launch=true", f"engine.port={port}", "engine.memory_fraction=0.08", "engine.launch_timeout_s=300",
            f"engine.files_dir={files_root(self.small) / f'faults_{name}'}", *engine, *extra,
        ]  # fmt: skip


def files_root(small: bool) -> Path:
    return Path(tempfile.gettempdir() if small else "/dev/shm")


def prepare(a: argparse.Namespace) -> Setup:
    """The target directory and the prepared conversations, made once under ``--work``."""
    from data_prep.prepare import PrepareConfig, Preparer

    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if a.small:
        from eagle3_train.targets.tiny import build_tiny_model, build_tiny_tokenizer

        target, data = work / "target", conversations(work / "c.jsonl", 64, 8)
        if not (target / "config.json").is_file():
            build_tiny_model().save_pretrained(target)
            build_tiny_tokenizer().save_pretrained(target)
        bin_dir = work / "bin"  # the stand-in answers as `vllm` on PATH
        bin_dir.mkdir(exist_ok=True)
        (bin_dir / "vllm").write_text(
            f'#!/bin/sh\nexec "{sys.executable}" "{REPO}/tests/standin_engines.py" vllm "$@"\n'
        )
        (bin_dir / "vllm").chmod(0o755)
        env.update(PATH=f"{bin_dir}:{env['PATH']}", OMP_NUM_THREADS="1")
    else:
        from eagle3_train.targets import load_target

        target = Path(str(load_target("embedded", cache_dir=os.environ["EAGLE3_CACHE"], dtype="float32").local_dir))
        data = REPO / "data_prep" / "prompts" / "synth_smollm2.jsonl.gz"
    prep = work / "prep"
    if not (prep / "manifest.json").is_file():
        shutil.rmtree(prep, ignore_errors=True)
        Preparer(PrepareConfig(target=str(target), input=str(data), out=str(prep), limit=None if a.small else 640,
                               max_length=256 if a.small else 512, progress=False)).run()  # fmt: skip
    return Setup(a.small, work, target, prep, a.steps, a.save_every, time.monotonic() + a.budget, env)


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to a process group: whether it was there (signal 0: only look)."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class Trainer:
    """One eagle3-train process: its own process group, its output (what the user sees) in a log."""

    def __init__(self, setup: Setup, out: Path, args: list[str], log: Path):
        if STOP.is_set():
            raise RuntimeError("stopped: the program is ending")
        self.out, self.log, self.engines = out, log, list[int]()
        cmd = [sys.executable, "-m", "eagle3_train.training.trainer", *args]
        with log.open("w") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=setup.env, start_new_session=True)  # fmt: skip
        LIVE.add(self.proc.pid)
        self.began, self.seen = time.monotonic(), dict[str, float]()  # notable line -> when it first appeared

    def step(self) -> int:
        """The last step metrics.jsonl logged (0: none yet)."""
        return max((r["step"] for r in metrics(self.out) if "loss" in r), default=0)

    def _look(self) -> None:
        """Note the engine process groups this trainer started (its children that lead a session)."""
        for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
            with contextlib.suppress(OSError):  # (ppid, pgrp, session) after the command name
                st = [int(x) for x in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1:4]]
                if st[0] == self.proc.pid and st[1] == pid == st[2] and pid not in self.engines:
                    self.engines.append(pid)
                    LIVE.add(pid)

    def until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Poll until ``done()``, the trainer exits, or ``deadline``: whether ``done()`` came."""
        while time.monotonic() < deadline and self.proc.poll() is None and not STOP.is_set():
            self._look()
            self._read()
            if done():
                return True
            time.sleep(0.2)
        return False

    def _read(self) -> None:
        for line in filter(NOTABLE.search, self.log.read_text(errors="replace").splitlines()):
            self.seen.setdefault(line, time.monotonic())

    def wait(self, deadline: float) -> int | None:
        """Its exit status (None: killed at ``deadline``)."""
        self.until(lambda: False, deadline)
        rc = None if self.proc.poll() is None else self.proc.returncode
        kill_group(self.proc.pid)
        self.proc.wait()
        self._read()  # what it wrote as it exited
        return rc

    def tail(self, n: int = 5) -> list[str]:
        return [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()][-n:]


def metrics(out: Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl records, the last line left out while it is still being written."""
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(x) for x in lines if x.endswith("}")]


def final(out: Path) -> dict[str, Any]:
    """The run's last step, loss and end-of-run evaluation, from its metrics.jsonl."""
    rows = metrics(out)
    steps, evals = [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]
    if not steps:
        return {}
    figures = {"final_step": steps[-1]["step"], "final_loss": steps[-1]["loss"]}
    if evals:
        figures |= {k: evals[-1][k] for k in ("eval_loss", "eval_tau", "eval_acc") if k in evals[-1]}
    return figures


def finish(setup: Setup, name: str, args: list[str], row: dict[str, Any], tag: str = "") -> dict[str, Any]:
    """Run ``args`` to its end (a rerun: the same command once the fault is gone) into ``row``."""
    t = Trainer(setup, setup.work / name, args, setup.work / f"{name}{tag}.log")
    rc = t.wait(setup.deadline)
    text = t.log.read_text(errors="replace")
    resumed = RESUMED.search(text)
    row[f"{tag or 'run'}"] = {
        "exit_code": rc if rc is not None else "killed: --budget or --timeout spent, or the program stopped",
        "wall_s": round(time.monotonic() - t.began, 1),
        "resumed_from_step": int(resumed.group(2)) if resumed else None,
        "last_lines": t.tail(),
    }
    row.update(final(setup.work / name))
    return row


def checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in (out / "checkpoints").glob("step*")), key=lambda s: int(s[4:] or 0))


def faulted(
    setup: Setup, name: str, args: list[str], fault: Callable[[Trainer], str], what: str, rerun: list[str] | None = None
) -> dict[str, Any]:
    """Start ``args``, apply ``fault`` at 60 % of the steps, see what the user sees, then run
    ``rerun`` (the same command by default) to the end."""
    row: dict[str, Any] = {"done": what}
    t = Trainer(setup, setup.work / name, args, setup.work / f"{name}.log")
    at = -(-setup.steps * 6 // 10)
    if not t.until(lambda: t.step() >= at, setup.deadline):
        row["fault"] = f"not applied: the run ended or the budget ran out before step {at}"
        t.wait(setup.deadline)
        row["first_last_lines"] = t.tail()
        return row
    step, hit = t.step(), time.monotonic()
    row["fault"] = {"at_step": step, "how": fault(t)}
    rc = t.wait(setup.deadline)
    row["first"] = {
        "exit_code": rc if rc is not None else "killed: --budget or --timeout spent, or the program stopped",
        "seconds_fault_to_exit": round(time.monotonic() - hit, 1),
        "last_step_logged": t.step(),
        "checkpoints_kept": checkpoints(setup.work / name),
        "last_lines": t.tail(),
        "seconds_fault_to_line": {x[:400]: round(when - hit, 1) for x, when in t.seen.items() if when >= hit},
    }
    exited = time.monotonic()  # the engines a killed trainer started must not outlive it
    while any(kill_group(g, 0) for g in t.engines) and time.monotonic() < exited + 60:
        time.sleep(0.2)
    row["first"]["engines_left_running"] = [g for g in t.engines if kill_group(g, 0)]
    row["first"]["seconds_exit_to_engines_gone"] = round(time.monotonic() - exited, 1)
    for g in t.engines:
        kill_group(g)
    if rc == 0:  # the run survived the fault (a lost replica): nothing to rerun
        row.update(final(setup.work / name))
        return row
    finish(setup, name, rerun or args, row, "rerun")
    if (resumed := row["rerun"]["resumed_from_step"]) is not None:
        row["steps_lost"] = row["first"]["last_step_logged"] - resumed
    return row


def engine_signal(sig: int, which: int = 0) -> Callable[[Trainer], str]:
    """The fault: ``sig`` to the process group of the run's engine replica ``which``."""

    def apply(t: Trainer) -> str:
        group = sorted(t.engines)[which]
        kill_group(group, sig)
        return f"{signal.Signals(sig).name} to the process group of engine replica {which} (pgid {group})"

    return apply


def kill_trainer(t: Trainer) -> str:
    kill_group(t.proc.pid)
    return f"SIGKILL to the trainer's process group (pgid {t.proc.pid})"


TIMEOUTS = ("engine.request_timeout_s=15", "engine.file_timeout_s=20", "engine.retries=1")
# scenario -> what is done, its options beyond the baseline's, the fault (None: none)
SCENARIOS: dict[str, tuple[str, tuple[str, ...], Callable[[Trainer], str] | None]] = {
    "baseline": ("the run uninterrupted", (), None),
    "repeat": ("the run uninterrupted, again", (), None),
    "engine_killed": ("the engine killed (SIGKILL)", (), engine_signal(signal.SIGKILL)),
    "engine_stopped": ("the engine stopped (SIGSTOP), the engine.* defaults", (), engine_signal(signal.SIGSTOP)),
    "replica_killed": ("one of two replicas killed (SIGKILL)", ("engine.replicas=2",), engine_signal(signal.SIGKILL, 1)),
    "trainer_killed": ("the trainer killed (SIGKILL to its process group)", (), kill_trainer),
    "files_full": ("engine.files_dir on a small tmpfs filled mid-run, rerun with it on a RAM disk", TIMEOUTS, None),
}  # fmt: skip


def scenario(setup: Setup, name: str, port: int) -> dict[str, Any]:
    """One scenario, start to end."""
    what, extra, fault = SCENARIOS[name]
    args = setup.args(name, port, *extra)
    shutil.rmtree(setup.work / name, ignore_errors=True)
    if name == "files_full":
        return files_full(setup, name, port)
    if fault is None:
        return finish(setup, name, args, {"done": what})
    return faulted(setup, name, args, fault, what)


def files_full(setup: Setup, name: str, port: int) -> dict[str, Any]:
    """engine.files_dir on a tmpfs filled mid-run; the rerun's files_dir on a RAM disk with room."""
    if os.geteuid() != 0:
        return {"done": "not run: mounting a tmpfs needs root"}
    mount, size = setup.work / f"{name}_tmpfs", "4m" if setup.small else "256m"
    mount.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode:
        return {"done": f"not run: mount -t tmpfs failed: {mounted.stderr.strip()[-300:]}"}

    def fill(t: Trainer) -> str:
        written = 0
        with (mount / "filler").open("wb", buffering=0) as f:
            for block in (2**20, 4096):  # MiBs, then the last pages: no room left for the smallest state file
                with contextlib.suppress(OSError):
                    while True:
                        written += f.write(b"\0" * block)
        return f"a {written / 2**20:.1f} MiB file filled the {size} tmpfs holding engine.files_dir"

    try:
        full = setup.args(name, port, *SCENARIOS[name][1], f"engine.files_dir={mount / 'files'}")
        what = f"engine.files_dir on a {size} tmpfs filled mid-run; rerun with it on {files_root(setup.small)}"
        return faulted(setup, name, full, fill, what, rerun=setup.args(name, port, *SCENARIOS[name][1]))
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def compare(rows: dict[str, dict[str, Any]]) -> None:
    """Each finished run's final figures against the baseline's (in place: ``vs_baseline``)."""
    base = rows.get("baseline", {})
    for name, row in rows.items():
        if name == "baseline" or "final_loss" not in row or "final_loss" not in base:
            continue
        diff: dict[str, Any] = {"same_final_step": row["final_step"] == base["final_step"]}
        for key in ("final_loss", "eval_loss", "eval_tau"):
            if key in row and key in base:
                diff[f"d_{key}"] = row[key] - base[key]
                diff[f"rel_{key}"] = abs(row[key] - base[key]) / max(abs(base[key]), 1e-12)
        row["vs_baseline"] = diff


DOCS = (
    "scenario",
    "first message after (s)",
    "run stops after (s)",
    "steps trained again",
    "final loss - baseline",
    "eval tau - baseline",
)  # fmt: skip  (docs/guide/faults.md's columns)


def table(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The fault table as the results page shows it (its first columns: the reliability page's)."""

    def cells(name: str, row: dict[str, Any]) -> list[Any]:
        first, again, diff = row.get("first", {}), row.get("rerun", row.get("run", {})), row.get("vs_baseline", {})
        lines = first.get("seconds_fault_to_line", {})
        saw = [x for x in lines if "dropped" in x or "error" in x] or first.get("last_lines") or [""]
        stops = "does not stop" if first.get("exit_code") == 0 else first.get("seconds_fault_to_exit")
        short = lambda x: None if x is None else float(f"{x:.2g}")  # noqa: E731
        return [
            name, min(lines.values(), default=None), stops, row.get("steps_lost"), short(diff.get("d_final_loss")),
            short(diff.get("d_eval_tau")), row.get("done"), first.get("exit_code"), saw[-1][:300],
            (first.get("checkpoints_kept") or [None])[-1], again.get("resumed_from_step"), row.get("final_step"),
            again.get("exit_code"), again.get("wall_s"),
        ]  # fmt: skip

    header = [*DOCS, "fault", "exit code", "last line the user saw", "last checkpoint", "resumed from step",
              "final step", "(re)run exit code", "(re)run s"]  # fmt: skip
    return {"title": "faults of a source=served run", "header": header, "rows": [cells(n, r) for n, r in rows.items()]}


def docs_table(a: argparse.Namespace) -> None:
    """Print the reliability page's table from a results file."""
    for row in [list(DOCS), ["---"] * len(DOCS), *Result.read(a.results).tables[0]["rows"]]:
        print("| " + " | ".join("—" if x is None else str(x) for x in row[: len(DOCS)]) + " |")


def gpu_name() -> str:
    """The first GPU's name as nvidia-smi gives it ("": none), without CUDA in this process."""
    smi = shutil.which("nvidia-smi")
    query = (
        subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        if smi
        else None
    )
    return query.stdout.splitlines()[0].strip() if query and query.stdout.strip() else ""


def run(a: argparse.Namespace) -> None:
    """Every scenario at once, within ``--budget`` seconds; the results JSON after each."""
    import torch  # its version only: CUDA stays out of this process

    start = time.monotonic()
    card = "" if a.small else gpu_name()  # H100 in "NVIDIA H100 80GB HBM3"
    short = next((w.lower() for w in card.split() if re.fullmatch(r"[A-Z]+\d+\w*", w) and w != "NVIDIA"), "cpu")
    out = a.out or str(REPO / "benchmarks" / "results" / f"faults_{short}.json")
    names = a.scenarios.split(",")
    if unknown := set(names) - set(SCENARIOS):
        raise SystemExit(f"no scenario {', '.join(sorted(unknown))}: choose from {', '.join(SCENARIOS)}")
    what = ("eagle3-train source=served (the engine launched by the run) under faults: what the user sees, what "
            "is kept, and the rerun of the same command against an uninterrupted run")  # fmt: skip
    result = Result(
        what=what, command=a.command, machine=f"1 x {card}, torch {torch.__version__}" if card else machine()
    )
    rows: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below stops every engine
    try:
        setup = prepare(a)
        result.figures = {"settings": {"small": a.small, "steps": a.steps, "save_every": a.save_every,
                                       "options": " ".join(setup.args("<scenario>", a.port)),
                                       "prepare_s": round(time.monotonic() - start, 1)}}  # fmt: skip

        def one(i: int, name: str) -> None:
            time.sleep(i * a.stagger)  # engines starting together contend for the same cores
            mine = Setup(**{**setup.__dict__, "deadline": min(setup.deadline, time.monotonic() + a.timeout)})
            began = time.monotonic()
            try:
                row = scenario(mine, name, a.port + 10 * i)
            except Exception as e:  # noqa: BLE001  (one scenario's failure keeps the others' rows)
                row = {"error": f"{type(e).__name__}: {e}"[-2000:]}
            row["scenario_s"] = round(time.monotonic() - began, 1)
            with lock:
                rows[name] = row
                compare(rows)
                ordered = {n: rows[n] for n in names if n in rows}
                result.figures["scenarios"] = ordered
                result.figures["wall_s"] = round(time.monotonic() - start, 1)
                if (state := sorted((setup.work / "baseline" / "checkpoints").glob("step*/state.json"))) and (
                    "states_from" not in result.figures
                ):
                    result.figures["states_from"] = json.loads(state[-1].read_text()).get("states_from")
                result.tables = [table(ordered)]
                result.write(out)
                print(f"== {name}: {json.dumps(row)[:1500]}", flush=True)

        pool = ThreadPoolExecutor(len(names))
        list(pool.map(one, range(len(names)), names))
    finally:  # however it ends (SIGTERM included): no trainer or engine left running
        STOP.set()
        for group in LIVE:
            kill_group(group)
        for name in names:
            shutil.rmtree(files_root(a.small) / f"faults_{name}", ignore_errors=True)
    for r in table({n: rows[n] for n in names if n in rows})["rows"]:
        print(" | ".join(str(c) for c in r))
    print(f"wrote {out} ({time.monotonic() - start:.0f} s)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the scenarios and write the results JSON")
    r.add_argument("--out", help="results JSON (default benchmarks/results/faults_<gpu>.json)")
    r.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: " + ",".join(SCENARIOS))
    r.add_argument("--budget", type=float, default=450, help="seconds for everything after the data is prepared")
    r.add_argument("--timeout", type=float, default=420, help="seconds one scenario may take (its reruns included)")
    r.add_argument("--steps", type=int, default=None, help="optimizer steps of a run (60; 16 with --small)")
    r.add_argument("--save-every", type=int, default=None, help="checkpoint every N steps (10; 4 with --small)")
    r.add_argument("--stagger", type=float, default=3, help="seconds between the scenarios' starts")
    r.add_argument("--port", type=int, default=8400, help="the first scenario's engine port (the next +10 each)")
    r.add_argument("--work", default=tempfile.gettempdir() + "/bench_faults", help="target, data and run directories")
    r.add_argument("--small", action="store_true", help="tiny target on the CPU against the stand-in engine")
    t = sub.add_parser("table", help="print the rows of docs/guide/faults.md's table from a results file")
    t.add_argument("results", help="the results JSON a run wrote")
    a = p.parse_args(argv)
    if a.cmd == "table":
        return docs_table(a)
    a.command = this_command("faults", argv)
    a.steps = a.steps or (16 if a.small else 60)
    a.save_every = a.save_every or (4 if a.small else 10)
    run(a)


if __name__ == "__main__":
    main()
