"""``eagle3-train``: fit the EAGLE-3 draft head with DeepSpeed, on standardized shards or with the
target in the loop (``source=online``, eagle3_train/training/online.py).

    eagle3-train data=runs/x/std target=embedded out=runs/x/train
    eagle3-train source=online data=runs/x/prepared target=embedded out=runs/x/train
    torchrun --nproc_per_node 8 -m eagle3_train.training.trainer data=... target=... out=... deepspeed=zero2

The run directory holds ``checkpoints/step<N>/`` (DeepSpeed's own files plus ``draft.safetensors``,
the consolidated head, and ``state.json``), ``metrics.jsonl`` (one line per logged step and per
evaluation), ``config.json``, and with ``train.keep_best`` ``best.json`` (the checkpoint with the
best eval simulated acceptance length, which keep_last never deletes and eagle3-export takes).
``resume=auto`` continues from the last checkpoint at its exact step and data position. An online
run also holds ``vocab_map.safetensors``, the map it counted at start (unless ``online.vocab_map``).
"""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING
from tqdm.auto import tqdm

from eagle3_train.core.cli import config_dict, entry_point
from eagle3_train.core.contract import BEST_FILE, run_checkpoints
from eagle3_train.training.data import Batch, OfflineSource, Source, micro_batches_for, plan_epoch, steps_in_epoch
from eagle3_train.core.dist import DistInfo, all_gather_objects, barrier, close, init_distributed, print0
from eagle3_train.core.errors import BadInputError, ConfigError, ContractError, Eagle3Error
from eagle3_train.core.fileio import atomic_write_json
from eagle3_train.model import DraftConfig, Eagle3Draft
from eagle3_train.training.objective import (
    acceptance_length,
    accuracies,
    correct_predictions,
    decode_walk,
    head_loss,
    soft_cross_entropy,
    step_weights,
    target_distribution,
)
from eagle3_train.training.parallel import (
    SequenceParallel,
    apply_activation_checkpointing,
    apply_compile,
    apply_sequence_parallel,
    sequence_parallel,
)
from eagle3_train.training.online import OnlineConfig, OnlineSource
from eagle3_train.core.stagedir import StageDir
from eagle3_train.targets import Target

CRASH_ENV = "EAGLE3_TRAIN_CRASH_AFTER_STEP"  # tests only: hard-exit after saving this step
USUAL_CHAIN = 5  # draft tokens per verify step that eagle3-eval and the engines' recipes use


