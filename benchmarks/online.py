"""Where a large target's states come from while training, on one GPU (the engine and the trainer
sharing it): tokens/s, peak GPU memory and state files in flight of the target in the trainer
(``source=online``) and of the target served by vLLM (``source=served``, the engine started by the
run with ``--load-format dummy``: random weights, no checkpoint on disk).

    python3 -m benchmarks.online --out benchmarks/results/online_h200.json     # one GPU, vLLM staged
    python3 -m benchmarks.online --small --out /tmp/online.json                # CPU (a `vllm` on PATH)

Cases: ``llama8b`` (Llama-3.1-8B's shape, the 8B-shaped head) and ``qwen3_30b_a3b`` (48 layers, hidden
2048, 128 experts top-8). Each mode of each case runs in its own process within its share of
``--budget``: synthetic conversations cut at ``--seq`` tokens, the real ``Trainer`` (ZeRO-2, ttt 7,
bf16, draft vocab 32000, micro-batches of ``--tokens`` tokens), the same micro-batches timed after
the warm-up ones:

- ``online``: ``forward`` (the in-process target alone), ``train`` (the draft step alone on states
  computed beforehand: the offline step), ``online`` (both, the forward overlapped);
- ``served``: ``states`` (the engine's states arriving, nothing trained), ``served`` (training fed
  by the engine).

The offline figure (dump once, then train) follows from ``forward`` and ``train``. ``--small`` runs
tiny shapes on the CPU; its served mode needs a ``vllm`` on PATH (the stand-in of
tests/standin_engines.py serves): numbers meaningless.
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

from benchmarks.lab import conversations, first_micro_batches, run_isolated, tokens_per_s, train_on
from benchmarks.result import Result, this_command

CASES = {"llama8b": 420, "qwen3_30b_a3b": 480}  # name -> seconds at most per mode
MEMORY_FRACTION = {"llama8b": 0.45, "qwen3_30b_a3b": 0.6}  # of the GPU, for the engine


def shape(case: str, small: bool) -> Any:
    """The target's config: the named model's shape, or a small one of its family with ``small``."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    if case == "llama8b":
        size = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096) if small else dict(
                    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                    rms_norm_eps=1e-5)  # fmt: skip
        return LlamaConfig(**size, tie_word_embeddings=False)
    size = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                vocab_size=1024, max_position_embeddings=4096) if small else dict(
                hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                norm_topk_prob=True)  # fmt: skip
    return Qwen3MoeConfig(**size, tie_word_embeddings=False)


def random_model(config: Any, device: torch.device) -> Any:
    """The target with random weights, built on ``device`` (bf16 on a GPU; grouped experts for an MoE)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": torch.float32 if device.type == "cpu" else torch.bfloat16}
    if config.model_type == "qwen3_moe" and device.type == "cuda":
        kwargs["experts_implementation"] = "grouped_mm"  # transformers' batched experts, not a loop over 128
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, **kwargs).eval()


def write_target(config: Any, path: Path, small: bool) -> None:
    """The target as a directory: config, the tiny tokenizer, and weights: all (small, for the stand-in)
    or only what the trainer reads (embeddings, final norm, lm_head; the engine makes up the rest)."""
    from safetensors.torch import save_file

    from eagle3_train.targets.tiny import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save_pretrained(path)
    # without it vLLM took the 30B-A3B shape for a model without generation (/v1/completions: 404)
    config.architectures = ["LlamaForCausalLM" if config.model_type == "llama" else "Qwen3MoeForCausalLM"]
    if small:
        random_model(config, torch.device("cpu")).save_pretrained(path)
        return
    config.save_pretrained(path)
    h, v, g = config.hidden_size, config.vocab_size, torch.Generator().manual_seed(0)
    weights = {
        "model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).bfloat16(),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": (torch.randn(v, h, generator=g) * 0.02).bfloat16(),
    }
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


class Sampler:
    """Peaks of the device's used memory and of the bytes under a directory, every 0.1 s."""

    def __init__(self, files: Path | None, device: torch.device):
        self.files, self.device, self.used, self.bytes = files, device, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                self.used = max(self.used, total - free)
            if self.files is not None and self.files.exists():
                self.bytes = max(self.bytes, sum(f.stat().st_size for f in self.files.rglob("*") if f.is_file()))
            time.sleep(0.1)

    def close(self) -> dict[str, float]:
        self.stop.set()
        self.thread.join()
        return {"device_peak_used_gib": self.used / 2**30, "files_in_flight_peak_mib": self.bytes / 2**20}


