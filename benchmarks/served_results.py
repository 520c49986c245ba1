"""benchmarks/results/served_h200.json from the raw outputs of one H200 lease (bench_served.py's
JSON files, and the figures of served_gpu.py's results.json): the equality of ``source=served``
with ``source=online``, the scale table (8B and 30B-A3B shapes: in-process, served, offline) and the
projection of GPU-hours for 500k conversations x 2k tokens from the measured rates and FLOPs.

    python3 benchmarks/served_results.py --scale benchmarks/results/raw/served_scale_run*_h200.json \
        --equality benchmarks/results/raw/served_equality_h200.json \
        --quantized benchmarks/results/raw/served_fp8_h200.json \
        --out benchmarks/results/served_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dump import forward_flops_per_token  # noqa: E402
from bench_train import flops_per_token  # noqa: E402

from eagle3_train.model.draft import DraftConfig  # noqa: E402

SEQ = 2048
TTT = 7
TOKENS = 500_000 * 2048  # the projection's data: 500k conversations of 2k tokens, one epoch
RECORDED_DUMP_8B = "benchmarks/results/dump_h200_8b.json"  # eagle3-dump at the 8B shape, same H200 kind


def target_shape(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int) -> SimpleNamespace:
    return SimpleNamespace(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
    )


def draft(hidden: int, heads: int, kv: int, inter: int, vocab: int) -> DraftConfig:
    return DraftConfig(
        hidden_size=hidden,
        target_hidden_size=hidden,
        num_aux=3,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        intermediate_size=inter,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        draft_vocab_size=32000,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )


# name -> (target forward GFLOP per token, draft config, what the figure is)
def projection_targets() -> dict[str, tuple[float, DraftConfig, str]]:
    llama8b = target_shape(4096, 32, 32, 8, 14336, 128256)
    llama70b = target_shape(8192, 80, 64, 8, 28672, 128256)

    def moe_forward(active_params: float, layers: int, heads: int, head_dim: int) -> float:
        # 2 x active parameters + causal attention over the mean context (SEQ / 2)
        return 2 * active_params + layers * 2 * 2 * heads * head_dim * (SEQ + 1) / 2

    return {
        "llama-3.1-8b": (
            forward_flops_per_token(llama8b, SEQ) / 1e9,
            draft(4096, 32, 8, 14336, 128256),
            "decoder FLOPs of the shape (bench_dump.forward_flops_per_token)",
        ),
        "llama-3.3-70b": (
            forward_flops_per_token(llama70b, SEQ) / 1e9,
            draft(8192, 64, 8, 28672, 128256),
            "decoder FLOPs of the shape (bench_dump.forward_flops_per_token)",
        ),
        "deepseek-v3": (
            moe_forward(37e9, 61, 128, 160) / 1e9,
            draft(7168, 56, 8, 18432, 129280),
            "2 x 37B active parameters + MLA attention (128 heads, mean q/k/v head 160)",
        ),
        "kimi-k2": (
            moe_forward(32e9, 61, 64, 160) / 1e9,
            draft(7168, 56, 8, 18432, 163840),
            "2 x 32B active parameters + MLA attention (64 heads, mean q/k/v head 160)",
        ),
    }


def case(runs: list[dict], key: str) -> dict[str, Any]:
    """The last run's figures of ``key`` that hold no error."""
    found: dict[str, Any] = {}
    for r in runs:
        got = r["cases"].get(key)
        if got and not any(k == "error" or k.endswith("_error") for k in got):
            found = got
    return found


def quantized(raw: Path) -> dict[str, Any]:
    """SmolLM2 served by vLLM with fp8 weights (``--quantization fp8``) beside the bf16 in-process
    runs: the states differ by the quantization (step-1 loss), the draft trains on them, and the run
    records what fed it."""
    got = json.loads(raw.read_text())
    runs = got["smollm2"]["runs"]
    ref, srv, seed1 = runs["online_seed0"], runs["served_seed0"], runs["online_seed1"]
    return {
        "engine_args": srv["states_from"]["engine_args"],
        "states_from": srv["states_from"],
        "engine_log": got["note"],
        "first_step_loss_online_bf16": ref["first_step"]["loss"],
        "first_step_loss_served_fp8": srv["first_step"]["loss"],
        "first_step_loss_rel_diff": got["smollm2"]["first_step_loss_rel_diff"],
        "eval_tau_online_bf16": ref["final_eval"]["eval_tau"],
        "eval_tau_served_fp8": srv["final_eval"]["eval_tau"],
        "eval_tau_diff_served_vs_online": got["smollm2"]["eval_tau_diff_served_vs_online"],
        "eval_tau_diff_seed1_vs_seed0": seed1["final_eval"]["eval_tau"] - ref["final_eval"]["eval_tau"],
        "tokens_per_s_served_over_online": got["smollm2"]["tokens_per_s_served_over_online"],
        "eval_on": "each run's own held-out states (the fp8 run's from the fp8 engine: the states it will be served with)",
    }


