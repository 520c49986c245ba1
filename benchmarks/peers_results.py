"""The side-by-side with the peer frameworks: its results file, written and read here only.

    python3 benchmarks/peers_results.py merge POLL benchmarks/results/peers_h100.json
    python3 benchmarks/peers_results.py supersede benchmarks/results/peers_h100.json ours:recipe --reason "..."
    python3 benchmarks/peers_results.py reinstate benchmarks/results/peers_h100.json NAME@SESSION ... --reason "..."
    python3 benchmarks/peers_results.py note benchmarks/results/peers_h100.json SESSION --text "..."

``POLL``: the ``poll.tgz`` a poll of ``benchmarks/peers_gpu.py`` brought back (read afresh, and kept as
``raw/<results file's stem>/<session id>.tgz`` beside the results file, so that merging those, oldest
first, gives the file again), the folder it was unpacked into, or the ``peers_partial.json`` beside
it. Runs are keyed by name (framework, head,
budget, lr, seed): a run measured again replaces the old one unless the new one got less far. The
verdict table is recomputed from every run in the file. ``supersede`` takes a framework's head out of
the file (into ``<file>_superseded.json``, with the reason) where a change to that framework changed
what its runs would measure, e.g. ours' step time: its probe, sweep and finals then run again, and
merging an old session's folder does not bring the taken-out runs back. ``reinstate`` brings named
runs back, with the reason, where a measurement showed that the change did not change what they
measure (e.g. a rerun of one of them after the change, equal within its spread). ``note`` writes a
session's note (what the machine did, what was left and why): the session's folder does not carry it,
so merging that folder again keeps the note the file holds.

Budgets are seconds of *steady* training loop: each framework's start-up (model load, data loading)
and the compilation of its first steps are measured and reported apart (:func:`split_compile`), and
every framework is stopped by a step count sized from its own steady step time measured alone on
the GPU (:func:`plan_steps`), so its lr schedule ends with the budget. Sized runs may then share the
GPU (``lanes``): their step counts, and so their drafts, do not depend on it; their own clocks run
slower, so the budget is judged by ``budget_loop_s`` (steps x the step time measured alone), and a
run's peak memory is its own only where it ran alone (else its probe's, which did).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import shutil
import statistics
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA = 1
FRAMEWORKS = ("ours", "speculators", "modelopt", "specforge")
SWEEP_S, FINAL_S = 180.0, 600.0  # the two budgets: the lr sweep's and the seeds'
LRS = {"ours": (1e-3, 2e-3, 4e-3), "speculators": (3e-4, 1e-3, 3e-3), "modelopt": (1e-4, 3e-4, 1e-3),
       "specforge": (3e-5, 1e-4, 3e-4),
       "ours:muon": (2e-2, 4e-2, 8e-2)}  # fmt: skip  # (ours:muon's lr is optim.muon_lr; optim.lr stays the recipe's)
HEADS = {"ours": ("recipe", "muon"), "speculators": ("default", "matched"), "modelopt": ("default", "matched"),
         "specforge": ("default", "matched")}  # fmt: skip
SEED = {"ours": 0, "speculators": 42, "modelopt": 42, "specforge": 42}  # each one's default seed; the second is +1
BAR_GAP_S = 10.0  # seconds between the readings of a progress bar's whole-second clock that time its steps
NOT_RUN = {  # (a framework's entry goes once the file holds a run of it)
    "specforge": "SpecForge 0.2.0 captures the target's states with SGLang 0.5.14 only, which needs transformers "
    "5.8.1 in a site of its own beside the image's 5.17 (benchmarks/staging/stage_sglang14.sh, 2 parts); not run "
    "yet: the harness runs it after the two other peers (benchmarks/notes/peer_training.md)"
}
WITHDRAWN = (
    "The equal-minutes verdict of 2026-12-04 (peers_pair2_h200: ours +0.45 tau over speculators, +0.42 served) is "
    "withdrawn: unequal data (ours over 73,728 conversations, speculators 8,192 for one epoch), 128 of "
    "speculators' 138 s of loop were its compilation, only ours was tuned, the heads differed (MLP, draft vocab, "
    "TTT steps), ModelOpt never left its warm-up, and one seed each. peers_h100 / peers_h200 replace it."
)


@dataclass
class RunSpec:
    """One training run as the harness planned it (``<po>/<name>/spec.json``)."""

    framework: str  # ours | speculators | modelopt
    head: str  # recipe (ours) | default (the peer's own) | matched (shaped like ours where its options allow)
    kind: str  # probe (measures the step time) | sweep | final
    budget_s: float | None  # seconds of steady training loop (None: a probe, sized in steps)
    lr: float
    seed: int
    steps_planned: int
    conversations: int  # the first N of the shared set, every framework alike
    data_sha256: str = ""
    epochs: int | None = None  # passes the framework is told to make (it stops at steps_planned)
    warmup_steps: int | None = None  # where the harness sets it (None: the framework's own rule)
    head_shape: dict[str, Any] = field(default_factory=dict)  # mlp, draft_vocab, ttt, lm_head, variant
    missing: list[str] = field(default_factory=list)  # matched options the framework has no flag for
    device: str = ""
    session: str = ""
    sized_on: str = ""  # the GPU kind whose probes sized it, where not ``device`` (its steps are that GPU's minutes)
    planned_step_s: float | None = None  # the steady step time measured alone that sized steps_planned
    lanes: int = 1  # sized runs that may share the GPU at once (1: alone)

    @property
    def name(self) -> str:
        """The run's key (a run of the same name is the same run): framework, head, head family, data,
        budget, lr, seed."""
        budget = f"{self.budget_s:g}s" if self.budget_s else f"{self.steps_planned}steps"
        family = self.head_shape.get("variant", "eagle3")
        return f"{self.framework}-{self.head}-{family}-n{self.conversations}-{budget}-lr{self.lr:g}-seed{self.seed}"


@dataclass
class Run(RunSpec):
    """A run and what it measured (None: not measured, or not reached)."""

    steps: int | None = None
    steps_per_epoch: int | None = None
    loop_s: float | None = None  # the training loop by the framework's own clock
    compile_s: float | None = None  # loop seconds above steps x the steady step time (its first steps)
    steady_step_s: float | None = None
    steady_loop_s: float | None = None  # steps x its own steady step time (slower where it shared the GPU)
    budget_loop_s: float | None = None  # steps x planned_step_s: the loop alone, what the budget is compared with
    startup_s: float | None = None  # the training command's wall time outside its loop
    data_s: float | None = None  # the session's data preparation for this framework (shared by its runs)
    tokens_per_s: float | None = None  # steady, trained tokens (padding left out where the log says)
    peak_gpu_mib: int | None = None  # nvidia-smi, the whole device, while the run trained alone
    peak_from: str | None = None  # run (it trained alone) | probe (it shared the GPU: its probe's peak)
    tau_heldout: float | None = None  # eagle3-eval, chain k=5, greedy, fp32, vLLM's rule
    tau_mtbench: float | None = None
    lossless: str | None = None
    vllm_acceptance: float | None = None  # vLLM's mean acceptance length, held-out prompts
    failed: list[str] = field(default_factory=list)  # phases that stopped with an error
    alone: bool | None = None  # it trained with the GPU to itself (a probe; one lane, nothing beside: reported only)
    reinstated: str | None = None  # brought back from the superseded file: why its measure still holds, and when
    first_acc: dict[str, float] | None = None  # step -> the first draft position's train accuracy (its own log)
    acc_by_tokens: dict[str, float] | None = None  # "<N>M" -> the same, once it had trained N million tokens
    scored_s: float | None = None  # from its training's end to its last phase: export, two evaluations, vLLM serving

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Run:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def scored(self) -> bool:
        """Evaluated as far as a job needs to hold it done (a final: on MT-bench too; its vLLM
        acceptance, lost with the machine that trained it, does not send it back to training)."""
        return self.tau_heldout is not None and (self.kind != "final" or self.tau_mtbench is not None)

    def reached(self) -> int:
        """How far the run got: trained, evaluated, served."""
        trained = self.steps is not None and self.steps >= self.steps_planned
        return trained + sum(x is not None for x in (self.tau_heldout, self.tau_mtbench, self.vllm_acceptance))


# --- budgets ---------------------------------------------------------------------------------------


def plan_steps(budget_s: float, step_s: float) -> int:
    """The optimizer steps that fill ``budget_s`` seconds of steady loop at ``step_s`` per step."""
    if not (budget_s > 0 and step_s > 0):
        raise ValueError(f"budget {budget_s} s and step time {step_s} s must be > 0")
    return max(1, round(budget_s / step_s))


def epochs_for(steps: int, steps_per_epoch: int) -> int:
    """Passes a framework must be allowed so that ``steps`` fit (it stops inside the last one)."""
    return max(1, math.ceil(steps / max(1, steps_per_epoch)))


def split_compile(points: list[tuple[int, float]]) -> tuple[float, float, float] | None:
    """(loop s, compile s, steady step s) from cumulative (step, loop seconds) readings.

    The steady step time is the median over the intervals after the first tenth of the steps (the
    first interval always left out: it holds the compilation); compile s is what the loop took above
    steps x that time. None: fewer than three readings."""
    pts = sorted(set(points))
    if len(pts) < 3:
        return None
    last_step, loop = pts[-1]
    cut = max(pts[0][0], last_step / 10)
    rates = [(s1 - s0) / (b - a) for (a, s0), (b, s1) in zip(pts, pts[1:]) if a >= cut and b > a]
    if not rates:
        return None
    steady = statistics.median(rates)
    return loop, max(0.0, loop - last_step * steady), steady


def bar_split(points: list[tuple[int, float]]) -> tuple[float, float, float] | None:
    """:func:`split_compile` for HF Trainer's bar, or, where its whole-second readings 10 s apart are
    too few for it (a short, fast run), the mean step after the first reading (the compilation came
    before that reading) up to the trainer's own loop time (the last point)."""
    if (split := split_compile(points)) and split[2] > 0:
        return split
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    (s0, t0), (s1, t1) = points[0], points[-1]
    step = (t1 - t0) / (s1 - s0)
    return t1, max(0.0, t1 - s1 * step), step


