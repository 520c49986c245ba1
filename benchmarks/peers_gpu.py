"""The side-by-side with the peer frameworks on one GPU, as one detached job polled from outside.

    here:  python3 benchmarks/peers_gpu.py pack MODELOPT_EXAMPLES MT_BENCH_QUESTIONS [SPECFORGE_SCRIPTS]   (-> .peers/)
    there: benchmarks/staging/gpu_stage.sh install; benchmarks/staging/stage_vllm.sh install (its parts);
           for specforge also benchmarks/staging/stage_sglang14.sh install (its parts)
           python3 benchmarks/peers_gpu.py stage                     (in the call that carries .peers)
           python3 benchmarks/peers_gpu.py start sweep ours speculators modelopt [--lanes 5] [--end-by-s 1600] [--then-seed [--seed-early]] [--then-final]
           python3 benchmarks/peers_gpu.py start final ours speculators modelopt [--seeds 0]
           python3 benchmarks/peers_gpu.py poll 540 "$OUT"           (back to back until it prints "ended")
           (vLLM's parts may also come after the start, one call each running stage_vllm.sh install alone, no
           poll beside it: a vLLM server, for speculators' states or a draft's serving, waits for its stage,
           15 min at most)
    here:  python3 benchmarks/peers_results.py merge OUT/poll.tgz benchmarks/results/peers_h100.json
           (it keeps the poll as benchmarks/results/raw/peers_h100/<session id>.tgz; then `note` the session)
    any:   python3 benchmarks/peers_gpu.py plan sweep ours --device h100   (the runs it would make, each one's
           expected seconds sharing the GPU and its lane's memory, as --end-by-s and --memory-gib judge them; no GPU;
           --rehearse: then the job itself over the results held, nothing run: when each run would start and end)

Every framework trains on the same conversations (the smollm2 recipe's synthesized ones) for a
budget of steady training loop (``sweep``: 3 minutes at three learning rates, and past the grid's
edge where a head's best lies there; ``final``: 10 minutes at
the sweep's best head and lr, two seeds), stopped by a step count sized from its own steady step time
alone on the GPU (measured by a short probe where no earlier run on this kind of GPU has it), so that
its lr schedule ends with the budget; start-up, compilation and the data preparation are measured
apart. Data preparation and probes run alone; the sized runs then share the GPU ``--lanes`` at a
time (their step counts, and so their drafts, are the same either way; only their clocks slow), mixed
across frameworks, and a run the results file already holds evaluated, at steps within 5 % of what it is
sized to now, is not run again (``plan`` names those it holds). Heads: ``ours:recipe`` (as shipped: AdamW), ``ours:muon`` (the recipe with
Muon on the matrices, speculators' default optimizer; its lrs are optim.muon_lr), ``FW:default`` (the
peer's own) and ``FW:matched`` (shaped like ours where its options allow; the results name what is
missing): two configurations a framework, each swept at three lrs (and past an edge). Each draft is evaluated
by eagle3-eval on the held-out prompts and MT-bench and served by vLLM (drafts of sessions before 46:
sweep runs on the held-out prompts only; ``--then-seed`` gives each best two more seeds scored all three
ways). Each poll
packs the session so far into ``poll.tgz`` and ``peers_partial.json``: a machine taken back mid-run
loses only what the last poll had not packed. The shared set (``.peers/data/<DATA_SET>``) is
committed as ``benchmarks/data/<DATA_SET>`` (3.8 MB), which ``pack`` copies; where missing, it is
synthesized by the session's first phase (outside every budget; 123-155 s on an H100, which gave the
same conversations each time) and polls bring it out as ``<DATA_SET>.part-N``: put those in
``.peers/data/`` and pack again, so later sessions carry the same set. The peers' compile cache (the
torch.compile graphs of the frameworks in ``PEERS_CACHED``: speculators and SpecForge, whose runs are
left; ModelOpt's, 27-32 MiB packed, were carried in sessions 37-48) comes out as
``inductor_peers.tgz.part-N`` (15 MiB parts, 48 MiB at most): put them in ``.peers_cache/`` here and
run ``peers_gpu.py cache-in .peers_cache`` in a call of their own that carries it (before ``start``),
so a fresh machine may skip most of their compile (a cache small enough may ride in
``.peers/cache/`` instead, which ``stage`` unpacks). The cache names the heads whose training it holds
(``heads.json``); ``plan`` and ``--end-by-s`` count those heads' compile warm. speculators' rows
(its ``prepare-data``) come from its vLLM render endpoint, about 100 s once the server is up; the job
also renders them here with the target's template before the server starts and compares the two
datasets speculators writes (phase ``check render <sha12>``), and once a held session found them the
same for the set, later jobs give speculators the rows rendered here and skip the endpoint's render.
Where a machine comes late, name every framework with work left: ``--end-by-s`` starts only the runs
that end in time; ``--seed-early`` lets a 3-minute seed pair run beside the sweep another head still
lacks. A second ``start`` on the same machine keeps the data a job wrote whole (speculators' states)
and reuses it. Notes: benchmarks/notes/peer_training.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import io
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from peers_results import (  # noqa: E402
    CHECK,
    FINAL_S,
    FRAMEWORKS,
    HEADS,
    LRS,
    PAST_EDGE,
    SEED,
    STEP_TOKENS,
    SWEEP_S,
    Run,
    RunSpec,
    best,
    epochs_for,
    load,
    memory_trace,
    merge_into,
    plan_steps,
    probe_peaks,
    read_run,
    read_session,
    save,
    step_time,
    sweep_lrs,
)
from peers_results import swept as swept_taus  # noqa: E402  (job() has a swept of its own)

from eagle3_train.engines.launcher import stop_group  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()  # (a phase runs this file again: same-prepared)
PEERS = Path(os.environ.get("PEERS", "/tmp/peers"))  # .peers/ staged: wheels, ModelOpt's launcher, data
PO = Path(os.environ.get("PO", "/tmp/po"))  # the session's folder
VSITE = Path(os.environ.get("VSITE", "/tmp/vsite"))  # where stage_vllm.sh installs vLLM (engine_env.sh reads it too)
DATA_N = 16384  # conversations of the shared set (synthesized by the first session where missing): speculators'
# states for them are about 15 GB (73,728 would be 67 GB, past the 64 GiB disk); every budget takes several epochs
DATA_SET = f"smollm2_synth_{DATA_N}.jsonl.gz"
DATA_PART = 12 << 20  # bytes per part of it that a poll brings out
PROBE_STEPS = {"ours": 300, "speculators": 200, "modelopt": 300, "specforge": 200}  # (ModelOpt's bar: whole seconds;
# ours' step falls from 0.5 s to 0.3 s over its first ~150 steps: 60 steps read it 40 % slow, 200 steps 11 %, 300 2 %)
MODELOPT_SEQ = 512  # its samples' length (padded): one a step
MODELOPT_WARMUP = 0.05  # its recipe's 1,000 warm-up steps are for far longer runs: this share of the steps
PORT_STATES, PORT_SERVE, PORT_DIST = 8765, 8766, 29600  # (PORT_SERVE and PORT_DIST: + the lane)
SERVE_MEMORY = 0.15  # vLLM's share of the GPU when serving a draft beside the other lanes' runs
CAPTURE_SHARE = 0.25  # ... and when writing speculators' states (prefill only, for a 135M target)
WHEELS = ("nvidia-modelopt==0.47.0", "pulp==3.3.2", "speculators==0.9.0", "hs-connectors==0.9.0", "specforge==0.2.0",
          "yunchang==0.6.4")  # fmt: skip
SPECFORGE_CAPTURE = "prepare_hidden_states.py"  # SpecForge@a6b6b02 scripts/ (GitHub only): its offline capture
SPECFORGE_LOG_EVERY = 10  # its step line comes each this many steps only: its runs take a multiple of it
SPECFORGE_BATCH = 32  # its capture's batch (its loader drops a last partial one: --n must be a multiple)
SPECFORGE_SHARE = 0.25  # SGLang's --mem-fraction-static for that capture (beside the lanes: 0.3 of the GPU held)
# the data a framework writes with an engine beside the lanes (its folder, the engine's share of the GPU), and
# the marker its folder gets once written whole (a later job on the same machine reuses it)
BESIDE = {"speculators": ("speculators_data", CAPTURE_SHARE), "specforge": ("specforge_data", SPECFORGE_SHARE)}
WRITTEN = "written.json"
# what SpecForge 0.2.0 copies from the target into the draft config it derives (training/model_loading.py)
SPECFORGE_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                    "max_position_embeddings", "rms_norm_eps", "hidden_act", "initializer_range", "attention_bias",
                    "attention_dropout", "head_dim", "rope_theta", "rope_scaling", "bos_token_id", "eos_token_id",
                    "pad_token_id")  # fmt: skip
MODELOPT_FILES = ("main.py", "eagle_utils.py", "fsdp2_buffer_patch.py", "scripts/ar_validate.py",
                  "scripts/export_hf_checkpoint.py", "scripts/calibrate_draft_vocab.py")  # fmt: skip


def say(msg: str) -> None:
    """One line, written whole: the lanes' threads say things at once, and print() writes the line
    and its newline apart."""
    sys.stdout.write(f"peers_gpu: {msg}\n")
    sys.stdout.flush()


# --- the heads ---------------------------------------------------------------------------------------


def ours_head() -> dict:
    """The smollm2 recipe's head, read from the recipe (old and new option names alike)."""
    import yaml

    train = yaml.safe_load((REPO / "conf/recipe/smollm2.yaml").read_text())["train"]
    opts = {**train.get("train", {}), **train.get("objective", {})}
    return {"mlp": train["model"]["intermediate_size"], "draft_vocab": train["prepared"]["draft_vocab_size"],
            "ttt": opts["ttt_length"], "lm_head": f"{train['model']['lm_head_init']}, trained",
            "variant": train["model"].get("variant", "eagle3")}  # fmt: skip


def head_shape(fw: str, head: str, target: dict, variant: str | None) -> tuple[dict, list[str]]:
    """(what the draft is, the matched options the framework has no flag for); ``variant``: the head
    family of ours and of speculators (None: the recipe's)."""
    ours = ours_head()
    ours["variant"] = variant = variant or ours["variant"]
    if fw == "ours":
        return ours, []
    if fw == "specforge":
        missing = ["the chain fed its normed output: SpecForge 0.2.0's next step takes the pre-norm output"] \
            if variant == "eagle3.1" else []  # fmt: skip
        if head == "matched":
            shape = dict(ours) | {"lm_head": "random, trained"}
            return shape, ["lm_head init from the target: SpecForge starts the draft lm_head at random", *missing]
        return {"mlp": target["intermediate_size"], "draft_vocab": 32000, "ttt": 7, "lm_head": "random, trained",
                "variant": variant}, missing  # fmt: skip
    if head == "matched":
        shape, missing = dict(ours), []
        if fw == "speculators":
            shape["lm_head"] = "target, frozen"  # it loads the target's rows and never trains them
            shape["residual"] = "raw"  # --no-norm-before-residual: the layer's residual is h, as ours has it
            missing.append("lm_head training: speculators keeps the draft lm_head frozen")
        else:
            shape["lm_head"] = "random"  # a reduced vocab gets a new lm_head; no option starts it from the target
            missing.append("lm_head init from the target: ModelOpt starts a reduced-vocab lm_head at random")
            if variant != "eagle3":
                missing.append(f"model variant {variant}: ModelOpt has no such option")
        return shape, missing
    ttt = 3  # both peers' default TTT steps
    lm = "target, frozen" if fw == "speculators" else "the target's own (full vocab), frozen"
    residual = {"residual": "normed"} if fw == "speculators" else {}  # (its default norm_before_residual; ours: raw)
    return {"mlp": target["intermediate_size"], "draft_vocab": target["vocab_size"], "ttt": ttt, "lm_head": lm,
            "variant": variant if fw == "speculators" else "eagle3", **residual}, []  # fmt: skip


# --- commands (pure: the plan prints them, the tests read them) --------------------------------------


def ours_cmd(spec: RunSpec, run: Path, convs: Path) -> list[str]:
    """The recipe; its ``muon`` head: the recipe with Muon on the draft's matrices at ``spec.lr``
    (optim.muon_lr), AdamW on the rest at the recipe's optim.lr (speculators' default optimizer)."""
    lr = [f"++train.optim.lr={spec.lr}"] if spec.head != "muon" else \
        ["++train.optim.optimizer=muon", f"++train.optim.muon_lr={spec.lr}"]  # fmt: skip
    o = [*lr, f"++train.loop.max_steps={spec.steps_planned}", "++train.loop.epochs=1000",
         f"++train.loop.seed={spec.seed}", "++train.loop.log_every=10", "++train.loop.eval_every=0",
         "++train.checkpoint.keep_best=false"]  # fmt: skip
    o.append(f"++train.model.variant={spec.head_shape.get('variant', 'eagle3')}")
    return [sys.executable, "-m", "eagle3_train.run", "recipe=smollm2", f"out={run}", f"data={convs}",
            "until=train", *o]  # fmt: skip


def speculators_cmd(spec: RunSpec, run: Path, target: Path) -> list[str]:
    # --loss-implementation eager: its fused Triton loss does not compile on the image's torch 2.11
    # (dynamo asserts on the autotuner configs its two kernels share); the eager one is the same loss
    cmd = [sys.executable, "-m", "speculators", "train", "--verifier-name-or-path", str(target),
           "--data-path", str(PO / "speculators_data/data"), "--save-path", str(run / "ckpt"), "--on-missing", "raise",
           "--loss-implementation", "eager", "--epochs", str(spec.epochs), "--max-steps", str(spec.steps_planned),
           "--lr", str(spec.lr), "--seed", str(spec.seed),
           # a checkpoint after its first epoch and its last only (not each of up to 30, ~0.4 GB each, on a
           # 64 GiB disk that also holds the states); its training is the same
           "--checkpoint-freq", str(spec.epochs or 1)]  # fmt: skip
    if spec.head == "matched":
        cmd += ["--draft-config", str(PO / "speculators_draft.json"), "--ttt-steps", str(spec.head_shape["ttt"]),
                "--draft-vocab-size", str(spec.head_shape["draft_vocab"])]  # fmt: skip
    if spec.head_shape.get("residual") == "raw":  # ours' layer adds h itself, not hidden_norm(h) (its default)
        cmd.append("--no-norm-before-residual")
    if spec.head_shape.get("variant") == "eagle3.1":
        # the EAGLE-3.1 paper's per-state norms before fc, in place of its default single norm over
        # their concatenation (the two are exclusive); its default already feeds the chain normed states
        cmd += ["--fc-norm", "--no-norm-before-fc"]
    return cmd