def build(scale_files: list[Path], equality: Path, quantized_raw: Path | None = None) -> dict[str, Any]:
    runs = [json.loads(p.read_text()) for p in scale_files]
    figures = {
        k: case(runs, k) for k in ("llama8b/online", "llama8b/served", "qwen3_30b_a3b/online", "qwen3_30b_a3b/served")
    }
    failed = {
        k: v.get("output_tail", "")[-600:] or {e: v[e] for e in v if e.endswith("_error")}
        for r in runs
        for k, v in r["cases"].items()
        if "error" in v or any(e.endswith("_error") for e in v)
    }
    dump8 = json.loads(Path(RECORDED_DUMP_8B).read_text())
    table: dict[str, Any] = {}
    for shape, name in (("llama8b", "llama-3.1-8b shape"), ("qwen3_30b_a3b", "qwen3-30b-a3b shape")):
        on, sv = figures[f"{shape}/online"], figures[f"{shape}/served"]
        row: dict[str, Any] = {"shape": name}
        if on:
            forward = on["forward_tokens_per_s"]
            if on.get("train_timing") == "alone":
                train_alone = on["train_tokens_per_s"]
                serial = 1 / (1 / forward + 1 / train_alone)
            else:  # the first version's "train" part timed the forward too (states computed inside its
                # timing): the serial forward + train; the draft step alone is what the forward leaves
                serial = on["train_tokens_per_s"]
                train_alone = 1 / (1 / serial - 1 / forward)
            row["in_process_online"] = {
                "tokens_per_s": on["online_tokens_per_s"],
                "target_forward_alone_tokens_per_s": forward,
                "forward_then_train_serial_tokens_per_s": serial,
                "trainer_peak_allocated_gib": on["trainer_peak_allocated_gib"],
                "device_peak_used_gib": on["device_peak_used_gib"],
                "disk_in_flight_mib": 0,
            }
            row["draft_step_alone_tokens_per_s_derived"] = train_alone
            dump = dump8["ours"]["tokens_per_s"] if shape == "llama8b" else forward
            bytes_per_token = 4 * (4096 if shape == "llama8b" else 2048) * 2  # 3 aux + last_hidden, bf16
            row["offline"] = {
                "dump_tokens_per_s": dump,
                "dump_source": "recorded eagle3-dump at this shape (dump_h200_8b.json, shards written)"
                if shape == "llama8b"
                else "the in-process forward of this run (compute only: shard writes not timed)",
                "train_tokens_per_s": train_alone,
                "one_epoch_tokens_per_s": 1 / (1 / dump + 1 / train_alone),
                "disk_bytes_per_token_bf16": bytes_per_token,
                "disk_for_1e9_tokens_tb_bf16": bytes_per_token * 1e9 / 1e12,
            }
        if sv:
            row["served_online"] = {
                "tokens_per_s": sv["served_tokens_per_s"],
                "engine_states_alone_tokens_per_s": sv["states_tokens_per_s"],
                "trainer_peak_allocated_gib": sv["trainer_peak_allocated_gib"],
                "device_peak_used_gib": sv["device_peak_used_gib"],
                "disk_in_flight_peak_mib": sv["files_in_flight_peak_mib"],
                "engine_start_and_setup_s": sv["setup_s"],
            }
            if on:
                row["served_over_in_process"] = sv["served_tokens_per_s"] / on["online_tokens_per_s"]
        table[shape] = row
    out: dict[str, Any] = {
        "what": "eagle3-train source=served (vLLM 0.26.0 started by the run) against source=online: equality on "
        "SmolLM2 and a tiny qwen3_moe target; tokens/s, memory and disk in flight at the 8B and 30B-A3B shapes; "
        "a projection of GPU-hours",
        "machine": "1 x NVIDIA H200 (device tool), torch 2.11.0+cu130, transformers 5.17.0, vLLM 0.26.0; engine and "
        "trainer sharing the GPU (vLLM --gpu-memory-utilization 0.45 for 8B and 0.6 for 30B-A3B, --enforce-eager, "
        "--load-format dummy at both shapes, states via ExampleHiddenStatesConnector into /dev/shm); three leases of "
        "that machine kind (the 30B-A3B served figure from the third)",
        "date": "2026-12-04",
        "runs": "single run per configuration (per seed for the equality runs)",
        "commands": {
            "equality": "W=/tmp/w50 python3 benchmarks/served_gpu.py (steps smollm2, qwen3_moe)",
            "scale": "python3 benchmarks/bench_served.py --modes served,online --warmup 3 --steps 8 "
            "--files-root=/dev/shm (micro-batches of 16384 tokens, seq 2048, ttt 7, ZeRO-2, bf16)",
        },
        "equality": json.loads(equality.read_text()),
        "scale": table,
        "failed": failed,
    }
    if quantized_raw is not None:
        out["quantized"] = quantized(quantized_raw)
        out["commands"]["quantized"] = (
            "W=/tmp/j/fp8 STEPS=smollm2 VLLM_ARGS='--enforce-eager --quantization fp8' python3 benchmarks/served_gpu.py"
        )
    out["projection"] = projection(table)
    out["tables"] = tables(out)
    out["raw_runs"] = runs
    return out