def step_time(
    runs: list[Run],
    framework: str,
    head: str,
    device: str,
    conversations: int | None = None,
    family: str | None = None,
    min_steps: int = 0,
) -> tuple[float, int | None] | None:
    """(steady step s, steps per epoch) of the longest probe of this framework and head on this device
    (probes have the GPU to themselves) of at least ``min_steps`` (or its one epoch, where that is
    shorter) that ended without a failed phase (its training ended: its start-up was measured), for
    speculators one whose log gave its steps per epoch. Only probes: a sized run's step time would
    re-size the sweep it belongs to."""
    known = [r for r in runs if (r.framework, r.head, r.device) == (framework, head, device) and r.steady_step_s
             and r.kind == "probe" and not r.failed and r.startup_s is not None
             and (r.steps or 0) >= min(min_steps, r.steps_per_epoch or min_steps)  # (a probe: one epoch at most)
             and (framework != "speculators" or r.steps_per_epoch)
             and conversations in (None, r.conversations)  # (speculators' epochs are the set's)
             and family in (None, r.head_shape.get("variant", "eagle3"))]  # fmt: skip
    if not known:
        return None
    best = max(known, key=lambda r: r.steps or 0)
    return best.steady_step_s, best.steps_per_epoch


def best(runs: list[Run], framework: str, budget_s: float = SWEEP_S) -> Run | None:
    """The framework's run with the highest held-out tau at the sweep's budget (any head): its
    configuration goes on to the seeds. Ties: the first in the file."""
    scored = [r for r in runs if r.framework == framework and r.budget_s == budget_s and r.tau_heldout is not None]
    return max(scored, key=lambda r: r.tau_heldout) if scored else None


PAST_EDGE = 2  # a sweep whose best lr is its highest (lowest) runs on past it, at most this many lrs a side


def swept(runs: list[Run], framework: str, head: str, seed: int | None = None) -> dict[float, float]:
    """lr -> held-out tau of the head's sweep runs scored (the sweep's budget; ``seed``: its default)."""
    seed = SEED[framework] if seed is None else seed
    return {r.lr: r.tau_heldout for r in runs if (r.framework, r.head, r.budget_s, r.seed) ==
            (framework, head, SWEEP_S, seed) and r.tau_heldout is not None}  # fmt: skip