def modelopt_cmd(spec: RunSpec, run: Path, target: Path, convs: Path, t: dict) -> list[str]:
    arch, theta = "eagle.eagle_architecture_config", t.get("rope_theta") or t["rope_parameters"]["rope_theta"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--mixed_precision", "bf16", "main.py",
           "--config", "/tmp/mosite/modelopt_recipes/general/speculative_decoding/eagle3.yaml",
           f"model.model_name_or_path={target}", f"data.data_path={convs}", f"training.output_dir={run / 'out'}",
           f"training.training_seq_len={MODELOPT_SEQ}",  # (it pads every sample to this; 512 holds the set's replies)
           # tf32 on, transformers 5.17 sets torch.backends.fp32_precision, which torch 2.11's inductor reads as
           # a mix of the old and new precision APIs and refuses: every frame of its torch.compile fell back
           # to eager (1 s a step). Off, it compiles; its matmuls run in bf16 under autocast either way
           "training.tf32=false",
           f"training.max_steps={spec.steps_planned}", f"training.warmup_steps={spec.warmup_steps}",
           f"training.learning_rate={spec.lr}", f"training.seed={spec.seed}", "training.logging_steps=10",
           "training.save_steps=1000000", f"{arch}.intermediate_size={spec.head_shape['mlp']}",
           # a draft shaped for this target (its default is Llama-3.1-8B's: 32 heads of 128, 8 kv heads)
           f"{arch}.num_attention_heads={t['num_attention_heads']}", f"{arch}.num_key_value_heads={t['num_key_value_heads']}",
           f"{arch}.head_dim={t.get('head_dim') or t['hidden_size'] // t['num_attention_heads']}",
           f"{arch}.rope_theta={theta}", f"{arch}.rope_scaling={{rope_type: default, rope_theta: {theta}}}",
           f"eagle.eagle_ttt_steps={spec.head_shape['ttt']}"]  # fmt: skip
    if spec.head == "matched":
        cmd += [f"data.draft_vocab_cache={PO / 'modelopt_vocab' / target.name / 'd2t.pt'}",
                f"{arch}.draft_vocab_size={spec.head_shape['draft_vocab']}"]  # fmt: skip
    return cmd


def sample_tokens(convs: Path, target: Path, max_len: int) -> float:
    """The mean tokens of a conversation of ``convs`` rendered by the target's chat template, cut at
    ``max_len``: what a batch of one such sample trains (its padding left out)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    rows = [json.loads(x)["messages"] for x in convs.read_text().split("\n") if x.strip()]  # (not splitlines: U+2028)
    texts = [tok.apply_chat_template(m, tokenize=False) for m in rows]  # (tokenized apart: a list in any version)
    lengths = [min(max_len, len(ids)) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    return round(sum(lengths) / max(1, len(lengths)), 1)


def specforge_draft(t: dict, shape: dict) -> dict:
    """The draft config SpecForge 0.2.0 derives from the target (its fields, one Llama layer), shaped as
    ``shape`` (MLP, draft vocab; EAGLE-3.1: its per-state norms before fc)."""
    d = {k: t[k] for k in SPECFORGE_FIELDS if t.get(k) is not None}
    if "rope_theta" not in d and t.get("rope_parameters"):  # (transformers 5 keeps it under rope_parameters)
        d["rope_theta"] = t["rope_parameters"]["rope_theta"]
    d |= {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
          "tie_word_embeddings": False, "use_cache": True, "pad_token_id": t.get("pad_token_id") or 0,
          "intermediate_size": shape["mlp"], "draft_vocab_size": shape["draft_vocab"]}  # fmt: skip
    if shape.get("variant") == "eagle3.1":
        d["fc_norm"] = True
    return d


def specforge_config(spec: RunSpec, run: Path, sf: Path, tied: bool) -> dict:
    """One run's SpecForge config (``specforge train -c``): its defaults but the budget's steps, the
    lr, the seed, the head and the data of the session (``sf``: the capture's folder)."""
    vocab = sf / "hs/vocab_mapping" if spec.head == "default" else sf / f"vocab{spec.head_shape['draft_vocab']}"
    return {
        "run_id": "run",
        "output_dir": str(run / "out"),
        "model": {
            "target_model_path": str(sf / "target"),
            "draft_model_config": str(sf / f"draft_{spec.head}.json"),
            "lm_head_key": "model.embed_tokens.weight" if tied else "lm_head.weight",
            "vocab_mapping_path": str(vocab / "vocab_mapping.pt"),
        },  # fmt: skip
        "data": {"hidden_states_path": str(sf / "hs"), "max_length": 2048, "chat_template": "lfm"},
        "training": {
            "strategy": "eagle3",
            "num_epochs": 1000,
            "max_steps": spec.steps_planned,  # (it stops there)
            "learning_rate": spec.lr,
            "seed": spec.seed,
            "ttt_length": spec.head_shape["ttt"],
            "log_interval": SPECFORGE_LOG_EVERY,
        },  # fmt: skip
    }


def eval_cmd(export: Path, prompts: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "eagle3_train.evaluation.eval", f"++draft={export}", "++target=embedded",
            "++engine=vllm", "++k=5", "++dtype=float32", "++batch_size=40", f"++prompts={prompts}", f"++out={out}",
            "++max_new_tokens=128", "++progress=false"]  # fmt: skip


# --- the session ---------------------------------------------------------------------------------------


def env_for(fw: str) -> dict[str, str]:
    site = {
        "ours": [],
        "speculators": ["/tmp/specsite", str(VSITE)],
        "modelopt": ["/tmp/mosite", str(PEERS / "modelopt_ex")],
        "specforge": ["/tmp/sfsite", "/tmp/sg14site"],  # (SGLang 0.5.14's site carries transformers 5.8.1: first)
    }
    path = [*site[fw], "/tmp/site", str(REPO), os.environ.get("PYTHONPATH", "")]
    # a fresh machine compiles again (ModelOpt's max-autotune: 5-6 min; speculators': 1-4 min): the cache of the
    # frameworks in CACHED goes out with the polls and comes back with a call of its own (cache-in; compilation is
    # measured apart from the budget either way)
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(COMPILE_CACHE)} if fw in CACHED else {}
    return {**os.environ, **cache, "PYTHONPATH": ":".join(p for p in path if p), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
            "EAGLE3_CACHE": os.environ.get("EAGLE3_CACHE", "/tmp/e3cache"),
            "TVM_FFI_CACHE_DIR": "/tmp/sg14cache/tvm-ffi", "FLASHINFER_WORKSPACE_BASE": "/tmp/sg14cache"}  # fmt: skip


# The frameworks that compile into the carried cache: those with runs left to start warm. One cache of
# COMPILE_CACHE_MIB holds ModelOpt's graphs (27-32 MiB packed) or the others', hardly both, and a cache over it
# is not brought out at all; ModelOpt's finals are done (its 3-minute seeds compile cold beside), ours' runs too.
CACHED = tuple(os.environ.get("PEERS_CACHED", "speculators specforge").split())
COMPILE_CACHE = Path(os.environ.get("COMPILE_CACHE", "/tmp/inductor_peers"))  # their torch.compile cache
COMPILE_CACHE_TGZ = "inductor_peers.tgz"  # a poll's parts of it (.part-N); a later session starts warm
# (sessions 37-48 carried ModelOpt's alone, as inductor_modelopt.tgz: pack those again under this name to use them)
COMPILE_CACHE_MIB = 48  # at most this much comes out (a call's files: 64 MiB together, 16 MiB each, 8 files)
CACHE_PART_BYTES = 15 << 20  # one file of it
CACHE_HEADS = "heads.json"  # in COMPILE_CACHE: the heads (framework:head@device) whose graphs it holds
CARRIED_COMPILE_S = {"modelopt": 90.0}  # a compile that found its graphs in a cache carried from another H100:
# ModelOpt's default head compiled in ~88 s so (peers_modelopt_cache_h100.json: 60 steps in 92 s, 4 s of them
# steps), against 17-21 s where the cache was the machine's own and 381 s cold. A framework not named here has not
# compiled from a carried cache yet: its runs are counted cold (the first such run's compile column says how warm)
SHARED_SET = REPO / "benchmarks" / "data" / DATA_SET  # the shared set, committed (pack copies it into .peers/)
PEERS_HERE = REPO / ".peers"  # what pack fills here, which a job's call carries
PEERS_CACHE = REPO / ".peers_cache"  # here: the parts a poll brought out, for cache-in (plan reads their heads)
PHASES = threading.Lock()  # the lanes append to one phases.jsonl
PHASE_TIMEOUT_S = 1800.0  # a phase that hangs (an engine, a rendezvous) frees its lane after this; training: below
CAPTURE_TIMEOUT_S = 600.0  # a peer's state capture (speculators' took 67 + 104 s alone on an H100; SpecForge's: new)
START = time.time()  # when the job began (--admit-for-s and --end-by-s count from it)
SHARED_SLOWDOWN = 2.0  # a loop sharing the GPU, where its framework has not shared it yet (speculators: 1.9x, H100)
EVAL_S = 90.0  # eagle3-eval of a draft beside the lanes (42-55 s measured; H100)
SERVE_S = 180.0  # vLLM's start with the draft and its served acceptance (every sized run; 150 s measured)
PLAN_GPU_MIB = {"h100": 81559, "h200": 143771}  # plan (no GPU here): the memory nvidia-smi reports there


def phase(
    run: str,
    name: str,
    cmd: list[str],
    env: dict,
    cwd: Path | None = None,
    log: Path | None = None,
    shared: bool = False,
    timeout: float = PHASE_TIMEOUT_S,
) -> bool:
    """Run one command in its own process group, its output to ``log``, stopped (the whole group) after
    ``timeout`` seconds (rc 124); append {run, phase, seconds, start, end, rc, shared} to phases.jsonl
    (``shared``: other work had the GPU too, so its seconds are not the phase's alone)."""
    log = log or PO / run / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc, 60.0)
            rc = 124
            say(f"{run} {name}: stopped after {timeout:.0f} s")
    end = time.time()
    record(run, name, start, end, rc, shared)
    say(f"{run} {name} {'done' if rc == 0 else f'failed (rc {rc}), its log: {log}'} in {end - start:.0f} s")
    return rc == 0


SPECULATORS_SEQ = 4096  # speculators' --seq-length (and its capture server's --max-model-len)
RENDER_CHECK = f"{CHECK}render "  # + a set's sha256[:12]: the phase comparing speculators' rows rendered here


def render_trusted(sessions: list[dict], sha: str) -> bool:
    """A held session found speculators' rows rendered here the same as its render endpoint's, for the
    set of this ``sha`` (its ``RENDER_CHECK`` phase ended 0)."""
    return any((p["run"], p["phase"], p["rc"]) == ("speculators_data", f"{RENDER_CHECK}{sha[:12]}", 0)
               for s in sessions for p in s.get("phases", []))  # fmt: skip


def chat_ids(tok: Any, messages: list[dict], prompt: bool) -> list[int]:
    """The chat rendered by the tokenizer's template as an OpenAI-style server renders it: the
    template's text (with the assistant's opening where ``prompt``), tokenized adding no special tokens
    of its own, cut at ``SPECULATORS_SEQ`` on the right."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    return tok(text, add_special_tokens=False)["input_ids"][:SPECULATORS_SEQ]


def speculators_rows(convs: Path, model: str, out: Path) -> bool:
    """speculators' training rows (``input_ids``, ``loss_mask``: the reply and what closes it trained)
    of ``convs`` (one ``conversations`` list a line) rendered here with ``model``'s chat template,
    one a conversation in its order, as its render endpoint path derives them: the prompt rendered
    with the assistant's opening, the whole chat without, the mask at the prompt's end. False (nothing
    written) where a chat is not one user turn answered once in text, or its prompt's render does not begin the
    whole chat's: speculators' own path then renders them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    lines = []
    for line in convs.read_text().splitlines():
        chat = [{"role": t.get("role"), "content": t.get("content")} for t in json.loads(line)["conversations"]]
        if [t["role"] for t in chat] != ["user", "assistant"] or not all(isinstance(t["content"], str) for t in chat):
            return False
        prompt, full = chat_ids(tok, chat[:1], True), chat_ids(tok, chat, False)
        if full[: len(prompt)] != prompt:
            return False
        lines.append(json.dumps({"input_ids": full, "loss_mask": [0] * len(prompt) + [1] * (len(full) - len(prompt))}))
    out.write_text("".join(x + "\n" for x in lines))
    return True


def same_prepared(a: Path, b: Path) -> str | None:
    """None where speculators' two prepared datasets hold the same rows in the same order and the same
    token counts (``token_freq.pt``); else where they first differ."""
    import torch
    from datasets import load_from_disk

    for d in (a, b):
        if not (d / "dataset_info.json").is_file():
            return f"{d} holds no dataset speculators' prepare-data wrote (no dataset_info.json)"
    x, y = (load_from_disk(str(d)).with_format(None) for d in (a, b))  # (python lists, whatever format it saved)
    if len(x) != len(y):
        return f"{len(x)} rows against {len(y)}"
    for i, (r, q) in enumerate(zip(x, y)):
        for k in ("input_ids", "loss_mask", "seq_len"):
            if r[k] != q[k]:
                return f"row {i}: {k} differs"
    same = torch.load(a / "token_freq.pt") == torch.load(b / "token_freq.pt")  # ({token id: count})
    return None if same else "token_freq.pt differs"


def record(run: str, name: str, start: float, end: float, rc: int = 0, shared: bool = False) -> None:
    """Append one phase to the session's phases.jsonl."""
    with PHASES, (PO / "phases.jsonl").open("a") as f:
        f.write(
            json.dumps(
                {
                    "run": run,
                    "phase": name,
                    "seconds": round(end - start, 1),
                    "start": start,
                    "end": end,
                    "rc": rc,
                    "shared": shared,
                }  # fmt: skip
            )
            + "\n"
        )


