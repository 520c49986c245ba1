"""Every tiny target family through real engines on one GPU (the family x engine matrix), as one
background job; run from the repository root after staging (benchmarks/staging/gpu_stage.sh, benchmarks/staging/stage_vllm.sh,
benchmarks/staging/stage_sglang.sh).

Per family (all families at once: the targets are tiny and the GPU is large):
  1. the family's tiny target saved as an HF directory (bf16 weights, as a user's model arrives);
     prepare TRAIN_N shipped synthesized prompts with the target's own greedy replies (regenerate),
     dump (hf), standardize, train, export for both engines, eagle3-check; eagle3-eval (fp32: the
     lossless check; bf16: the served dtype) of the export and of two broken copies (ids shifted by
     one layer; d2t removed: eagle3-check must refuse both)
  2. each engine serving the target with the export, then with the shifted copy: vLLM's servers
     for every family started together (with --kv-cache-memory-bytes, which skips the memory
     profiling that concurrent start-ups upset), SGLang's one at a time (it refuses a
     --mem-fraction-static below the share other processes already hold), then
     eagle3-served-acceptance against each: the engine's own acceptance length beside eval's tau
  3. eagle3-dump backend=<engine> of CMP_N prompts against backend=hf of the same prepared data
     (benchmarks/compare_dumps.py: per-layer relative L2, token ids identical)

Results: $W/results.json (per family and engine: steps with exit status and seconds, and a summary
table), rewritten after every step; $W/bundle/ holds results.json, log and logs.tgz for a polling
call to copy back. Every step runs under a time limit; a failed step never stops the others.

Variables (default): W (/tmp/w31), FAMILIES (every tiny family), ENGINES (vllm), DUMP_ENGINES (vllm:
SGLang 0.5.17 has no aux-state return for a dump, --return-aux-hidden-state-layer-ids came later),
VLLM_FAMILIES / SGLANG_FAMILIES (every tiny family: those each engine serves), PHASES (train,serve; serve
alone reuses phase 1's outputs in W), CLIENT_TEMPLATE (gpt_oss: served acceptance with template=client), TRAIN_N (512), CMP_N (64), K (4), NEW_TOKENS (64), EPOCHS (10),
TRAIN_S (400), TRAIN_OVERRIDES (more eagle3-train overrides, space-separated), SGLANG_MEM (0.1: --mem-fraction-static), BASE_PORT (8100), SITE / VSITE / SGSITE (/tmp/site, /tmp/vsite, /tmp/sgsite: where
benchmarks/staging/gpu_stage.sh, stage_vllm.sh and stage_sglang.sh installed; each engine runs with its own).

On the CPU the same script runs against the stand-in engines of tests/standin_engines.py (PATH with a
`vllm` that runs it) to catch mistakes before device time is spent:
  W=/tmp/w31 FAMILIES=llama TRAIN_N=8 CMP_N=4 NEW_TOKENS=8 EPOCHS=1 python3 benchmarks/families_gpu.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagle3_train.targets.tiny import FAMILIES  # noqa: E402

W = Path(os.environ.get("W", "/tmp/w31"))
FAMS = [f for f in os.environ.get("FAMILIES", ",".join(FAMILIES)).split(",") if f]
ENGINES = [e for e in os.environ.get("ENGINES", "vllm").split(",") if e]
DUMP_ENGINES = [e for e in os.environ.get("DUMP_ENGINES", "vllm").split(",") if e]
SERVE_FAMILIES = {e: os.environ.get(f"{e.upper()}_FAMILIES", ",".join(FAMILIES)).split(",") for e in ("vllm", "sglang")}
PHASES = os.environ.get("PHASES", "train,serve").split(",")  # serve only: phase 1's outputs already in W
# served acceptance with the prompts rendered here (template=client: token ids to the engine), for
# targets whose engine-side chat template the tiny tokenizer cannot render (vLLM's harmony for gpt-oss)
CLIENT_TEMPLATE = os.environ.get("CLIENT_TEMPLATE", "gpt_oss").split(",")
TRAIN_N = int(os.environ.get("TRAIN_N", 512))
CMP_N = int(os.environ.get("CMP_N", 64))
K = int(os.environ.get("K", 4))
NEW = int(os.environ.get("NEW_TOKENS", 64))
EPOCHS = int(os.environ.get("EPOCHS", 10))
TRAIN_S = int(os.environ.get("TRAIN_S", 400))
TRAIN_OVERRIDES = os.environ.get("TRAIN_OVERRIDES", "").split()  # more eagle3-train overrides, e.g. model.aux_norm=true
BASE_PORT = int(os.environ.get("BASE_PORT", 8100))
PY = sys.executable
PROMPTS = REPO / "data_prep" / "prompts"
HELDOUT = PROMPTS / "heldout.jsonl"
VARIANTS = ("export", "shifted", "nod2t")  # checked and evaluated; the first SERVED are also served
SERVED = ("export", "shifted")
VLLM_ARGS = [
    "--enforce-eager",
    "--gpu-memory-utilization",
    "0.04",
    "--kv-cache-memory-bytes",
    str(1 << 30),
    "--max-model-len",
    "4096",
]
# SGLang refuses a fraction below what other processes already hold (its weights check), so its
# servers start one family at a time (SGLANG_FAMILIES run one after the other: launch per family)
SGLANG_ARGS = [
    "--disable-cuda-graph",
    "--mem-fraction-static",
    os.environ.get("SGLANG_MEM", "0.1"),
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--context-length",
    "4096",
    "--skip-server-warmup",
]
SITE, VSITE, SGSITE = (
    os.environ.get(k, d) for k, d in (("SITE", "/tmp/site"), ("VSITE", "/tmp/vsite"), ("SGSITE", "/tmp/sgsite"))
)
# each engine's packages first on the path; the project's own wheels and the repository after them
ENGINE_ENV = {
    "vllm": {
        "PYTHONPATH": f"{VSITE}:{SITE}:{REPO}",
        "PATH": f"{VSITE}/bin:{os.environ.get('PATH', '')}",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    },
    "sglang": {
        "PYTHONPATH": f"{SGSITE}:{SGSITE}/nvidia_cutlass_dsl/dsl_packages:{SITE}:{REPO}",
        "PATH": f"{SGSITE}/bin:{os.environ.get('PATH', '')}",
        "TVM_FFI_CACHE_DIR": "/tmp/sgcache/tvm-ffi",
        "FLASHINFER_WORKSPACE_BASE": "/tmp/sgcache",
    },
}

_lock = threading.Lock()
RESULTS: dict = {"issue": 31, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": {}}


def log(text: str) -> None:
    line = f"== {time.strftime('%H:%M:%S')} {text}"
    with _lock:
        print(line, flush=True)


def save() -> None:
    with _lock:
        RESULTS["summary"] = summary()
        tmp = W / "results.json.tmp"
        tmp.write_text(json.dumps(RESULTS, indent=2))
        os.replace(tmp, W / "results.json")
        bundle = W / "bundle"
        bundle.mkdir(exist_ok=True)
        shutil.copy(W / "results.json", bundle / "results.json")
        if (W / "log").exists():
            shutil.copy(W / "log", bundle / "log")


def bundle_logs() -> None:
    with tarfile.open(W / "bundle" / ".logs.tgz", "w:gz") as tar:
        for p in sorted(W.rglob("*")):
            if (
                p.is_file()
                and (p.suffix == ".log" or p.name in ("report.json", "compare.json", "config.json"))
                and "bundle" not in p.parts
                and p.stat().st_size < 4 << 20
            ):
                tar.add(p, arcname=str(p.relative_to(W)))
    os.replace(W / "bundle" / ".logs.tgz", W / "bundle" / "logs.tgz")


def step(key: str, limit: int, cmd: list[str], result: Path | None = None, env: dict | None = None) -> int:
    """Run ``cmd`` under ``limit`` seconds, output to $W/<key>.log; record rc, seconds and the JSON
    figures of ``result`` under RESULTS['steps'][key]."""
    logf = W / f"{key}.log"
    logf.parent.mkdir(parents=True, exist_ok=True)
    log(f"{key}: {' '.join(cmd)[:300]}")
    t0 = time.time()
    with open(logf, "w") as out:
        p = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        try:
            rc = p.wait(limit)
        except subprocess.TimeoutExpired:
            rc = 124
        _kill(p)
    entry: dict = {"rc": rc, "seconds": round(time.time() - t0, 1)}
    if result is not None and result.is_file():
        data = json.loads(result.read_text())
        entry["result"] = {k: v for k, v in data.items() if k not in ("config", "request", "definitions", "per_prompt")}
    with _lock:
        RESULTS["steps"][key] = entry
    log(f"{key}: exit {rc} after {entry['seconds']} s")
    save()
    return rc


def _kill(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        for _ in range(20):
            if p.poll() is not None:
                break
            time.sleep(0.5)


def m(module: str, *args: str) -> list[str]:
    return [PY, "-m", module, *args]


def edit_copy(src: Path, dst: Path, variant: str) -> None:
    """The export with its ids shifted by one layer (both keys), or without d2t/t2d."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    if variant == "shifted":
        c = json.loads((dst / "config.json").read_text())
        c["eagle_aux_hidden_state_layer_ids"] = [v + 1 for v in c["eagle_aux_hidden_state_layer_ids"]]
        nested = c["eagle_config"]
        nested["eagle_aux_hidden_state_layer_ids"] = [v + 1 for v in nested["eagle_aux_hidden_state_layer_ids"]]
        (dst / "config.json").write_text(json.dumps(c, indent=2))
    elif variant == "nod2t":
        from safetensors.torch import load_file, save_file

        t = {k: v for k, v in load_file(str(dst / "model.safetensors")).items() if k not in ("d2t", "t2d")}
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})