def sweep_lrs(runs: list[Run], framework: str, head: str, seed: int | None = None) -> list[float]:
    """The lrs of a framework's head to sweep: its grid (``LRS``), and where the grid is scored (held-out
    tau at the sweep's budget, ``seed``: its default) and its best lr is at an end of what ran (ties
    count: the best may lie further), one lr further that way, by the ratio of the two lrs at that end
    rounded to one digit, and again once that one is scored, at most ``PAST_EDGE`` a side. The same rule
    for every framework: a best at the edge of a grid may not be the best."""
    lrs = sorted(LRS.get(f"{framework}:{head}", LRS[framework]))
    tau = swept(runs, framework, head, seed)
    up = down = 0
    while len(lrs) > 1 and all(lr in tau for lr in lrs):
        top = max(tau[lr] for lr in lrs)
        if tau[lrs[-1]] == top and up < PAST_EDGE:
            lrs.append(float(f"{lrs[-1] * lrs[-1] / lrs[-2]:.0e}"))
            up += 1
        elif tau[lrs[0]] == top and down < PAST_EDGE:
            lrs.insert(0, float(f"{lrs[0] * lrs[0] / lrs[1]:.0e}"))
            down += 1
        else:
            break
    return lrs


def _when(session: str) -> str:
    """A session id's time (``h100-20261206T1041`` -> ``20261206T1041``), what orders sessions."""
    return session.rsplit("-", 1)[-1]


def merge(old: list[Run], new: list[Run]) -> list[Run]:
    """``old`` with ``new`` in: a run of the same name is replaced where the new one got further, or as
    far from the same session or a later one (an older session's folder merged again leaves a later
    run of the name standing). The same run read again keeps what the file gave it: its note, and the
    data seconds and peak it took from other sessions and probes when first merged."""
    out = {r.name: r for r in old}
    for r in new:
        was = out.get(r.name)
        if was is not None and (r.reached(), _when(r.session)) < (was.reached(), _when(was.session)):
            continue
        if was is not None and was.session == r.session:
            r.reinstated = r.reinstated or was.reinstated
            r.data_s = was.data_s if r.data_s is None else r.data_s
            if r.peak_gpu_mib is None and was.peak_from == "probe":
                r.peak_gpu_mib, r.peak_from = was.peak_gpu_mib, was.peak_from
        out[r.name] = r
    return list(out.values())


# --- the verdict -----------------------------------------------------------------------------------


def spread(values: list[float]) -> float | None:
    """Largest minus smallest of a configuration's seeds (None: one seed)."""
    return round(max(values) - min(values), 3) if len(values) >= 2 else None


def _config(runs: list[Run], framework: str, budget_s: float) -> list[Run]:
    """The runs at a budget (every seed) of the framework's best configuration: the one its sweep chose
    at 3 minutes, the one its finals ran. At 10 minutes too: a framework whose finals ran two
    configurations (ours: AdamW's before Muon's sweep won) is judged by its sweep's choice, not by the
    better of them at 10 minutes. None where that configuration has no run at the budget."""
    top = best(runs, framework, SWEEP_S)
    if top is None:
        return []
    return [r for r in runs if (r.framework, r.head, r.budget_s, r.lr) == (top.framework, top.head, budget_s, top.lr)]


def compare(ours: list[float], peer: list[float]) -> dict[str, Any]:
    """Ours minus the peer (means over seeds), the larger of the two seed spreads, and whether the
    difference is larger than that spread (None: a side with one seed, no spread to judge by)."""
    if not ours or not peer:
        return {"diff": None, "spread": None, "beyond_spread": None}
    diff = round(statistics.mean(ours) - statistics.mean(peer), 3)
    spreads = [s for s in (spread(ours), spread(peer)) if s is not None]
    worst = max(spreads) if len(spreads) == 2 else None
    return {"diff": diff, "spread": worst, "beyond_spread": None if worst is None else abs(diff) > worst}


def _mean_loop(runs: list[Run]) -> float | None:
    loops = [r.budget_loop_s for r in runs if r.budget_loop_s is not None]
    return round(statistics.mean(loops), 1) if loops else None


def _one_set(runs: list[Run]) -> bool | None:
    """Whether the runs compared all trained on the same conversations (their sha256); None where a
    run does not say."""
    shas = {r.data_sha256 for r in runs}
    return None if "" in shas else len(shas) == 1


def _swept_heads(runs: list[Run], framework: str) -> list[str]:
    """The framework's heads, where the file holds any run of it (a head whose runs were superseded
    still has its sweep to run); none where it holds none (``not_run`` says why)."""
    return list(HEADS[framework]) if any(r.framework == framework for r in runs) else []


def sweeps_left(runs: list[Run], framework: str) -> list[str]:
    """``head lr`` of each lr the framework's sweeps (of each of its heads, where the file holds a run
    of it) still call for."""
    return [f"{h} {lr:g}" for h in _swept_heads(runs, framework) for lr in sweep_lrs(runs, framework, h)
            if lr not in swept(runs, framework, h)]  # fmt: skip


def sweep_table(runs: list[Run]) -> dict[str, Any]:
    """Each framework's head: its held-out tau at each lr it swept (3 minutes, its default seed), the
    lrs its sweep still calls for (its grid, and past an edge where its best lies there), and the lr
    MT-bench tau would have chosen where every lr swept has it (the held-out prompts both choose and
    score: a choice the other prompts make too does not hang on them)."""
    rows = []
    for fw in FRAMEWORKS:
        for head in _swept_heads(runs, fw):
            tau = swept(runs, fw, head)
            left = [lr for lr in sweep_lrs(runs, fw, head) if lr not in tau]
            top = max(tau, key=lambda lr: tau[lr]) if tau else None
            mt = {r.lr: r.tau_mtbench for r in runs if (r.framework, r.head, r.budget_s, r.seed) ==
                  (fw, head, SWEEP_S, SEED[fw]) and r.lr in tau and r.tau_mtbench is not None}  # fmt: skip
            by_mt = f"{max(mt, key=lambda lr: mt[lr]):g}" if tau and set(mt) == set(tau) else "—"
            rows.append([f"{fw}:{head}", ", ".join(f"{lr:g}: {tau[lr]:.3f}" for lr in sorted(tau)) or "—",
                         "—" if top is None else f"{top:g}", ", ".join(f"{lr:g}" for lr in left) or "—", by_mt])  # fmt: skip
    return {"title": "The sweeps (3 minutes, each framework's default seed): held-out tau at each lr, the best, the "
            "lrs still to run (the grid, and past its edge where the best lies there), and the best by MT-bench tau "
            "where every lr has it",
            "header": ["framework:head", "held-out tau by lr", "best lr", "lrs still to run", "best lr by MT-bench"],
            "rows": rows}  # fmt: skip