@dataclass
class OptimConfig:
    """The training recipe (``train.*``)."""

    ttt_length: int = 7  # training-time-test steps unrolled
    loss_decay: float = 0.8  # weight of step j is loss_decay**j
    epochs: int = 1  # passes over the training split
    max_steps: int | None = None  # stop after this many optimizer steps (null: all epochs)
    lr: float = 1e-4  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.0  # final lr as a fraction of the peak
    warmup_steps: int = 0  # linear warmup from 0
    schedule: str = "cosine"  # decay after warmup: cosine | linear | constant
    weight_decay: float = 0.0  # AdamW weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    grad_clip: float = 0.5  # max global gradient norm (0: off)
    max_tokens_per_batch: int = 8192  # padded tokens in one micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step on each rank
    seed: int = 0  # data order and initialisation
    eval_every: int = 0  # evaluate every N steps (0: only at the end)
    save_every: int = 0  # checkpoint every N steps (0: only at the end)
    keep_last: int = 2  # checkpoints kept
    log_every: int = 10  # metrics line every N steps
    cache_target_gb: float = 0.0  # keep each sample's target distribution in memory after its first use, up to this size (0: recompute every epoch)
    keep_best: bool = False  # keep the checkpoint with the best eval simulated tau (saved when it improves, never deleted by keep_last, the one eagle3-export takes)
    early_stop_patience: int = 0  # stop after this many evaluations without a better eval simulated tau (0: off; needs eval_every)
    head_chunk: int = 4096  # positions per chunk of the fused draft lm_head + soft cross-entropy: no step's [T, V_draft] logits are kept (0: whole logits through autograd; ZeRO-3 needs 0)
    activation_checkpointing: bool = False  # recompute each TTT step's decoder layer in backward instead of keeping its activations (long sequences; ~1/3 more layer FLOPs)
    compile: bool = False  # torch.compile the decoder layer's step-independent parts (2 graphs per grad mode) and the fused head loss's chunk math (GPU; the first steps compile)
    sequence_parallel: int = 1  # ranks that share each sequence (Ulysses all-to-all over heads); divides the world size and the head counts; data parallelism runs over world / this

    def __post_init__(self) -> None:
        if self.ttt_length < 1:
            raise ConfigError(f"train.ttt_length must be >= 1, got {self.ttt_length}")
        if self.early_stop_patience < 0:
            raise ConfigError(f"train.early_stop_patience must be >= 0, got {self.early_stop_patience}")
        if self.early_stop_patience and not self.eval_every:
            raise ConfigError("train.early_stop_patience counts evaluations: set train.eval_every too")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ConfigError(f"train.schedule must be cosine, linear or constant, got {self.schedule!r}")
        for name in ("epochs", "max_tokens_per_batch", "grad_accum", "keep_last", "log_every", "sequence_parallel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"train.max_steps must be >= 1 or null, got {self.max_steps}")
        if not self.lr > 0:  # also refuses nan
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if not 0 < self.loss_decay <= 1:
            raise ConfigError(f"train.loss_decay must be in (0, 1], got {self.loss_decay}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"train.betas must be two numbers in [0, 1), got {list(self.betas)}")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "eval_every", "save_every", "cache_target_gb", "head_chunk"):
            if not getattr(self, name) >= 0:  # 0 means off where the field says so; nan is refused
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class ModelOptions:
    """Recipe options of the draft head (``model.*``); its shapes come from the target."""

    lm_head_init: str = "random"  # random | target: start lm_head from the target lm_head's rows of the draft vocab (and norm from the target's final norm)
    freeze_lm_head: bool = False  # keep lm_head at its initial value (needs lm_head_init=target)
    aux_norm: bool = False  # RMSNorm over the concatenated aux states before fc; SGLang and vLLM cannot load it, so eagle3-export refuses such a head
    intermediate_size: int = 0  # the draft MLP's width; 0: the target's (engines read it from the exported config.json)

    def __post_init__(self) -> None:
        if self.lm_head_init not in ("random", "target"):
            raise ConfigError(f"model.lm_head_init must be random or target, got {self.lm_head_init!r}")
        if self.freeze_lm_head and self.lm_head_init != "target":
            raise ConfigError("model.freeze_lm_head=true would freeze a random lm_head: set model.lm_head_init=target")
        if self.intermediate_size < 0:
            raise ConfigError(f"model.intermediate_size must be >= 0 (0: the target's), got {self.intermediate_size}")


@dataclass
class DeepSpeedConfig:
    """How DeepSpeed shards the run (``deepspeed=zero1|zero2|zero3``)."""

    zero_stage: int = 1  # ZeRO stage 0-3
    bf16: str = "auto"  # auto: bf16 on GPU, fp32 on CPU; true / false to force
    offload_optimizer: bool = False  # ZeRO optimizer states in host memory

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")


@dataclass
class LoggingConfig:
    """Where metrics go besides the console and metrics.jsonl (``logging=none|wandb``)."""

    wandb: bool = False  # log to Weights & Biases
    wandb_project: str = "eagle3_train"  # its project
    wandb_mode: str = "offline"  # online | offline
    run_name: str | None = None  # its run name (null: the run directory's name)


@dataclass
class TrainConfig:
    """Options of ``eagle3-train`` (``conf/train.yaml``)."""

    data: str = MISSING  # source=offline: a standardized directory (eagle3-standardize's out); source=online: a prepared one (eagle3-prepare's out)
    target: str = "embedded"  # the target whose embeddings and lm_head are read (offline: from its safetensors only; online: it runs in the loop)
    source: str = "offline"  # offline: states read from data=; online: the target runs on data= in the training loop (online.*)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    out: str = MISSING  # run directory
    cache_dir: str | None = None  # where GGUF targets are converted once
    resume: str = "auto"  # auto: continue from the last checkpoint in out; never: refuse a used out
    device: str = "auto"  # auto: cuda:<local_rank> if present, else cpu
    train: OptimConfig = field(default_factory=OptimConfig)
    model: ModelOptions = field(default_factory=ModelOptions)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    progress: bool = True  # progress bar on rank 0

    def __post_init__(self) -> None:
        if self.resume not in ("auto", "never"):
            raise ConfigError(f"resume must be auto or never, got {self.resume!r}")
        if self.source not in ("offline", "online"):
            raise ConfigError(f"source must be offline or online, got {self.source!r}")
        if self.source == "offline" and self.online != OnlineConfig():
            raise ConfigError("online.* options apply to source=online (the target in the loop); add source=online")
        if self.deepspeed.zero_stage == 3 and self.train.head_chunk:
            raise ConfigError("train.head_chunk reads lm_head's weight outside its module, which ZeRO-3 does not gather: "
                              "set train.head_chunk=0 with deepspeed=zero3")


ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def lr_factor(step: int, total: int, cfg: OptimConfig) -> float:
    """Multiplier of the peak lr at ``step`` (0-based): linear warmup, then the decay schedule."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or total <= cfg.warmup_steps:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


class Prefetcher:
    """Runs an iterator on a background thread, ``depth`` items ahead (reading and padding the
    next micro-batches while the GPU trains on this one). Errors surface at ``next``."""

    def __init__(self, items: Iterator[Any], depth: int):
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.thread = threading.Thread(target=self._fill, args=(items,), daemon=True)
        self.thread.start()

    def _fill(self, items: Iterator[Any]) -> None:
        try:
            for item in items:
                self.queue.put((item, None))
        except BaseException as e:
            self.queue.put((None, e))
        self.queue.put((None, StopIteration()))

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        item, error = self.queue.get()
        if error is not None:
            raise error
        return item


def build_engine(model: Eagle3Draft, o: OptimConfig, ds: DeepSpeedConfig, dtype: torch.dtype,
                 device: torch.device, total_steps: int, sp: SequenceParallel | None = None) -> Any:
    """The one place that turns the draft into a DeepSpeed engine: sequence parallelism over
    ``sp``'s group, activation checkpointing and torch.compile as ``o`` asks (eagle3_train.training.parallel),
    AdamW (torch) on the trainable parameters, warmup + decay schedule, ZeRO stage over every rank
    (ZeRO's data parallelism averages the gradients of all ranks, sequence-parallel ones included:
    see :meth:`Trainer.train_step`), bf16, clipping, gradient accumulation."""
    import deepspeed

    if sp is not None:
        apply_sequence_parallel(model, sp)
    if o.activation_checkpointing:
        apply_activation_checkpointing(model)
    if o.compile:
        apply_compile(model)

    if device.type == "cpu":  # skip the shared-memory op's C++ build on CPU
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, o))
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": 1,  # batches are token-budgeted; DeepSpeed only counts
        "gradient_accumulation_steps": o.grad_accum,
        "gradient_clipping": o.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=config)
    return engine


def ttt_losses(model: Eagle3Draft, batch: Batch, lm_head: torch.Tensor, t2d: torch.Tensor, ttt_length: int,
               decay: float, target: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               head_chunk: int = 0, sp: SequenceParallel | None = None, compiled_head: bool = False,
               hits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted TTT loss of one micro-batch, and per-step statistics [ttt_length, 4] (hits,
    in-vocab, counted, loss; see :func:`correct_predictions`) left on the device, so the step never
    waits for the GPU.

    Step j at position t predicts token t+2+j; its target is the target's distribution at t+1+j.
    A position is counted when that token exists and is loss-masked; it enters the loss only when
    the target's argmax at t+1+j is also in the draft vocab (otherwise it is a miss). ``target`` is
    that distribution when already known (probs [B, T, V_draft], argmax [B, T], in_draft [B, T]);
    otherwise it is computed from ``last_hidden``. ``head_chunk`` > 0 fuses the draft lm_head with
    the loss (:func:`head_loss`, that many positions at a time, through torch.compile with
    ``compiled_head``; 0: whole logits).

    ``hits`` ([ttt_length, B, T], bool or integer; given for eval's decode walk) receives at [j, b, t]
    whether step j's draft at position t was right (a hit as the statistics count it); a shard
    writes its own positions only, so a group's buffers add up to the whole rows'.

    With ``sp`` this rank runs its shard of every row's positions (rows padded to a multiple of the
    group): the target distribution only where the shard's steps read it, each step's loss over the
    whole rows' count of loss positions, so the group's losses add up to the one-rank loss; the
    statistics are the shard's (they add up over the group as well).
    """
    sp = sp or SequenceParallel(None, 0, 1)
    batch, target = _pad_positions(batch, target, sp.size)
    b, t = batch.input_ids.shape
    h = batch.last_hidden.shape[-1]
    dev = batch.input_ids.device
    start, stop = sp.span(t)
    lo, hi = start, min(stop + ttt_length, t)  # target positions the shard's steps read (but lo itself)
    if target is None:
        probs, argmax, in_draft = target_distribution(batch.last_hidden[:, lo:hi].reshape(-1, h), lm_head, t2d)
        target = probs.view(b, hi - lo, -1), argmax.view(b, hi - lo), in_draft.view(b, hi - lo)
    else:
        target = tuple(x[:, lo:hi] for x in target)
    probs, argmax, in_draft = target
    positions = torch.arange(t, device=dev)
    # step j: the shard's first n positions (start..start+n-1) have a token 2+j further on
    steps = []
    for j in range(ttt_length):
        n = max(0, min(stop, t - 2 - j) - start)
        q, p = slice(start + 1 + j - lo, start + 1 + j - lo + n), slice(start + 2 + j, start + 2 + j + n)
        counted = ((positions[None, p] < batch.lengths[:, None]) & batch.loss_mask[:, p]).reshape(-1)
        steps.append((n, q, counted, counted & in_draft[:, q].reshape(-1)))
    counts = sp.all_reduce(torch.stack([mask.sum() for *_, mask in steps]))  # loss positions of step j, whole rows
    total = torch.zeros((), device=dev)
    stats = torch.zeros(ttt_length, 4, device=dev)
    weights = step_weights(ttt_length, decay)
    # every step enters the loss, also with no position on this shard: the sequence-parallel
    # backward runs the same collectives on every rank
    for j, out in enumerate(model.unroll(batch.aux_hidden[:, start:stop], batch.input_ids, ttt_length, start)):
        n, q, counted, mask = steps[j]
        target_probs = probs[:, q].reshape(b * n, probs.shape[-1])  # [B*n, V_draft]
        if head_chunk:
            loss, pred = head_loss(model.norm(out[:, :n]).reshape(b * n, h), model.lm_head.weight, target_probs,
                                   mask, counts[j], head_chunk, compiled_head)
        else:
            logits = model.logits(out[:, :n]).reshape(b * n, probs.shape[-1])  # [B*n, V_draft]
            loss, pred = soft_cross_entropy(logits, target_probs, mask, counts[j]), logits.argmax(-1)
        total = total + weights[j] * loss
        stats[j, :3] = correct_predictions(pred, argmax[:, q].reshape(-1), counted)
        if hits is not None:
            right = (pred == argmax[:, q].reshape(-1)) & (argmax[:, q].reshape(-1) >= 0) & counted  # [B*n]
            m = max(0, min(n, hits.shape[2] - start))  # padded positions are never hits
            hits[j, :, start: start + m] = right.view(b, n)[:, :m]
        stats[j, 3] = loss.detach()
    return total, stats


def _pad_positions(batch: Batch, target: tuple[torch.Tensor, ...] | None, multiple: int
                   ) -> tuple[Batch, tuple[torch.Tensor, ...] | None]:
    """Rows right-padded to a multiple of ``multiple`` positions (``lengths`` unchanged: the
    padding never counts), the target distribution with them."""
    extra = -batch.input_ids.shape[1] % multiple
    if not extra:
        return batch, target
    pad = lambda x: torch.cat([x, x.new_zeros(x.shape[0], extra, *x.shape[2:])], dim=1)  # noqa: E731
    batch = Batch(pad(batch.aux_hidden), pad(batch.last_hidden), pad(batch.input_ids), pad(batch.loss_mask),
                  batch.lengths, batch.sample_ids)
    return batch, None if target is None else tuple(pad(x) for x in target)


class Trainer:
    """One training run on this rank: build -> (resume) -> train_step... -> evaluate/save -> close."""

    def __init__(self, cfg: TrainConfig, target: Target | None = None):
        """``target``: with source=online, an already loaded target (a benchmark's random weights)."""
        self.cfg = cfg
        self.out = Path(cfg.out).expanduser()
        self.dist: DistInfo = init_distributed(cfg.device, always=True)
        bf16 = cfg.deepspeed.bf16 == "true" or (cfg.deepspeed.bf16 == "auto" and self.dist.device.type == "cuda")
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        self.source = self._source(target)
        self.spec, self.vocab, self.vocab_sha = self.source.spec, self.source.vocab, self.source.vocab_sha
        from_target = ("embed", "head", "norm") if cfg.model.lm_head_init == "target" else ("embed", "head")
        target_config, tensors = self.source.target_tensors(from_target)
        embed, head = tensors["embed"], tensors["head"]
        self.lm_head = head.to(self.dist.device, self.dtype)  # frozen target lm_head [V, H]
        self.t2d = self.vocab.t2d.to(self.dist.device)
        draft_cfg = DraftConfig.from_target(target_config, len(self.spec.aux_indices), self.vocab.draft_vocab_size)
        torch.manual_seed(cfg.train.seed)
        draft_cfg = replace(draft_cfg, aux_norm=cfg.model.aux_norm,
                            intermediate_size=cfg.model.intermediate_size or draft_cfg.intermediate_size)
        self.model = Eagle3Draft(draft_cfg)
        with torch.no_grad():
            self.model.embed_tokens.weight.copy_(embed)
            self.model.d2t.copy_(self.vocab.d2t)
            self.model.t2d.copy_(self.vocab.t2d)
        self._init_head(head, tensors.get("norm"))
        o = cfg.train
        if o.ttt_length < USUAL_CHAIN:
            print0(f"warning: train.ttt_length={o.ttt_length} < {USUAL_CHAIN}, the chain length eagle3-eval and the "
                   f"engines usually draft: draft positions past {o.ttt_length} were never trained and accept less; "
                   f"train at least as many steps as the draft will propose")
        self.train_split, self.eval_split = self.source.train_split, self.source.eval_split
        if len(self.train_split) == 0:
            raise BadInputError(f"{self.source.where} has no training samples")
        if self.dist.world_size % o.sequence_parallel:
            raise ConfigError(f"train.sequence_parallel={o.sequence_parallel} must divide the number of ranks ({self.dist.world_size})")
        self.sp = sequence_parallel(o.sequence_parallel)
        self.world = self.dist.world_size // self.sp.size  # data-parallel ranks; each reads its own micro-batches
        self.data_rank = self.dist.rank // self.sp.size
        # Epochs shuffle differently, so their micro-batch counts can differ by a few.
        n_batches = [len(plan_epoch(self.train_split.length, o.max_tokens_per_batch, o.seed, e)) for e in range(o.epochs)]
        self.epoch_steps = [steps_in_epoch(n, self.world, o.grad_accum) for n in n_batches]
        if min(self.epoch_steps) == 0:
            raise ConfigError(
                f"one optimizer step needs {self.world * o.grad_accum} micro-batches, the training split "
                f"gives {min(n_batches)}: lower train.grad_accum or train.max_tokens_per_batch"
            )
        self.total_steps = sum(self.epoch_steps)
        if o.max_steps is not None:
            self.total_steps = min(self.total_steps, o.max_steps)
        self.target_cache = self._target_cache()
        self.model.to(self.dist.device)
        self.engine = build_engine(self.model, cfg.train, cfg.deepspeed, self.dtype, self.dist.device, self.total_steps,
                                   self.sp)
        self.step = 0
        # each micro-batch's loss finiteness, still on the device: (0-based step, flag, sample ids)
        self._unchecked: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.best: dict[str, Any] = {"step": None, "eval_tau": None}  # the best evaluation so far
        self.evals_since_best = 0
        self.early_stopped = False
        self.metrics_path = self.out / "metrics.jsonl"
        self._resume()
        self.tracker = self._tracker()

    # -- building --------------------------------------------------------------------------------

    def _source(self, target: Target | None) -> Source:
        """Where the states come from (``source=``)."""
        cfg = self.cfg
        if cfg.source == "online":
            return OnlineSource(cfg.data, cfg.target, cfg.cache_dir, cfg.online, cfg.train.max_tokens_per_batch, self.out,
                                self.dist, self.dtype, target)
        if target is not None:
            raise ConfigError("a loaded target runs in the loop only: set source=online")
        return OfflineSource(cfg.data, cfg.target, cfg.cache_dir, cfg.train.max_tokens_per_batch, self.dist.device, self.dtype)

    def _init_head(self, head: torch.Tensor, norm: torch.Tensor | None) -> None:
        """``model.lm_head_init`` and ``model.freeze_lm_head``; head [V_target, H], norm [H]."""
        m = self.cfg.model
        if m.lm_head_init == "target":
            with torch.no_grad():
                # draft token i is target id t2d.nonzero()[i] (= i + d2t[i]): the draft vocab is
                # sorted by target id, so these rows are in draft order. [V_draft, H]
                self.model.lm_head.weight.copy_(head[self.vocab.t2d.nonzero().squeeze(1)])
                # The target's rows were fitted to read the output of its final norm. With that
                # norm's weight, the draft's logits are the target's own on whatever pre-norm state
                # the layer produces, so the layer starts by approximating the target's last
                # pre-norm hidden state; a unit weight would feed the rows differently scaled features.
                self.model.norm.weight.copy_(norm)
        self.model.lm_head.weight.requires_grad_(not m.freeze_lm_head)

    def _target_cache(self) -> dict[int, tuple] | None:
        limit = self.cfg.train.cache_target_gb
        if limit <= 0:
            return None
        tokens = int(self.train_split.length.sum() + self.eval_split.length.sum())
        need = tokens * self.vocab.draft_vocab_size * 4 / 2**30  # fp32 probabilities
        if need > limit:
            raise ConfigError(f"train.cache_target_gb={limit} is too small: the target distribution of {tokens} tokens "
                              f"over {self.vocab.draft_vocab_size} draft tokens needs {need:.2f} GiB (set 0 to recompute instead)")
        print0(f"caching the target distribution per sample (up to {need:.2f} GiB)")
        return {}

    def _tracker(self) -> Any:
        if not (self.cfg.logging.wandb and self.dist.is_main):
            return None
        import wandb

        return wandb.init(project=self.cfg.logging.wandb_project, mode=self.cfg.logging.wandb_mode,
                          name=self.cfg.logging.run_name or self.out.name, dir=str(self.out),
                          config=config_dict(self.cfg), resume="allow")

    # -- checkpoints -----------------------------------------------------------------------------

    def _checkpoints(self) -> list[Path]:
        return run_checkpoints(self.out)

    @property
    def run_dir(self) -> StageDir:
        """The run directory; what its checkpoints must agree with to be continued: the capture
        they learned from, the vocab map their lm_head rows mean, the draft's shape, and how many
        micro-batches make one step (the data position)."""
        request = {"capture": self.spec.to_dict(), "vocab_sha256": self.vocab_sha,
                   "draft_config": self.model.config.to_dict(),
                   "micro_batches_per_step": self.world * self.cfg.train.grad_accum}

        def hint(diffs: list[str]) -> str:
            why = {"vocab_sha256": "the lm_head rows would mean other tokens: standardize with vocab_map=<the old map>",
                   "micro_batches_per_step": "keep ranks x train.grad_accum the same to resume at the same data position"}
            said = [text for key, text in why.items() if any(d.startswith(key) for d in diffs)]
            return "; ".join(said + ["or start a new run with another out="])

        return StageDir(self.out, "train", request, what="training run", hint=hint)

    def _resume(self) -> None:
        if self.dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        barrier()
        ckpts = self._checkpoints()
        if ckpts and self.cfg.resume == "never":
            raise ContractError(f"{self.out} already holds checkpoints; resume=auto continues it, or use another out=")
        self.run_dir.claim(replace=not ckpts)  # checkpoints are continued only by the same request
        if self.dist.is_main and (not ckpts or not self.cfg.train.keep_best):
            # a record left by an earlier run, or one keep_last may now delete, would mislead export
            (self.out / BEST_FILE).unlink(missing_ok=True)
        if not ckpts:
            if self.dist.is_main:
                self.metrics_path.unlink(missing_ok=True)
                atomic_write_json(self.out / "config.json", config_dict(self.cfg))
            return
        last = ckpts[-1]
        state = json.loads((last / "state.json").read_text())
        self.engine.load_checkpoint(str(last.parent), tag=last.name, load_optimizer_states=True, load_lr_scheduler_states=True)
        with torch.no_grad():  # frozen weights are not in every ZeRO checkpoint: always the target's
            self.model.d2t.copy_(self.vocab.d2t)
            self.model.t2d.copy_(self.vocab.t2d)
        self.step = state["step"]
        self.best = state.get("best", self.best)
        self.evals_since_best = state.get("evals_since_best", 0)
        self.early_stopped = state.get("early_stopped", False)
        if self.cfg.train.keep_best and self.best["step"] is not None:
            best = self.out / "checkpoints" / f"step{self.best['step']}"
            if not (best / "state.json").is_file():  # tracked while keep_best was off: never saved
                self.best = {"step": None, "eval_tau": None}
            elif self.dist.is_main:  # (re)written: a crash may have come between its save and this record
                atomic_write_json(self.out / BEST_FILE, {"checkpoint": best.name} | self.best)
        print0(f"resumed from {last} at step {self.step}")

    def save(self) -> Path:
        """A DeepSpeed checkpoint plus the consolidated head; the oldest beyond keep_last go, but
        for the best one under keep_best (``best.json`` names it)."""
        o = self.cfg.train
        tag = f"step{self.step}"
        root = self.out / "checkpoints"
        state = {"step": self.step, "epoch": self.epoch_of(self.step)[0], "world_size": self.world,
                 "grad_accum": o.grad_accum, "vocab_sha256": self.vocab_sha,
                 "capture": self.spec.to_dict(), "draft_config": self.model.config.to_dict(),
                 "ttt_length": o.ttt_length, "model": config_dict(self.cfg.model),
                 "best": self.best, "evals_since_best": self.evals_since_best, "early_stopped": self.early_stopped}
        self.engine.save_checkpoint(str(root), tag=tag, client_state={"eagle3": state})
        weights = self.consolidated_state_dict()
        if self.dist.is_main:
            from safetensors.torch import save_file

            save_file(weights, str(root / tag / "draft.safetensors"))
            atomic_write_json(root / tag / "state.json", state)  # last: marks the checkpoint complete
            best = f"step{self.best['step']}" if o.keep_best and self.best["step"] is not None else None
            if best == tag:
                atomic_write_json(self.out / BEST_FILE, {"checkpoint": tag} | self.best)
            for old in [p for p in self._checkpoints() if p.name != best][: -o.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        return root / tag

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight but the target's embeddings, gathered whole (ZeRO-3 included), fp32 CPU."""
        params = dict(self.model.named_parameters())
        if self.cfg.deepspeed.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
                return self._cpu_weights()
        return self._cpu_weights()

    def _cpu_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().cpu().clone() if v.is_floating_point() else v.detach().cpu().clone()
                for k, v in self.model.state_dict().items() if not k.startswith("embed_tokens")}

    # -- the loop --------------------------------------------------------------------------------

    def losses(self, batch: Batch, hits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.cfg.train
        return ttt_losses(self.engine.module, batch, self.lm_head, self.t2d, o.ttt_length, o.loss_decay,
                          self.cached_target(batch), o.head_chunk, self.sp, o.compile and o.head_chunk > 0, hits)

    def cached_target(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The batch's target distribution from the per-sample cache (``train.cache_target_gb``),
        computing the samples seen for the first time; None when the cache is off.

        On a CPU the target lm_head over the full vocab is ~40 % of a step; with the cache only the
        first epoch pays it. Each sample is computed alone, so the values never depend on batching."""
        if self.target_cache is None:
            return None
        b, t = batch.input_ids.shape
        dev = batch.input_ids.device
        probs = torch.zeros(b, t, self.vocab.draft_vocab_size, device=dev)
        argmax = torch.full((b, t), -1, dtype=torch.long, device=dev)
        in_draft = torch.zeros(b, t, dtype=torch.bool, device=dev)
        for i, (sample, n) in enumerate(zip(batch.sample_ids.tolist(), batch.lengths.tolist(), strict=True)):
            if sample not in self.target_cache:
                self.target_cache[sample] = target_distribution(batch.last_hidden[i, :n], self.lm_head, self.t2d)
            probs[i, :n], argmax[i, :n], in_draft[i, :n] = self.target_cache[sample]
        return probs, argmax, in_draft

    def epoch_of(self, step: int) -> tuple[int, int]:
        """(epoch, step within it) of a global optimizer step."""
        for epoch, n in enumerate(self.epoch_steps):
            if step < n:
                return epoch, step
            step -= n
        return len(self.epoch_steps), step

    def train_batches(self) -> Iterator[Batch]:
        """This rank's micro-batches from the current step to the end, in order (host memory,
        pinned on CUDA). Runs on the prefetch thread."""
        o = self.cfg.train
        pin = self.dist.device.type == "cuda"
        epoch_no, plan = -1, []
        for step in range(self.step, self.total_steps):
            epoch, step_in_epoch = self.epoch_of(step)
            if epoch != epoch_no:
                epoch_no, plan = epoch, plan_epoch(self.train_split.length, o.max_tokens_per_batch, o.seed, epoch)
            for indices in micro_batches_for(plan, step_in_epoch, self.data_rank, self.world, o.grad_accum):
                batch = self.train_split.batch(indices)
                yield batch.pin() if pin else batch

    def train_step(self, batches: Iterator[Batch]) -> dict[str, Any]:
        """One optimizer step: this rank's next micro-batches (on the device: ``source.device_batches``),
        backward, DeepSpeed's step. Nothing here waits for the device, so the host queues the next
        micro-batch's kernels while the GPU runs this one's (a small head is otherwise bound by the
        launches): the loss, the counts and the tokens come back as device tensors, and each loss's
        finiteness is checked later by ``check_finite``, which the loop calls before it logs,
        evaluates or saves. A non-finite loss therefore stops training before any checkpoint or
        evaluation sees weights it touched, naming its step and samples."""
        o = self.cfg.train
        self.engine.train()
        counts = loss_sum = tokens = None
        for _ in range(o.grad_accum):
            batch = next(batches)
            loss, stats = self.losses(batch)
            finite = torch.isfinite(loss.detach()).float().reshape(1)
            if torch.distributed.is_initialized():  # every rank stops at the same step
                torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
            self._unchecked.append((self.step, finite, batch.sample_ids))
            # DeepSpeed averages gradients over all ranks; a sequence-parallel group's losses add up
            # to its micro-batch's, so each counts sp times (the mean over data-parallel ranks)
            self.engine.backward(loss * self.sp.size)
            self.engine.step()
            c, l, n = stats[:, :3].to(torch.int64), loss.detach().float(), batch.lengths.sum()
            counts, loss_sum, tokens = (c, l, n) if counts is None else (counts + c, loss_sum + l, tokens + n)
        self.step += 1
        return {"loss": loss_sum / o.grad_accum, "counts": counts, "tokens": tokens}

    def check_finite(self) -> None:
        """Raise on the first micro-batch since the last check whose loss was not finite (one wait
        for the device for all of them)."""
        if not self._unchecked:
            return
        unchecked, self._unchecked = self._unchecked, []
        bad = (torch.cat([f for _, f, _ in unchecked]).cpu() < 1).nonzero()
        if len(bad):
            step, _, samples = unchecked[int(bad[0])]
            last = [c for c in self._checkpoints() if int(c.name.removeprefix("step")) <= step]
            raise Eagle3Error(
                f"non-finite loss at step {step + 1} (epoch {self.epoch_of(step)[0]}, micro-batch of samples "
                f"{samples.tolist()[:8]} on some rank); last good checkpoint: {last[-1] if last else 'none'}"
            )

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Per-step accuracy, loss and simulated acceptance length on the eval split (all ranks),
        honest and over in-vocab positions only, and the share of counted positions whose target
        argmax is in the draft vocab (``eval_vocab_coverage``, step 0: the ceiling of eval_acc[0])."""
        o = self.cfg.train
        self.engine.eval()
        counts = np.zeros((o.ttt_length, 3), dtype=np.int64)
        loss_sum, n = 0.0, 0
        walk = np.zeros(2, dtype=np.int64)  # decode walk: tokens, verify steps
        if len(self.eval_split):
            batches = plan_epoch(self.eval_split.length, o.max_tokens_per_batch, 0, 0)
            mine = batches[self.data_rank :: self.world]
            # every rank runs as many forwards (ZeRO-3 gathers parameters collectively); a rank
            # short of batches repeats its first one without counting it
            rounds = -(-len(batches) // self.world)
            host = (self.eval_split.batch(mine[r] if r < len(mine) else batches[0]) for r in range(rounds))
            for r, batch in enumerate(self.source.device_batches(host)):
                hits = torch.zeros(o.ttt_length, *batch.input_ids.shape, dtype=torch.int32, device=batch.input_ids.device)
                loss, stats = self.losses(batch, hits)
                hits = self.sp.all_reduce(hits)  # each shard wrote its own positions
                if r < len(mine):
                    counts += stats[:, :3].cpu().numpy().astype(np.int64)
                    loss_sum += float(loss)
                    n += self.sp.rank == 0  # a sequence-parallel group's shards add up to one batch
                    if self.sp.rank == 0:
                        walk += self._walk(batch, hits)
        gathered = all_gather_objects((counts, loss_sum, n, walk))
        counts = sum(g[0] for g in gathered)
        loss_sum, n = sum(g[1] for g in gathered), sum(g[2] for g in gathered)
        tokens, steps = sum(g[3] for g in gathered)
        acc, acc_in_vocab = accuracies(counts)
        return {"step": self.step, "eval_loss": loss_sum / max(n, 1), "eval_acc": acc, "eval_tau": acceptance_length(acc),
                "eval_tau_decoded": float(tokens / steps) if steps else 0.0,
                "eval_acc_in_vocab": acc_in_vocab, "eval_tau_in_vocab": acceptance_length(acc_in_vocab),
                "eval_vocab_coverage": float(counts[0, 1] / counts[0, 2]) if counts[0, 2] else 0.0}

    @staticmethod
    def _walk(batch: Batch, hits: torch.Tensor) -> np.ndarray:
        """[tokens, verify steps] of :func:`decode_walk` over the batch's rows."""
        h = hits.bool().cpu().numpy()  # [k, B, T]
        answer = (batch.loss_mask & (torch.arange(batch.input_ids.shape[1], device=batch.lengths.device)[None]
                                     < batch.lengths[:, None])).cpu().numpy()  # [B, T]
        return np.sum([decode_walk(h[:, i], answer[i]) for i in range(len(answer))], axis=0, dtype=np.int64)

    def after_eval(self, result: dict[str, Any]) -> bool:
        """Log an evaluation and track the best eval simulated tau; True when early stopping is due
        (``train.early_stop_patience`` evaluations in a row without a better one)."""
        self.log(result)
        if self.best["eval_tau"] is None or result["eval_tau"] > self.best["eval_tau"]:
            self.best = {"step": self.step, "eval_tau": result["eval_tau"]}
            self.evals_since_best = 0
        else:
            self.evals_since_best += 1
        patience = self.cfg.train.early_stop_patience
        return bool(patience) and self.evals_since_best >= patience

    def log(self, record: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tracker is not None:
            flat = {k: v for k, v in record.items() if not isinstance(v, list)}
            for k, v in record.items():
                if isinstance(v, list):
                    flat |= {f"{k}/{j}": x for j, x in enumerate(v)}
            self.tracker.log(flat, step=record["step"])

    def run(self) -> dict[str, Any]:
        o = self.cfg.train
        if (self.step >= self.total_steps or self.early_stopped) and self._checkpoints():
            how = "stopped early" if self.early_stopped else "already trained"
            print0(f"eagle3-train: {self.out} is {how} at step {self.step}; nothing to do")
            evals = [json.loads(line) for line in self.metrics_path.read_text().splitlines() if "eval_acc" in line]
            return (evals[-1] if evals else {}) | self._checkpoint_paths(self._checkpoints()[-1])
        bar = tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                   disable=not (self.cfg.progress and self.dist.is_main))
        window_start = time.time()
        crash_after = int(os.environ.get(CRASH_ENV, 0))
        batches = self.source.device_batches(Prefetcher(self.train_batches(), depth=2 * o.grad_accum))
        final: dict[str, Any] | None = None
        pending: list[dict[str, torch.Tensor]] = []  # the steps' figures since the last record, on the device
        while self.step < self.total_steps:
            pending.append(self.train_step(batches))
            bar.update(1)
            if self.step % o.log_every == 0 or self.step == self.total_steps:
                self.check_finite()
                counts = torch.stack([r["counts"] for r in pending]).sum(0).cpu().numpy()
                loss = float(torch.stack([r["loss"] for r in pending]).double().mean())
                tokens = int(torch.stack([r["tokens"] for r in pending]).sum())
                pending.clear()
                record = self._train_record(counts, loss, tokens, time.time() - window_start)
                self.log(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['acc'][0]:.2f}", tau=f"{record['tau']:.2f}",
                                lr=f"{record['lr']:.1e}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
                self._write(bar, f"step {self.step}/{self.total_steps} loss {record['loss']:.4f} acc "
                                 f"{' '.join(f'{a:.3f}' for a in record['acc'])} tau {record['tau']:.2f} (in-vocab "
                                 f"{record['tau_in_vocab']:.2f}) lr {record['lr']:.2e} {record['tokens_per_s']:.0f} tok/s")
                window_start = time.time()
            improved = False
            if o.eval_every and self.step % o.eval_every == 0 and self.step < self.total_steps:
                self.check_finite()
                final = self.evaluate()
                stop = self.after_eval(final)
                self._write(bar, self._eval_line(final))
                if stop:  # never on an improvement: the step's checkpoint is the final one below
                    self.early_stopped = True
                    self._write(bar, f"early stop: eval simulated tau has not improved on {self.best['eval_tau']:.3f} "
                                     f"(step {self.best['step']}) for {self.evals_since_best} evaluations")
                    break
                improved = o.keep_best and self.best["step"] == self.step
            if improved or (o.save_every and self.step % o.save_every == 0 and self.step < self.total_steps):
                self.check_finite()
                self.save()
                if crash_after and self.step >= crash_after:
                    os._exit(17)
        bar.close()
        self.check_finite()
        if final is None or final["step"] != self.step:
            final = self.evaluate()
            self.after_eval(final)
        path = self.save()
        print0(f"eagle3-train: {self.step} steps; {self._eval_line(final)} -> {path}")
        paths = self._checkpoint_paths(path)
        if "best_checkpoint" in paths:
            print0(f"best: eval simulated tau {self.best['eval_tau']:.3f} at step {self.best['step']} -> {paths['best_checkpoint']}")
        if self.dist.is_main:
            self.run_dir.write_manifest({"step": self.step, "early_stopped": self.early_stopped, "eval": final,
                                         "best": self.best, "config": config_dict(self.cfg)} | paths)
        return final | paths

    def _checkpoint_paths(self, last: Path) -> dict[str, str]:
        """The last checkpoint, and under keep_best the best one (what eagle3-export takes)."""
        out = {"checkpoint": str(last)}
        if self.cfg.train.keep_best and self.best["step"] is not None:
            out["best_checkpoint"] = str(self.out / "checkpoints" / f"step{self.best['step']}")
        return out

    @staticmethod
    def _eval_line(r: dict[str, Any]) -> str:
        return (f"eval at step {r['step']}: acc per step {[round(a, 3) for a in r['eval_acc']]}, simulated tau "
                f"{r['eval_tau']:.2f} (walked as decoding visits positions: {r['eval_tau_decoded']:.2f}; over in-vocab "
                f"positions: {r['eval_tau_in_vocab']:.2f}; the draft vocab covers {r['eval_vocab_coverage']:.1%} of the "
                f"target's argmaxes)")

    def _write(self, bar: Any, line: str) -> None:
        """A console line on rank 0 that does not break the progress bar."""
        if self.dist.is_main and not bar.disable:
            bar.write(line)

    def _train_record(self, counts: np.ndarray, loss: float, tokens: int, seconds: float) -> dict[str, Any]:
        """Metrics of the steps since the last record, over all ranks (the loss is the mean of the
        ranks' micro-batch means: what the averaged gradient descends)."""
        gathered = all_gather_objects((counts, tokens, loss))
        counts = sum(g[0] for g in gathered)
        tokens = sum(g[1] for g in gathered) // self.sp.size  # a sequence-parallel group reads one batch
        loss = sum(g[2] for g in gathered) / len(gathered) * self.sp.size  # and its shards' losses add up
        acc, acc_in_vocab = accuracies(counts)
        return {"step": self.step, "loss": loss, "acc": acc, "tau": acceptance_length(acc),
                "acc_in_vocab": acc_in_vocab, "tau_in_vocab": acceptance_length(acc_in_vocab),
                "lr": self.engine.get_lr()[0], "tokens_per_s": tokens / max(seconds, 1e-9)}

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.finish()


def _run(cfg: TrainConfig) -> None:
    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
        close()


main = entry_point("train", TrainConfig, _run)

if __name__ == "__main__":
    main()
