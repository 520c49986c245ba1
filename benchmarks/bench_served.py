"""Where a large target's states come from, measured on one GPU (the engine and the trainer sharing
it, as a user with one GPU would): tokens/s, peak GPU memory and disk in flight of the target in the
trainer (``source=online``) and of the target served by vLLM (``source=served``, the engine started
by the run with ``--load-format dummy``: random weights, no checkpoint on disk). Not part of the
test suite.

    python3 benchmarks/bench_served.py --out $OUT/served_bench.json                 # one H200
    python3 benchmarks/bench_served.py --small --out /tmp/served_bench.json         # CPU dry run

Cases (each mode of each case in its own process, within its share of ``--budget``):

- ``llama8b``: Llama-3.1-8B's shape (32 layers, hidden 4096, vocab 128256), the 8B-shaped head;
- ``qwen3_30b_a3b``: Qwen3-30B-A3B's shape (48 layers, hidden 2048, 128 experts top-8, vocab 151936).

Each prepares synthetic conversations cut at ``--seq`` tokens (the tiny byte-level tokenizer's ids,
valid in any vocabulary), builds the real ``Trainer`` (ZeRO-2, ttt 7, bf16, draft vocab 32000, a
micro-batch of ``--tokens`` tokens) and times the same micro-batches after ``--warmup`` of them:

- mode ``online``: ``forward`` (the in-process target alone), ``train`` (the draft step alone on
  states computed beforehand: the offline step), ``online`` (both, the forward overlapped);
- mode ``served``: ``states`` (the states arriving from the engine, with nothing trained),
  ``served`` (training fed by the engine, ``engine.prefetch`` micro-batches ahead).

Besides tokens/s: the trainer's peak allocated GPU memory, the device's peak used memory (engine and
trainer together, sampled every 0.1 s) and the peak bytes of the engine's state files in flight.
The offline figure (dump once, then train) is derived in the results from ``forward`` (the dump's
compute) and ``train``. ``--small`` runs tiny shapes on the CPU against the stand-in vLLM of
tests/standin_engines.py (a ``vllm`` on PATH that runs it): numbers meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from bench_online import conversations
from common import first_micro_batches, run_isolated, tokens_per_s, train_on

CASES = {"llama8b": 420, "qwen3_30b_a3b": 480}  # name -> seconds at most per mode
MODES = ("online", "served")


def shape(case: str, small: bool) -> Any:
    """The target's config: the named model's shape, or a small one of its family on --small."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    if case == "llama8b":
        if small:
            return LlamaConfig(
                hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=False,
            )  # fmt: skip
        return LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=False,
        )  # fmt: skip
    if small:
        return Qwen3MoeConfig(
            hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
            vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=False,
        )  # fmt: skip
    return Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, norm_topk_prob=True,
    )  # fmt: skip


def random_model(config: Any, device: torch.device) -> Any:
    """The target with random weights, built on ``device`` (bf16 on a GPU)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    kwargs: dict[str, Any] = {"dtype": dtype}
    if config.model_type == "qwen3_moe" and device.type == "cuda":
        kwargs["experts_implementation"] = "grouped_mm"  # transformers' batched experts, not a loop over 128
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        except (TypeError, ValueError):  # a transformers without the option: its default, recorded
            kwargs.pop("experts_implementation", None)
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.experts_implementation_used = kwargs.get("experts_implementation", "default")
    return model.eval()


def write_target(config: Any, path: Path, small: bool) -> None:
    """The target as a directory: config, the tiny tokenizer, and weights: all of them (small, for
    the stand-in) or only the embeddings, final norm and lm_head the trainer reads (the engine
    makes up the rest: --load-format dummy)."""
    from safetensors.torch import save_file

    from eagle3_train.targets.tiny import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save_pretrained(path)
    # without it vLLM 0.26 took the 30B-A3B shape for a model without generation (/v1/completions: 404)
    config.architectures = ["LlamaForCausalLM" if config.model_type == "llama" else "Qwen3MoeForCausalLM"]
    if small:
        random_model(config, torch.device("cpu")).save_pretrained(path)
        return
    config.save_pretrained(path)
    h, v = config.hidden_size, config.vocab_size
    g = torch.Generator().manual_seed(0)
    weights = {
        "model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).bfloat16(),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": (torch.randn(v, h, generator=g) * 0.02).bfloat16(),
    }
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


class Sampler:
    """Peaks of the device's used memory and of the bytes under a directory, every 0.1 s."""

    def __init__(self, files: Path | None, device: torch.device):
        self.files, self.device = files, device
        self.used, self.bytes = 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                self.used = max(self.used, total - free)
            if self.files is not None and self.files.exists():
                size = sum(f.stat().st_size for f in self.files.rglob("*") if f.is_file())
                self.bytes = max(self.bytes, size)
            time.sleep(0.1)

    def close(self) -> dict[str, float]:
        self.stop.set()
        self.thread.join()
        return {"device_peak_used_gib": self.used / 2**30, "files_in_flight_peak_mib": self.bytes / 2**20}