def train_family(fam: str) -> None:
    """Phase 1 for one family: the target, its draft, eval of the export and the broken copies."""
    d = W / fam
    target = d / "target"
    t = str(target)
    # smollm2: the embedded SmolLM2-135M-Instruct (trained weights: real margins, distinct layers) as
    # the HF directory its GGUF converts to; every other name is a tiny random-init family
    save = (
        (
            "import shutil, sys, os; from eagle3_train.targets import _local_dir; "
            "shutil.copytree(_local_dir('embedded', os.environ['EAGLE3_CACHE']), sys.argv[2])"
        )
        if fam == "smollm2"
        else "import sys; from eagle3_train.targets.tiny import save_tiny; save_tiny(sys.argv[1], sys.argv[2])"
    )
    if step(f"{fam}/save_target", 300, [PY, "-c", save, f"tiny:{fam}", t]):
        return
    step(
        f"{fam}/prepare",
        900,
        m(
            "data_prep.prepare",
            f"target={t}",
            f"input={PROMPTS / 'synth_smollm2.jsonl.gz'}",
            f"out={d / 'prep'}",
            f"limit={TRAIN_N * (4 if fam == 'smollm2' else 1)}",
            "regenerate=true",
            f"regen.max_new_tokens={NEW}",
            "regen.batch_size=128",
            "on_bad_row=skip",
            "progress=false",
        ),
    )
    step(
        f"{fam}/dump_hf",
        600,
        m("data_prep.dump", f"target={t}", f"data={d / 'prep'}", f"out={d / 'dump'}", "progress=false"),
    )
    step(
        f"{fam}/standardize",
        300,
        m(
            "data_prep.standardize",
            f"dumps=[{d / 'dump'}]",
            f"out={d / 'std'}",
            f"draft_vocab_size={8192 if fam == 'smollm2' else 256}",
            "eval_fraction=0.05",
            "progress=false",
        ),
    )
    step(
        f"{fam}/train",
        TRAIN_S,
        m(
            "eagle3_train.training.trainer",
            f"data={d / 'std'}",
            f"target={t}",
            f"out={d / 'train'}",
            f"train.ttt_length={K}",
            f"train.epochs={EPOCHS}",
            "train.lr=2e-3",
            "train.warmup_steps=20",
            "train.max_tokens_per_batch=16384",
            "train.eval_every=50",
            "train.save_every=50",
            "train.log_every=20",
            "progress=false",
            *TRAIN_OVERRIDES,
        ),
    )
    if step(f"{fam}/export", 300, m("eagle3_train.serving.export", f"run={d / 'train'}", f"out={d / 'export'}")):
        return
    for variant in VARIANTS[1:]:
        edit_copy(d / "export", d / variant, variant)
    for variant in VARIANTS:
        step(f"{fam}/check_{variant}", 300, m("eagle3_train.serving.check", f"draft={d / variant}", f"target={t}"))
    for variant, dtype in (("export", "float32"), ("export", "bfloat16"), ("shifted", "float32")):
        out = d / f"eval_{variant}_{dtype}"
        step(
            f"{fam}/eval_{variant}_{dtype}",
            600,
            m(
                "eagle3_train.evaluation.eval",
                f"draft={d / variant}",
                f"target={t}",
                "engine=vllm",
                f"prompts={HELDOUT}",
                f"k={K}",
                f"max_new_tokens={NEW}",
                f"dtype={dtype}",
                "batch_size=43",
                f"out={out}",
                "progress=false",
            ),
            result=out / "report.json",
        )
    # the prepared data both dumps of phase 3 read
    step(
        f"{fam}/prepare_cmp",
        300,
        m(
            "data_prep.prepare",
            f"target={t}",
            f"input={PROMPTS / 'synth_smollm2.jsonl.gz'}",
            f"out={d / 'prep_cmp'}",
            f"limit={CMP_N}",
            "progress=false",
        ),
    )
    step(
        f"{fam}/dump_hf_cmp",
        300,
        m("data_prep.dump", f"target={t}", f"data={d / 'prep_cmp'}", f"out={d / 'dump_cmp_hf'}", "progress=false"),
    )