def other_sets(known: list[Run], sha: str) -> str | None:
    """What to say where runs in the results trained on other conversations than the set here (e.g.
    a shared set lost here and synthesized again, which a machine's numbers may not repeat)."""
    other = {r.data_sha256 for r in known if r.data_sha256 not in ("", sha)}
    if not other:
        return None
    return (f"the shared set here (sha256 {sha[:12]}) is not the one {sum(r.data_sha256 in other for r in known)} "
            f"runs in the results trained on ({', '.join(sorted(x[:12] for x in other))}): the verdict's "
            "'one data set' column says where a comparison mixes them")  # fmt: skip


def synthesize(data: Path) -> bool:
    """The shared set, written once on the GPU by the smollm2 recipe's synthesis (its own phase,
    outside every budget); polls then bring it out in parts (:func:`data_parts`)."""
    data.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "eagle3_train.run", "recipe=smollm2", f"out={PO / 'data' / 'run'}", "until=prepare",
           f"prepare.synthesize={DATA_N}", f"prepare.save_conversations={data}"]  # fmt: skip
    return phase("data", "synthesize", cmd, env_for("ours"))


def data_parts(dest: Path) -> None:
    """A set synthesized this session, in parts that fit a poll's files (``cat`` them, in order, into
    ``.peers/data/<DATA_SET>`` here; ``pack`` does)."""
    data = PEERS / "data" / DATA_SET
    if not any(ph["run"] == "data" and ph["rc"] == 0 for ph in phases()):  # none made here, or not yet whole
        return
    write_parts(data.read_bytes(), dest / DATA_SET, DATA_PART)


def write_parts(blob: bytes, path: Path, size: int) -> None:
    """``blob`` as ``<path>.part-N`` of ``size`` bytes each (a call's files are 16 MiB at most),
    replacing the parts an earlier poll left there."""
    for old in path.parent.glob(f"{path.name}.part-*"):
        old.unlink()
    for i in range(0, len(blob), size):
        path.with_name(f"{path.name}.part-{i // size}").write_bytes(blob[i : i + size])


def part_files(path: Path) -> list[Path]:
    """``<path>.part-N``, in order."""
    return sorted(path.parent.glob(f"{path.name}.part-*"), key=lambda f: int(f.name.rsplit("-", 1)[1]))


STAGE_WAIT_S = 900.0  # a server waits this long for vLLM's stage: its parts may come with the polls after the start


def vllm_staged(wait_s: float = 0.0) -> bool:
    """vLLM is installed in ``VSITE`` (stage_vllm.sh's marker, written once every part is installed),
    waiting up to ``wait_s`` for it."""
    end = time.time() + wait_s
    while not any(VSITE.glob(".stage_vllm-*")):
        if time.time() >= end:
            return False
        time.sleep(min(1.0, max(0.05, end - time.time())))
    return True


STARTING = threading.Lock()  # one vLLM server starts at a time (its profile reads the whole GPU's free memory)


class Server:
    """A vLLM server in its own process group, up until the block ends. Its start is tried twice:
    beside the lanes, another process freeing GPU memory while vLLM profiles it fails the start. The
    lanes' servers start one at a time (``STARTING``): session 46's three, started within a second of
    each other, each read the others' growth as its own, and one found -0.2 GiB left for its KV cache.
    It first waits for vLLM's stage (``STAGE_WAIT_S``), so a job may start before the calls that carry
    vLLM's parts."""

    def __init__(self, cmd: str, log: Path, url: str):
        self.cmd, self.log, self.url = cmd, log, url

    def __enter__(self) -> Server:
        if not vllm_staged():
            say(f"waiting for vLLM's stage in {VSITE} (benchmarks/staging/stage_vllm.sh install, each of its parts)")
            if not vllm_staged(STAGE_WAIT_S):
                raise RuntimeError(f"vLLM is not staged in {VSITE} after {STAGE_WAIT_S:.0f} s: carry its parts "
                                   "(benchmarks/staging/stage_vllm.sh install)")  # fmt: skip
        engine = f'source {REPO}/benchmarks/staging/engine_env.sh && exec "${{vllm_env[@]}}" {self.cmd}'
        with STARTING:
            return self._start(engine)

    def _start(self, engine: str) -> Server:
        for attempt in (1, 2):
            with self.log.open("a") as out:
                self.proc = subprocess.Popen(["bash", "-c", engine], stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=True, cwd=REPO)  # fmt: skip
            end = time.time() + 600
            while time.time() < end and self.proc.poll() is None:
                try:
                    urllib.request.urlopen(self.url, timeout=2)
                    return self
                except OSError:
                    time.sleep(2)
            self.__exit__()
            say(f"vLLM did not answer at {self.url} (start {attempt} of 2): {self.log}")
        raise RuntimeError(f"vLLM did not answer at {self.url}: {self.log}")

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            stop_group(self.proc, 60.0)


class Session:
    """One job: the shared data, each framework's preparation once, then its runs in order."""

    def __init__(self, a: argparse.Namespace, device: str):
        from eagle3_train.targets import resolve_local_dir

        self.a, self.device = a, device
        self.target = resolve_local_dir("embedded", os.environ.get("EAGLE3_CACHE", "/tmp/e3cache"))
        self.t = json.loads((self.target / "config.json").read_text())
        self.size_on = a.size_on or device  # (whose probes size the runs)
        self.known, self.sessions = load(a.results or REPO / f"benchmarks/results/peers_{self.size_on}.json")
        self.ready: set[str] = set()
        self.prep_locks = {fw: threading.Lock() for fw in FRAMEWORKS}  # (two heads, one preparation)
        self.prep_failed: set[str] = set()
        self.lanes: Lanes | None = None  # set once the runs share the GPU: preparations then go beside them
        self.convs = PO / "convs.jsonl"
        data = PEERS / "data" / DATA_SET
        if not data.is_file() and not synthesize(data):
            raise SystemExit(f"peers_gpu: the shared set {data} could not be synthesized (see {PO}/data/)")
        with gzip.open(data, "rt") as f:
            rows = [line for _, line in zip(range(a.n), f)]
        if len(rows) < a.n:
            raise SystemExit(f"peers_gpu: {data} holds {len(rows)} conversations, fewer than --n {a.n}")
        self.convs.write_text("".join(rows))
        (PO / "convs_conversations.jsonl").write_text(  # the one key speculators' reader takes
            "".join(json.dumps({"conversations": json.loads(r)["messages"]}) + "\n" for r in rows)
        )
        self.sha = hashlib.sha256(self.convs.read_bytes()).hexdigest()
        if msg := other_sets(self.known, self.sha):
            say(msg)

    def prepare(self, fw: str, head: str) -> bool:
        """The framework's data (once per session): ours tokenized, speculators' states, ModelOpt's vocab.
        One that failed is not tried again for the framework's other head."""
        with self.prep_locks[fw]:
            if fw in self.prep_failed:
                return False
            try:
                ok = self._prepare(fw, head)
            except Exception:
                self.prep_failed.add(fw)
                raise
            if not ok:
                self.prep_failed.add(fw)
            return ok

    def _prepare(self, fw: str, head: str) -> bool:
        shared = self.lanes is not None
        if fw == "speculators":  # the matched head's decoder config (here, not with its states: those may be reused)
            draft = {**self.t, "num_hidden_layers": 1, "intermediate_size": ours_head()["mlp"]}
            (PO / "speculators_draft.json").write_text(json.dumps(draft))
        if fw not in self.ready and fw in BESIDE and self.written(fw):
            say(f"{BESIDE[fw][0]}: written by an earlier job on this machine from the same conversations, reused")
            self.ready.add(fw)
        if fw not in self.ready:
            if fw == "ours":
                ok = phase("ours_data", "prepare", [sys.executable, "-m", "eagle3_train.run", "recipe=smollm2",
                           f"out={PO / 'ours_data'}", f"data={self.convs}", "until=prepare"], env_for("ours"),
                           shared=shared)  # fmt: skip
            elif fw == "speculators":
                ok = self.speculators_data()
            elif fw == "specforge":
                ok = self.specforge_data()
            else:
                ok = install("/tmp/mosite", "nvidia_modelopt-*.whl", "pulp-*.whl")
                (PO / "modelopt_data").mkdir(parents=True, exist_ok=True)
                (PO / "modelopt_data" / STEP_TOKENS).write_text(json.dumps(
                    {"tokens_per_step": sample_tokens(self.convs, self.target, MODELOPT_SEQ)}))  # fmt: skip
            if not ok:
                return False
            if fw in BESIDE:  # (a later job on this machine reuses it: its states take minutes)
                (PO / BESIDE[fw][0]).mkdir(parents=True, exist_ok=True)
                (PO / BESIDE[fw][0] / WRITTEN).write_text(json.dumps({"sha256": self.sha, "n": self.a.n}))
            self.ready.add(fw)
        if fw == "modelopt" and head == "matched" and "modelopt:vocab" not in self.ready:  # from the same conversations
            if not phase("modelopt_data", "vocab", [sys.executable, "scripts/calibrate_draft_vocab.py", "--model",
                         str(self.target), "--data", str(self.convs), "--draft_vocab_size", str(ours_head()["draft_vocab"]),
                         "--save_dir", str(PO / "modelopt_vocab")], env_for("modelopt"), cwd=PEERS / "modelopt_ex",
                         shared=shared):  # fmt: skip
                return False
            self.ready.add("modelopt:vocab")
        return True

    def written(self, fw: str) -> bool:
        """The framework's data folder holds what an earlier job on this machine wrote whole from these
        conversations (its marker is written last)."""
        try:
            mark = json.loads((PO / BESIDE[fw][0] / WRITTEN).read_text())
        except (OSError, ValueError):
            return False
        return mark == {"sha256": self.sha, "n": self.a.n}

    def speculators_data(self) -> bool:
        """vLLM writes the target's states (HF ids 2, N//2, N-3 and the pre-norm N) of speculators'
        rows. The rows are its render endpoint's (each chat rendered twice by the server, masked at
        the boundary), or, where a held session found them the same for this set
        (``render_trusted``), rendered here before the server is up (``speculators_rows``: the
        render's ~100 s off the data's critical path); where it has not, both, and the two compared
        (``RENDER_CHECK``; the two phases of the check are not counted in its data's seconds)."""
        if not install("/tmp/specsite", "speculators-*.whl", "hs_connectors-*.whl"):
            return False
        from eagle3_train.engines.vllm import launch

        n, out = self.t["num_hidden_layers"], PO / "speculators_data"
        cmd = launch(str(self.target), [2, n // 2, n - 3, n], "bfloat16", PORT_STATES, str(out / "hs"))
        cmd += f" --gpu-memory-utilization {CAPTURE_SHARE} --max-model-len {SPECULATORS_SEQ} --enforce-eager"  # (eager:
        # the same states)
        out.mkdir(parents=True, exist_ok=True)
        spec = [sys.executable, "-m", "speculators"]
        prep = [*spec, "prepare-data", "--model", str(self.target), "--seq-length", str(SPECULATORS_SEQ),
                "--max-samples", str(self.a.n), "--no-skip-token-freq"]  # fmt: skip
        url, shared, env = f"http://127.0.0.1:{PORT_STATES}", self.lanes is not None, env_for("speculators")
        rows, trusted = out / "rows.jsonl", render_trusted(self.sessions, self.sha)
        try:
            local = speculators_rows(PO / "convs_conversations.jsonl", str(self.target), rows)
        except Exception as e:  # (a check of ours: speculators' own path goes on without it)
            say(f"speculators_data: its rows not rendered here ({type(e).__name__}: {e}); its render endpoint's only")
            local = False
        if local:  # (no server needed: it runs while vLLM is staged)
            dest = out / ("data" if trusted else "data_rows")
            shutil.rmtree(dest, ignore_errors=True)  # (prepare-data keeps what a folder holds)
            local = phase("speculators_data", "rows" if trusted else f"{CHECK}rows", [*prep, "--data", str(rows),
                          "--output", str(dest)], env, shared=shared, timeout=CAPTURE_TIMEOUT_S)  # fmt: skip
        if trusted and local:
            say(f"speculators_data: its rows rendered here (a held session found them the render endpoint's for "
                f"set {self.sha[:12]})")  # fmt: skip
        with self.beside_lanes("speculators"), Server(cmd, out / "vllm.log", f"{url}/v1/models"):
            if not (trusted and local):
                shutil.rmtree(out / "data", ignore_errors=True)  # (what failed rows left: it would be kept)
                if not phase("speculators_data", "render", [*prep, "--data", str(PO / "convs_conversations.jsonl"),
                             "--render-endpoint", url, "--output", str(out / "data")], env, shared=shared,
                             timeout=CAPTURE_TIMEOUT_S):  # fmt: skip
                    return False
                if local:  # (the rows rendered here against the endpoint's, as speculators wrote both)
                    phase("speculators_data", f"{RENDER_CHECK}{self.sha[:12]}", [sys.executable, str(HERE),
                          "same-prepared", str(out / "data"), str(out / "data_rows")], env, shared=shared)  # fmt: skip
            return phase("speculators_data", "states", [*spec, "generate-offline-data", "--preprocessed-data",
                         str(out / "data"), "--endpoint", f"{url}/v1", "--concurrency", "32"], env, shared=shared,
                         timeout=CAPTURE_TIMEOUT_S)  # fmt: skip

    @staticmethod
    def beside_mib(fw: str) -> float:
        """What the framework's data preparation holds of the GPU beside the lanes: its engine's share
        (+ its CUDA context and activations)."""
        return (BESIDE[fw][1] + 0.05) * gpu_memory_mib()

    @contextmanager
    def beside_lanes(self, fw: str) -> Iterator[None]:
        """Room on the GPU for the framework's data preparation (``beside_mib``), held against the
        lanes' cap while runs share the GPU; nothing before. The hold is a phase of its own
        (``lanes_hold``): its engine starts before the preparation's first phase, and a run it
        overlapped did not have the GPU to itself."""
        name = BESIDE[fw][0]
        if self.lanes is None:
            yield
            return
        with self.lanes.hold(name, self.beside_mib(fw)):
            start = time.time()
            try:
                yield
            finally:
                record("lanes_hold", name, start, time.time(), shared=True)

    def specforge_data(self) -> bool:
        """SpecForge's capture (SGLang 0.5.14 in process) renders the chats with its template and writes
        the target's states with the default head's vocabulary; the matched head's vocabulary is
        SpecForge's own mapping over the same rows."""
        if not install("/tmp/sfsite", "specforge-*.whl", "yunchang-*.whl"):
            return False
        if self.a.n % SPECFORGE_BATCH:
            say(f"specforge: --n {self.a.n} is not a multiple of its capture's batch {SPECFORGE_BATCH} (it drops "
                "the last partial batch, while the matched head's vocabulary counts every conversation)")  # fmt: skip
            return False
        sf, shared = PO / "specforge_data", self.lanes is not None
        specforge_target(self.target, sf / "target")
        for head in HEADS["specforge"]:
            shape, _ = head_shape("specforge", head, self.t, self.a.variant)
            (sf / f"draft_{head}.json").write_text(json.dumps(specforge_draft(self.t, shape), indent=1))
        data, target = str(PO / "convs_conversations.jsonl"), str(sf / "target")
        capture = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                   str(PEERS / "specforge" / SPECFORGE_CAPTURE), "--target-model-path", target, "--draft-model-config",
                   str(sf / "draft_default.json"), "--data-path", data, "--output-path", str(sf / "hs"),
                   "--chat-template", "lfm", "--max-length", "2048", "--num-samples", str(self.a.n), "--batch-size",
                   str(SPECFORGE_BATCH), "--cache-dir", str(sf / "cache"), "--sglang-attention-backend", "triton",
                   "--sglang-mem-fraction-static", str(SPECFORGE_SHARE)]  # fmt: skip
        with self.beside_lanes("specforge"):
            if not phase("specforge_data", "states", capture, env_for("specforge"), shared=shared,
                         timeout=CAPTURE_TIMEOUT_S):  # fmt: skip
                return False
        size = head_shape("specforge", "matched", self.t, self.a.variant)[0]["draft_vocab"]
        return phase("specforge_data", "vocab", [sys.executable, "-c", SPECFORGE_VOCAB, data, target, str(self.a.n),
                     str(self.t["vocab_size"]), str(size), str(sf / f"vocab{size}"), str(sf / STEP_TOKENS)], env_for("specforge"),
                     shared=shared)  # fmt: skip

    def spec(self, fw: str, head: str, kind: str, budget: float | None, lr: float, seed: int) -> RunSpec | None:
        """The run sized to its budget from the framework's steady step time (None: none measured)."""
        shape, missing = head_shape(fw, head, self.t, self.a.variant)
        s = RunSpec(fw, head, kind, budget, lr, seed, PROBE_STEPS[fw], self.a.n, self.sha, head_shape=shape,
                    missing=missing, device=self.device, session=self.a.session)  # fmt: skip
        if budget is not None:
            timing = step_time(self.known, fw, head, self.size_on, s.conversations, shape.get("variant", "eagle3"),
                               PROBE_STEPS[fw])  # fmt: skip
            if timing is None:
                return None
            s.planned_step_s, s.lanes = timing[0], self.a.lanes
            s.sized_on = "" if self.size_on == self.device else self.size_on
            s.steps_planned = sized_steps(fw, budget, timing[0])
            if fw == "speculators":
                if timing[1] is None:
                    raise RuntimeError(f"{fw}:{head}: its probe's log gave no steps per epoch")
                s.epochs = epochs_for(s.steps_planned, timing[1])
        if fw == "speculators" and s.epochs is None:
            s.epochs = 1  # a probe: one epoch at most (more, and each epoch after the stop still runs a step)
        if fw == "modelopt":
            s.warmup_steps = max(1, round(MODELOPT_WARMUP * s.steps_planned))
        return s

    def train(self, s: RunSpec, lane: int = 0) -> None:
        """Train, export, evaluate (and for a final: MT-bench, vLLM); record what it measured. ``lane``:
        which of the runs sharing the GPU this is (its ports)."""
        run = PO / s.name
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True)
        (run / "spec.json").write_text(json.dumps(asdict(s), indent=1))
        say(f"{s.name}: {s.steps_planned} steps, {s.epochs} epochs at most ({s.kind}, lane {lane})")
        env, export = env_for(s.framework) | {"MASTER_PORT": str(PORT_DIST + lane)}, run / "export"
        limit = 4 * (s.budget_s or 0) + 900  # (its loop slowed by the lanes, start-up and compilation)
        if s.framework == "ours":
            (run / "run").mkdir()
            (run / "run/prepared").symlink_to(PO / "ours_data/prepared")  # tokenized once per session
            ok = phase(s.name, "train", ours_cmd(s, run / "run", self.convs), env, timeout=limit) and phase(s.name, "export",
                       [sys.executable, "-m", "eagle3_train.serving.export", f"++run={run / 'run/train'}",
                        f"++out={export}"], env)  # fmt: skip
        elif s.framework == "specforge":
            config = specforge_config(s, run, PO / "specforge_data", bool(self.t.get("tie_word_embeddings")))
            draft = config["model"]["draft_model_config"]
            (run / "config.json").write_text(json.dumps(config, indent=1))
            env.pop("MASTER_PORT")  # (it takes a free port itself, and refuses a partial torchrun environment)
            ok = phase(s.name, "train", [sys.executable, "-m", "specforge.cli", "train", "-c", str(run / "config.json")],
                       env, timeout=limit) and phase(s.name, "export", [sys.executable, "-m", "specforge.cli", "export", "--to",
                       "sglang", "--checkpoint", str(run / "out/run-latest"), "--draft-config", draft,
                       "--vocab-mapping", config["model"]["vocab_mapping_path"], "--output-dir", str(export)], env)  # fmt: skip
            shutil.rmtree(run / "out", ignore_errors=True)
        elif s.framework == "speculators":
            ok = phase(s.name, "train", speculators_cmd(s, run, self.target), env, timeout=limit)
            ckpts = sorted((p for p in (run / "ckpt").glob("[0-9]*") if p.is_dir()), key=lambda p: int(p.name))
            if ok and ckpts:
                export.symlink_to(ckpts[-1])  # its last epoch's directory is what vLLM serves
                for old in ckpts[:-1]:
                    shutil.rmtree(old)
        else:
            ex = PEERS / "modelopt_ex"
            ok = phase(s.name, "train", modelopt_cmd(s, run, self.target, self.convs, self.t), env, cwd=ex,
                       timeout=limit) and phase(
                s.name, "export", [sys.executable, "scripts/export_hf_checkpoint.py", "--model_path",
                str(run / "out"), "--export_path", str(export)], env, cwd=ex)  # fmt: skip
            shutil.rmtree(run / "out", ignore_errors=True)
        if ok and s.kind != "probe":
            phase(
                s.name,
                "eval_heldout",
                eval_cmd(export, REPO / "data_prep/prompts/heldout.jsonl", run / "eval_heldout"),
                env_for("ours"),
            )
            phase(
                s.name,
                "eval_mtbench",
                eval_cmd(export, PEERS / "data/mt_bench_question.jsonl", run / "eval_mtbench"),
                env_for("ours"),
            )
            if self.lanes is not None:  # (its training's room goes back; vLLM's waits ahead of new runs)
                self.lanes.move(lane, serve_mib(gpu_memory_mib()))
            self.serve(s.name, export, lane)
        got = read_run(run, phases(), memory_trace(PO / "smi.csv"))
        with PHASES:  # (the lanes end runs at once: this run now stands for its name, an earlier one's goes)
            self.known = [r for r in self.known if r.name != got.name] + [got]

    def expected(self, spec: RunSpec) -> float:
        return expected_s(self.known, spec, self.a.slowdown, warm=head_key(spec) in cached_heads())

    def peak(self, spec: RunSpec) -> int | None:
        return lane_peak(self.known, spec, gpu_memory_mib())

    def serve(self, name: str, export: Path, lane: int = 0) -> None:
        """vLLM serving the target with the draft; eagle3-served-acceptance on the held-out prompts."""
        spec = json.dumps({"method": "eagle3", "model": str(export), "num_speculative_tokens": 5})
        # vLLM's default attention (FA3 on Hopper): every draft here has the target's attention shape, the
        # one 0.26 plans a draft's FA3 schedule with (the staged vLLM carries no FA2 kernels)
        cmd = (f"vllm serve {self.target} --port {PORT_SERVE + lane} --dtype bfloat16 --max-model-len 4096 "
               f"--gpu-memory-utilization {SERVE_MEMORY} --enforce-eager --speculative-config '{spec}'")  # fmt: skip
        url, start = f"http://127.0.0.1:{PORT_SERVE + lane}", time.time()
        try:
            with Server(cmd, PO / name / "vllm_serve.log", f"{url}/health"):
                phase(name, "served", [sys.executable, "-m", "eagle3_train.evaluation.served_acceptance",
                      f"++server={url}", "++engine=vllm", f"++prompts={REPO / 'data_prep/prompts/heldout.jsonl'}",
                      "++max_new_tokens=128", f"++draft={export}", f"++out={PO / name / 'served'}"], env_for("ours"))  # fmt: skip
        except RuntimeError as e:  # (recorded: a run that vLLM will not serve is not trained again for it)
            record(name, "served", start, time.time(), rc=1)
            say(f"{name}: not served: {e}")