def prepared(a: argparse.Namespace, work: Path, target: Path) -> Path:
    """Synthetic conversations for the target's tokenizer, prepared once per case."""
    from data_prep.prepare import PrepareConfig, Preparer

    prep = work / "prep"
    if not (prep / "manifest.json").is_file():
        shutil.rmtree(prep, ignore_errors=True)
        n = (a.warmup + a.steps) * max(1, a.tokens // a.seq) + 2
        data = conversations(work / "c.jsonl", n, a.seq)
        Preparer(
            PrepareConfig(target=str(target), input=str(data), out=str(prep), max_length=a.seq, progress=False)
        ).run()
    return prep


def measure(a: argparse.Namespace) -> None:
    """One mode of one case in this process; ``--out`` is rewritten after each figure."""
    from eagle3_train.targets import Target, target_identity
    from eagle3_train.targets.tiny import build_tiny_tokenizer
    from eagle3_train.training.config import DeepSpeedConfig, LoopConfig, ObjectiveConfig, OptimConfig, TrainConfig
    from eagle3_train.training.online import PreparedConfig
    from eagle3_train.training.served import EngineConfig
    from eagle3_train.training.trainer import Trainer

    device = torch.device("cpu" if a.small else "cuda")
    work, config = Path(a.work) / a.case, shape(a.case, a.small)
    report: dict[str, Any] = {"case": a.case, "mode": a.mode, "seq": a.seq, "tokens_per_micro_batch": a.tokens}

    def save(**figures: Any) -> None:
        report.update(figures)
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(figures), flush=True)

    start = time.perf_counter()
    target = work / "target"
    if not (target / "config.json").is_file():
        write_target(config, target, a.small)
    prep = prepared(a, work, target)
    loaded, engine, files = None, EngineConfig(), Path(a.files_root) / f"{a.case}_{os.getpid()}"
    if a.mode == "online":
        model, tokenizer = random_model(config, device), build_tiny_tokenizer()
        loaded = Target(model, tokenizer, model.config, target_identity(str(target), model.config, tokenizer), None)
    else:
        engine = EngineConfig(
            launch=True, engine_args="" if a.small else a.engine_args,
            memory_fraction=None if a.small else MEMORY_FRACTION[a.case], dtype="float32" if a.small else "auto",
            files_dir=str(files), check_samples=0,  # the engine's dummy weights are not the checkpoint's lm_head
            launch_timeout_s=a.launch_timeout, port=a.port,
        )  # fmt: skip
    run = work / f"run_{a.mode}"
    shutil.rmtree(run, ignore_errors=True)
    cfg = TrainConfig(
        data=str(prep), target=str(target), out=str(run), source=a.mode,
        prepared=PreparedConfig(draft_vocab_size=256 if a.small else 32000, eval_fraction=0.0), engine=engine,
        objective=ObjectiveConfig(ttt_length=a.ttt), optim=OptimConfig(schedule="constant"),
        loop=LoopConfig(max_tokens_per_batch=a.tokens),
        deepspeed=DeepSpeedConfig(zero_stage=2), progress=False,
    )  # fmt: skip
    sampler = Sampler(files if a.mode == "served" else None, device)
    trainer = Trainer(cfg, target=loaded)
    try:
        source = trainer.source
        save(setup_s=time.perf_counter() - start, capture=list(trainer.spec.aux_indices))
        warm, timed, tokens = first_micro_batches(trainer, a.warmup, a.steps)
        save(micro_batches=len(timed), tokens=tokens)
        rate = lambda work_: tokens_per_s(tokens, device, work_)  # noqa: E731

        def train_alone() -> float:
            states = [source.states(b) for b in timed]  # computed before the clock starts
            return rate(lambda: [trainer.train_step(iter([x])) for x in states])

        parts: dict[str, Any] = {"warmup": lambda: train_on(trainer, warm)}
        if a.mode == "online":
            parts["forward"] = lambda: rate(lambda: [source.states(b) for b in timed])
            parts["train"] = train_alone
            parts["online"] = lambda: rate(lambda: train_on(trainer, timed))
        else:
            parts["states"] = lambda: rate(lambda: list(source.device_batches(iter(timed))))
            parts["served"] = lambda: rate(lambda: train_on(trainer, timed))
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
    """Every mode of every case in its own process within ``--budget`` seconds."""
    settings = {"seq": a.seq, "tokens_per_micro_batch": a.tokens, "ttt": a.ttt, "warmup": a.warmup, "steps": a.steps}
    result = Result(what="training fed by the target in the trainer (online) and by vLLM serving it (served), "
                    "one GPU: tokens/s, memory, files in flight", command=a.command, figures=settings)  # fmt: skip
    cases: dict[str, Any] = {}
    deadline = time.monotonic() + a.budget
    for case in a.cases.split(","):
        for mode in a.modes.split(","):
            left, key = deadline - time.monotonic(), f"{case}/{mode}"
            if left < 60:
                cases[key] = {"skipped": f"out of time ({left:.0f} s of the budget left)"}
                continue
            part = Path(a.out).with_name(f".{Path(a.out).stem}.{case}.{mode}.json")
            cmd = [sys.executable, "-m", "benchmarks.online", "--case", case, "--mode", mode, "--out", str(part)]
            for flag in (
                "seq",
                "tokens",
                "ttt",
                "warmup",
                "steps",
                "work",
                "files_root",
                "engine_args",
                "port",
                "launch_timeout",
            ):
                cmd.append(f"--{flag.replace('_', '-')}={getattr(a, flag)}")  # = : a value may start with --
            cases[key] = run_isolated(cmd + (["--small"] if a.small else []), part, min(CASES[case], left))
            result.figures = {**settings, "cases": cases}
            result.write(a.out)
            print(f"== {key}: {json.dumps(cases[key])[:3000]}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    p.add_argument("--out", required=True, help="results JSON")
    p.add_argument("--budget", type=float, default=1200, help="seconds for all cases together")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ",".join(CASES))
    p.add_argument("--modes", default="online,served", help="comma-separated: online,served")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=None, help="tokens per sample (2048; 128 with --small)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch (16384; 512 with --small)")
    p.add_argument("--ttt", type=int, default=7, help="test-time-training steps (3 at most with --small)")
    p.add_argument("--warmup", type=int, default=None, help="micro-batches before timing (4; 1 with --small)")
    p.add_argument("--steps", type=int, default=None, help="timed micro-batches (16; 3 with --small)")
    p.add_argument("--work", default=tempfile.gettempdir() + "/bench_online", help="targets, data and runs")
    p.add_argument("--files-root", default="/dev/shm", help="where the engine's state files go (a RAM disk)")
    p.add_argument("--engine-args", default="--load-format dummy --enforce-eager", help="vLLM's flags")
    p.add_argument("--launch-timeout", type=float, default=600, help="seconds for the engine to answer")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU: a smoke test, numbers meaningless")
    a = p.parse_args(argv)
    a.command = this_command("online", argv)
    for key, big, small in (("seq", 2048, 128), ("tokens", 16384, 512), ("warmup", 4, 1), ("steps", 16, 3)):
        if getattr(a, key) is None:
            setattr(a, key, small if a.small else big)
    a.ttt = min(a.ttt, 3) if a.small else a.ttt
    return measure(a) if a.case else suite(a)


if __name__ == "__main__":
    main()