def verdict(runs: list[Run]) -> dict[str, Any]:
    """Ours against each peer at each budget, each framework at its best configuration."""
    rows = []
    for budget in (SWEEP_S, FINAL_S):
        mine = _config(runs, "ours", budget)
        for peer in FRAMEWORKS[1:]:
            theirs = _config(runs, peer, budget)
            if not mine or not theirs:
                continue
            row: list[Any] = [f"{budget / 60:g} min", peer, f"{theirs[0].head} lr {theirs[0].lr:g}", len(theirs)]
            for key in ("tau_heldout", "tau_mtbench", "vllm_acceptance"):
                c = compare(
                    [getattr(r, key) for r in mine if getattr(r, key) is not None],
                    [getattr(r, key) for r in theirs if getattr(r, key) is not None],
                )
                row += [c["diff"], c["spread"], c["beyond_spread"]]
            row += [f"{mine[0].head} lr {mine[0].lr:g}", _mean_loop(mine), _mean_loop(theirs), _one_set(mine + theirs),
                    "; ".join(f"{fw} {x}" for fw in ("ours", peer) for x in sweeps_left(runs, fw)) or "—"]  # fmt: skip
            rows.append(row)
    header = ["budget", "peer", "peer's config", "peer seeds"]
    for what in ("held-out tau", "MT-bench tau", "vLLM acceptance"):
        header += [f"ours ahead by ({what})", "seed spread", "beyond spread"]
    header += ["ours' config", "ours' loop s (alone)", "peer's loop s (alone)",  # (a budget one side missed shows)
               "one data set", "sweep lrs still to run (either side)"]  # fmt: skip
    return {"title": "Verdict: ours minus each peer, each at its best configuration (means over seeds)",
            "header": header, "rows": rows}  # fmt: skip


RUN_COLUMNS = ("name", "kind", "device", "lanes", "steps", "budget_loop_s", "steady_loop_s", "compile_s", "startup_s", "data_s",
               "tokens_per_s", "peak_gpu_mib", "peak_from", "tau_heldout", "tau_mtbench", "vllm_acceptance",
               "lossless")  # fmt: skip


def with_alone_data(runs: list[Run], sessions: list[dict[str, Any]]) -> list[Run]:
    """Runs whose data was prepared beside other work take the seconds it took alone in the latest
    session that measured it (as their peaks come from probes)."""
    latest_first = sorted(sessions, key=lambda s: str(s.get("id")), reverse=True)
    for r in runs:
        if r.data_s is None:
            found = (data_seconds(s.get("phases", []), r.framework, r.head) for s in latest_first)
            r.data_s = next((x for x in found if x is not None), None)
    return runs


def probe_peaks(runs: list[Run]) -> dict[tuple[str, str, str], int]:
    """(framework, head, GPU) -> the whole device's peak while its probe trained alone (the highest
    where it was probed more than once)."""
    out: dict[tuple[str, str, str], int] = {}
    for r in runs:
        if r.kind == "probe" and r.peak_from == "run" and r.peak_gpu_mib:
            key = (r.framework, r.head, r.device)
            out[key] = max(out.get(key, 0), r.peak_gpu_mib)
    return out


def with_probe_peaks(runs: list[Run]) -> list[Run]:
    """Runs that shared the GPU take the peak memory of their probe (the same framework, head and
    GPU, alone): the whole device's figure is not theirs."""
    probes = probe_peaks(runs)
    for r in runs:
        key = (r.framework, r.head, r.sized_on or r.device)
        if r.peak_gpu_mib is None and key in probes and r.steps is not None:
            r.peak_gpu_mib, r.peak_from = probes[key], "probe"
    return runs


def _device(r: Run) -> str:
    """Where the run trained, and where its steps were sized when that was another GPU."""
    return f"{r.device} (sized on {r.sized_on})" if r.sized_on and r.sized_on != r.device else r.device


YARDSTICK_KEYS = ("matmul_tflops", "launch_us", "python_loop_s")  # peers_gpu.yardstick's


def _probed(runs: list[Run], session: str | None) -> str:
    """The framework:head pairs whose probe a session measured."""
    return (
        ", ".join(sorted(f"{r.framework}:{r.head}" for r in runs if r.kind == "probe" and r.session == session)) or "—"
    )


def results(runs: list[Run], sessions: list[dict[str, Any]]) -> dict[str, Any]:
    """The results file's content."""
    order = sorted(
        with_probe_peaks(with_alone_data(runs, sessions)),
        key=lambda r: (r.budget_s or 0, FRAMEWORKS.index(r.framework), r.head, r.lr, r.seed),
    )
    return {
        "schema": SCHEMA,
        "what": "ours, speculators 0.9.0, ModelOpt 0.47.0 and SpecForge 0.2.0 on the embedded SmolLM2-135M-Instruct: the same "
        "conversations, equal budgets of steady training loop (start-up and compilation apart), a three-lr sweep "
        "at 3 minutes per framework and head (going on past the grid's edge where a head's best lies there), its "
        "best at 10 minutes with two seeds; one yardstick: eagle3-eval "
        "(chain k=5, greedy, fp32, lossless-checked, vLLM's rule) on the held-out prompts and MT-bench, and "
        "vLLM's acceptance length",
        "command": "python3 benchmarks/peers_gpu.py start sweep|final FRAMEWORK[:HEAD] ... (its --help)",
        "machine": "one GPU a session: " + ", ".join(sorted({str(s.get("device")) for s in sessions})),
        "runs": "single run each; the 10-minute configurations two seeds; probes ran alone on the GPU, sized runs "
        "up to `lanes` at once (the budget_loop_s column is their loop alone)",
        "withdrawn": WITHDRAWN,
        "raw": "benchmarks/results/raw/peers_<gpu>/<session id>.tgz: each session's last poll (phases, logs, "
        "train metrics, eval and served reports); `peers_results.py merge` of those, oldest first, into this "
        "file gives it again byte for byte (session notes, written here, are kept)",
        "not_run": {fw: why for fw, why in NOT_RUN.items() if not any(r.framework == fw for r in runs)},
        "sessions": sessions,
        "frameworks": [asdict(r) | {"name": r.name} for r in order],
        "tables": [
            {**(v := verdict(runs)), "rows": [[_dash(x) for x in row] for row in v["rows"]]},
            sweep_table(runs),
            {
                "title": "Every run (seconds: steady loop, compilation, start-up, data preparation)",
                "header": list(RUN_COLUMNS),
                "rows": [[_dash(_device(r) if c == "device" else getattr(r, c)) for c in RUN_COLUMNS] for r in order],
            },
            {
                "title": "Sessions, each on a machine of its own: the yardstick each ran alone at its start (bf16 "
                "matmul 8192, a one-element op's launch, 3M Python loop steps)",
                "header": ["session", "device", "matmul TFLOP/s", "launch us", "Python loop s", "probes"],
                "rows": [
                    [
                        s.get("id"),
                        s.get("device"),
                        *[_dash((s.get("yardstick") or {}).get(k)) for k in YARDSTICK_KEYS],
                        _probed(runs, s.get("id")),
                    ]
                    for s in sorted(sessions, key=lambda s: str(s.get("id")))
                ],
            },
            *([learning] if (learning := learning_table(order))["rows"] else []),
            *([by_tokens] if (by_tokens := tokens_table(order))["rows"] else []),
            *(
                [
                    {
                        "title": "Runs not carried through: where each stopped, and whether the next job that "
                        "wants it trains it again",
                        "header": ["name", "session", "steps", "missing", "why", "trained again"],
                        "rows": rows,
                    }
                ]
                if (rows := unfinished(order))
                else []
            ),
            *(
                [
                    {
                        "title": "Runs brought back from the superseded file, and why their measure holds",
                        "header": ["name", "session", "reinstated"],
                        "rows": [[r.name, r.session, r.reinstated] for r in order if r.reinstated],
                    }
                ]
                if any(r.reinstated for r in order)
                else []
            ),
        ],  # fmt: skip
    }