def sized_steps(fw: str, budget: float, step_s: float) -> int:
    """The steps ``budget`` seconds of steady loop take at the framework's step time alone."""
    steps = plan_steps(budget, step_s)
    if fw == "specforge":  # (a last partial window of steps would go unlogged, its seconds unknown)
        steps = max(3, round(steps / SPECFORGE_LOG_EVERY)) * SPECFORGE_LOG_EVERY
    return steps


def expected_s(known: list, spec: RunSpec, slowdown: float | None = None, warm: bool = False) -> float:
    """Seconds the run may take from its start while sharing the GPU: its loop slowed as much as its
    framework's slowest shared run was (either head, each against its own step alone) among those that
    shared it with no more lanes than this one's job (else among all; else ``SHARED_SLOWDOWN``;
    ``slowdown``: the operator's), its
    probe's start-up and compilation, slowed as its framework's were beside as many lanes
    (``overhead_slowdown``; a fresh machine compiles again; ``warm``: the compile cache here
    holds its head's graphs, so its compile is a warm one's, ``warm_compile_s``, or one from a cache
    carried from another machine, ``CARRIED_COMPILE_S``, whichever is longer; cold where its framework
    has no carried compile measured), and its draft's
    scoring (``scoring_s``: two evaluations, held-out and MT-bench, and vLLM serving)."""
    return expected_total(expected_parts(known, spec, slowdown, warm))


def expected_total(parts: dict[str, float]) -> float:
    """The seconds of ``expected_parts`` (its factors left out)."""
    return parts["loop"] + parts["overhead"] + parts["scoring"]


def expected_parts(known: list, spec: RunSpec, slowdown: float | None = None, warm: bool = False) -> dict[str, float]:
    """``expected_s``'s parts, each in seconds and with its factor: ``loop`` (at ``loop_x`` its time
    alone), ``overhead`` (start-up and compile, at ``overhead_x``) and ``scoring``."""
    shared = []  # (lanes, its steady step over its step alone) of the framework's runs that shared the GPU
    for r in known:
        alone = spec.planned_step_s if r.head == spec.head else r.planned_step_s  # (another head: its own)
        if r.framework == spec.framework and (r.lanes or 1) > 1 and r.steady_step_s and alone:
            shared.append((r.lanes, r.steady_step_s / alone))
    met = at_lanes(shared, spec.lanes)
    slowdown = slowdown or (max(1.0, met) if met is not None else SHARED_SLOWDOWN)
    slowdown = slowdown if spec.lanes > 1 else 1.0  # (one lane: the GPU to itself)
    factor = overhead_slowdown(known, spec, warm)
    return {"loop": (spec.steps_planned or 0) * (spec.planned_step_s or 0.0) * slowdown, "loop_x": slowdown,
            "overhead": alone_overhead(known, spec, warm) * factor, "overhead_x": factor,
            "scoring": scoring_s(known, spec)}  # fmt: skip


def scoring_s(known: list, spec: RunSpec) -> float:
    """From a run's training's end to its draft scored (export, held-out and MT-bench evaluations, vLLM
    serving, their waits): the longest its framework's runs took (``scored_s``) beside no more lanes
    than this one's job (else beside any); ``2 * EVAL_S + SERVE_S`` where none was measured. Session
    46: speculators' 3-minute drafts 237 s in six lanes, ModelOpt's finals 390 s (its export 30 s, a
    vLLM start of 150 s), against the 360 s counted."""
    took = [(r.lanes or 1, r.scored_s) for r in known if r.framework == spec.framework and r.scored_s is not None
            and (r.sized_on or r.device) == (spec.sized_on or spec.device)]  # fmt: skip
    near = [x for n, x in took if n <= spec.lanes] or [x for _, x in took]
    return max(near) if near else 2 * EVAL_S + SERVE_S


def probe_of(known: list, fw: str, head: str, device: str) -> Run | None:
    """The head's probe on that GPU kind (its longest, where several): what sizes its runs."""
    probes = [
        r for r in known if (r.framework, r.head, r.device, r.kind) == (fw, head, device, "probe") and not r.failed
    ]
    return max(probes, key=lambda r: r.steps or 0) if probes else None


def alone_overhead(known: list, spec: RunSpec, warm: bool) -> float:
    """The run's start-up and compilation alone on the GPU: its head's probe's (60 s each where
    unmeasured), the compile a warm one's where ``warm`` (``expected_s``)."""
    alone = probe_of(known, spec.framework, spec.head, spec.sized_on or spec.device)
    measured = (alone.startup_s, alone.compile_s) if alone else (None, None)
    carried = CARRIED_COMPILE_S.get(spec.framework)  # (the cache may have come from another machine)
    if warm and alone and carried is not None and (hit := warm_compile_s(known, spec, alone.compile_s)) is not None:
        measured = (alone.startup_s, max(hit, carried))
    return sum(60.0 if x is None else x for x in measured)