class Server:
    """One engine serving one family's target with one draft variant, in the background."""

    def __init__(self, engine: str, fam: str, variant: str, port: int):
        self.engine, self.fam, self.variant, self.port = engine, fam, variant, port
        self.key = f"{fam}/{engine}_{variant}"
        self.url = f"http://127.0.0.1:{port}"
        d = W / fam
        draft = str((d / variant).resolve())
        if engine == "vllm":
            spec = json.dumps({"method": "eagle3", "model": draft, "num_speculative_tokens": K})
            cmd = [
                "vllm",
                "serve",
                str(d / "target"),
                "--port",
                str(port),
                "--dtype",
                "bfloat16",
                "--speculative-config",
                spec,
                *VLLM_ARGS,
            ]
        else:
            cmd = [
                PY,
                "-m",
                "sglang.launch_server",
                "--model-path",
                str(d / "target"),
                "--port",
                str(port),
                "--dtype",
                "bfloat16",
                "--speculative-algorithm",
                "EAGLE3",
                "--speculative-draft-model-path",
                draft,
                "--speculative-num-steps",
                str(K),
                "--speculative-eagle-topk",
                "1",
                "--speculative-num-draft-tokens",
                str(K + 1),
                *SGLANG_ARGS,
            ]
        log(f"{self.key}: {' '.join(cmd)}")
        self.t0 = time.time()
        self.logf = open(W / f"{self.key}.log", "w")  # noqa: SIM115 (the server's log while it runs; closed in stop)
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            start_new_session=True,
            env={**os.environ, **ENGINE_ENV[engine]},
        )

    def ready(self, limit: int) -> bool:
        deadline = time.time() + limit
        while time.time() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                ok = True
                break
            except OSError:
                time.sleep(3)
        else:
            ok = False
        ok = ok if self.proc.poll() is None else False
        with _lock:
            RESULTS["steps"][f"{self.key}_ready"] = {"rc": 0 if ok else 1, "seconds": round(time.time() - self.t0, 1)}
        log(f"{self.key}: ready={ok} after {time.time() - self.t0:.0f} s")
        save()
        return ok

    def stop(self) -> None:
        _kill(self.proc)
        self.logf.close()