def step_tokens(r: Run) -> int | None:
    """About how many tokens a step of the run carried: its steady tokens/s over its steady step."""
    return round(r.tokens_per_s * r.steady_step_s) if r.tokens_per_s and r.steady_step_s else None


def learning_table(runs: list[Run]) -> dict[str, Any]:
    """What each sweep and final run learned by optimizer step: the first draft position's train
    accuracy by its own log (ours' ``acc[0]``, speculators' ``full_acc_0``: the same quantity, argmax
    against the target's, over its trained positions; where a head's draft vocabulary lacks a target
    token, ours counts the position as missed, and how speculators' matched head counts it is not
    checked: its default head, on the full vocabulary, reads within 0.05 of it), beside the tokens each
    of its steps carried."""
    rows = [[r.name, step_tokens(r), r.steps, *[(r.first_acc or {}).get(str(s)) for s in ACC_STEPS],
             (r.first_acc or {}).get("last"), r.tau_heldout]
            for r in runs if r.first_acc and r.kind != "probe"]  # fmt: skip
    return {"title": f"Learning by optimizer step: the first draft position's train accuracy (each framework's own "
                     f"log, the mean over the {ACC_WINDOW} steps up to each), beside the tokens a step carried",
            "header": ["name", "tokens a step (about)", "steps", *[f"acc @{s}" for s in ACC_STEPS], "acc last",
                       "held-out tau"],
            "rows": [[_dash(x) for x in row] for row in rows]}  # fmt: skip


def tokens_table(runs: list[Run]) -> dict[str, Any]:
    """The learning table read by trained tokens rather than optimizer steps: the same accuracy once
    each run had trained 2, 5, 10, 15 and 20 million tokens (ours' steps carry ~32k tokens, speculators'
    ~8k), so that how much a framework learns from a token can be read apart from how many steps its
    minutes make."""
    rows = [[r.name, step_tokens(r), r.steps, *[(r.acc_by_tokens or {}).get(f"{m}M") for m in TOKEN_MARKS],
             r.tau_heldout]
            for r in runs if r.acc_by_tokens and r.kind != "probe"]  # fmt: skip
    return {"title": "Learning by trained tokens: the first draft position's train accuracy (as in the table above) "
                     "once each run had trained so many tokens",
            "header": ["name", "tokens a step (about)", "steps", *[f"acc @{m}M tokens" for m in TOKEN_MARKS],
                       "held-out tau"],
            "rows": [[_dash(x) for x in row] for row in rows]}  # fmt: skip


def unfinished(runs: list[Run]) -> list[list[Any]]:
    """Sweep and final runs the file holds short of their end (steps short of the plan, or a measure a
    run of that kind takes missing): where each stopped, and what it says of why."""
    rows = []
    for r in runs:
        wanted = ["tau_heldout", *(["tau_mtbench", "vllm_acceptance"] if r.kind == "final" else [])]
        missing = [k for k in wanted if getattr(r, k) is None]
        short = r.steps is None or r.steps < r.steps_planned
        if r.kind == "probe" or not (short or missing):
            continue
        why = ", ".join(f"{p} failed" for p in r.failed) or (
            "no phase failed: the machine went back, or the job was still running, at the session's last poll"
        )
        rows.append([r.name, r.session, f"{r.steps or 0} of {r.steps_planned}", ", ".join(missing) or "—", why,
                     not r.scored()])  # fmt: skip
    return rows


def _dash(x: Any) -> Any:
    return "—" if x is None else x


# --- reading a session's folder --------------------------------------------------------------------


def memory_trace(path: Path) -> list[tuple[float, int]]:
    """(epoch seconds, MiB used) from nvidia-smi's csv (its timestamps in UTC)."""
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        m = re.match(r"\s*(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d+),\s*(\d+) MiB", line)
        if m:
            t = datetime.strptime(m[1], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
            out.append((t, int(m[2])))
    return out


def ours_points(text: str) -> tuple[list[tuple[int, float]], float | None]:
    """Our trainer's metrics.jsonl: (step, loop_s) per logged step, and its median tokens/s."""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in rows[1:] if "tokens_per_s" in r]  # (the first window compiles)
    pts = [(r["step"], r["loop_s"]) for r in rows if "loop_s" in r]
    return pts, (statistics.median(rates) if rates else None)


def without_validation(text: str) -> str:
    """speculators' log without its validation passes (their bars also read 'Epoch N')."""
    return re.sub(r"Validation epoch \d+/\d+ started.*?(?:Validation epoch \d+/\d+ completed|\Z)", "", text, flags=re.S)