def overhead_slowdown(known: list, spec: RunSpec, warm: bool) -> float:
    """How much longer start-up and compilation take beside the other lanes (host work: the lanes
    share the host's cores): the slowest ratio met by the framework's runs that shared the GPU with no
    more lanes than this one's job (else with any), each run's start-up and compile over its own
    head's alone (``alone_overhead``), among compiles of this run's kind (from a cache, or from
    nothing); 1 where none is measured, or in one lane. Session 46: speculators' matched head took
    180 s and 230 s beside five lanes against 66 s and 67 s alone."""
    if spec.lanes <= 1:
        return 1.0
    device, ratios = spec.sized_on or spec.device, []
    for r in known:
        shared = (r.framework, r.sized_on or r.device) == (spec.framework, device) and (r.lanes or 1) > 1
        cold = probe_of(known, r.framework, r.head, device) if shared and r.kind != "probe" else None
        if cold is None or not cold.compile_s or r.startup_s is None or r.compile_s is None:
            continue
        hit = r.compile_s < cold.compile_s / 2  # (its compile found its graphs cached)
        if hit == warm:
            ratios.append(
                (r.lanes, (r.startup_s + r.compile_s) / alone_overhead(known, replace(spec, head=r.head), hit))
            )
    return max(1.0, at_lanes(ratios, spec.lanes) or 1.0)


def at_lanes(met: list[tuple[int, float]], lanes: int) -> float | None:
    """A slowdown for a job of ``lanes`` from those met (lanes, factor): the slowest met in no more
    lanes, and where more lanes were met too, at least the straight line from there to the fewest
    more met (speculators: 1.27x in two lanes, 2.04x in five, so 1.78x counted in four, not 1.27x);
    where none was met in so few lanes, the slowest met (None: none met)."""
    if not met:
        return None
    below = [(n, x) for n, x in met if n <= lanes]
    if not below:
        return max(x for _, x in met)
    low_n, low = max(n for n, _ in below), max(x for _, x in below)
    above = [n for n, _ in met if n > lanes]
    if not above:
        return low
    high_n = min(above)
    high = max(x for n, x in met if n == high_n)
    return max(low, low + (high - low) * (lanes - low_n) / (high_n - low_n))


def warm_compile_s(known: list, spec: RunSpec, cold: float | None) -> float | None:
    """A compile that found its graphs cached: the median compile of the head's sized runs whose
    compile took under half its probe's (``cold``: a compile from nothing), on the device it sizes by."""
    if not cold:
        return None
    hits = sorted(r.compile_s for r in known if (r.framework, r.head, r.device) == (spec.framework, spec.head,
                  spec.sized_on or spec.device) and r.kind != "probe" and r.compile_s is not None
                  and r.compile_s < cold / 2)  # fmt: skip
    return hits[len(hits) // 2] if hits else None


def head_key(spec: RunSpec) -> str:
    """How the compile cache names a head it holds the graphs of (``CACHE_HEADS``)."""
    return f"{spec.framework}:{spec.head}@{spec.device}"


def lane_peak(known: list, spec: RunSpec, device_mib: int) -> int | None:
    """What the run's lane may take while it trains and is evaluated: the whole device's peak while
    this framework and head trained alone (its probe). A final's lane then moves to what vLLM takes
    serving its draft (``serve_mib``: ``Lanes.move``)."""
    alone = probe_peaks(known).get((spec.framework, spec.head, spec.sized_on or spec.device))
    return None if alone is None else int(alone)


def serve_mib(device_mib: int) -> int:
    """What a final's lane holds while vLLM serves its draft (+ its CUDA context)."""
    return int((SERVE_MEMORY + 0.03) * device_mib)


SPECFORGE_VOCAB = """\
import json, sys
from datasets import Dataset
from specforge.data.preprocessing import build_eagle3_dataset, generate_vocab_mapping_file
from specforge.utils import load_tokenizer, safe_conversations_generator
data, target, n, vocab, size, out, tokens = sys.argv[1:]
chats = Dataset.from_generator(safe_conversations_generator, gen_kwargs={"file_path": data}).select(range(int(n)))
rows = build_eagle3_dataset(chats, load_tokenizer(target), chat_template="lfm", max_length=2048)
generate_vocab_mapping_file(rows, target_vocab_size=int(vocab), draft_vocab_size=int(size), cache_dir=out)
lengths = [x.numel() for x in rows["input_ids"]]
with open(tokens, "w") as f:
    json.dump({"tokens_per_step": sum(lengths) / len(lengths)}, f)
"""  # the matched head's draft vocabulary by SpecForge's own functions, over the rows its capture read; and its
# rows' mean length, its tokens a step (a batch of one, its default)


def specforge_target(hf: Path, dest: Path) -> None:
    """The target's files, its config saying bfloat16, and the weight index SpecForge's target head
    asks for (it reads the lm_head, tied or not, through one). The embedded target's checkpoint is
    fp32: SpecForge's capture has no dtype option and would write fp32 states (twice the disk), which
    its bf16-only target head refuses at the first step (float != BFloat16, seen on the CPU)."""
    from safetensors import safe_open

    dest.mkdir(parents=True, exist_ok=True)
    for f in hf.iterdir():
        if f.name != "config.json" and not (dest / f.name).exists():
            (dest / f.name).symlink_to(f)
    config = {k: v for k, v in json.loads((hf / "config.json").read_text()).items() if k != "torch_dtype"}
    (dest / "config.json").unlink(missing_ok=True)  # (never written through a link into the target itself)
    (dest / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}, indent=1))
    if not (dest / "model.safetensors.index.json").exists():
        weights = {}
        for f in sorted(hf.glob("*.safetensors")):
            with safe_open(str(f), "pt") as w:
                weights |= dict.fromkeys(w.keys(), f.name)
        (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weights}))


YARDSTICK = """\
import json, sys, time, torch
n, dev = int(sys.argv[1]), "cuda" if torch.cuda.is_available() else "cpu"
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
for _ in range(3):
    x @ x
sync(); t = time.perf_counter()
for _ in range(100):
    x @ x
sync(); tflops = 100 * 2 * n**3 / (time.perf_counter() - t) / 1e12
y = torch.zeros(1, device=dev)
for _ in range(200):
    y.add_(1)
sync(); t = time.perf_counter()
for _ in range(5000):
    y.add_(1)
sync(); launch_us = (time.perf_counter() - t) / 5000 * 1e6
t, k = time.perf_counter(), 0
for i in range(3_000_000):
    k += i
sig = lambda x: float(f"{x:.3g}")  # (three significant figures: a small matmul on a CPU is far below 0.01)
print(json.dumps({"matmul_tflops": sig(tflops), "launch_us": sig(launch_us),
                  "python_loop_s": sig(time.perf_counter() - t)}))
"""  # a bf16 matmul (the GPU), a tiny op (a kernel launch: small drafts are bound by it), a Python loop (the CPU)
YARDSTICK_N = 8192


def yardstick(n: int = YARDSTICK_N) -> dict | None:
    """This machine's speed, a few seconds alone: two H100s differed 1.3x in ours' step (sessions 35, 36),
    and each framework's step time is measured on the machine of the session that probed it."""
    try:
        done = subprocess.run([sys.executable, "-c", YARDSTICK, str(n)], capture_output=True, text=True, timeout=120,
                              env=env_for("ours"))  # fmt: skip
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, ValueError) as e:
        say(f"no yardstick: {e!r}")
        return None


def install(site: str, *wheels: str) -> bool:
    files = [str(f) for w in wheels for f in (PEERS / "whl").glob(w)]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site, *files]
    return len(files) == len(wheels) and subprocess.run(cmd).returncode == 0


def phases() -> list[dict]:
    path = PO / "phases.jsonl"
    with PHASES:  # (not half a line a lane is writing)
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def runs_wanted(a: argparse.Namespace, known: list) -> list[tuple[str, str, float, list[float], list[int]]]:
    """(framework, head, budget, lrs, seeds) for each FRAMEWORK[:HEAD] asked, in the order asked."""
    out = []
    for item in dict.fromkeys(a.frameworks):  # (one of each)
        fw, _, head = item.partition(":")
        if fw not in FRAMEWORKS:
            raise SystemExit(f"peers_gpu: {fw!r} is not one of {FRAMEWORKS}")
        if head and head not in HEADS[fw]:
            raise SystemExit(f"peers_gpu: {item!r}: the heads of {fw} are {', '.join(HEADS[fw])}")
        if a.what == "sweep":
            for h in [head] if head else HEADS[fw]:
                if not any(w[:2] == (fw, h) for w in out):  # (ours and ours:recipe: one group)
                    seeds = a.seeds or [SEED[fw]]  # (its grid, and past its edge where its best lies there)
                    lrs = a.lrs or sweep_lrs(known, fw, h, seeds[0])
                    out.append((fw, h, SWEEP_S, lrs, seeds))
            continue
        top = best([r for r in known if not head or r.head == head], fw)  # (a head named: that head's best lr)
        if top is None and (a.lrs is None or not head):
            raise SystemExit(f"peers_gpu: no 3-minute sweep of {fw} in the results: give --lrs and FW:HEAD")
        out.append((fw, head or top.head, FINAL_S, a.lrs or [top.lr], a.seeds or [SEED[fw], SEED[fw] + 1]))
    return out


SIZED_WITHIN = 0.05  # a run held at steps within this share of what it is sized to now is done


def done(known: list, spec: RunSpec, whole: bool = False) -> bool:
    """The results already hold this run evaluated (a final: on MT-bench too; ``whole``: on MT-bench
    and its vLLM acceptance too, or vLLM failed to serve it) at the steps it is sized to now, within
    ``SIZED_WITHIN`` (one sized from a step time that has moved further runs again: two H100s' steps
    differ by more than that, a 60-step probe's from a 300-step one's by far more)."""
    return any(r.name == spec.name and abs(r.steps_planned - spec.steps_planned) <= SIZED_WITHIN * spec.steps_planned
               and r.scored() and (not whole or r.tau_mtbench is not None and (r.vllm_acceptance is not None
               or "served" in r.failed)) for r in known)  # fmt: skip


REHEARSAL_SCALE = 60.0  # a rehearsal's clock runs this many times faster than a job's (its host's own work: 60x)
ENGINE_STAGED_S = 230.0  # a job's engine (vLLM, SGLang 0.5.14) is staged and started this long after its start
# (its parts come with the first polls: session 46's speculators asked at 0 s and rendered from 232 s)
CAPTURE_GUESS_S = 300.0  # a rehearsal's data preparation for a framework no held session prepared
SYNTHESIS_GUESS_S = 160.0  # ... and the shared set's synthesis where no held session synthesized it (H100: 123-155 s)


def set_carried(peers: Path, committed: Path) -> bool:
    """Whether a job will find the shared set (else it synthesizes it first): in ``peers`` where it was
    packed, else in the committed copy ``pack`` will put there."""
    return (peers / "data" / DATA_SET).is_file() if peers.is_dir() else committed.is_file()


