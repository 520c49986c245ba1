"""The draft head's variants at equal training minutes on one GPU: EAGLE-3 against EAGLE-3.1
(``model.variant``), each at several seeds, held-out τ and τ by prompt length, then the best heads
served by vLLM and SGLang (acceptance and speed-up through eagle3-bench).

    python3 benchmarks/heads.py long-prompts                       # here: data_prep/prompts/long.jsonl
    python3 benchmarks/heads.py start --work /tmp/heads            # there: one detached job
    python3 benchmarks/heads.py poll --work /tmp/heads 540 "$OUT"   # there: back to back until "ended"
    python3 benchmarks/heads.py results FILES_AT/heads.json        # here: benchmarks/results/heads_<gpu>.json

The job synthesizes ``--n`` conversations once with the smollm2 recipe's prepare options, then runs
``eagle3-run recipe=smollm2`` from that prepared data for every (seed, variant) with
``train.loop.max_minutes`` (export, check and eval on the shipped held-out prompts follow), evaluates
each head on the long-prompt set, and benches the heads of the first seed in both engines when they
are staged (``benchmarks/staging/stage_vllm.sh`` / ``stage_sglang.sh``). Every step rewrites
``<work>/heads.json``, so a machine lost partway leaves what was measured; each poll copies it out.

A variant named ``eagle3.1+long`` trains on its own prepared data with ``prepare.synth.long_fraction``
(long-context samples); ``--steps`` gives every run the same optimizer steps instead of minutes (runs
that share the GPU, ``--parallel``); ``--bench-variant`` with ``--bench`` benches one head
(``vllm:[levels]``, ``sglang:chain``, ``sglang:tree``), and ``--same-turns`` evaluates it on exactly
the turns the first bench counted (fp32 and bf16), the yardstick for served acceptance against eval τ.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "data_prep" / "prompts"
BUCKETS = {"len_0.1k": 100, "len_1k": 1000, "len_2k": 2000, "len_4k": 4000, "len_7k": 7000}  # tokens of document
TASKS = (
    "Summarize the text above in three sentences.",
    "List the main points of the text above as a short bulleted list.",
    "Write a short title for the text above, then explain in two sentences why it fits.",
    "What question does the text above answer best? State it, then answer it briefly.",
    "Rewrite the first idea of the text above for a ten-year-old.",
    "Which part of the text above is the least clear? Explain and improve it.",
)
ENV = {"PYTHONPATH": "/tmp/site:/tmp/repo", "EAGLE3_CACHE": "/tmp/e3cache", "HF_HUB_OFFLINE": "1"} | {
    "PYTHONUNBUFFERED": "1",
    "WANDB_MODE": "disabled",
}
ENGINE_SITES = {"vllm": "/tmp/vsite", "sglang": "/tmp/sgsite"}
MAX_TURNS = 8  # user turns per held-out conversation sent by the bench (and by the same-turns eval)
SGLANG_ARGS = "--attention-backend triton --sampling-backend pytorch --mem-fraction-static {memory}"
CONVERSATIONS = "conversations.jsonl.gz"  # the base prepare's synthesized conversations, polled out
LONG = "+long"  # a variant's suffix: trained on data with long-context samples (prepare.synth.long_fraction)


def long_prompts(out: Path, per_bucket: int) -> None:
    """Documents of each bucket's length cut from the replies the embedded target wrote itself
    (``synth_smollm2.jsonl.gz``: its own text, so the draft meets its target's style), each followed
    by a task; ``category`` names the bucket, so eagle3-eval's per-category τ is τ by length."""
    from transformers import AutoTokenizer

    from eagle3_train.targets import load_target

    local = load_target("embedded", cache_dir=os.environ.get("EAGLE3_CACHE"), dtype="float32").local_dir
    tok = AutoTokenizer.from_pretrained(str(local))
    with gzip.open(PROMPTS / "synth_smollm2.jsonl.gz", "rt") as f:
        replies = [m["content"] for line in f for m in json.loads(line)["messages"] if m["role"] == "assistant"]
    ids = [tok.encode(r + "\n\n", add_special_tokens=False) for r in replies]
    rows, cursor = [], 0
    for bucket, length in BUCKETS.items():
        for i in range(per_bucket):
            doc: list[int] = []
            while len(doc) < length:  # whole replies, then cut at the bucket's length
                doc += ids[cursor % len(ids)]
                cursor += 1
            text = tok.decode(doc[:length]).strip()
            task = TASKS[i % len(TASKS)]
            rows.append(
                {
                    "id": f"{bucket}-{i}",
                    "category": bucket,
                    "messages": [{"role": "user", "content": f"{text}\n\n{task}"}],
                }
            )
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts, {per_bucket} per bucket {list(BUCKETS)} -> {out}")


class Job:
    """The detached pipeline: every step's figures into ``heads.json`` as soon as it ends."""

    def __init__(self, a: argparse.Namespace):
        self.a, self.work = a, Path(a.work)
        self.path, self.lock = self.work / "heads.json", threading.Lock()
        self.res: dict[str, Any] = (
            json.loads(self.path.read_text())
            if self.path.exists()
            else {
                "what": "EAGLE-3 against EAGLE-3.1 heads (model.variant) at equal training-loop minutes on the smollm2 "
                "recipe's synthesized data; tau on the shipped held-out prompts and by prompt length; served by vLLM "
                "and SGLang through eagle3-bench",
                "machine": gpu_name(),
                "command": "python3 benchmarks/heads.py start " + " ".join(sys.argv[2:]),
                "date": datetime.date.today().isoformat(),
                "runs": "single run per (variant, seed)",
                "settings": vars(a),
                "steps": {},
                "heads": {},
                "bench": {},
            }
        )

    def save(self) -> None:
        with self.lock:  # the +long arm's thread saves too
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.res, indent=1))
            os.replace(tmp, self.path)

    def sh(self, name: str, cmd: list[str], limit: int, env: dict[str, str] | None = None) -> int:
        """``cmd`` under a time limit, its output in ``<work>/<name>.log``; its time and status recorded."""
        t0 = time.time()
        with open(self.work / f"{name}.log", "w") as log:
            try:
                rc = subprocess.run(
                    cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit, env={**os.environ, **ENV, **(env or {})}
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        self.res["steps"][name] = {"rc": rc, "seconds": round(time.time() - t0, 1)}
        self.save()
        return rc

    def run(self) -> None:
        a = self.a
        long = [v for v in a.variants if v.endswith(LONG)]
        rest = [v for v in a.variants if v not in long]
        side = None
        if a.parallel and long and rest:
            # the long-context arm beside the benches once the others are trained (one synthesis and one
            # training at a time on the GPU); equal steps then, not minutes
            self.arms(rest)
            side = threading.Thread(target=self.arms, args=(long,))
            side.start()
        else:
            self.arms(a.variants)
        if a.bench_variant:
            export = self.work / run_name(a.bench_variant, a.seeds[0]) / "export"
            for spec in a.bench:
                self.bench(spec, a.bench_variant, export)
                if spec == a.bench[0] and a.same_turns:
                    self.same_turns(a.bench_variant, export)
        else:  # the first seed's heads, served
            for variant in a.variants:
                export = self.work / run_name(variant, a.seeds[0]) / "export"
                for spec in (f"vllm:{a.vllm_concurrency}", "sglang:chain"):
                    if variant != a.variants[-1]:
                        spec = spec.replace(a.vllm_concurrency, "[1]")  # the control: its acceptance only
                    self.bench(spec, variant, export)
        if side:
            side.join()
        self.res["ended"] = True
        self.save()

    def data_options(self, variant: str) -> list[str]:
        """The prepare options of a variant's data (the same in its prepare and its run)."""
        a = self.a
        opts = [f"prepare.synthesize={a.n}"]
        if a.memory_share:
            opts.append(f"prepare.regen.memory_share={a.memory_share}")
        if variant.endswith(LONG):
            opts += [f"prepare.synth.long_fraction={a.long_fraction}", "prepare.max_length=8192"]  # 7k documents
        return opts

    def prepare(self, variant: str) -> Path:
        """The prepared data a variant trains on, synthesized once per kind (plain, long-context)."""
        base = self.work / ("base_long" if variant.endswith(LONG) else "base")
        if not (base / "prepared").exists():
            run = [sys.executable, "-m", "eagle3_train.run", "recipe=smollm2", f"out={base}", "until=prepare"]
            keep = f"prepare.save_conversations={base / CONVERSATIONS}"  # the peers' shared set too
            self.sh(f"prepare_{base.name}", [*run, *self.data_options(variant), keep], 1500)
        return base

    def arms(self, variants: list[str]) -> None:
        """Train and evaluate each variant at each seed on its data."""
        for seed in self.a.seeds:
            for variant in variants:
                self.head(self.prepare(variant), variant, seed)

    def head(self, base: Path, variant: str, seed: int) -> None:
        name, a = run_name(variant, seed), self.a
        out = self.work / name
        if not (out / "prepared").exists():  # the same prepared conversations for every run
            shutil.copytree(base / "prepared", out / "prepared")
        budget = f"train.loop.max_steps={a.steps}" if a.steps else f"train.loop.max_minutes={a.minutes}"
        overrides = [*self.data_options(variant), budget, f"train.loop.seed={seed}"]
        overrides.append(f"train.model.variant={variant.removesuffix(LONG)}")
        self.sh(
            f"run_{name}", [sys.executable, "-m", "eagle3_train.run", "recipe=smollm2", f"out={out}", *overrides], 1200
        )
        rec = {"variant": variant, "seed": seed, "minutes": None if a.steps else a.minutes, "max_steps": a.steps}
        rec |= read_train(out / "train")
        rec["heldout"] = read_eval(out / "eval" / "report.json")
        if (out / "export").exists():
            long = out / "eval_long"
            self.sh(
                f"long_{name}",
                [
                    sys.executable,
                    "-m",
                    "eagle3_train.evaluation.eval",
                    f"draft={out / 'export'}",
                    "target=embedded",
                    f"prompts={PROMPTS / 'long.jsonl'}",
                    "engine=sglang",
                    "k=5",
                    "max_new_tokens=128",
                    "dtype=float32",
                    "batch_size=10",
                    "plot=false",
                    f"out={long}",
                ],
                900,
            )
            rec["long"] = read_eval(long / "report.json")
        self.res["heads"][name] = rec
        self.save()

    def bench(self, spec: str, variant: str, export: Path) -> None:
        """eagle3-bench of ``export``: ``spec`` is ``vllm:[levels]``, ``sglang:chain`` or ``sglang:tree``."""
        engine, how = spec.split(":", 1)
        concurrency = how if how.startswith("[") else "[1]"
        key = f"{engine}_{run_name(variant)}" + ("_tree" if how == "tree" else "")
        site = ENGINE_SITES[engine]
        deadline = time.time() + 900
        staged = lambda: any(Path(site).glob(".stage_*"))  # noqa: E731  (stage_lib.sh's mark of a finished install)
        while not staged() and time.time() < deadline:  # the staging calls may still be running
            time.sleep(10)
        if not export.exists() or not staged():
            self.res["bench"][key] = {"skipped": f"no export or {engine} not staged"}
            return
        tdir = target_dir()
        out = self.work / f"bench_{key}"
        args = [
            f"engine={engine}",
            f"target={tdir}",
            f"draft={export}",
            f"out={out}",
            "max_new_tokens=128",
            f"max_turns={MAX_TURNS}",
            "plot=false",
            f"concurrency={concurrency}",
            "num_speculative_tokens=5",
        ]
        if engine == "sglang":
            tree = "--speculative-eagle-topk 4 --speculative-num-draft-tokens 16"
            chain = "--speculative-eagle-topk 1 --speculative-num-draft-tokens 6"
            args += [
                f"engine_args={SGLANG_ARGS.format(memory=self.a.memory)}",
                f"spec_args={tree if how == 'tree' else chain}",
            ]
        else:
            args += [f"engine_args=--dtype bfloat16 --gpu-memory-utilization {self.a.memory}"]
        env = {
            "PYTHONPATH": f"{site}:/tmp/site:/tmp/repo",
            "PATH": f"{site}/bin:{os.environ['PATH']}",
            "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "TVM_FFI_CACHE_DIR": "/tmp/sgcache/tvm-ffi",
            "FLASHINFER_WORKSPACE_BASE": "/tmp/sgcache",
        }
        self.sh(f"bench_{key}", [sys.executable, "-m", "eagle3_train.evaluation.bench", *args], 900, env)
        path = out / "results.json"
        self.res["bench"][key] = json.loads(path.read_text()).get("rows") if path.exists() else None
        self.save()

    def same_turns(self, variant: str, export: Path) -> None:
        """eagle3-eval over exactly the turns the bench counted at concurrency 1 (the first
        ``min_requests`` held-out conversations, ``max_turns`` 8): τ to set beside the engines'
        acceptance length, in float32 and in bfloat16 (the engines' dtype)."""
        from eagle3_train.evaluation.bench import BenchConfig, level_requests

        counted = level_requests(1, BenchConfig(out="", target="t", draft="d"))  # what the bench counts at c=1
        for dtype in ("float32", "bfloat16"):
            out = self.work / run_name(variant, self.a.seeds[0]) / f"eval_turns_{dtype}"
            args = [f"draft={export}", "target=embedded", f"prompts={PROMPTS / 'heldout.jsonl'}", "k=5"]
            args += ["max_new_tokens=128", f"max_turns={MAX_TURNS}", f"limit={counted}", f"dtype={dtype}"]
            args += ["plot=false", f"out={out}"]
            self.sh(
                f"turns_{run_name(variant)}_{dtype}", [sys.executable, "-m", "eagle3_train.evaluation.eval", *args], 600
            )
            self.res.setdefault("same_turns", {})[f"{variant}_{dtype}"] = read_eval(out / "report.json")
            self.save()


def run_name(variant: str, seed: int | None = None) -> str:
    """A variant's directory and log name (``eagle3.1+long`` -> ``eagle3.1_long``), with its seed."""
    name = variant.replace("+", "_")
    return name if seed is None else f"{name}_s{seed}"


def read_train(out: Path) -> dict:
    """Steps, loop seconds and the last logged rate of a training run (its metrics.jsonl)."""
    rows = (
        [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        if (out / "metrics.jsonl").exists()
        else []
    )
    train = [r for r in rows if "loss" in r and "lr" in r]
    evals = [r for r in rows if "eval_tau" in r]
    return {
        "steps": train[-1]["step"] if train else None,
        "loop_s": train[-1].get("loop_s") if train else None,
        "tok_s": train[-1].get("tok_s") if train else None,
        "eval_simulated_tau": evals[-1]["eval_tau"] if evals else None,
    }


def read_eval(path: Path) -> dict | None:
    """τ, acceptance per position, lossless counts, and τ per category and per prompt length of an
    eval report (read through its one reader)."""
    if not path.exists():
        return None
    from eagle3_train.core.reports import read_eval_report

    r = read_eval_report(path)
    return {
        "tau": round(r.tau, 3),
        "acceptance_per_position": r.acceptance_per_position,
        "lossless_counts": r.lossless_counts,
        "categories": {c: round(v["tau"], 3) for c, v in r.categories.items()},
        "prompt_lengths": {s: round(v["tau"], 3) for s, v in (r.prompt_lengths or {}).items()},
    }


def target_dir() -> str:
    """The embedded target as the HF directory the engines serve (converted once into EAGLE3_CACHE)."""
    from eagle3_train.targets import load_target

    return str(load_target("embedded", cache_dir=ENV["EAGLE3_CACHE"], dtype="float32").local_dir)


def gpu_name() -> str:
    try:
        name = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        name = "no GPU"
    return f"1 x {name} (device tool), {sys.version.split()[0]}"


def start(a: argparse.Namespace) -> None:
    """Copy the repository to /tmp/repo and run the job there, detached (it outlives this call)."""
    shutil.rmtree("/tmp/repo", ignore_errors=True)
    shutil.copytree(
        REPO, "/tmp/repo", ignore=shutil.ignore_patterns(".git", ".vllm", ".sglang", ".gguf", ".whl", ".venv")
    )
    Path(a.work).mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "/tmp/repo/benchmarks/heads.py", "run", *sys.argv[2:]]
    with open(Path(a.work) / "job.log", "a") as log:
        subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **ENV},
            cwd="/tmp/repo",
        )
    print("started:", " ".join(cmd))