def tables(out: dict[str, Any]) -> list[dict[str, Any]]:
    """The docs page's tables: equality, scale, projection."""
    eq = out["equality"]
    rows = []
    for target in ("smollm2", "qwen3_moe"):
        e = eq[target]
        rows.append(
            [
                target,
                f"{e['online_seed0']['first_step_loss']:.4f}",
                f"{e['served_seed0']['first_step_loss']:.4f}",
                f"{e['first_step_loss_rel_diff_served_vs_online']:.1e}",
                f"{e['online_seed0']['eval_tau']:.3f}",
                f"{e['served_seed0']['eval_tau']:.3f}",
                f"{e['eval_tau_diff_served_vs_online']:+.4f}",
                f"{e['eval_tau_diff_seed1_vs_seed0']:+.4f}",
            ]
        )
    scale_rows = []
    for row in out["scale"].values():
        on, sv, off = row.get("in_process_online"), row.get("served_online"), row.get("offline")
        fmt = lambda x: f"{x:,.0f}" if isinstance(x, (int, float)) else "not measured"  # noqa: E731
        scale_rows.append(
            [
                row["shape"],
                fmt(on and on["tokens_per_s"]),
                fmt(sv and sv["tokens_per_s"]),
                f"{row['served_over_in_process']:.2f}" if "served_over_in_process" in row else "-",
                fmt(off and off["one_epoch_tokens_per_s"]),
                f"{on['device_peak_used_gib']:.0f} / {sv['device_peak_used_gib']:.0f}" if on and sv else "-",
                f"0 / {sv['disk_in_flight_peak_mib']:.0f} MiB / {off['disk_for_1e9_tokens_tb_bf16']:.1f} TB per 1e9 tokens"
                if sv and off
                else "-",
            ]
        )
    if "quantized" in out:
        q = out["quantized"]
        rows.append(
            [
                "smollm2, served with fp8 weights",
                f"{q['first_step_loss_online_bf16']:.4f}",
                f"{q['first_step_loss_served_fp8']:.4f}",
                f"{q['first_step_loss_rel_diff']:.1e}",
                f"{q['eval_tau_online_bf16']:.3f}",
                f"{q['eval_tau_served_fp8']:.3f}",
                f"{q['eval_tau_diff_served_vs_online']:+.4f}",
                f"{q['eval_tau_diff_seed1_vs_seed0']:+.4f}",
            ]
        )
    proj = out["projection"]
    proj_rows = [
        [name, f"{t['target_gflop_per_token']:.0f}", f"{t['draft_gflop_per_token']:.0f}", f"{t['gpu_hours_served']:.0f}",
         f"{t['gpu_hours_served_with_8b_overlap']:.0f}"]
        for name, t in proj.get("targets", {}).items()
    ]  # fmt: skip
    return [
        {
            "title": "source=served against source=online (same data and options, vLLM 0.26.0; bf16 unless the row "
            "says fp8: then vLLM quantized the weights, the in-process target stayed bf16)",
            "header": ["target", "step-1 loss online", "served", "rel. diff", "eval tau online", "served",
                       "served - online", "seed 1 - seed 0"],
            "rows": rows,
        },
        {
            "title": "Tokens/s on one H200 (engine and trainer sharing it), seq 2048, ttt 7",
            "header": ["shape", "in-process online", "served online", "served / in-process", "offline (dump + 1 epoch)",
                       "device GiB in-process / served", "disk: in-process / served in flight / offline"],
            "rows": scale_rows,
        },
        {
            "title": "Projected GPU-hours, 500k conversations x 2k tokens, one epoch, served",
            "header": ["target", "target GFLOP/token", "draft GFLOP/token", "GPU-hours", "with the 8B overlap"],
            "rows": proj_rows,
        },
    ]  # fmt: skip


