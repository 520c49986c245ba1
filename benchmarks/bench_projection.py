"""Step times of random-weight targets and EAGLE-3 drafts of real shapes, and the speed-up they
project (issue #34 item 2; eagle3_train/evaluation/projection.py, docs/guide/bench.md).

Per shape and batch size B, over a KV cache of ``--context`` tokens per sequence:

- ``target_step_s`` t_T(B): one target forward over one new token of each sequence (a decode step);
- ``verify_s`` t_V(B): one target forward over ``k + 1`` new tokens of each sequence (a verify step);
- ``draft_step_s`` t_D(B): one draft step: the EAGLE-3 head's decoder layer, whose attention reads
  ``[embedding, hidden]`` (2H) and its own KV cache of the context, its final norm and its lm_head
  over the draft vocabulary, and the pick of the next token;
- ``cycle_overhead_s``: the draft's ``fc`` over the three captured states, run once per cycle.

Each forward is our own (attention, RoPE, SwiGLU MLP or routed experts, final norm, lm_head and the
argmax), on buffers that never move, so on a GPU it is captured once as a CUDA graph and replayed,
as the engines replay their decode steps; it is timed by CUDA events, the median over ``--repeats``
rounds of ``--replays`` replays. It is not the engine's kernel set (no paged attention, no fused
MoE, no tensor parallelism): the engine's own step time, where known, replaces it. Weights are
random (bf16 on a GPU, fp32 on the CPU): the arithmetic does not depend on their values. The
MoE block routes each token to its top experts and runs a grouped GEMM over the experts the batch
routes to (what fused MoE kernels read). A target that does not fit is built with ``max_layers``
of its layers, and its times scaled by layers: ``t = t_head + L * (t_built - t_head) / built``,
with ``t_head`` the same forward with no layer (embedding, final norm, lm_head, argmax). On a GPU each
shape runs in its own process, so that one shape's memory is all gone before the next is built.

Shapes: ``llama8b`` (Llama-3.1-8B), ``llama70b`` (Llama-3.1-70B: 16 of 80 layers built, scaled),
``qwen3moe`` (Qwen3-30B-A3B: 128 experts, 8 per token), ``smollm2`` (SmolLM2-135M, the embedded
target the served runs measure, draft vocabulary 8192); ``--smoke``: tiny shapes, in seconds on a CPU.

    python3 benchmarks/bench_projection.py --out $OUT/projection_h200.json     # a GPU machine
    python3 benchmarks/bench_projection.py --smoke --out /tmp/projection.json  # a CPU, seconds

``--from`` a results JSON of this script and ``--served`` an ``eagle3-bench`` results.json of the
``--served-shape`` target (default smollm2) measure nothing: per concurrency of the bench, the
engine's per-cycle cost beyond the forwards that its speed-up implies at its acceptance length
(projection.cycle_overhead_from_served), then every shape projected again with that cost added
(projection.calibrated): what the engine's own spec path costs, carried to the larger targets.

    python3 benchmarks/bench_projection.py --from benchmarks/results/projection_h200.json \
        --served /tmp/w/speedup/bench_graphs/results.json --out /tmp/projection_served.json

The results JSON holds, per shape, its row of times per batch size and the projection
(eagle3_train.evaluation.projection.project) at each ``--taus`` value and ``--k``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import run_isolated  # noqa: E402
from eagle3_train.evaluation.projection import (  # noqa: E402
    StepTimes,
    calibrated,
    cycle_overhead_from_served,
    nearest_batch,
    project,
    speedup,
)


@dataclass(frozen=True)
class Shape:
    """A target (and its draft) by its sizes."""

    hidden: int
    intermediate: int  # the dense MLP's width, or one expert's for a MoE
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0  # 0: a dense MLP
    experts_per_token: int = 0
    draft_vocab: int = 32000
    draft_intermediate: int | None = None  # the draft's MLP width (None: the target's intermediate)
    max_layers: int | None = None  # build only this many layers and scale by layers (None: all)


SHAPES = {  # measured in this order, the results rewritten after each
    "smollm2": Shape(576, 1536, 30, 9, 3, 64, 49152, draft_vocab=8192),
    "llama8b": Shape(4096, 14336, 32, 32, 8, 128, 128256),
    "qwen3moe": Shape(2048, 768, 48, 32, 4, 128, 151936, experts=128, experts_per_token=8, draft_intermediate=6144),
    "llama70b": Shape(8192, 28672, 80, 64, 8, 128, 128256, max_layers=16),
}
SMOKE = {
    "tiny_dense": Shape(64, 128, 4, 4, 2, 16, 256, draft_vocab=128, max_layers=2),
    "tiny_moe": Shape(64, 32, 2, 4, 2, 16, 256, experts=8, experts_per_token=2, draft_vocab=128, draft_intermediate=96),
}


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d] rotated by tables [T, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class Layer:
    """One decoder layer's weights (random) and its forward over ``T`` new tokens per sequence
    with a KV cache of ``context`` earlier positions: qkv (of an input ``in_mult`` x H wide), GQA
    attention, o_proj, then a SwiGLU MLP or ``experts`` routed ones."""

    def __init__(
        self,
        s: Shape,
        device: torch.device,
        dtype: torch.dtype,
        in_mult: int = 1,
        intermediate: int | None = None,
        dense: bool = False,
    ):
        H, d = s.hidden, s.head_dim
        r = lambda *shape: torch.randn(*shape, device=device, dtype=dtype) * 0.02  # noqa: E731
        self.s, self.g = s, s.heads // s.kv_heads
        self.ln1, self.ln2 = (
            torch.ones(in_mult * H, device=device, dtype=dtype),
            torch.ones(H, device=device, dtype=dtype),
        )
        self.qkv = r(in_mult * H, (s.heads + 2 * s.kv_heads) * d)
        self.o = r(s.heads * d, H)
        self.moe = s.experts > 0 and not dense
        inter = intermediate or s.intermediate
        if self.moe:
            self.router = r(H, s.experts)
            self.gate_up = r(s.experts, H, 2 * inter)  # [E, H, 2I]: grouped GEMM's [groups, K, N]
            self.down = r(s.experts, inter, H)
        else:
            self.gate_up, self.down = r(H, 2 * inter), r(inter, H)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if not self.moe:
            g, u = (h @ self.gate_up).chunk(2, -1)
            return (F.silu(g) * u) @ self.down
        B, T, H = h.shape
        E, k = self.s.experts, self.s.experts_per_token
        flat = h.reshape(-1, H)  # [N, H]
        top = (flat @ self.router).topk(k, -1)  # [N, k]
        weight = torch.softmax(top.values.float(), -1).to(h.dtype).reshape(-1)  # [N*k]
        expert = top.indices.reshape(-1)  # [N*k]
        order = expert.argsort(stable=True)  # the (token, slot)s grouped by expert
        token = order // k
        counts = torch.zeros(E, dtype=torch.int32, device=h.device).scatter_add_(
            0, expert, torch.ones_like(expert, dtype=torch.int32)
        )  # no bincount: it syncs with the host
        offs = counts.cumsum(0, dtype=torch.int32)  # each expert's rows end here
        g, u = torch._grouped_mm(flat[token], self.gate_up, offs=offs).chunk(2, -1)
        y = torch._grouped_mm(F.silu(g) * u, self.down, offs=offs) * weight[order, None]  # [N*k, H]
        return torch.zeros_like(flat).index_add_(0, token, y).reshape(B, T, H)

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        cache: torch.Tensor,
        context: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [B, T, in_mult*H] (the layer's input), residual [B, T, H]; cache [2, B, kv, context+T, d]
        holds the context's keys and values and gets the new ones. Returns the new residual [B, T, H]."""
        s, g = self.s, self.g
        B, T, _ = x.shape
        d, kv = s.head_dim, s.kv_heads
        q, k, v = (rms(x, self.ln1) @ self.qkv).split([s.heads * d, kv * d, kv * d], -1)
        q = rope(q.view(B, T, s.heads, d).transpose(1, 2), cos, sin)  # [B, heads, T, d]
        k = rope(k.view(B, T, kv, d).transpose(1, 2), cos, sin)  # [B, kv, T, d]
        cache[0, :, :, context : context + T] = k
        cache[1, :, :, context : context + T] = v.view(B, T, kv, d).transpose(1, 2)
        # the query heads that share a key head as one head of g*T rows: no repeated keys
        q = q.reshape(B, kv, g * T, d)
        a = F.scaled_dot_product_attention(q, cache[0], cache[1], attn_mask=mask)  # [B, kv, g*T, d]
        h = residual + a.view(B, s.heads, T, d).transpose(1, 2).reshape(B, T, s.heads * d) @ self.o
        return h + self.mlp(rms(h, self.ln2))