def speculators_points(text: str) -> tuple[list[tuple[int, float]], float | None, int | None]:
    """speculators' log: cumulative (step, seconds) from its per-step ``profile/step_ms``, its median
    tokens/s, and its steps per epoch (the training bar's total)."""
    text = without_validation(text)
    ms = [float(x) for x in re.findall(r"profile/step_ms=([0-9.e+-]+)", text)]
    pts, t = [], 0.0
    for i, m in enumerate(ms, 1):
        t += m / 1000
        pts.append((i, t))
    rates = [float(x) for x in re.findall(r"profile/tokens_per_s=([0-9.e+-]+)", text)][len(ms) // 10 + 1 :]
    totals = re.findall(r"Epoch \d+\s+\d+%\s+\S+\s+\d+/(\d+)", text)
    return pts, (statistics.median(rates) if rates else None), (int(totals[0]) if totals else None)


ACC_STEPS = (100, 300, 600, 1000, 2000)  # the optimizer steps the learning table reads each run's accuracy at
ACC_WINDOW = 20  # ... as the mean of the values it logged over this many steps up to it (one batch is noisy)


def window(pairs: list[tuple[int, float]], step: int) -> list[float]:
    """What a log's (step, value) pairs hold over the :data:`ACC_WINDOW` steps up to ``step``."""
    return [a for s, a in pairs if step - ACC_WINDOW < s <= step]


def first_acc(pairs: list[tuple[int, float]]) -> dict[str, float] | None:
    """The first draft position's train accuracy at each of :data:`ACC_STEPS` the run reached, and at
    its last step (``"last"``), each the mean of what it logged over the :data:`ACC_WINDOW` steps up to
    there (None: the log has none)."""
    if not pairs:
        return None
    last = max(s for s, _ in pairs)
    out = {str(s): round(statistics.fmean(w), 3) for s in ACC_STEPS if s <= last and (w := window(pairs, s))}
    return out | {"last": round(statistics.fmean(window(pairs, last)), 3)}


TOKEN_MARKS = (2, 5, 10, 15, 20)  # millions of trained tokens the learning-by-tokens table reads each run at


def acc_by_tokens(pairs: list[tuple[int, float]], tokens_per_step: float) -> dict[str, float] | None:
    """The first draft position's train accuracy once the run had trained each of :data:`TOKEN_MARKS`
    million tokens (the step its steady tokens a step reach them at), the mean of what it logged over the
    :data:`ACC_WINDOW` steps up to there; marks past its last step are left out (None: none reached)."""
    if not pairs or tokens_per_step <= 0:
        return None
    last, out = max(s for s, _ in pairs), {}
    for m in TOKEN_MARKS:
        step = round(m * 1e6 / tokens_per_step)
        if step <= last and (w := window(pairs, step)):
            out[f"{m}M"] = round(statistics.fmean(w), 3)
    return out or None


def ours_acc(text: str) -> list[tuple[int, float]]:
    """Our trainer's metrics.jsonl: (step, acc of the first chain position) per logged step."""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [(r["step"], r["acc"][0]) for r in rows if r.get("acc")]


def speculators_acc(text: str) -> list[tuple[int, float]]:
    """speculators' log: (global_step, ``train/full_acc_0``) per training record (its validation passes
    left out)."""
    out = []
    for record in without_validation(text).split("train/loss_0=")[1:]:
        acc, step = re.search(r"train/full_acc_0=([0-9.e+-]+)", record), re.search(r"global_step=(\d+)", record)
        if acc and step:
            out.append((int(step[1]), float(acc[1])))
    return out


def specforge_points(text: str) -> list[tuple[int, float]]:
    """SpecForge's console lines ``step N: {..., 'perf/optimizer_step_time_s': s, ...}`` (one each
    ``training.log_interval`` steps, s the mean over those steps): cumulative (step, seconds)."""
    pts, t, last = [], 0.0, 0
    for step, body in re.findall(r"^step (\d+): (\{.*\})\s*$", text, re.M):
        if m := re.search(r"'perf/optimizer_step_time_s': ([0-9.e+-]+)", body):
            t += float(m[1]) * (int(step) - last)
            last = int(step)
            pts.append((last, t))
    return pts


def trainer_points(text: str, steps: int) -> list[tuple[int, float]]:
    """HF Trainer's progress bar (ModelOpt): (step, seconds) at each reading of the bar that counts
    ``steps`` (its max_steps; the data loading's and the save's bars count other things)."""
    bars = re.findall(r"(\d+)/(\d+) \[(?:(\d+):)?(\d+):(\d\d)", text)
    pts = [
        (int(d), 3600.0 * int(h or 0) + 60 * int(m) + int(s)) for d, n, h, m, s in bars if int(n) == steps and int(d)
    ]
    kept = pts[:1]
    for p in pts[1:]:  # its clock counts whole seconds: readings BAR_GAP_S apart, or the median interval reads 0 s
        if p[1] - kept[-1][1] >= BAR_GAP_S:
            kept.append(p)
    return kept + pts[-1:] if pts and kept[-1] != pts[-1] else kept


def _tau(path: Path) -> tuple[float | None, str | None]:
    if not path.is_file():
        return None, None
    from eagle3_train.core.reports import read_eval_report  # (the readers above need no package)

    r = read_eval_report(path)
    return round(r.tau, 3), r.lossless


CHECK = "check "  # a data phase of the harness's own checks (not the framework's preparation): not its seconds


def data_seconds(phases: list[dict], framework: str, head: str) -> float | None:
    """The framework's data preparation for this head, where it ran alone on the GPU (None: not in
    these phases, or beside other work)."""
    mine = [p for p in phases if p["run"] == f"{framework}_data" and not p["rc"]]
    if not mine or any(p.get("shared") for p in mine):
        return None
    return round(sum(p["seconds"] for p in mine if (p["phase"] != "vocab" or head == "matched")
                     and not p["phase"].startswith(CHECK)), 1) or None  # fmt: skip


STEP_TOKENS = "tokens_per_step.json"  # in <session>/modelopt_data/, specforge_data/: mean tokens a step


def train_log(d: Path) -> str | None:
    """The run's training log, or the gzipped one of a raw folder (large logs are kept gzipped there)."""
    if (d / "train.log").is_file():
        return (d / "train.log").read_text(errors="replace")
    if (d / "train.log.gz").is_file():
        return gzip.decompress((d / "train.log.gz").read_bytes()).decode(errors="replace")
    return None


def read_run(d: Path, phases: list[dict], trace: list[tuple[float, int]]) -> Run:
    """One run's folder (``<po>/<name>``): its spec, its training log, its reports."""
    run = Run.from_dict(json.loads((d / "spec.json").read_text()))
    mine = {p["phase"]: p for p in phases if p["run"] == d.name}
    run.failed = [p for p, v in mine.items() if v["rc"]]
    pts: list[tuple[int, float]] = []
    acc: list[tuple[int, float]] = []
    timing, per_step = split_compile, None
    log = train_log(d)
    if (d / "run/train/metrics.jsonl").is_file():
        metrics = (d / "run/train/metrics.jsonl").read_text()
        pts, run.tokens_per_s = ours_points(metrics)
        run.first_acc = first_acc(acc := ours_acc(metrics))
    elif run.framework == "speculators" and log is not None:
        pts, run.tokens_per_s, run.steps_per_epoch = speculators_points(log)
        run.first_acc = first_acc(acc := speculators_acc(log))
    elif run.framework == "specforge" and log is not None:
        pts = specforge_points(log)
    elif log is not None:
        pts = trainer_points(log, run.steps_planned)
        if m := re.findall(r"'train_runtime': '?([0-9.]+)", log):
            pts.append((pts[-1][0] if pts else 0, float(m[-1])))  # its own loop time closes the curve
        timing = bar_split
    if (tokens := d.parent / f"{run.framework}_data" / STEP_TOKENS).is_file():  # (ModelOpt, SpecForge: one sample
        per_step = json.loads(tokens.read_text())["tokens_per_step"]  # a step, their mean; none for the others)
    if pts:
        run.steps = max(s for s, _ in pts)
    if split := timing(pts):
        run.loop_s, run.compile_s, run.steady_step_s = (round(x, 4) for x in split)
        run.steady_loop_s = round(run.steps * run.steady_step_s, 1)
        if per_step and run.steady_step_s:
            run.tokens_per_s = round(per_step / run.steady_step_s, 1)
    if run.tokens_per_s and run.steady_step_s:
        run.acc_by_tokens = acc_by_tokens(acc, run.tokens_per_s * run.steady_step_s)
    if "train" in mine:
        t = mine["train"]
        beside = [p for p in phases if p["run"] != d.name and p["start"] < t["end"] and p["end"] > t["start"]]
        run.alone = run.kind == "probe" or (run.lanes == 1 and not beside)  # (an engine's hold: lanes_hold)
        if run.loop_s is not None:
            run.startup_s = round(t["seconds"] - run.loop_s, 1)
        inside = [mib for ts, mib in trace if t["start"] <= ts <= t["end"]]
        if inside and run.alone:  # (a run that had company: its probe's peak, see with_probe_peaks)
            run.peak_gpu_mib, run.peak_from = max(inside), "run"
    if run.steps is not None:  # its loop alone: its own steady step where it was alone, else the one measured alone
        alone = run.steady_step_s if run.alone else run.planned_step_s
        run.budget_loop_s = round(run.steps * alone, 1) if alone else None
    run.data_s = data_seconds(phases, run.framework, run.head)
    if "train" in mine and {"eval_heldout", "eval_mtbench", "served"} <= set(mine):  # (scored the three ways)
        run.scored_s = round(max(p["end"] for p in mine.values()) - mine["train"]["end"], 1)
    run.tau_heldout, run.lossless = _tau(d / "eval_heldout/report.json")
    run.tau_mtbench, _ = _tau(d / "eval_mtbench/report.json")
    if (d / "served/report.json").is_file():
        from eagle3_train.core.reports import read_served_report

        run.vllm_acceptance = round(read_served_report(d / "served/report.json").mean_acceptance_length, 3)
    return run


def read_session(po: Path) -> tuple[list[Run], dict[str, Any]]:
    """Every run of a session's folder (the GPU machine's, or an unpacked poll), and the session."""
    phases = [json.loads(x) for x in (po / "phases.jsonl").read_text().splitlines() if x.strip()] \
        if (po / "phases.jsonl").is_file() else []  # fmt: skip
    trace = memory_trace(po / "smi.csv")
    runs = [read_run(spec.parent, phases, trace) for spec in sorted(po.glob("*/spec.json"))]
    session = json.loads((po / "session.json").read_text()) if (po / "session.json").is_file() else {}
    kept = ("data", "lanes_hold")  # (the shared set; a preparation's hold beside the lanes, from asking to ready)
    session["phases"] = [p for p in phases if p["run"] in kept or p["run"].endswith("_data")]
    return runs, session


def save(out: Path, runs: list[Run], sessions: list[dict[str, Any]]) -> None:
    """The results file ``out`` written afresh from ``runs`` and ``sessions`` (its tables recomputed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results(runs, sessions), indent=1) + "\n")


def load(path: Path) -> tuple[list[Run], list[dict[str, Any]]]:
    """A results file's runs and sessions (none where it does not exist yet)."""
    if not path.is_file():
        return [], []
    data = json.loads(path.read_text())
    if data.get("schema") != SCHEMA:
        raise SystemExit(f"{path}: schema {data.get('schema')}, this reader knows {SCHEMA}")
    return [Run.from_dict(r) for r in data["frameworks"]], data["sessions"]


def superseded_path(out: Path) -> Path:
    return out.with_name(f"{out.stem}_superseded.json")


def _superseded(out: Path) -> list[dict[str, Any]]:
    path = superseded_path(out)
    return json.loads(path.read_text())["frameworks"] if path.is_file() else []


def supersede(out: Path, framework: str, head: str, reason: str) -> int:
    """The framework's head's runs taken out of the results file ``out`` into its superseded file, each
    with ``reason`` and the date; how many. Their sessions stay (their other runs, their yardsticks)."""
    runs, sessions = load(out)
    gone = [r for r in runs if (r.framework, r.head) == (framework, head)]
    kept = [r for r in runs if (r.framework, r.head) != (framework, head)]
    if not gone:
        raise SystemExit(f"peers_results: {out} holds no run of {framework}:{head}")
    moved = _superseded(out) + [asdict(r) | {"name": r.name, "superseded": reason, "superseded_on": _today()}
                                for r in gone]  # fmt: skip
    _write_superseded(out, moved)
    save(out, kept, sessions)
    return len(gone)


def _today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def reinstate(out: Path, keys: list[str], reason: str) -> int:
    """The superseded runs ``keys`` (``NAME@SESSION``) back in the results file ``out``, each with
    ``reason`` and the date; how many. A name the results already hold (a run of it measured since) is
    refused: that newer run stands."""
    runs, sessions = load(out)
    away = _superseded(out)
    index = {f"{r['name']}@{r.get('session')}": i for i, r in enumerate(away)}
    missing = [k for k in keys if k not in index]
    if missing:
        raise SystemExit(f"peers_results: {superseded_path(out)} holds no run {', '.join(missing)} (NAME@SESSION: "
                         f"{', '.join(index) or 'none there'})")  # fmt: skip
    back = [away[index[k]] for k in keys]
    held = {r.name: r.session for r in runs}
    clash = [f"{r['name']} (session {held[r['name']]})" for r in back if r["name"] in held]
    if clash:
        raise SystemExit(f"peers_results: {out} already holds {', '.join(clash)}, measured since: it stands")
    extra = ("name", "superseded", "superseded_on")
    returned = [Run.from_dict({k: v for k, v in r.items() if k not in extra}) for r in back]
    for r, old in zip(returned, back):
        r.reinstated = f"{reason} (superseded on {old['superseded_on']}: {old['superseded']}; reinstated {_today()})"
    taken = {index[k] for k in keys}
    _write_superseded(out, [r for i, r in enumerate(away) if i not in taken])
    save(out, runs + returned, sessions)
    return len(returned)


def note(out: Path, session: str, text: str) -> None:
    """``text`` as the note of the session ``session`` in the results file ``out`` (replacing its note)."""
    runs, sessions = load(out)
    ids = [str(s.get("id")) for s in sessions]
    if session not in ids:
        raise SystemExit(
            f"peers_results: {out} holds no session {session} (its sessions: {', '.join(sorted(ids)) or 'none'})"
        )
    sessions = [{**s, "note": text} if s.get("id") == session else s for s in sessions]
    save(out, runs, sessions)


def _write_superseded(out: Path, moved: list[dict[str, Any]]) -> None:
    columns = ("name", "session", "steps", "planned_step_s", "tau_heldout", "superseded_on", "superseded")
    superseded_path(out).write_text(json.dumps({
        "schema": SCHEMA,
        "what": f"runs taken out of {out.name}: each still measured what it says, but a change to its framework "
        "since (the reason beside it) changed what such a run measures, so its configuration runs again",
        "command": "python3 benchmarks/peers_results.py supersede RESULTS FRAMEWORK:HEAD --reason ...",
        "runs": "as in the results file they left",
        "frameworks": moved,
        "tables": [{"title": "The runs taken out, and why", "header": list(columns),
                    "rows": [[_dash(r.get(c)) for c in columns] for r in moved]}],
    }, indent=1) + "\n")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["merge", "supersede", "reinstate", "note"])
    ap.add_argument("new", type=Path, help="merge: a poll's poll.tgz (kept under raw/), the folder it was unpacked "
                    "into, or its peers_partial.json; supersede, reinstate: the results file")  # fmt: skip
    ap.add_argument("out", nargs="+", help="merge: the results file (created, or merged into); supersede: "
                    "FRAMEWORK:HEAD; reinstate: NAME@SESSION of each run (its superseded file's table names them); "
                    "note: the session's id")  # fmt: skip
    ap.add_argument("--reason", help="supersede: what changed, so that its runs measure something else now; "
                    "reinstate: the measurement that shows they still measure what they say")  # fmt: skip
    ap.add_argument("--text", help="note: the session's note")
    a = ap.parse_args(argv)
    if a.what == "reinstate":
        if not a.reason:
            ap.error("reinstate takes NAME@SESSION ... and --reason")
        print(f"peers_results: {reinstate(a.new, a.out, a.reason)} runs back in {a.new} from {superseded_path(a.new)}")
        return
    if a.what == "note":
        if len(a.out) != 1 or not a.text:
            ap.error("note takes one SESSION and --text")
        note(a.new, a.out[0], a.text)
        print(f"peers_results: the note of session {a.out[0]} in {a.new}")
        return
    if len(a.out) != 1:
        ap.error(f"{a.what} takes one {'FRAMEWORK:HEAD' if a.what == 'supersede' else 'results file'}")
    if a.what == "supersede":
        fw, _, head = a.out[0].partition(":")
        if not head or not a.reason:
            ap.error("supersede takes FRAMEWORK:HEAD and --reason")
        print(f"peers_results: {supersede(a.new, fw, head, a.reason)} runs of {a.out[0]} taken out of {a.new} into "
              f"{superseded_path(a.new)}")  # fmt: skip
        return
    a.out = Path(a.out[0])
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (eagle3_train reads the eval reports)
    if not a.new.exists():
        raise SystemExit(f"peers_results: {a.new}: no such file or folder (a poll's poll.tgz, the folder it was "
                         "unpacked into, or its peers_partial.json)")  # fmt: skip
    print(f"peers_results: {merge_into(a.new, a.out)} runs in {a.out}")