def held_range(held: list[float]) -> tuple[float, str]:
    """The held sessions' seconds: their median, and their range in words (``123-154``)."""
    xs = sorted(held)
    return xs[len(xs) // 2], f"{xs[0]:.0f}" + (f"-{xs[-1]:.0f}" if len(xs) > 1 else "")


def synthesis_s(sessions: list[dict]) -> list[float]:
    """The seconds each held session's synthesis of the shared set took."""
    return [p["seconds"] for s in sessions for p in s.get("phases", [])
            if (p["run"], p["phase"]) == ("data", "synthesize") and not p["rc"]]  # fmt: skip


def data_ready_s(phases: list[dict], fw: str) -> float | None:
    """Seconds from a framework's data preparation being asked for to its data ready, in one session's
    phases: from its hold of room beside the lanes (``lanes_hold``: its engine's stage and start came
    inside it) to its last phase; where it held none (it ran before the lanes, or the session predates
    the holds kept), its phases summed, and for one with an engine ``ENGINE_STAGED_S`` more. None: it
    prepared nothing there."""
    mine = [p for p in phases if p["run"] == f"{fw}_data" and not p["rc"]]
    if not mine:
        return None
    hold = [p for p in phases if (p["run"], p["phase"]) == ("lanes_hold", f"{fw}_data")]
    if hold:
        return max(p["end"] for p in mine + hold) - min(p["start"] for p in mine + hold)
    return sum(p["seconds"] for p in mine) + (ENGINE_STAGED_S if fw in BESIDE else 0.0)


def rendered_here(session: dict) -> bool:
    """speculators' rows came from ``speculators_rows`` alone in this session (a held check trusted
    them), not through its render endpoint: its data was ready some 100 s sooner."""
    return any((p["run"], p["phase"], p["rc"]) == ("speculators_data", "rows", 0) for p in session.get("phases", []))


class Rehearsal(Session):
    """The job as it would go over the results held, with nothing run (``plan --rehearse``): the shared
    set's synthesis first where the job will not find the set (``set_carried``: the held sessions'
    median), each
    framework's data takes what the held sessions' took from asking to ready (the median, the range
    said; ``data_ready_s``: speculators' and SpecForge's wait for their engine's stage; speculators'
    from the sessions whose rows took the path the job's will, ``rendered_here``, once one did), each sized
    run its expected seconds (``expected_s``), on a clock ``REHEARSAL_SCALE`` times faster. A
    rehearsed run ends evaluated below every held one, highest at its grid's middle lr, so it moves no
    best and opens no edge; a probe measures nothing, so its framework's runs are left out; serving's
    memory is not counted."""

    def __init__(self, a: argparse.Namespace, device: str):
        self.a, self.device, self.size_on = a, device, a.size_on or device
        self.t: dict = {"intermediate_size": None, "vocab_size": None}  # (no target: sizing reads no shape)
        self.known, sessions = load(a.results or REPO / f"benchmarks/results/peers_{self.size_on}.json")
        shas = [r.data_sha256 for r in self.known if r.data_sha256]
        self.sha = max(set(shas), key=shas.count) if shas else ""
        self.ready, self.prep_failed, self.lanes = set(), set(), None
        self.prep_locks = {fw: threading.Lock() for fw in FRAMEWORKS}
        self.cached = carried_heads(a.cache or PEERS_CACHE)
        self.took: dict[str, list[float]] = {}
        trusted, paths = render_trusted(sessions, self.sha), any(map(rendered_here, sessions))
        for session in sessions:
            for fw in FRAMEWORKS:
                if fw == "speculators" and paths and rendered_here(session) != trusted:
                    continue  # (its data's path differs: the render on the critical path, or not)
                if (x := data_ready_s(session.get("phases", []), fw)) is not None:
                    self.took.setdefault(fw, []).append(x)
        self.data_s = {fw: held_range(x)[0] for fw, x in self.took.items()}
        self.floor = min([r.tau_heldout for r in self.known if r.tau_heldout is not None] or [1.0]) - 1.0  # (held)
        self.t0 = time.time()
        self.ahead = 0.0  # the job's seconds before its lanes (the set's synthesis)
        if not set_carried(PEERS_HERE, SHARED_SET):  # (the job's first phase, alone, before anything)
            held = synthesis_s(sessions)
            self.ahead, span = held_range(held) if held else (SYNTHESIS_GUESS_S, "")
            say(f"{self.ahead:5.0f} s  the shared set synthesized, as it is not in .peers/data (" + (
                f"held sessions: {span} s, median {self.ahead:.0f} s)" if held else f"none held: {self.ahead:.0f} s)"))  # fmt: skip

    def now(self) -> float:
        return (time.time() - self.t0) * REHEARSAL_SCALE

    def prepare(self, fw: str, head: str) -> bool:
        with self.prep_locks[fw]:
            if fw not in self.ready:
                time.sleep(self.data_s.get(fw, CAPTURE_GUESS_S) / REHEARSAL_SCALE)
                self.ready.add(fw)
                held = self.took.get(fw, [])
                span = held_range(held)[1] if held else ""
                say(f"{self.now():5.0f} s  the data of {fw} ready (" + (f"held sessions: {span} s from asking, "
                    f"median {self.data_s[fw]:.0f} s)" if held else f"none held: {CAPTURE_GUESS_S:.0f} s)"))  # fmt: skip
        return True

    def beside_mib(self, fw: str) -> float:
        return (BESIDE[fw][1] + 0.05) * PLAN_GPU_MIB.get(self.device, 0)

    def expected(self, spec: RunSpec) -> float:
        return expected_s(self.known, spec, self.a.slowdown, warm=head_key(spec) in self.cached) / REHEARSAL_SCALE

    def peak(self, spec: RunSpec) -> int | None:
        return lane_peak(self.known, spec, PLAN_GPU_MIB.get(self.device, 0))

    def train(self, s: RunSpec, lane: int = 0) -> None:
        if s.kind == "probe":
            say(f"{self.now():5.0f} s  {s.name}: a probe, whose step time sizes its framework's runs: left out here")
            return
        took = self.expected(s) * REHEARSAL_SCALE
        say(f"{self.now():5.0f} s  {s.name} starts in lane {lane}, expected to end at {self.now() + took:.0f} s")
        time.sleep(took / REHEARSAL_SCALE)
        grid = LRS.get(f"{s.framework}:{s.head}", LRS[s.framework])
        off = abs(math.log(s.lr / grid[len(grid) // 2]))  # (its grid's middle scores best: no edge)
        low = self.floor - 0.01 * off
        got = Run.from_dict(asdict(s) | {"steps": s.steps_planned, "tau_heldout": low, "tau_mtbench": low,
                                         "vllm_acceptance": low, "lossless": "identical"})  # fmt: skip
        with PHASES:
            self.known = [r for r in self.known if r.name != got.name] + [got]
        say(f"{self.now():5.0f} s  {s.name} ends")


def job(a: argparse.Namespace, rehearse: bool = False) -> None:
    """Alone on the GPU: the shared set where missing, then, for each framework and head with no step
    time on this GPU yet, its data and a probe. Then the sized runs share the GPU in lanes; a
    framework's data not yet written this session (speculators' states) is written beside them, and
    its runs join the lanes once it is. ``rehearse``: as a ``Rehearsal`` (nothing run, nothing written)."""
    device = a.device if rehearse else gpu_kind()
    a.session = f"{device}-{datetime.now(timezone.utc):%Y%m%dT%H%M}"
    command = "python3 benchmarks/peers_gpu.py start " + shlex.join(sys.argv[2:])
    session = {"id": a.session, "device": device, "command": command, "lanes": a.lanes, "size_on": a.size_on or device,
               "date": f"{datetime.now(timezone.utc):%Y-%m-%d}"}  # fmt: skip
    if not rehearse:
        if stick := yardstick():  # (alone, before anything: this machine's speed beside the other sessions')
            session["yardstick"] = stick
        (PO / "session.json").write_text(json.dumps(session))
    s = Rehearsal(a, device) if rehearse else Session(a, device)
    wanted, failed = runs_wanted(a, s.known), set()
    for fw, head, budget, lrs, seeds in wanted:
        try:
            if s.spec(fw, head, "sweep", budget, lrs[0], seeds[0]) is None:  # no step time yet: a probe, alone
                if s.size_on != device:
                    raise RuntimeError(f"no probe on {s.size_on} to size it by (--size-on): it is probed there only")
                if not s.prepare(fw, head):
                    raise RuntimeError("its preparation failed")
                s.train(s.spec(fw, head, "probe", None, lrs[0], seeds[0]))  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001  (the next framework still runs)
            failed.add((fw, head))
            say(f"{fw}:{head}: {e!r}; its runs are left out")

    def sized(fw: str, head: str, budget: float, lrs: list[float], seeds: list[int]) -> list[RunSpec | None]:
        """The group's runs sized to their budget (None: no step time to size one by)."""
        return [s.spec(fw, head, "sweep" if budget == SWEEP_S else "final", budget, lr, seed)
                for lr in lrs for seed in seeds]  # fmt: skip

    def runs_of(
        fw: str, head: str, budget: float, lrs: list[float], seeds: list[int], whole: bool = False
    ) -> list[RunSpec]:
        specs = sized(fw, head, budget, lrs, seeds)
        if None in specs:
            raise RuntimeError("its probe measured no step time (or it failed)")
        todo = [x for x in specs if x is not None and not done(s.known, x, whole)]
        if not todo or (last is not None and time.time() > last):  # (nothing to prepare for)
            return []
        if not s.prepare(fw, head):
            raise RuntimeError("its preparation failed")
        return todo

    def to_run(fw: str, head: str, budget: float, lrs: list[float], seeds: list[int]) -> bool:
        """Some of these runs are not yet done (or cannot be sized: the group will say why)."""
        try:
            specs = sized(fw, head, budget, lrs, seeds)
        except RuntimeError:
            return True
        return any(x is None or not done(s.known, x) for x in specs)

    def giving_back(fw: str, make: Callable[[], list[RunSpec]]) -> list[RunSpec]:
        try:
            return make()
        finally:
            s.lanes.release(BESIDE[fw][0])  # type: ignore[union-attr]

    def swept(fw: str) -> list[tuple[str, str, float, list[float], list[int]]]:
        """The framework's sweep as it is sized now. A final job: its heads asked (all where none is
        named) at their sweep's lrs. A sweep's finals (--then-final): every head of the framework, this
        job's as it sweeps them and the others at their sweep's lrs (its best goes on, whichever head)."""
        three = argparse.Namespace(**{**vars(a), "what": "sweep", "lrs": None, "seeds": None})
        if a.what != "sweep":
            return [w for w in runs_wanted(three, s.known) if w[0] == fw]
        mine = [(f, h, b, lrs if a.lrs else sweep_lrs(s.known, f, h, seeds[0]), seeds)  # (as scored so far)
                for f, h, b, lrs, seeds in wanted if f == fw]  # fmt: skip
        three.frameworks = [fw]
        return mine + [w for w in runs_wanted(three, s.known) if w[1] not in {m[1] for m in mine}]

    def edge_names(fw: str, head: str, upto: int = 2 * PAST_EDGE) -> list[str]:
        return [f"{fw}:{head}", *(f"{fw}:{head} past edge {k}" for k in range(1, upto + 1))]

    tried = {(w[0], w[1]): set(w[3]) for w in wanted if a.what == "sweep"}  # a head's lrs this job has run

    def past_edge(fw: str, head: str, seeds: list[int], k: int) -> list[RunSpec]:
        """Once the head's sweep so far is over: the lr past its edge where its best lies there (the
        ``k``-th such step at most, up or down; nothing where its best is inside, or a run went unscored)."""
        s.lanes.over(edge_names(fw, head, k - 1))  # type: ignore[union-attr]
        new = [lr for lr in sweep_lrs(s.known, fw, head, seeds[0]) if lr not in tried[fw, head]]
        tried[fw, head].update(new)
        return runs_of(fw, head, SWEEP_S, new, seeds) if new else []

    def held_of(w: tuple[str, str, float, list[float], list[int]]) -> tuple[list[Run], list[str]]:
        """A head's sweep as sized now: (its runs held scored, those it lacks)."""
        fw, h, budget, lrs, sweep_seeds = w
        runs, missing = [], []
        for lr, seed in [(lr, seed) for lr in lrs for seed in sweep_seeds]:
            x = s.spec(fw, h, "sweep", budget, lr, seed)
            if x is None or not done(s.known, x):
                missing.append(x.name if x else f"{fw}:{h} lr {lr:g} seed {seed} (no step time)")
            else:
                runs += [r for r in s.known if r.name == x.name]
        return runs, missing

    def finals_of(fw: str, seeds: list[int], at: float = FINAL_S, early: bool = False) -> list[RunSpec]:
        """Once the framework's sweep (as sized now) is over and whole: its best head and lr at ``at``
        seconds (the final's; the sweep's for --then-seed, where a seed's run held without its MT-bench
        tau or vLLM acceptance trains again, its record replaced), ``seeds``. A sweep cut short, or one
        sized from another step time, chooses nothing. ``early`` (--seed-early): the best of the heads
        whose sweeps are whole when the job comes to it, beside the runs the other heads still lack
        (where none is whole yet, as without it)."""
        sweep = swept(fw)
        heads = [h for _, h, *_ in sweep]
        if early and (whole := [w[1] for w in sweep if not held_of(w)[1]]) and whole != heads:
            say(f"{fw}: seeds {', '.join(map(str, seeds))} of the best of its heads swept whole now "
                f"({', '.join(whole)}), beside the sweep of {', '.join(h for h in heads if h not in whole)}")  # fmt: skip
            heads = whole
        s.lanes.over([n for h in heads for n in edge_names(fw, h)])  # type: ignore[union-attr]
        runs, missing = [], []
        for w in swept(fw):  # (again: its lrs past an edge as scored now)
            if w[1] in heads:
                held, lacks = held_of(w)
                runs, missing = runs + held, missing + lacks
        if missing:
            what = "final" if at == FINAL_S else f"{at:g}-s run of seed {', '.join(map(str, seeds))}"
            say(f"{fw}: no {what} this job, its sweep lacks {', '.join(missing)}")
            return []
        top = best(runs, fw)
        return runs_of(fw, top.head, at, [top.lr], seeds, at == SWEEP_S) if top else []  # type: ignore[union-attr]

    if isinstance(s, Rehearsal):  # (its clock starts with the lanes, after the set's synthesis where the job
        s.t0 = time.time() - s.ahead / REHEARSAL_SCALE  # synthesizes it: its sizing so far took the host's time only)
    began, scale = (s.t0, REHEARSAL_SCALE) if isinstance(s, Rehearsal) else (START, 1.0)  # (what deadlines count on)
    last = None if a.admit_for_s is None else began + a.admit_for_s / scale
    end = None if a.end_by_s is None else began + a.end_by_s / scale
    s.lanes = Lanes(a.lanes, a.memory_gib * 1024, s.peak, last, end, s.expected, scale)
    say(f"the sized runs, {a.lanes} at a time on the GPU within {a.memory_gib:g} GiB")
    groups: list[tuple[str, Callable[[], list[RunSpec]]]]
    frameworks = dict.fromkeys(w[0] for w in wanted)
    if a.what == "final" and a.lrs is None:  # (each framework's best of its whole sweep as sized now)
        groups = [(f"{fw} final", partial(finals_of, fw, a.seeds or [SEED[fw], SEED[fw] + 1])) for fw in frameworks]
        asked = [next(w for w in wanted if w[0] == fw) for fw in frameworks]  # (its final as the results have it)
    else:
        asked = [w for w in wanted if (w[0], w[1]) not in failed]
        groups = [(f"{w[0]}:{w[1]}", partial(runs_of, *w)) for w in asked]
    # data written beside the lanes (speculators' states) has its room reserved before the first run starts,
    # not only once its engine is installed (else runs fill the GPU first and it waits for them to end);
    # the first group with runs to prepare it for gives the reservation back when it is over
    owners: dict[str, int] = {}
    for i, w in enumerate(asked):
        if w[0] in BESIDE and w[0] not in owners and to_run(*w):
            owners[w[0]] = i
    for fw, i in owners.items():
        if fw not in s.ready and not s.written(fw):
            s.lanes.reserve(BESIDE[fw][0], s.beside_mib(fw))
            groups[i] = (groups[i][0], partial(giving_back, fw, groups[i][1]))
    if a.what == "sweep" and a.lrs is None:  # (a head's best at its grid's edge: the next lr, in this job)
        groups += [(f"{fw}:{h} past edge {k}", partial(past_edge, fw, h, seeds, k))
                   for fw, h, _, _, seeds in asked for k in range(1, 2 * PAST_EDGE + 1)]  # fmt: skip
    if a.then_seed and a.what == "sweep":  # (the 3-minute verdict: the best with two more seeds, each scored as a
        # final is; not its sweep seed's run again, whose score chose it: a rerun of that could choose another)
        groups += [(f"{fw} 3-minute pair", partial(finals_of, fw, [SEED[fw] + 1, SEED[fw] + 2], SWEEP_S,
                                                    a.seed_early)) for fw in frameworks]  # fmt: skip
    if a.then_final and a.what == "sweep":
        groups += [(f"{fw} final", partial(finals_of, fw, [SEED[fw], SEED[fw] + 1])) for fw in frameworks]
    s.lanes.run(groups, s.train)


class Lanes:
    """Sized runs sharing the GPU: at most ``n`` at once, and a run starts only where the peaks its
    framework and head reached alone (their probes) fit ``cap_mib`` beside what is running (a run whose
    peak is unknown waits for the GPU to itself). Each run is told its lane (its ports)."""

    def __init__(self, n: int, cap_mib: float, peak: Callable[[RunSpec], int | None], last: float | None = None,
                 end: float | None = None, expected: Callable[[RunSpec], float] | None = None,
                 scale: float = 1.0):  # fmt: skip
        self.n, self.cap, self.peak, self.last = n, cap_mib, peak, last  # last: no run starts after this time
        self.end, self.expected = end, expected  # no run starts that is expected to end after ``end``
        self.scale = scale  # a job's seconds in one of this clock's (a rehearsal's: REHEARSAL_SCALE)
        self.left: dict[str, int] = {}  # a group -> its runs not yet over (+1 while it prepares)
        self.running: dict[int | str, float] = {}  # a lane, or a preparation -> the MiB it holds
        self.waiting: dict[str, float] = {}  # preparations waiting to start -> MiB: no new run takes their room
        self.reserved: dict[str, float] = {}  # ... and those the job will ask for, before they ask (``reserve``)
        self.cond = threading.Condition()

    def _fits(self, need: float, lane: bool) -> bool:
        if not lane:
            return not self.running or sum(self.running.values()) + need <= self.cap
        lanes = sum(isinstance(k, int) for k in self.running)
        ahead = sum(self.waiting.values()) + sum(self.reserved.values())
        alone = not self.running and not ahead
        return lanes < self.n and (alone or sum(self.running.values()) + need + ahead <= self.cap)

    def move(self, lane: int, need: float) -> None:
        """The lane's run goes on to a phase holding ``need`` (a final's vLLM, once it has trained): it
        gives back what it held and waits for ``need``, ahead of runs not yet started."""
        with self.cond:
            self.running[lane] = 0.0  # (still a lane)
            self.waiting[f"lane {lane}"] = need
            self.cond.notify_all()
            self.cond.wait_for(lambda: sum(self.running.values()) + need <= self.cap)
            del self.waiting[f"lane {lane}"]
            self.running[lane] = need

    def reserve(self, name: str, need: float) -> None:
        """Room for a preparation the job will ask for (``hold``) once it has installed what it needs:
        runs admitted before it asks leave it room, as they would once it waits."""
        with self.cond:
            self.reserved[name] = need

    def release(self, name: str) -> None:
        """A reservation not taken (its preparation was not needed, failed before asking, or is over)."""
        with self.cond:
            if self.reserved.pop(name, None) is not None:
                self.cond.notify_all()

    @contextmanager
    def hold(self, name: str, need: float) -> Iterator[None]:
        """GPU memory for a preparation beside the runs (no lane); runs admitted after it asks (or
        after it was reserved) wait behind it."""
        with self.cond:
            self.reserved.pop(name, None)
            self.waiting[name] = need
            self.cond.wait_for(lambda: self._fits(need, False))
            del self.waiting[name]
            self.running[name] = need
        try:
            yield
        finally:
            with self.cond:
                del self.running[name]
                self.cond.notify_all()

    def one(self, spec: RunSpec, work: Callable[[RunSpec, int], None]) -> None:
        need = self.peak(spec) or self.cap
        with self.cond:
            self.cond.wait_for(lambda: self._fits(need, True))
            if self.last is not None and time.time() > self.last:  # it could not end before the machine goes
                say(f"{spec.name}: not started (past --admit-for-s), left for the next session")
                return
            if self.end is not None and self.expected is not None and time.time() + self.expected(spec) > self.end:
                past = (time.time() + self.expected(spec) - self.end) * self.scale
                say(f"{spec.name}: not started (it would end {past:.0f} s past --end-by-s), left for the next session")
                return
            lane = min(set(range(self.n)) - set(self.running))
            self.running[lane] = need
        try:
            work(spec, lane)
        except Exception as e:  # noqa: BLE001  (the other lanes go on)
            say(f"{spec.name}: {e!r}")
        finally:
            with self.cond:
                del self.running[lane]
                self.cond.notify_all()

    def over(self, names: list[str]) -> None:
        """Wait until these groups (of the ``run`` going on) have given their runs and every one of them
        is over: trained, failed or not started. A group not in the run counts as over."""
        with self.cond:
            self.cond.wait_for(lambda: not any(self.left.get(n, 0) for n in names))

    def run(self, groups: list[tuple[str, Callable[[], list[RunSpec]]]], work: Callable[[RunSpec, int], None]) -> None:
        """Each group's callable prepares what it needs (beside the runs already going) and gives its
        runs; they are taken one group after another in turn, so the lanes hold a mix (ours' online
        training holds the most memory). A group's callable may wait for others to be ``over``."""
        ready: list[deque[RunSpec]] = [deque() for _ in groups]
        pending, turn = len(groups), 0
        with self.cond:
            self.left = {}
            for name, _ in groups:  # (a name given twice: each of its groups counts)
                self.left[name] = self.left.get(name, 0) + 1

        def prepare(i: int, name: str, make: Callable[[], list[RunSpec]]) -> None:
            nonlocal pending
            try:
                specs = make()
            except Exception as e:  # noqa: BLE001  (the other groups go on)
                say(f"{name}: {e!r}; its runs are left out")
                specs = []
            with self.cond:
                ready[i].extend(specs)
                pending -= 1
                self.left[name] += len(specs) - 1
                self.cond.notify_all()

        def take() -> tuple[str, RunSpec] | None:
            nonlocal turn
            with self.cond:
                while True:
                    for k in range(len(ready)):
                        i = (turn + k) % len(ready)
                        if ready[i]:
                            turn = i + 1
                            return groups[i][0], ready[i].popleft()
                    if not pending:
                        return None
                    self.cond.wait()

        def lane() -> None:
            while (taken := take()) is not None:
                try:
                    self.one(taken[1], work)
                except Exception as e:  # noqa: BLE001  (a lane that died would leave its group never over)
                    say(f"{taken[1].name}: {e!r}")
                finally:
                    with self.cond:
                        self.left[taken[0]] -= 1
                        self.cond.notify_all()

        threads = [threading.Thread(target=prepare, args=(i, *g)) for i, g in enumerate(groups)]
        threads += [threading.Thread(target=lane) for _ in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def gpu_memory_mib() -> int:
    """The GPU's memory (0 where there is none)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout  # fmt: skip
        return int(out.split()[0])
    except (FileNotFoundError, IndexError, ValueError):
        return 0


def gpu_kind() -> str:
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True).stdout  # fmt: skip
    except FileNotFoundError:
        return "cpu"
    return next((k for k in ("h200", "h100", "a100", "l40") if k in name.lower()), "gpu")


# --- pack / stage / start / poll -----------------------------------------------------------------------


def pack(examples: Path, mt_bench: Path, specforge_scripts: Path | None = None) -> None:
    """Here: the peers' wheels, ModelOpt's launcher and SpecForge's capture (GitHub only) and MT-bench
    into .peers/ (git-ignored)."""
    dest = PEERS_HERE
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest / "whl"), *WHEELS], check=True
    )
    for f in MODELOPT_FILES:
        (dest / "modelopt_ex" / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(examples / f, dest / "modelopt_ex" / f)
    if specforge_scripts is not None:
        (dest / "specforge").mkdir(exist_ok=True)
        shutil.copy(specforge_scripts / SPECFORGE_CAPTURE, dest / "specforge" / SPECFORGE_CAPTURE)
    (dest / "data").mkdir(exist_ok=True)
    shutil.copy(mt_bench, dest / "data/mt_bench_question.jsonl")
    join_data_parts(dest)
    if not (dest / "data" / DATA_SET).is_file():
        say(f".peers/data/{DATA_SET} missing: the first session synthesizes it (its own phase) and its polls "
            f"bring it out as {DATA_SET}.part-N: put those in .peers/data/ and pack again")  # fmt: skip


def cached_heads() -> set[str]:
    """The heads whose graphs the compile cache here holds (``head_key``): a run of one compiles warm."""
    try:
        return set(json.loads((COMPILE_CACHE / CACHE_HEADS).read_text()))
    except (OSError, ValueError):
        return set()


def carried_cache(folder: Path) -> bytes | None:
    """The packed compile cache an earlier session brought out into ``folder``: its parts joined, or
    the whole ``.tgz`` (None: neither is there)."""
    parts, whole = part_files(folder / COMPILE_CACHE_TGZ), folder / COMPILE_CACHE_TGZ
    if parts:
        return b"".join(f.read_bytes() for f in parts)
    return whole.read_bytes() if whole.is_file() else None


def carried_heads(folder: Path) -> set[str]:
    """The heads the cache carried in ``folder`` holds the graphs of (none where there is none, or it
    names none: a cache brought out before they were named)."""
    if (blob := carried_cache(folder)) is None:
        return set()
    try:
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            f = tar.extractfile(f"{COMPILE_CACHE.name}/{CACHE_HEADS}")
            return set(json.loads(f.read())) if f else set()
    except (KeyError, tarfile.TarError, ValueError):
        return set()


def name_cached_heads() -> None:
    """Add to the cache's ``CACHE_HEADS`` the heads of ``CACHED`` frameworks that trained here (their graphs
    are in it)."""
    trained = set()
    for p in phases():
        if p["phase"] == "train" and not p["rc"] and (PO / p["run"] / "spec.json").is_file():
            spec = Run.from_dict(json.loads((PO / p["run"] / "spec.json").read_text()))
            if spec.framework in CACHED:
                trained.add(head_key(spec))
    if trained - (held := cached_heads()):
        (COMPILE_CACHE / CACHE_HEADS).write_text(json.dumps(sorted(held | trained)))


def cache_fingerprint() -> str:
    """What the peers' compile cache holds now: its files' paths, sizes and times (Triton's own left out)."""
    h, triton = hashlib.sha256(), COMPILE_CACHE / "triton"
    for f in sorted(COMPILE_CACHE.rglob("*")):
        if f.is_file() and triton not in f.parents:
            st = f.stat()
            h.update(f"{f.relative_to(COMPILE_CACHE)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def cache_side(what: str) -> Path:
    """Beside the compile cache: ``carried`` (the fingerprint of what cache-in unpacked), ``out`` (the
    last parts packed, and their fingerprint)."""
    return COMPILE_CACHE.parent / f".{COMPILE_CACHE.name}.{what}"


def compile_cache_out(dest: Path) -> None:
    """The peers' compile cache as dest/COMPILE_CACHE_TGZ.part-N (``CACHE_PART_BYTES`` each, a call's
    files being 16 MiB at most), where it fits COMPILE_CACHE_MIB: its graphs (their Triton kernels
    bundled in), not Triton's own cache of every autotuned candidate, and the heads they are of.
    Packed only when it changed (every poll packed it again before): the last parts are copied again,
    and a cache unchanged since cache-in is not brought out (the parts carried in hold it)."""
    if not COMPILE_CACHE.is_dir():
        return
    name_cached_heads()
    now, carried, out = cache_fingerprint(), cache_side("carried"), cache_side("out")
    if carried.is_file() and carried.read_text() == now:
        return
    if (out / "fingerprint").is_file() and (out / "fingerprint").read_text() == now:
        write_parts(b"", dest / COMPILE_CACHE_TGZ, CACHE_PART_BYTES)  # (an earlier poll's parts go)
        for part in part_files(out / COMPILE_CACHE_TGZ):
            shutil.copyfile(part, dest / part.name)
        return
    tmp = dest / f".{COMPILE_CACHE_TGZ}"
    triton = f"{COMPILE_CACHE.name}/triton"  # (Triton's own cache, under inductor's by default)
    try:
        with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:  # (level 9, the default: slower, for little less)
            tar.add(COMPILE_CACHE, arcname=COMPILE_CACHE.name,
                    filter=lambda m: None if m.name == triton or m.name.startswith(f"{triton}/") else m)  # fmt: skip
    except (OSError, tarfile.TarError) as e:  # (a compile writing it now: the next poll packs it)
        say(f"the peers' compile cache not packed this time: {e!r}")
        tmp.unlink(missing_ok=True)
        return
    if tmp.stat().st_size > COMPILE_CACHE_MIB << 20:
        say(
            f"the peers' compile cache is {tmp.stat().st_size / 2**20:.0f} MiB packed: over {COMPILE_CACHE_MIB}, left here"
        )
        tmp.unlink()
        return
    write_parts(tmp.read_bytes(), dest / COMPILE_CACHE_TGZ, CACHE_PART_BYTES)
    tmp.unlink()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for part in part_files(dest / COMPILE_CACHE_TGZ):
        shutil.copyfile(part, out / part.name)
    (out / "fingerprint").write_text(now)


def compile_cache_in(folder: Path) -> None:
    """The compile cache an earlier session brought out (its parts, or the whole ``.tgz``, in
    ``folder``), where the peers look; never over a cache already there (this machine's own)."""
    if COMPILE_CACHE.is_dir() or (blob := carried_cache(folder)) is None:
        return
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(COMPILE_CACHE.parent, filter="data")
    cache_side("carried").write_text(cache_fingerprint())  # (a poll brings it out again only once it changed)
    say(f"the peers' compile cache from an earlier session: {COMPILE_CACHE} ({len(blob) / 2**20:.0f} MiB packed)")


def join_data_parts(peers: Path, committed: Path | None = None) -> None:
    """The shared set's parts a session's polls brought out (put in ``<peers>/data/``), joined in order;
    else, where ``<peers>/data/`` has no set, the committed one (``SHARED_SET``) copied there."""
    data = peers / "data" / DATA_SET
    parts = part_files(data)
    if parts and not data.is_file():
        data.write_bytes(b"".join(f.read_bytes() for f in parts))
        for f in parts:
            f.unlink()
    committed = SHARED_SET if committed is None else committed
    if not data.is_file() and committed.is_file():
        data.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(committed, data)


def packed(dest: Path) -> None:
    """The session so far as dest/poll.tgz (logs, specs, metrics, reports) and dest/peers_partial.json."""
    dest.mkdir(parents=True, exist_ok=True)
    names = ["log", "phases.jsonl", "smi.csv", "session.json"]
    for pattern in ("*/spec.json", "*/*.log", "*/run/train/metrics.jsonl", "*/eval_*/report.json",
                    "*/served/report.json", "*/export/config.json", "speculators_data/*.log", "specforge_data/*.log",
                    f"modelopt_data/{STEP_TOKENS}", f"specforge_data/{STEP_TOKENS}"):  # fmt: skip
        names += [str(p.relative_to(PO)) for p in PO.glob(pattern)]
    with tarfile.open(dest / ".poll.tgz", "w:gz") as tar:
        for n in names:
            if (PO / n).is_file():
                tar.add(PO / n, arcname=n)
    (dest / ".poll.tgz").rename(dest / "poll.tgz")
    data_parts(dest)
    try:
        runs, session = read_session(PO)
        save(dest / "peers_partial.json", runs, [session])
    except Exception as e:  # noqa: BLE001  (a log half written must not cost the archive)
        say(f"the partial results could not be read yet: {e!r}")


def poll(seconds: float, dest: Path) -> None:
    end, nxt = time.time() + seconds, 0.0
    while not (PO / "rc").is_file() and time.time() < end:
        if time.time() >= nxt:
            packed(dest)
            nxt = time.time() + 60
        time.sleep(5)
    packed(dest)
    compile_cache_out(dest)  # (once a poll: what a call brings out is what is under dest when it returns)
    lines = (PO / "log").read_text(errors="replace").splitlines() if (PO / "log").is_file() else []
    said = [x for x in lines if x.startswith("peers_gpu:")][-15:]  # (and the log's end where it is not the job's own)
    print("\n".join(said + [x for x in lines[-3:] if not x.startswith("peers_gpu:")]))
    free = shutil.disk_usage(PO).free / 2**30
    print(f"disk: {free:.1f} GiB free under {PO}")  # (states and checkpoints fill it: SpecForge's ~17 GB in bf16)
    print(f"ended: rc={(PO / 'rc').read_text().strip()}" if (PO / "rc").is_file() else "running")


def detach(cmd: list[str], out: Path, errors: bool = True, **kw: Any) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own, writing to ``out`` (its errors too, or nowhere) and
    holding none of this process's streams: ``start ... | tail`` returns once ``start`` does."""
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out.open("w"),
                            stderr=subprocess.STDOUT if errors else subprocess.DEVNULL, start_new_session=True, **kw)  # fmt: skip


def fold_earlier_job(results_file: Path) -> None:
    """Before a new job takes the session's folder: refuse while the last job runs; an ended one's runs
    go into the results file the new job reads (so a final after a sweep on this machine sees it)."""
    if (PO / "log").is_file() and not (PO / "rc").is_file():
        raise SystemExit(f"peers_gpu: a job is still running in {PO} (no rc yet): poll it until it ends")
    if (PO / "smi.pid").is_file():  # (the last job's memory trace)
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int((PO / "smi.pid").read_text()), 15)
    if (PO / "session.json").is_file():
        say(f"the last job's runs: {merge_into(PO, results_file)} runs in {results_file} now")


def clear_session_folder() -> None:
    """The session's folder emptied for a new job, less the data an earlier job on this machine wrote
    whole beside the lanes (speculators' states: minutes of vLLM's time; the new job's ``written``
    reuses them where its conversations are the same, and writes them again where not)."""
    kept = PO.with_name(f"{PO.name}.kept")
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    for folder, _ in BESIDE.values():
        if (PO / folder / WRITTEN).is_file():
            (PO / folder).rename(kept / folder)
    shutil.rmtree(PO, ignore_errors=True)
    kept.rename(PO)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])  # fmt: skip
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("examples", type=Path, help="ModelOpt's examples/speculative_decoding (0.47.0)")
    p.add_argument("mt_bench", type=Path, help="MT-bench's question.jsonl")
    p.add_argument("specforge", type=Path, nargs="?", help="SpecForge's scripts/ (0.2.0: @a6b6b02)")
    sub.add_parser("stage")
    p = sub.add_parser("same-prepared", help="exit 0 where speculators' two prepared datasets are the same")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    for name in ("start", "job", "plan"):
        p = sub.add_parser(name)
        p.add_argument("what", choices=["sweep", "final"])
        p.add_argument(
            "frameworks", nargs="+", help="ours, speculators[:default|:matched], modelopt[:default|:matched]"
        )
        p.add_argument("--lrs", type=float, nargs="+", help="default: three per framework (sweep), the best (final)")
        p.add_argument("--seeds", type=int, nargs="+", help="default: its own (sweep), its own and +1 (final)")
        p.add_argument("--n", type=int, default=DATA_N, help="the first N conversations of the shared set, for all")
        p.add_argument("--lanes", type=int, default=5, help="sized runs sharing the GPU at once (probes run alone)")
        p.add_argument("--admit-for-s", type=float, default=None,
                       help="start no sized run later than this many seconds after the job began (those left "
                       "would not end before the device time does; the running ones then share the GPU with fewer)")  # fmt: skip
        p.add_argument("--end-by-s", type=float, default=None,
                       help="start no sized run expected to end later than this many seconds after the job began "
                       f"(its loop at {SHARED_SLOWDOWN:g}x its time alone, its probe's start-up and compilation (warm where "
                       "the compile cache holds its head's graphs), its evaluations and its serving)")  # fmt: skip
        p.add_argument("--slowdown", type=float, default=None,
                       help="--end-by-s: the loop's slowdown sharing the GPU (default: the slowest its framework and "
                       f"head met in lanes, else {SHARED_SLOWDOWN:g}); e.g. 1.3 for two seeds of one framework")  # fmt: skip
        p.add_argument(
            "--then-final",
            action="store_true",
            help="sweep: once a framework's sweep is all in, its finals join the lanes in the same job",
        )
        p.add_argument("--then-seed", action="store_true",
                       help="sweep: once a framework's sweep is all in, its best head and lr at the sweep's budget "
                       "with two more seeds (its own +1 and +2), each scored on MT-bench and served by vLLM (the "
                       "3-minute verdict's spread), in the same job: a seed's run held without those trains again")  # fmt: skip
        p.add_argument("--seed-early", action="store_true",
                       help="--then-seed: the pair of the best of the framework's heads swept whole when the job "
                       "comes to it, beside the runs its other heads still lack (time the GPU would give them "
                       "alone); where one of those then does better, its pair is left for a later job")  # fmt: skip
        p.add_argument("--memory-gib", type=float, default=64.0,
                       help="the sum of the lanes' peaks (each measured alone) a new run must fit under")  # fmt: skip
        p.add_argument("--variant", choices=["eagle3", "eagle3.1"], default=None,
                       help="ours' and speculators' head family (default: the recipe's)")  # fmt: skip
        p.add_argument(
            "--results", type=Path, help="where earlier runs are read from (default: results/peers_<gpu>.json)"
        )
        p.add_argument("--device", default="h100", help="plan: the GPU kind whose step times to use")
        if name == "plan":
            p.add_argument("--rehearse", action="store_true",
                           help="then the job itself over the results held, nothing run: when each run would start "
                           f"and end and which --end-by-s would leave ({REHEARSAL_SCALE:g}x faster than the job)")  # fmt: skip
        p.add_argument("--cache", type=Path, default=None,
                       help="plan: the compile cache's parts that cache-in will bring, where its heads compile warm "
                       "(default: .peers_cache)")  # fmt: skip
        p.add_argument("--size-on", default=None, metavar="KIND",
                       help="size the runs by the probes of another GPU kind (e.g. h100 on an H200: the same steps, "
                       "so the same drafts, as there); a framework never probed there is left out, not probed here")  # fmt: skip
    p = sub.add_parser("cache-in", help="the peers' compile cache from a poll's parts in FOLDER (a call carrying it)")
    p.add_argument("folder", type=Path)
    p = sub.add_parser("poll")
    p.add_argument("seconds", type=float)
    p.add_argument("dest", type=Path)
    a = ap.parse_args(argv)
    if unknown := [fw for fw in CACHED if fw not in FRAMEWORKS]:
        ap.error(f"PEERS_CACHED={' '.join(CACHED)}: {', '.join(unknown)} is no framework here ({' '.join(FRAMEWORKS)})")
    if getattr(a, "seed_early", False) and not (a.then_seed and a.what == "sweep"):
        ap.error("--seed-early: it starts --then-seed's pair early, so it goes with 'sweep ... --then-seed'")
    if a.cmd == "stage":
        shutil.rmtree(PEERS, ignore_errors=True)
        shutil.copytree(REPO / ".peers", PEERS)
        shutil.rmtree("/tmp/repo", ignore_errors=True)
        shutil.copytree(REPO, "/tmp/repo", ignore=shutil.ignore_patterns(".peers", ".git"))
        compile_cache_in(PEERS / "cache")
        say(f"staged {PEERS} and the repository in /tmp/repo (start runs from there)")
    elif a.cmd == "cache-in":  # (named by hand: a folder that is not there, or holds no cache, is said)
        if carried_cache(a.folder) is None:
            raise SystemExit(f"peers_gpu: cache-in {a.folder}: no {COMPILE_CACHE_TGZ} or its .part-N there")
        compile_cache_in(a.folder)
    elif a.cmd == "pack":
        pack(a.examples, a.mt_bench, a.specforge)
    elif a.cmd == "same-prepared":
        if differs := same_prepared(a.a, a.b):
            raise SystemExit(f"peers_gpu: {a.a} and {a.b} differ: {differs}")
        say(f"{a.a} and {a.b}: the same rows, in the same order, and the same token counts")
    elif a.cmd == "start":
        repo = (
            Path("/tmp/repo") if Path("/tmp/repo").is_dir() else REPO
        )  # (the call's own copy is replaced by the next)
        fold_earlier_job(a.results or repo / f"benchmarks/results/peers_{a.size_on or gpu_kind()}.json")
        clear_session_folder()
        smi = ["nvidia-smi", "--query-gpu=timestamp,memory.used", "--format=csv,noheader", "-l", "2"]
        if shutil.which("nvidia-smi"):
            (PO / "smi.pid").write_text(str(detach(smi, PO / "smi.csv", errors=False).pid))
        job_cmd = f"{sys.executable} benchmarks/peers_gpu.py job {shlex.join(sys.argv[2:])}; echo $? > {PO / 'rc'}"
        detach(
            ["bash", "-c", job_cmd], PO / "log", cwd=repo, env={**env_for("ours"), "PYTHONPATH": f"/tmp/site:{repo}"}
        )
        say(f"started: {' '.join(sys.argv[2:])}")
    elif a.cmd == "job":
        job(a)
    elif a.cmd == "plan":
        sizing = a.size_on or a.device  # (as a job there would: the probes of --size-on size its runs)
        known, _ = load(a.results or REPO / f"benchmarks/results/peers_{sizing}.json")
        wanted = runs_wanted(a, known)
        if a.cache is not None and not a.cache.is_dir():
            raise SystemExit(f"peers_gpu: --cache {a.cache}: no such folder")
        cached = carried_heads(a.cache or PEERS_CACHE)  # (what cache-in would bring to the machine)
        for fw, head, budget, lrs, seeds in wanted:  # (any head family: plan has no target)
            timing = step_time(known, fw, head, sizing, a.n, min_steps=PROBE_STEPS[fw])
            if not timing:
                print(f"{fw}:{head} {budget:g} s, lrs {lrs}, seeds {seeds}: a {PROBE_STEPS[fw]}-step probe first, "
                      "then sized steps each")  # fmt: skip
                continue
            kind = "sweep" if budget == SWEEP_S else "final"
            # (plan has no target: the head family, all that sizing reads of the shape, does not depend on it)
            family = {
                "variant": head_shape(fw, head, {"intermediate_size": None, "vocab_size": None}, a.variant)[0][
                    "variant"
                ]
            }
            spec = RunSpec(fw, head, kind, budget, lrs[0], seeds[0], sized_steps(fw, budget, timing[0]), a.n,
                           device=a.device, planned_step_s=timing[0], lanes=a.lanes, head_shape=family,
                           sized_on="" if sizing == a.device else sizing)  # fmt: skip
            held = [(lr, seed) for lr in lrs for seed in seeds if done(known, replace(spec, lr=lr, seed=seed))]
            if len(held) == len(lrs) * len(seeds):
                print(f"{fw}:{head} {budget:g} s, lrs {lrs}, seeds {seeds}: all held in the results")
                continue
            lrs = [lr for lr in lrs if any((lr, seed) not in held for seed in seeds)]
            held_note = f" (held in the results: {', '.join(f'lr {lr:g} seed {s}' for lr, s in held)})" if held else ""
            peak = lane_peak(known, spec, PLAN_GPU_MIB.get(a.device, 0))
            serving = (
                f", then {serve_mib(PLAN_GPU_MIB.get(a.device, 0)) / 1024:.1f} GiB serving" if kind == "final" else ""
            )
            warm = head_key(spec) in cached
            x = expected_parts(known, spec, a.slowdown, warm)
            print(f"{fw}:{head} {budget:g} s, lrs {lrs}, seeds {seeds}: {spec.steps_planned} steps each, about "
                  f"{expected_total(x):.0f} s from its start sharing the GPU (loop "
                  f"{x['loop']:.0f} s at {x['loop_x']:.2f}x alone, start-up and compile {x['overhead']:.0f} s at "
                  f"{x['overhead_x']:.2f}x, scoring {x['scoring']:.0f} s)"
                  f"{f' (compiling warm: {(a.cache or PEERS_CACHE).name} holds its graphs)' if warm else ''}, its lane "
                  f"{'unknown' if peak is None else f'{peak / 1024:.1f} GiB'}{serving}{held_note}")  # fmt: skip
        if a.what == "sweep" and (a.then_seed or a.then_final):
            for fw in dict.fromkeys(w[0] for w in wanted):
                whole = [h for h in HEADS[fw] if set(sweep_lrs(known, fw, h)) <= set(swept_taus(known, fw, h))]
                early = a.then_seed and a.seed_early and whole  # (the pair: the best of the heads swept whole)
                top = best([r for r in known if r.head in whole] if early else known, fw)
                now = f"now {top.head} lr {top.lr:g}" if top else "none scored yet"
                if a.then_seed:
                    pair = [SEED[fw] + 1, SEED[fw] + 2]
                    held = [seed for seed in pair if top and done(known, replace(top, seed=seed), whole=True)]
                    say_held = (
                        " (held in the results)" if len(held) == 2
                        else f" (seed {held[0]} held in the results)" if held else ""
                    )  # fmt: skip
                    when = "once a head's sweep is whole (--seed-early), the best of those" if a.seed_early else \
                        "once its sweep is whole, its best"  # fmt: skip
                    print(f"{fw}: {when} ({now}) at {SWEEP_S:g} s, seeds {pair[0]} and "
                          f"{pair[1]}, each on MT-bench and served by vLLM{say_held}")  # fmt: skip
                if a.then_final:
                    print(f"{fw}: once its sweep is whole, its best ({now}) at {FINAL_S:g} s, seeds {SEED[fw]} and "
                          f"{SEED[fw] + 1} (`plan final {fw}` sizes them)")  # fmt: skip
        print(f"sized runs {a.lanes} at a time on the GPU within {a.memory_gib:g} GiB; data and probes alone")
        if a.rehearse:
            say(
                "rehearsed (seconds from the job's start; each run its expected seconds, a new run scored below "
                "every held one):"
            )
            job(a, rehearse=True)
    else:
        poll(a.seconds, a.dest)


if __name__ == "__main__":
    main()