def projection(table: dict[str, Any]) -> dict[str, Any]:
    """GPU-hours for 500k conversations x 2k tokens (one epoch), from the 8B measurements: the
    engine's FLOP rate (its states alone) and the draft step's (alone), each applied to the target's
    and the draft's FLOPs per token of a larger model; GPU-seconds per token add (engine and trainer
    on separate GPUs, or taking turns on one). The 8B served run overlapped them (the measured rate
    over that sum is the overlap, shown as the upside)."""
    row = table.get("llama8b", {})
    if "served_online" not in row or "draft_step_alone_tokens_per_s_derived" not in row:
        return {"missing": "the 8B served and in-process figures"}
    targets = projection_targets()
    f_t8, d8, _ = targets["llama-3.1-8b"]
    f_d8 = flops_per_token(d8, SEQ, TTT) / 1e9
    engine_rate = row["served_online"]["engine_states_alone_tokens_per_s"] * f_t8  # GFLOP/s
    draft_rate = row["draft_step_alone_tokens_per_s_derived"] * f_d8
    serial = 1 / (f_t8 / engine_rate + f_d8 / draft_rate)
    overlap = row["served_online"]["tokens_per_s"] / serial
    out: dict[str, Any] = {
        "tokens": TOKENS,
        "epochs": 1,
        "engine_tflops_per_gpu_measured_8b": engine_rate / 1e3,
        "draft_train_tflops_per_gpu_measured_8b": draft_rate / 1e3,
        "overlap_on_one_gpu_measured_8b": overlap,
        "assumes": "the engine keeps the FLOP rate per GPU it had serving the 8B shape alone on one H200 (tensor/expert "
        "parallelism and fp8 change it either way); the draft step keeps its 8B rate; no overlap (the overlap "
        "measured at 8B would lower every figure by that factor)",
        "targets": {},
    }
    for name, (f_t, d, how) in targets.items():
        f_d = flops_per_token(d, SEQ, TTT) / 1e9
        seconds = TOKENS * (f_t / engine_rate + f_d / draft_rate)
        out["targets"][name] = {
            "target_gflop_per_token": f_t,
            "target_flops_from": how,
            "draft_gflop_per_token": f_d,
            "gpu_hours_served": seconds / 3600,
            "gpu_hours_served_with_8b_overlap": seconds / overlap / 3600,
        }
    out["published"] = {
        "kimi-k2.5 (TorchSpec)": "about 1,500 H200 GPU-hours for 600k samples",
        "gpt-oss-120b (SpecForge)": "8 x H200 for 10 hours (80 GPU-hours)",
        "70B target (ModelOpt issue 593)": "four days to dump 120k samples",
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", nargs="+", type=Path, required=True)
    p.add_argument("--equality", type=Path, required=True)
    p.add_argument("--quantized", type=Path, default=None, help="served_gpu.py's results.json of an fp8-served run")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    a.out.write_text(json.dumps(build(a.scale, a.equality, a.quantized), indent=1) + "\n")


if __name__ == "__main__":
    main()