def raw_path(out: Path, session_id: str) -> Path:
    """Where a session's poll is kept beside the results file ``out``."""
    return out.parent / "raw" / out.stem / f"{session_id}.tgz"


def merge_into(new: Path, out: Path) -> int:
    """A poll (its ``.tgz``, kept under :func:`raw_path`), a session's folder or a partial results file
    merged into the results file ``out``; how many runs it then holds."""
    runs, sessions = load(out)
    if new.name.endswith((".tgz", ".tar.gz")):
        with tempfile.TemporaryDirectory() as unpacked:
            with tarfile.open(new) as tar:
                tar.extractall(unpacked, filter="data")
            fresh, session = read_session(Path(unpacked))
        if not session.get("id"):
            raise SystemExit(f"peers_results: {new} holds no session.json (is it a poll of peers_gpu.py?)")
        kept = raw_path(out, session["id"])
        if not kept.exists() or not kept.samefile(new):
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(new, kept)
        new_sessions = [session]
    elif new.is_dir():
        fresh, session = read_session(new)
        new_sessions = [session]
    else:
        fresh, new_sessions = load(new)
    ids = {s.get("id") for s in new_sessions}
    notes = {s.get("id"): s["note"] for s in sessions if s.get("note")}  # (written here, not in the folder)
    new_sessions = [{**s, "note": notes[s.get("id")]} if not s.get("note") and s.get("id") in notes else s
                    for s in new_sessions]  # fmt: skip
    sessions = [s for s in sessions if s.get("id") not in ids] + new_sessions
    sessions.sort(key=lambda s: _when(str(s.get("id", ""))))  # (in time: any order of merging gives one file)
    gone = {(r["name"], r.get("session")) for r in _superseded(out)}  # (an old session's folder merged again)
    merged = merge(runs, [r for r in fresh if (r.name, r.session) not in gone])
    save(out, merged, sessions)
    return len(merged)


if __name__ == "__main__":
    main()