def serve_all(engine: str, fams: list[str], port0: int) -> None:
    """Phase 2 for one engine, one wave per served variant: every family's server started at once,
    then the engine's own figures against each."""
    for i, variant in enumerate(SERVED):
        serve_wave(engine, [f for f in fams if (W / f / variant / "config.json").is_file()], variant, port0 + 20 * i)


def serve_wave(engine: str, fams: list[str], variant: str, port0: int) -> None:
    servers = [Server(engine, f, variant, port0 + i) for i, f in enumerate(fams)]
    try:
        with ThreadPoolExecutor(len(servers) or 1) as pool:
            up = list(pool.map(lambda s: s.ready(900), servers))

        def measure(s: Server) -> None:
            out = W / s.fam / f"served_{engine}_{s.variant}"
            client = ["template=client", f"tokenizer={W / s.fam / 'target'}"] if s.fam in CLIENT_TEMPLATE else []
            step(
                f"{s.key}_served",
                600,
                m(
                    "eagle3_train.evaluation.served_acceptance",
                    f"server={s.url}",
                    f"engine={engine}",
                    f"prompts={HELDOUT}",
                    f"max_new_tokens={NEW}",
                    f"out={out}",
                    "wait_for_server_s=60",
                    *client,
                ),
                result=out / "report.json",
            )

        with ThreadPoolExecutor(len(servers) or 1) as pool:
            list(pool.map(measure, [s for s, ok in zip(servers, up) if ok]))
    finally:
        for s in servers:
            s.stop()