class Model:
    """A target (``layers`` decoder layers) or a draft (one layer over [embedding, hidden], and
    its fc): embedding, layers, final norm, lm_head over ``vocab`` and the argmax."""

    def __init__(self, s: Shape, layers: int, device: torch.device, dtype: torch.dtype, draft: bool = False):
        r = lambda *shape: torch.randn(*shape, device=device, dtype=dtype) * 0.02  # noqa: E731
        self.s, self.draft, self.device, self.dtype = s, draft, device, dtype
        self.embed = r(s.vocab, s.hidden)
        self.layers = [
            Layer(
                s,
                device,
                dtype,
                in_mult=2 if draft else 1,
                intermediate=s.draft_intermediate if draft else 0,
                dense=draft,
            )
            for _ in range(layers)
        ]
        self.norm = torch.ones(s.hidden, device=device, dtype=dtype)
        self.lm_head = r(s.hidden, s.draft_vocab if draft else s.vocab)
        self.fc = r(3 * s.hidden, s.hidden) if draft else None

    def step(self, batch: int, new: int, context: int) -> Callable[[], None]:
        """A forward over ``new`` tokens of ``batch`` sequences after ``context`` cached ones, as a
        closure over buffers that never move (so it can be captured as a CUDA graph)."""
        s, dev = self.s, self.device
        ids = torch.randint(0, s.vocab, (batch, new), device=dev)
        hidden = torch.randn(batch, new, s.hidden, device=dev, dtype=self.dtype)  # the draft's input state
        caches = [
            torch.randn(2, batch, s.kv_heads, context + new, s.head_dim, device=dev, dtype=self.dtype)
            for _ in self.layers
        ]
        pos = torch.arange(context, context + new, device=dev, dtype=torch.float32)
        freq = 1e4 ** (-torch.arange(0, s.head_dim // 2, device=dev, dtype=torch.float32) * 2 / s.head_dim)
        angle = torch.cat([pos[:, None] * freq] * 2, -1)  # [T, d]
        cos, sin = angle.cos().to(self.dtype), angle.sin().to(self.dtype)
        mask = None
        if new > 1:  # row (query head j of a group, new token t) sees the context and new tokens <= t
            t = torch.arange(self.layers[0].g * new if self.layers else new, device=dev) % new
            mask = torch.arange(context + new, device=dev)[None] <= context + t[:, None]
        out = torch.zeros(batch, new, dtype=torch.long, device=dev)

        def forward() -> None:
            x = self.embed[ids]  # [B, T, H]
            if self.draft:
                layer = self.layers[0]
                h = layer(torch.cat([x, hidden], -1), hidden, caches[0], context, cos, sin, mask)
            else:
                h = x
                for layer, cache in zip(self.layers, caches):
                    h = layer(h, h, cache, context, cos, sin, mask)
            out.copy_((rms(h, self.norm) @ self.lm_head).argmax(-1))

        return forward

    def fuse(self, batch: int) -> Callable[[], None]:
        """The draft's fc over the three captured states of ``batch`` sequences' newest position."""
        aux = torch.randn(batch, 1, 3 * self.s.hidden, device=self.device, dtype=self.dtype)
        out = torch.empty(batch, 1, self.s.hidden, device=self.device, dtype=self.dtype)
        return lambda: torch.matmul(aux, self.fc, out=out)


def timed(fn: Callable[[], None], device: torch.device, replays: int, repeats: int) -> float:
    """Seconds per call of ``fn``: on a GPU as a CUDA graph replayed, timed by events; on a CPU
    eagerly. The median over ``repeats`` rounds of ``replays`` calls."""
    if device.type != "cuda":
        fn()
        rounds = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(replays):
                fn()
            rounds.append((time.perf_counter() - start) / replays)
        return statistics.median(rounds)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture wants
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize(device)
    rounds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / 1000 / replays)
    del graph
    return statistics.median(rounds)


def measure(s: Shape, a: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The shape's times per batch size (scaled by layers where only some are built)."""
    built = min(s.layers, s.max_layers or s.layers)
    target, draft = Model(s, built, device, dtype), Model(s, 1, device, dtype, draft=True)
    head = Model(s, 0, device, dtype) if built < s.layers else None
    rows, raw = [], []
    for b in a.batches:
        t = {"batch": b}
        for name, new in (("target_step_s", 1), ("verify_s", a.k + 1)):
            t[name] = timed(target.step(b, new, a.context), device, a.replays, a.repeats)
            if head is not None:  # t_head + L * per layer
                t[name + "_built"], t[name + "_head"] = (
                    t[name],
                    timed(head.step(b, new, a.context), device, a.replays, a.repeats),
                )
                t[name] = t[name + "_head"] + s.layers * (t[name + "_built"] - t[name + "_head"]) / built
        t["draft_step_s"] = timed(draft.step(b, 1, a.context), device, a.replays, a.repeats)
        t["cycle_overhead_s"] = timed(draft.fuse(b), device, a.replays, a.repeats)
        raw.append(t)
        rows.append(StepTimes(b, t["target_step_s"], t["verify_s"], t["draft_step_s"], t["cycle_overhead_s"]))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{json.dumps(t)}", flush=True)
    return {
        "shape": asdict(s),
        "layers_built": built,
        "scaled": head is not None,
        "times": raw,
        "projection": {str(tau): project(rows, tau, a.k) for tau in a.taus},
    }


def _times(shape: dict[str, Any]) -> list[StepTimes]:
    return [
        StepTimes(t["batch"], t["target_step_s"], t["verify_s"], t["draft_step_s"], t.get("cycle_overhead_s", 0.0))
        for t in shape["times"]
    ]


def served_projection(proj: dict[str, Any], bench: dict[str, Any], served_shape: str, taus: list[float]) -> dict:
    """Every measured shape of ``proj`` projected again with the per-cycle cost that ``bench`` (an
    eagle3-bench results.json of the ``served_shape`` target) implies, per concurrency (= batch)."""
    k = int(bench["config"]["num_speculative_tokens"])
    base = {t.batch: t for t in _times(proj["shapes"][served_shape])}
    calib, overhead = {}, {}
    for row in bench["rows"]:
        c, spec = row["concurrency"], row.get("spec") or {}
        tau, measured = spec.get("mean_acceptance_length"), row.get("speedup")
        if row.get("temperature", 0.0) != 0.0 or tau is None or measured is None:
            continue
        t = base[nearest_batch(base, c)]
        overhead[c] = cycle_overhead_from_served(measured, tau, k, t)
        calib[f"c{c}"] = {
            "tau": round(tau, 4),
            "measured_speedup": round(measured, 4),
            "projected_speedup": round(
                speedup(tau, k, t.target_step_s, t.verify_s, t.draft_step_s, t.cycle_overhead_s), 4
            ),
            "engine_overhead_ms": round(overhead[c] * 1e3, 4),
            "target_step_ms": round(t.target_step_s * 1e3, 4),
        }
    if not overhead:
        raise SystemExit("the bench results hold no greedy row with a speed-up and an acceptance length")
    shapes, rows = {}, []
    for name, shape in proj["shapes"].items():
        if not shape.get("times"):
            continue
        plain, engine = _times(shape), calibrated(_times(shape), overhead)
        shapes[name] = {}
        for tau in taus:
            p0, p1 = project(plain, tau, k), project(engine, tau, k)
            shapes[name][f"tau_{tau}"] = {f"b{a['batch']}": round(b["speedup"], 3) for a, b in zip(p0, p1)}
            for a, b in zip(p0, p1):
                rows.append(
                    [
                        name,
                        str(a["batch"]),
                        str(tau),
                        f"{a['speedup']:.2f}",
                        f"{b['speedup']:.2f}",
                        f"{b['break_even_tau']:.2f}",
                    ]
                )
    return {
        "k": k,
        "served_shape": served_shape,
        "calibration": calib,
        "projected_with_engine_overhead": shapes,
        "tables": [
            {
                "title": f"The engine's cost per cycle, read off its measured speed-up ({served_shape}, k={k})",
                "header": [
                    "concurrency",
                    "engine τ",
                    "measured ×",
                    "projected × (forwards only)",
                    "engine overhead per cycle (ms)",
                    "target step (ms)",
                ],
                "rows": [
                    [
                        c.removeprefix("c"),
                        f"{v['tau']:.2f}",
                        f"{v['measured_speedup']:.2f}",
                        f"{v['projected_speedup']:.2f}",
                        f"{v['engine_overhead_ms']:.2f}",
                        f"{v['target_step_ms']:.2f}",
                    ]
                    for c, v in calib.items()
                ],
            },
            {
                "title": "Projected speed-up, forwards only and with the engine's measured per-cycle cost",
                "header": [
                    "shape",
                    "batch",
                    "τ",
                    "× forwards only",
                    "× with engine overhead",
                    "break-even τ with overhead",
                ],
                "rows": rows,
            },
        ],
    }


def _head(what: str, machine: str, argv: list[str]) -> dict[str, str]:
    """A results file's what, machine, command and date."""
    command = " ".join(["python3", "benchmarks/bench_projection.py", *argv])
    return {"what": what, "machine": machine, "command": command, "date": datetime.date.today().isoformat()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the results JSON")
    p.add_argument("--shapes", default=None, help="comma-separated names (default: all of the mode)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, in seconds")
    p.add_argument("--batches", default=None, help="batch sizes (default 1,4,16,64; smoke 1,4)")
    p.add_argument("--context", type=int, default=None, help="cached tokens per sequence (default 1024; smoke 64)")
    p.add_argument("--k", type=int, default=5, help="draft tokens per cycle (verify: k + 1 tokens)")
    p.add_argument("--taus", default="1.78,2.5,3.5", help="acceptance lengths to project at")
    p.add_argument("--replays", type=int, default=None, help="calls per timed round (default 20; smoke 3)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds; the median is kept")
    p.add_argument("--shape-timeout-s", type=float, default=900, help="a GPU shape's time limit")
    p.add_argument("--from", dest="from_", help="a results JSON of this script: project again, measure nothing")
    p.add_argument("--served", help="with --from: an eagle3-bench results.json of --served-shape's target")
    p.add_argument("--served-shape", default="smollm2", help="the shape the served bench measured")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a GPU shape in its own process: measure it alone ...
    p.add_argument("--part", help=argparse.SUPPRESS)  # ... and write its result here
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    if bool(a.from_) != bool(a.served):
        p.error("--from and --served go together")
    if a.from_:
        proj, bench = json.loads(Path(a.from_).read_text()), json.loads(Path(a.served).read_text())
        if a.served_shape not in proj.get("shapes", {}) or not proj["shapes"][a.served_shape].get("times"):
            p.error(f"{a.from_} has no measured shape {a.served_shape!r}")
        res = {
            **_head(
                "issue #34: the projection checked against the served speed-up, and carried to larger shapes "
                "with the engine's measured per-cycle cost (benchmarks/bench_projection.py --from/--served)",
                f"step times: {proj.get('machine')}; served: {bench.get('machine', {}).get('gpus')}",
                argv,
            ),
            "sources": {
                "projection": proj.get("date"),
                "served": bench.get("date"),
                "served_command": bench.get("command"),
            },
            **served_projection(proj, bench, a.served_shape, [float(x) for x in a.taus.split(",")]),
        }
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        return res
    shapes = SMOKE if a.smoke else SHAPES
    names = a.shapes.split(",") if a.shapes else list(shapes)
    unknown = [n for n in names if n not in shapes]
    if unknown:
        p.error(f"unknown shapes {unknown}; {'--smoke ' if a.smoke else ''}shapes: {list(shapes)}")
    a.batches = [int(x) for x in (a.batches or ("1,4" if a.smoke else "1,4,16,64")).split(",")]
    a.context = a.context or (64 if a.smoke else 1024)
    a.replays = a.replays or (3 if a.smoke else 20)
    a.taus = [float(x) for x in a.taus.split(",")]
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    if a.one:
        Path(a.part).write_text(json.dumps(measure(shapes[a.one], a, device, dtype)))
        return {}
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    results: dict[str, Any] = {
        **_head(
            "issue #34: step times of random-weight targets and EAGLE-3 drafts (our graph-captured forward), "
            "and the speed-up they project (eagle3_train.evaluation.projection)",
            f"{gpu or platform.processor() or 'CPU'}, torch {torch.__version__}, Python {platform.python_version()}",
            argv,
        ),
        "settings": {
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "context": a.context,
            "k": a.k,
            "batches": a.batches,
            "taus": a.taus,
            "replays": a.replays,
            "repeats": a.repeats,
        },
        "shapes": {},
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        print(f"== {name}", flush=True)
        if device.type == "cuda":  # each GPU shape in its own process: a shape's memory is all gone before the next
            part = out.with_name(f"{out.stem}.{name}.part.json")
            cmd = [sys.executable, __file__, *argv, "--one", name, "--part", str(part)]
            results["shapes"][name] = run_isolated(cmd, part, a.shape_timeout_s)
        else:
            try:
                results["shapes"][name] = measure(shapes[name], a, device, dtype)
            except Exception as e:  # a kernel this machine lacks: the next shape may still run
                results["shapes"][name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        out.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