def measure(a: argparse.Namespace) -> None:
    """One mode of one case in this process; ``--out`` is rewritten after each figure."""
    from data_prep.prepare import PrepareConfig, Preparer
    from eagle3_train.targets import Target, target_identity
    from eagle3_train.targets.tiny import build_tiny_tokenizer
    from eagle3_train.training.config import DeepSpeedConfig, OptimConfig, TrainConfig
    from eagle3_train.training.online import OnlineConfig
    from eagle3_train.training.served import EngineConfig
    from eagle3_train.training.trainer import Trainer

    device = torch.device("cpu" if a.small else "cuda")
    work = Path(a.work) / a.case
    config = shape(a.case, a.small)
    report: dict[str, Any] = {
        "case": a.case,
        "mode": a.mode,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "seq": a.seq,
        "tokens_per_micro_batch": a.tokens,
        "ttt": a.ttt,
    }
    out = Path(a.out)

    def save(**figures: Any) -> None:
        report.update(figures)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(figures), flush=True)

    start = time.perf_counter()
    target = work / "target"
    if not (target / "config.json").is_file():
        write_target(config, target, a.small)
    prep = work / "prep"
    n = (a.warmup + a.steps) * max(1, a.tokens // a.seq) + 2
    if not (prep / "manifest.json").is_file():
        shutil.rmtree(prep, ignore_errors=True)
        Preparer(
            PrepareConfig(
                target=str(target),
                input=str(conversations(work / "c.jsonl", n, a.seq)),
                out=str(prep),
                max_length=a.seq,
                progress=False,
            )
        ).run()
    loaded = None
    if a.mode == "online":
        model = random_model(config, device)
        tokenizer = build_tiny_tokenizer()
        loaded = Target(model, tokenizer, model.config, target_identity(str(target), model.config, tokenizer), None)
        save(experts_implementation=model.experts_implementation_used, train_timing="alone")
    files = Path(a.files_root) / f"{a.case}_{os.getpid()}"
    engine = EngineConfig()
    if a.mode == "served":
        engine = EngineConfig(
            launch=True,
            engine_args=a.engine_args,
            memory_fraction=a.memory_fraction.get(a.case) if not a.small else None,
            dtype="float32" if a.small else "auto",
            files_dir=str(files),
            check_samples=0,  # the engine's dummy weights are not the checkpoint's lm_head
            launch_timeout_s=a.launch_timeout,
            port=a.port,
        )
    run = work / f"run_{a.mode}"
    shutil.rmtree(run, ignore_errors=True)
    cfg = TrainConfig(
        data=str(prep),
        target=str(target),
        out=str(run),
        source=a.mode,
        online=OnlineConfig(draft_vocab_size=256 if a.small else 32000, eval_fraction=0.0),
        engine=engine,
        train=OptimConfig(ttt_length=a.ttt, max_tokens_per_batch=a.tokens, schedule="constant"),
        deepspeed=DeepSpeedConfig(zero_stage=2),
        progress=False,
    )
    sampler = Sampler(files if a.mode == "served" else None, device)
    trainer = Trainer(cfg, target=loaded)
    try:
        source = trainer.source
        save(setup_s=time.perf_counter() - start, capture=list(trainer.spec.aux_indices))
        warm, timed, tokens = first_micro_batches(trainer, a.warmup, a.steps)
        save(micro_batches=len(timed), tokens=tokens)

        def train(batches: list[Any]) -> None:
            train_on(trainer, batches)

        def rate(work_: Any) -> float:
            return tokens_per_s(tokens, device, work_)

        def rate_on(step_all: Any) -> float:
            """The draft step alone: on states computed before the clock starts."""
            states = [source.states(b) for b in timed]
            return rate(lambda: step_all(states))

        parts: dict[str, Any] = {"warmup": lambda: train(warm)}
        if a.mode == "online":
            parts["forward"] = lambda: rate(lambda: [source.states(b) for b in timed])
            parts["train"] = lambda: rate_on(lambda states: [trainer.train_step(iter([x])) for x in states])
            parts["online"] = lambda: rate(lambda: train(timed))
        else:
            parts["states"] = lambda: rate(lambda: list(source.device_batches(iter(timed))))
            parts["served"] = lambda: rate(lambda: train(timed))
        for part, go in parts.items():
            try:
                value = go()
                if part != "warmup":
                    save(**{f"{part}_tokens_per_s": value})
            except Exception as e:  # noqa: BLE001  (one failing part keeps the others' numbers)
                save(**{f"{part}_error": f"{type(e).__name__}: {e}"[:2000]})
        if device.type == "cuda":
            save(trainer_peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30)
    finally:
        trainer.close()
        save(**sampler.close())
        shutil.rmtree(files, ignore_errors=True)


def suite(a: argparse.Namespace) -> None:
    """Every mode of every case in its own process, within ``--budget`` seconds."""
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"budget_s": a.budget, "cases": {}}
    if out.is_file():  # a second call adds cases to the same file
        results = json.loads(out.read_text())
    deadline = time.monotonic() + a.budget
    for case in a.cases.split(","):
        for mode in a.modes.split(","):
            left = deadline - time.monotonic()
            key = f"{case}/{mode}"
            if left < 60:
                results["cases"][key] = {"skipped": f"out of time ({left:.0f} s of the budget left)"}
                continue
            part = out.with_name(f".{out.stem}.{case}.{mode}.json")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--mode", mode, "--out", str(part)]
            for flag in ("seq", "tokens", "ttt", "warmup", "steps", "work", "files_root", "engine_args", "port"):
                cmd.append(f"--{flag.replace('_', '-')}={getattr(a, flag)}")  # = : a value may start with --
            cmd += ["--memory-fraction", json.dumps(a.memory_fraction), "--launch-timeout", str(a.launch_timeout)]
            cmd += ["--small"] if a.small else []
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            results["cases"][key] = run_isolated(cmd, part, min(CASES[case], left), env)
            out.write_text(json.dumps(results, indent=1) + "\n")
            print(f"== {key}: {json.dumps(results['cases'][key])[:3000]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--budget", type=float, default=1200, help="seconds for all cases together")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=None, help="tokens per sample (2048; 128 on --small)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch (16384; 512 on --small)")
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--warmup", type=int, default=None, help="micro-batches before timing (4; 1 on --small)")
    p.add_argument("--steps", type=int, default=None, help="timed micro-batches (16; 3 on --small)")
    p.add_argument("--work", default=tempfile.gettempdir() + "/bench_served", help="targets, data and runs")
    p.add_argument("--files-root", default="/dev/shm", help="where the engine's state files go (a RAM disk)")
    p.add_argument("--engine-args", default="--load-format dummy --enforce-eager", help="vLLM flags (small: none)")
    p.add_argument("--memory-fraction", type=json.loads, default={"llama8b": 0.45, "qwen3_30b_a3b": 0.6})
    p.add_argument("--launch-timeout", type=float, default=600)
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU, against the stand-in vLLM")
    a = p.parse_args()
    for key, big, small in (("seq", 2048, 128), ("tokens", 16384, 512), ("warmup", 4, 1), ("steps", 16, 3)):
        if getattr(a, key) is None:
            setattr(a, key, small if a.small else big)
    if a.small:
        a.ttt, a.engine_args = min(a.ttt, 3), ""
    if a.case:
        return measure(a)
    suite(a)


if __name__ == "__main__":
    main()