def dump_served(engine: str, fam: str, port: int) -> None:
    """Phase 3 for one family: the engine's dump of the comparison data against the hf one."""
    d = W / fam
    args = VLLM_ARGS if engine == "vllm" else SGLANG_ARGS
    urls = [f"server.url=http://127.0.0.1:{port}"] + (
        [f"server.final_url=http://127.0.0.1:{port + 1}"] if engine == "sglang" else []
    )
    (d / f"dump_{engine}_engine").mkdir(exist_ok=True)
    rc = step(
        f"{fam}/dump_{engine}",
        900,
        [
            "bash",
            "launch/dump_served.sh",
            f"target={d / 'target'}",
            f"data={d / 'prep_cmp'}",
            f"out={d / f'dump_cmp_{engine}'}",
            *urls,
            "client.wait_for_server_s=600",
            "progress=false",
        ],
        env={
            **ENGINE_ENV[engine],
            "BACKEND": engine,
            "CLIENTS": "1",
            "LOGDIR": str(d / f"dump_{engine}_engine"),
            "EAGLE3_DUMP": f"{PY} -m data_prep.dump",
            "ENGINE_ARGS": " ".join(args),
        },
    )
    if rc == 0:
        step(
            f"{fam}/compare_{engine}",
            300,
            [
                PY,
                "-c",
                "import json, sys; from pathlib import Path; "
                "from benchmarks.compare_dumps import compare; "
                "Path(sys.argv[3]).write_text(json.dumps(compare(Path(sys.argv[1]), Path(sys.argv[2])), indent=2))",
                str(d / "dump_cmp_hf"),
                str(d / f"dump_cmp_{engine}"),
                str(d / f"compare_{engine}.json"),
            ],
            result=d / f"compare_{engine}.json",
        )


