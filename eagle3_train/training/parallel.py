"""Memory and parallelism wraps of the draft head, applied from outside the model file.

- **Sequence parallelism** (Ulysses): the ranks of a group each hold a contiguous shard of every
  row's positions. Everything in the head but attention is per position; around the attention an
  all-to-all trades the shard of positions for a shard of the heads ([B, heads, T/sp, d] ->
  [B, heads/sp, T, d]), so each rank attends over the whole sequence with its heads (exactly the
  single-rank attention, heads being independent), and a second all-to-all trades back. The TTT
  cache keeps the second layout. Gradients flow through both all-to-alls (each one's backward is
  the other); each rank's loss is its shard's share of the sequence's loss.
- **Activation checkpointing**: each TTT step's decoder layer is recomputed in backward, so only
  its inputs and outputs are kept (~1/3 more layer FLOPs; memory per step a few [T, H] tensors).
- **torch.compile** of the decoder layer.

Heads must divide by the group size; a micro-batch's rows are padded to a multiple of it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from eagle3_train.core.errors import ConfigError
from eagle3_train.model import Eagle3Draft
from eagle3_train.training.config import TrainConfig, lr_factor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its sequence-parallel group: rows are cut along positions into ``size``
    equal shards, shard ``rank`` is this rank's. ``group`` None is a group of one."""

    group: Any
    rank: int
    size: int

    def span(self, t: int) -> tuple[int, int]:
        """[start, stop) of this rank's positions in rows of ``t`` (a multiple of ``size``)."""
        n = t // self.size
        return self.rank * n, (self.rank + 1) * n

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the group (in place; no gradient)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x


def sequence_parallel(size: int) -> SequenceParallel:
    """Groups of ``size`` consecutive ranks (collective: every rank calls it with the same size);
    rank r is position shard ``r % size`` of data-parallel rank ``r // size``."""
    if size == 1:
        return SequenceParallel(None, 0, 1)
    group, _ = dist.new_subgroups(size)
    return SequenceParallel(group, dist.get_rank(group), size)


def apply_sequence_parallel(model: Eagle3Draft, sp: SequenceParallel) -> None:
    """Wrap the decoder layer's attention core in the all-to-alls (no-op for a group of one)."""
    if sp.size == 1:
        return
    attn = model.midlayer.self_attn
    for heads, what in ((attn.num_heads, "attention heads"), (attn.num_kv, "key/value heads")):
        if heads % sp.size:
            raise ConfigError(f"runtime.sequence_parallel={sp.size} must divide the draft's {what} ({heads})")
    attn.core = UlyssesCore(attn.core, sp.group)


def apply_activation_checkpointing(model: Eagle3Draft) -> None:
    """Recompute each TTT step's decoder layer in backward (the layer's forward reads the cache
    without changing it, so running it again gives the same result)."""
    layer = model.midlayer
    # the methods are wrapped in place (here and in apply_compile): the same module and weights
    wrapped = functools.partial(
        torch.utils.checkpoint.checkpoint, layer.forward, use_reentrant=False, preserve_rng_state=False
    )
    layer.forward = wrapped  # type: ignore[method-assign]


def apply_compile(model: Eagle3Draft, backend: Any = "inductor") -> None:
    """torch.compile the decoder layer's two step-independent parts (:meth:`DraftLayer.qkv`: norms,
    projections, RoPE; :meth:`DraftLayer.finish`: output projection, residuals, norm, MLP), with
    dynamic batch and sequence sizes from the start: one graph each per grad mode (training, and the
    no-grad eval) for every TTT step and batch shape. The attention core between them runs eagerly
    (SDPA plus the diagonal terms, whose keys grow with the step).

    Compiling the whole layer instead gives one graph per TTT step and grad mode (10 at ttt 5),
    several minutes of compiling on the GPU (recipe_starter_h200x2.json), and dynamo's recompile
    limit reached at the first eval. ``backend``: tests count the graphs."""
    layer = model.midlayer
    layer.qkv = torch.compile(layer.qkv, dynamic=True, backend=backend)  # type: ignore[method-assign]
    layer.finish = torch.compile(layer.finish, dynamic=True, backend=backend)  # type: ignore[method-assign]


class UlyssesCore(nn.Module):
    """A TTT attention core run over the whole sequence with this rank's share of the heads.

    Args:
        inner: the core it wraps (:class:`eagle3_train.model.draft.TTTCore`).
        group: the sequence-parallel process group.
    """

    def __init__(self, inner: nn.Module, group: Any):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        step: int,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """q [B, nh, T/sp, d], k/v [B, nkv, T/sp, d] (this rank's positions) -> ([B, nh, T/sp, d],
        this step's cache entry [B, nkv/sp, T, d]); ``cache`` in that layout too."""
        if mask is not None:
            raise ValueError("sequence parallelism runs the training unroll (causal TTT attention) only")
        q, k, v = (all_to_all(x, self.group, scatter=1, gather=2) for x in (q, k, v))  # -> [B, h/sp, T, d]
        out, kv = self.inner(q, k, v, cache, step)
        return all_to_all(out, self.group, scatter=2, gather=1), kv  # [B, nh/sp, T, d] -> [B, nh, T/sp, d]