def poll(a: argparse.Namespace) -> None:
    """Wait until the job ends or ``seconds`` pass, then copy heads.json, the job's log and a tarball of
    the steps' logs and reports into ``dest``."""
    work, end = Path(a.work), time.time() + a.seconds
    path = work / "heads.json"
    while time.time() < end and not (path.exists() and json.loads(path.read_text()).get("ended")):
        time.sleep(5)
    dest = Path(a.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("heads.json", "job.log", f"base/{CONVERSATIONS}"):
        if (work / f).exists():
            shutil.copy(work / f, dest / Path(f).name)
    with tarfile.open(dest / "logs.tgz", "w:gz") as tar:
        for f in (
            sorted(work.glob("*.log"))
            + sorted(work.glob("*/eval*/report.json"))
            + sorted(work.glob("bench_*/results.json"))
        ):
            tar.add(f, arcname=str(f.relative_to(work)))
    res = json.loads(path.read_text()) if path.exists() else {}
    print(
        json.dumps(
            {
                "steps": res.get("steps"),
                "heads": {
                    k: (v.get("steps"), (v.get("heldout") or {}).get("tau")) for k, v in res.get("heads", {}).items()
                },
            }
        )
    )
    print("ended" if res.get("ended") else "running")


def results(a: argparse.Namespace) -> None:
    """A polled heads.json as a results file (benchmarks/result.py): the figures, one table of the heads."""
    sys.path.insert(0, str(REPO))
    from benchmarks.result import Result

    res = json.loads(Path(a.file).read_text())
    rows = [
        [
            k,
            h["variant"],
            h["seed"],
            h["steps"],
            h["loop_s"],
            (h.get("heldout") or {}).get("tau"),
            (h.get("heldout") or {}).get("categories", {}).get("multi_turn"),
            (h.get("long") or {}).get("tau"),
        ]
        + [(h.get("long") or {}).get("categories", {}).get(b) for b in BUCKETS]
        for k, h in res["heads"].items()
    ]
    served = [
        [
            k,
            r["concurrency"],
            round(r["spec"]["mean_acceptance_length"], 3),
            r["spec"]["requests"],
            round(r["speedup"], 3),
        ]
        for k, v in res["bench"].items()
        if isinstance(v, list)
        for r in v
    ]
    kind = "h200" if "H200" in res["machine"] else "h100"
    Result(
        what=res["what"],
        command=res["command"],
        machine=res["machine"],
        date=res["date"],
        runs=res["runs"],
        figures={k: res.get(k) for k in ("settings", "steps", "heads", "bench", "same_turns")},
        tables=[
            {
                "title": (
                    f"heads at equal {'optimizer steps' if res['settings'].get('steps') else 'training-loop minutes'} "
                    "(tau: eagle3-eval, chain k=5, greedy, fp32, 128 new tokens)"
                ),
                "header": [
                    "run",
                    "variant",
                    "seed",
                    "steps",
                    "loop s",
                    "held-out tau",
                    "multi-turn tau",
                    "long tau",
                    *BUCKETS,
                ],
                "rows": rows,
            },
            {
                "title": "eagle3-eval on the turns the first bench counted (first 16 held-out conversations, 8 turns)",
                "header": ["variant_dtype", "tau", "lossless"],
                "rows": [
                    [k, v and v["tau"], v and v["lossless_counts"]] for k, v in (res.get("same_turns") or {}).items()
                ],
            },
            {
                "title": "served (eagle3-bench, 5 speculative tokens, 128 new tokens, held-out prompts)",
                "header": ["engine_variant", "concurrency", "acceptance length", "conversations", "speed-up"],
                "rows": served,
            },
        ],
    ).write(REPO / "benchmarks" / "results" / f"{a.name}_{kind}.json")
    print(f"benchmarks/results/{a.name}_{kind}.json")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("long-prompts", help="write data_prep/prompts/long.jsonl (here, on the CPU)")
    lp.add_argument("--per-bucket", type=int, default=6)
    for name in ("start", "run"):
        s = sub.add_parser(name, help="start the detached job (run: the job itself)")
        s.add_argument("--work", default="/tmp/heads")
        s.add_argument("--n", type=int, default=12288, help="conversations synthesized once, shared by every run")
        s.add_argument("--minutes", type=float, default=2.0, help="train.loop.max_minutes of every run")
        s.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
        s.add_argument("--variants", nargs="+", default=["eagle3", "eagle3.1"])
        s.add_argument(
            "--vllm-concurrency", default="[1,4,16,64]", help="eagle3-bench's levels for the last variant in vLLM"
        )
        s.add_argument("--steps", type=int, default=None, help="train.loop.max_steps instead of --minutes")
        s.add_argument(
            "--long-fraction", type=float, default=0.05, help="prepare.synth.long_fraction of +long variants"
        )
        s.add_argument("--parallel", action="store_true", help="the +long variants in a thread beside the others")
        s.add_argument("--bench-variant", default=None, help="bench only this variant (first seed), with --bench")
        s.add_argument("--bench", nargs="+", default=["sglang:chain", "vllm:[1]", "sglang:tree"])
        s.add_argument("--same-turns", action="store_true", help="eval on the first bench's turns (fp32 and bf16)")
        s.add_argument("--memory-share", type=float, default=None, help="prepare.regen.memory_share of every run")
        s.add_argument("--memory", type=float, default=0.5, help="the bench engines' share of GPU memory")
    pp = sub.add_parser("poll", help="wait, then copy what exists into DEST")
    pp.add_argument("--work", default="/tmp/heads")
    pp.add_argument("seconds", type=int)
    pp.add_argument("dest")
    rp = sub.add_parser("results", help="write benchmarks/results/heads_<gpu>.json from a polled heads.json")
    rp.add_argument("file")
    rp.add_argument("--name", default="heads", help="benchmarks/results/<name>_<gpu>.json")
    a = p.parse_args()
    if a.cmd == "long-prompts":
        long_prompts(PROMPTS / "long.jsonl", a.per_bucket)
    elif a.cmd == "start":
        start(a)
    elif a.cmd == "run":
        Job(a).run()
    elif a.cmd == "poll":
        poll(a)
    else:
        results(a)


if __name__ == "__main__":
    main()