def summary() -> dict:
    """Per family and engine: eval tau beside the engine's acceptance length, per variant; the dump
    comparison; check's verdicts."""
    s = RESULTS["steps"]

    def res(key: str) -> dict:
        return (s.get(key) or {}).get("result") or {}

    out = {}
    for fam in FAMS:
        row: dict = {"check_rc": {v: (s.get(f"{fam}/check_{v}") or {}).get("rc") for v in VARIANTS}}
        for variant, dtype in (("export", "float32"), ("export", "bfloat16"), ("shifted", "float32")):
            r = res(f"{fam}/eval_{variant}_{dtype}")
            row[f"eval_{variant}_{dtype}"] = {
                k: r.get(k) for k in ("tau", "acceptance_per_position", "lossless", "captured_hf_indices")
            }
        for engine in ENGINES:
            for variant in SERVED:
                r = res(f"{fam}/{engine}_{variant}_served")
                row[f"{engine}_{variant}"] = {
                    k: r.get(k)
                    for k in (
                        "mean_acceptance_length",
                        "acceptance_per_position",
                        "conditional_acceptance_per_position",
                        "warnings",
                    )
                }
            c = res(f"{fam}/compare_{engine}")
            row[f"{engine}_dump_vs_hf"] = {
                k: v.get("rel_l2") if isinstance(v, dict) and "rel_l2" in v else v for k, v in c.items()
            }
        out[fam] = row
    return out


def main() -> None:
    W.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("EAGLE3_CACHE", str(W / "cache"))
    versions = {}
    for name in ("torch", "transformers", "vllm", "sglang"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:
            versions[name] = None
    RESULTS["versions"] = versions
    RESULTS["variables"] = {
        "FAMILIES": FAMS,
        "ENGINES": ENGINES,
        "TRAIN_N": TRAIN_N,
        "CMP_N": CMP_N,
        "K": K,
        "NEW_TOKENS": NEW,
        "EPOCHS": EPOCHS,
        "TRAIN_OVERRIDES": TRAIN_OVERRIDES,
    }
    try:
        RESULTS["machine"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        RESULTS["machine"] = "no GPU"
    if "train" not in PHASES and (W / "results.json").is_file():  # phase 1's steps kept beside this run's
        RESULTS["steps"] = json.loads((W / "results.json").read_text()).get("steps", {})
    save()
    t0 = time.time()
    if "train" in PHASES:
        with ThreadPoolExecutor(len(FAMS)) as pool:  # started 2 s apart: 7 interpreters importing at once once failed
            list(pool.map(lambda i_f: (time.sleep(2 * i_f[0]), train_family(i_f[1])), enumerate(FAMS)))
    RESULTS["phase_seconds"] = {"train": round(time.time() - t0, 1)}
    port = BASE_PORT
    for engine in ENGINES if "serve" in PHASES else []:
        fams = [f for f in FAMS if f in SERVE_FAMILIES[engine]]
        t1 = time.time()
        for group in [[f] for f in fams] if engine == "sglang" else [fams]:  # SGLang: one server at a time
            serve_all(engine, group, port)
        port += 100
        if engine in DUMP_ENGINES:
            with ThreadPoolExecutor(len(fams) or 1) as pool:
                list(
                    pool.map(
                        lambda ip, engine=engine, port=port: dump_served(engine, ip[1], port + 2 * ip[0]),
                        enumerate(fams),
                    )
                )
        port += 100
        RESULTS["phase_seconds"][engine] = round(time.time() - t1, 1)
    RESULTS["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    RESULTS["seconds"] = round(time.time() - t0, 1)
    save()
    bundle_logs()
    (W / "done").touch()
    log("all done")


if __name__ == "__main__":
    main()