def all_to_all(x: torch.Tensor, group: Any, scatter: int, gather: int) -> torch.Tensor:
    """Chunk ``i`` of ``x`` along ``scatter`` goes to rank ``i``; what comes from rank ``r`` is
    part ``r`` along ``gather``. Differentiable: the backward is the all-to-all the other way."""
    return _AllToAll.apply(x, group, scatter, gather)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter, gather):
        ctx.args = (group, gather, scatter)
        return _exchange(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, *ctx.args), None, None, None


def _exchange(x: torch.Tensor, group: Any, scatter: int, gather: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, scatter))  # [size, ...]: row i goes to rank i
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), gather)


def scheduled_lr(engine: Any) -> float:
    """optim.lr as the schedule has it now: the first group AdamW steps (with optim.optimizer=muon the
    matrices' groups run at optim.muon_lr times the same factor)."""
    groups = engine.optimizer.param_groups
    return float(next((g["lr"] for g in groups if not g.get("use_muon")), groups[0]["lr"]))


def build_engine(
    model: Eagle3Draft,
    cfg: TrainConfig,
    dtype: torch.dtype,
    device: torch.device,
    total_steps: int | Callable[[], int],
    sp: SequenceParallel | None = None,
) -> Any:
    """The one place that turns the draft into a DeepSpeed engine: sequence parallelism over
    ``sp``'s group, activation checkpointing and torch.compile as ``cfg.runtime`` asks,
    AdamW (torch) on the trainable parameters or DeepSpeed's Muon (``optim.optimizer``), warmup + decay schedule, ZeRO stage over every rank
    (ZeRO's data parallelism averages the gradients of all ranks, sequence-parallel ones included:
    see :meth:`Trainer.train_step`), bf16, clipping, gradient accumulation. ``total_steps`` may be a
    function: the schedule reads the total at each step (a wall-clock budget resizes it while training)."""
    import deepspeed

    if sp is not None:
        apply_sequence_parallel(model, sp)
    o, ds = cfg.optim, cfg.deepspeed
    if cfg.runtime.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.runtime.compile:
        apply_compile(model)

    if device.type == "cpu":  # skip the shared-memory op's C++ build on CPU
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    trained = [p for p in model.parameters() if p.requires_grad]
    groups: list[dict[str, Any]] = [{"params": trained}]
    total = total_steps if callable(total_steps) else lambda: total_steps
    plain = lambda s: lr_factor(s, total(), o)  # noqa: E731
    head_only = lambda s: lr_factor(s, total(), o) if s < o.lm_head_steps else 0.0  # noqa: E731
    if o.lm_head_steps:  # lm_head in a group of its own whose lr drops to 0 after its steps (AdamW's decay with it)
        head = {id(p) for p in model.lm_head.parameters()}
        groups = [  # (named: the schedule finds lm_head's group by its name, Muon's halves included)
            {"params": [p for p in trained if id(p) not in head], "name": "draft"},
            {"params": [p for p in trained if id(p) in head], "name": "lm_head"},
        ]
    # DeepSpeed's Muon orthogonalizes the matrices' gradients inside its step, before the global norm, so
    # its clip scales the orthogonalized update (a norm of about sqrt(min(rows, cols)) a matrix), not the
    # gradient (DeepSpeed issue 8439, open for 0.19): at the recipe's head and optim.grad_clip 0.5 every
    # Muon step came out 40x smaller than torch's Muon takes it (muon_check_clip_cpu.json). Muon's update
    # is normalized anyway (torch's and the peers' clip the raw gradient, which barely moves it), so under
    # Muon nothing is clipped
    clip = o.grad_clip
    if o.optimizer == "muon" and clip > 0:
        logger.info("optim.grad_clip=%g is not applied with optim.optimizer=muon: DeepSpeed would clip Muon's "
                    "orthogonalized update, not the gradient, and shrink every Muon step", clip)  # fmt: skip
        clip = 0.0
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if o.optimizer == "muon" and ds.zero_stage == 3:  # (ZeRO-3 refuses Muon beside its reduce-scatter)
        zero["reduce_scatter"] = False
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,  # batches are token-budgeted; DeepSpeed only counts
        "gradient_accumulation_steps": cfg.loop.grad_accum,
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16, "check_grad_overflow": ds.check_grad_overflow},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    optimizer = None
    if o.optimizer == "muon":
        # DeepSpeed's own Muon, which each ZeRO stage orthogonalizes inside its partitioning (a torch
        # optimizer handed in would see ZeRO's flat 1-D buffers): it takes the matrices not named
        # embed or lm_head and splits each group into its Muon and AdamW halves ("<group>-muon-params"
        # / "-adam-params"), each at its own peak lr under the one schedule
        config["optimizer"] = {"type": "Muon", "params": {
            "lr": o.lr, "muon_lr": o.muon_lr, "momentum": o.muon_momentum, "betas": list(o.betas),
            "weight_decay": o.weight_decay,
            "torch_adam": True}}  # fmt: skip  # (its other half torch's AdamW, as without Muon: no fused op to build)
    else:
        optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.betas[0], o.betas[1]), weight_decay=o.weight_decay)

    def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            opt, [head_only if str(g.get("name", "")).startswith("lm_head") else plain for g in opt.param_groups]
        )

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=config,
                                           model_parameters=groups if optimizer is None else None)  # fmt: skip
    return engine
